"""Bytes of shards, local or remote: the bottom layer that ``tokenbal.index`` (the scan) and
``tokenbal.data`` (the readers) both build on, so neither imports the other for it.

``tar`` parses tar headers (the scan's member walk, the reader's header check), ``ranged`` reads
byte ranges of local files or fsspec URLs (one per-process LRU of open shards), ``remote`` holds
how remote objects are read: ``RemoteOptions``, ``with_retries`` (transient errors retried with
backoff), per-process filesystems, object info and ranged reads with a segment cache. Imports
nothing of tokenbal outside this package, and no third-party module at import time (fsspec is
imported when a URL is read).
"""
