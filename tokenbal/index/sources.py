"""Turn the user's SOURCES (paths, globs, brace patterns) into a list of shard paths.

Brace patterns follow the webdataset / bash convention: ``data-{000..099}.tar`` is a numeric range
(zero-padded to the wider endpoint when either endpoint has a leading zero) and ``{a,b}`` is a list;
groups may nest and repeat. After brace expansion, a pattern with ``*``, ``?`` or ``[`` is a glob
(sorted), unless a file of exactly that name exists (``shard[1].tar`` is that file when it exists);
anything else is a literal path that must exist.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Sequence

_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")


def expand_braces(pattern: str) -> list[str]:
    """Expand the first top-level ``{...}`` group of ``pattern``, recursively; no group -> itself."""
    start = pattern.find("{")
    while start != -1:
        end = _matching_brace(pattern, start)
        if end == -1:
            return [pattern]          # an unbalanced "{" is a literal character
        inner = pattern[start + 1:end]
        options = _brace_options(inner)
        if options is not None:
            head, tail = pattern[:start], pattern[end + 1:]
            out: list[str] = []
            for opt in options:
                # The option itself may hold groups, and so may the tail: expand the joined string.
                out.extend(expand_braces(head + opt + tail))
            return out
        start = pattern.find("{", end + 1)   # "{x}" with no comma and no range stays literal
    return [pattern]


def _matching_brace(s: str, start: int) -> int:
    depth = 0
    for i in range(start, len(s)):
        if s[i] == "{":
            depth += 1
        elif s[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return -1


def _brace_options(inner: str) -> list[str] | None:
    m = _RANGE.match(inner)
    if m:
        a, b = m.group(1), m.group(2)
        lo, hi = int(a), int(b)
        padded = (len(a.lstrip("-")) > 1 and a.lstrip("-").startswith("0")) or \
                 (len(b.lstrip("-")) > 1 and b.lstrip("-").startswith("0"))
        width = max(len(a), len(b)) if padded else 0
        step = 1 if hi >= lo else -1
        return [str(v).zfill(width) for v in range(lo, hi + step, step)]
    parts, depth, cur = [], 0, []
    for ch in inner:
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur.append(ch)
    parts.append("".join(cur))
    return parts if len(parts) > 1 else None


def _inside(path: str, folder: str | None) -> bool:
    """Whether ``path`` is ``folder`` or under it (both local)."""
    if folder is None:
        return False
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def expand_sources(sources: Sequence[str], remote=None, out: str | None = None) -> list[str]:
    """Absolute shard paths for ``sources``, in the order given (globs sorted), without duplicates.

    Raises ``FileNotFoundError`` naming every literal path that does not exist and every glob that
    matches nothing, and ``ValueError`` for a directory, so a typo never turns into a silently
    smaller dataset. ``.json`` / ``.jsonl`` paths are annotation files (``tokenbal.index.annotations``).
    A source with a scheme (``s3://``, ``https://``, ...) is a remote one, read through fsspec with
    ``remote`` (``tokenbal.io.remote.RemoteOptions``): globs are listed by the store, and every URL
    must exist. ``out``: the index folder being built; a glob that matches it (``data/*`` with ``--out
    data/idx``) does not take it as a source, or every build after the first would be refused.
    """
    from tokenbal.index import remote as rm
    from tokenbal.io.remote import RemoteOptions, is_url

    if isinstance(sources, str):
        sources = [sources]
    paths: list[str] = []
    missing: list[str] = []
    literal_urls: list[str] = []   # checked together below (globbed ones exist already)
    for source in sources:
        for pattern in expand_braces(source if is_url(source) else os.path.expanduser(source)):
            if is_url(pattern):
                urls = rm.expand_url(pattern, remote or RemoteOptions())
                if not urls:
                    missing.append(f"{pattern} (pattern matches no object)")
                if not glob.has_magic(pattern):
                    literal_urls.append(pattern)
                paths.extend(urls)
            elif os.path.exists(pattern):
                # An existing file is itself even when its name has glob characters: "shard[1].tar"
                # names that file, not "shard1.tar".
                paths.append(pattern)
            elif glob.has_magic(pattern):
                matches = sorted(m for m in glob.glob(pattern) if not _inside(m, out))
                if not matches:
                    missing.append(f"{pattern} (pattern matches no file)")
                paths.extend(matches)
            else:
                missing.append(pattern)
    if literal_urls:
        missing.extend(rm.missing_urls(list(dict.fromkeys(literal_urls)), remote or RemoteOptions()))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise FileNotFoundError(f"{len(missing)} shard source(s) not found: {shown}")
    out: list[str] = []
    seen: set[str] = set()
    for p in paths:
        if is_url(p):
            if p not in seen:
                seen.add(p)
                out.append(p)
            continue
        ap = os.path.abspath(p)
        if os.path.isdir(ap):
            raise ValueError(f"source {p!r} is a directory; pass its shards, e.g. {p.rstrip('/')}/*.tar")
        # Overlapping patterns (data-*.tar data-000.tar) must not index a shard twice.
        key = os.path.realpath(ap)
        if key not in seen:
            seen.add(key)
            out.append(ap)
    if not out:
        raise FileNotFoundError("no shard sources given")
    return out
