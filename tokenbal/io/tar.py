"""Tar headers, parsed in one place: the index scan's fast member walk and the reader's header check.

The ustar field layout, numeric fields and checksum are decoded here once; two callers use them:
``walk_members`` (the index scan, ``tokenbal.index.scan`` / ``tokenbal.index.remote``) and
``parse_tar_header`` / ``name_matches`` / ``header_stamp`` (the reader,
``tokenbal.data.indexed.IndexedShardDataset``, which checks the header right before each payload).

The walk is a fast listing of a shard's members: 512-byte headers read with ``pread``, no ``TarInfo``.
CPython's ``tarfile`` costs ~35 µs per member (most of it building ``TarInfo`` objects and
parsing fields the index never uses); this walk costs a few µs. It is an *optimisation only*:
``walk_members`` returns ``None`` for anything it does not handle exactly as ``tarfile`` does
(a bad checksum, a header cut short, a payload past EOF, base-256 numbers, GNU sparse / long-link /
global PAX headers, a PAX ``hdrcharset``), and the caller then lists the shard with ``tarfile``, whose
behaviour (and error messages) the damage rules in ``tokenbal.index.scan`` are written against.
When it returns a list, the names, types, payload offsets and sizes, and the end offset are the ones
``tarfile.open(path, "r:")`` gives (tests check both on the same shards, damaged ones included).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass

BLOCK = 512
_ZERO_BLOCK = bytes(BLOCK)
_REGULAR = frozenset({b"0", b"\0", b"7"})        # tarfile.REGULAR_TYPES minus GNU sparse
# What the reader accepts right before a payload the index points at: the regular-file types the
# index takes (``TarMember.isfile`` / ``TarInfo.isfile``: "0", old "\0" and contiguous "7", whose
# payload is stored like any file's); GNU sparse ("S") never reaches the index.
PLAIN_TYPES = (b"0", b"\0", b"7")
# ustar field offsets (POSIX.1-1988).
_NAME, _SIZE, _MTIME, _CHKSUM, _TYPE = slice(0, 100), slice(124, 136), slice(136, 148), slice(148, 156), 156
_MAGIC, _PREFIX = slice(257, 263), slice(345, 500)
# Types tarfile treats as "supported, not regular": it never skips payload blocks after them.
_SPECIAL = frozenset({b"1", b"2", b"3", b"4", b"5", b"6"})
_PAX_RECORD = re.compile(rb"(\d+) ([^=]+)=")
_PAX_KEYS_OK = frozenset({b"path", b"size", b"mtime", b"atime", b"ctime", b"uid", b"gid", b"uname",
                          b"gname", b"linkpath", b"comment", b"mode"})


@dataclass(slots=True)
class TarMember:
    """The fields of ``tarfile.TarInfo`` the index uses, with the same names and meanings."""
    name: str
    type: bytes
    size: int
    offset_data: int
    chksum: int = -1      # the member's own ustar header: checksum field and mtime field, as stored
    mtime: int = -1       # (see ``header_stamp``); -1 when unknown

    def isfile(self) -> bool:
        return self.type in _REGULAR

    def isdir(self) -> bool:
        return self.type == b"5"


class _Fallback(Exception):
    """Something ``tarfile`` must judge; never leaves this module."""


def walk_members(fd, size: int, progress: Callable[[int], None] | None = None,
                 every: int = 1 << 22) -> tuple[list[TarMember], int] | None:
    """``(members, end_of_members)`` of the uncompressed tar open as ``fd`` (``size`` bytes), or
    ``None`` when the shard needs ``tarfile`` (see the module docstring). ``fd`` is a file
    descriptor, or an object with ``pread(n, offset)`` (a remote shard: ``tokenbal.index.remote``).
    ``progress(offset)``: the walk reached the header at ``offset``, each time ``every`` more bytes
    of the shard are behind it (a count, not a clock: the same calls on every run)."""
    pread = fd.pread if hasattr(fd, "pread") else (lambda n, off: os.pread(fd, n, off))
    try:
        return _walk(pread, size, progress, every)
    except _Fallback:
        return None


def _walk(pread, size: int, progress: Callable[[int], None] | None = None,
          every: int = 1 << 22) -> tuple[list[TarMember], int]:
    members: list[TarMember] = []
    pos = 0
    # The next offset to report at: one compare per header, no call unless a mark is passed.
    mark = every if progress is not None else size + 1
    pax_path: str | None = None
    pax_size: int | None = None
    long_name: str | None = None
    while True:
        if pos >= mark:
            progress(pos)
            mark = pos + every
        if pos + BLOCK > size:
            raise _Fallback   # EOF without end blocks, or a payload past EOF: tarfile's call
        buf = pread(BLOCK, pos)
        if len(buf) != BLOCK:
            raise _Fallback
        if buf == _ZERO_BLOCK:
            if pax_path is not None or pax_size is not None or long_name is not None:
                raise _Fallback   # an extended header with no member after it
            return members, pos
        chksum = _number(buf[_CHKSUM])
        if chksum != unsigned_checksum(buf):
            raise _Fallback       # bad checksum (or a signed-sum writer): tarfile decides
        kind = buf[_TYPE:_TYPE + 1]
        n = _number(buf[_SIZE])
        data = pos + BLOCK
        blocks = -(-n // BLOCK) * BLOCK
        if kind in (b"x", b"L"):
            if data + blocks > size:
                raise _Fallback
            payload = pread(n, data)
            if len(payload) != n:
                raise _Fallback
            if kind == b"L":
                long_name = _text(cstr(payload))
            else:
                pax_path, pax_size = _pax(payload)
            pos = data + blocks
            continue
        if kind not in _REGULAR and kind not in _SPECIAL:
            raise _Fallback       # sparse, long link, global PAX, vendor types
        # Name rules in tarfile's order (TarInfo.frombuf, _proc_gnulong, _apply_pax_info).
        name = _text(cstr(buf[_NAME]))
        if kind == b"\0" and name.endswith("/"):
            kind = b"5"           # old V7 directory
        prefix = _text(cstr(buf[_PREFIX]))
        if kind == b"5":
            name = name.rstrip("/")
        if prefix:
            name = prefix + "/" + name
        if long_name is not None and pax_path is not None:
            raise _Fallback       # both kinds of long name: let tarfile decide which wins
        if long_name is not None:
            name, long_name = long_name, None
            if kind == b"5":
                name = name.removesuffix("/")
        if pax_path is not None:
            name, pax_path = pax_path.rstrip("/"), None
        if pax_size is not None:
            n, pax_size = pax_size, None
            blocks = -(-n // BLOCK) * BLOCK
        members.append(TarMember(name, kind, n, data, chksum, _number(buf[_MTIME])))
        pos = data + (blocks if kind in _REGULAR else 0)
        if pos > size:
            raise _Fallback


def header_stamp(block: bytes) -> tuple[int, int]:
    """(checksum field, mtime field) of a 512-byte ustar header, as stored; (-1, -1) if unreadable.

    The ustar header right before a member's payload is that member's own (PAX / GNU long-name
    records come before it), so this is what a reader finds at ``offset_data - 512``. A rewritten
    member almost always changes one of the two (new mtime, new checksum), even at the same size.
    """
    try:
        return _number(block[_CHKSUM]), _number(block[_MTIME])
    except _Fallback:
        return -1, -1


def _number(field: bytes) -> int:
    # base-256 (members > 8 GiB) is rare: the walk lets tarfile parse it.
    try:
        return number(field, base256=False)
    except ValueError:
        raise _Fallback from None


def number(field: bytes, *, base256: bool = True) -> int:
    """A numeric ustar field: octal text, or GNU base-256 (first byte 0x80 / 0xff) for big values
    when ``base256``; ``ValueError`` if it is neither."""
    if field[:1] in (b"\x80", b"\xff"):
        if not base256:
            raise ValueError("a base-256 number")
        n = int.from_bytes(field[1:], "big")
        return n - (1 << (8 * (len(field) - 1))) if field[:1] == b"\xff" else n
    return int(field.split(b"\0", 1)[0].strip() or b"0", 8)


def cstr(field: bytes) -> bytes:
    """A NUL-terminated field, up to its first NUL."""
    return field.split(b"\0", 1)[0]


def unsigned_checksum(block: bytes) -> int:
    """The checksum a header's bytes give, counting the checksum field itself as 8 spaces."""
    return sum(block) - sum(block[_CHKSUM]) + 8 * 32


def parse_tar_header(block: bytes) -> tuple[bytes, int, bytes]:
    """(name as stored, size, typeflag) of a 512-byte ustar header; ``ValueError`` if it is not one.

    The name is ``prefix/name`` for POSIX ustar headers with a prefix; for a member with a long
    name (PAX or GNU records before this header) it is the truncated copy the writer stored.
    """
    if len(block) != BLOCK:
        raise ValueError(f"header is {len(block)} bytes, not {BLOCK}")
    if not block.strip(b"\0"):
        raise ValueError("an all-zero block (end of archive), not a member header")
    try:
        stored = number(block[_CHKSUM])
        size = number(block[_SIZE])
    except ValueError as e:
        raise ValueError(f"not a tar header: bad numeric field ({e})") from None
    # tarfile accepts the unsigned and the (historic) signed byte sum; the signed one is only worked
    # out when the unsigned one fails (it is rare and slow).
    unsigned = unsigned_checksum(block)
    if stored != unsigned:
        rest = block[:148] + b" " * 8 + block[156:]
        if stored != unsigned - 256 * sum(1 for b in rest if b > 127):
            raise ValueError(f"tar header checksum mismatch (stored {stored}, computed {unsigned})")
    name = cstr(block[_NAME])
    if block[_MAGIC] == b"ustar\0":           # POSIX ustar: a long path may be split into prefix/name
        prefix = cstr(block[_PREFIX])
        if prefix:
            name = prefix + b"/" + name
    return name, size, block[_TYPE:_TYPE + 1]


def header_names(block: bytes) -> tuple[bytes, ...]:
    """The names a member's 512-byte header stands for, for ``name_matches``: ``parse_tar_header``'s,
    then CPython ``tarfile``'s where that differs. ``tarfile`` (and so the index, which lists members
    by its rules) joins bytes 345..500 to the name as a ustar prefix whatever the magic says; in a GNU
    header those bytes are the atime / ctime fields, which GNU tar fills in incremental archives, so
    the index then names ``k.jpg`` as ``<atime>/k.jpg``. ``ValueError`` as ``parse_tar_header``."""
    stored, _, typeflag = parse_tar_header(block)
    prefix = cstr(block[_PREFIX])
    if not prefix or block[_MAGIC] == b"ustar\0" or typeflag in (b"L", b"K", b"S"):
        return (stored,)
    name = cstr(block[_NAME])
    if typeflag == b"5" or (typeflag == b"\0" and name.endswith(b"/")):
        name = name.rstrip(b"/")      # tarfile strips a directory's slashes before joining
    return stored, prefix + b"/" + name


def name_matches(stored: bytes, expected: str) -> bool:
    """Whether a header's stored name (``parse_tar_header``) is the member name ``expected``."""
    enc = expected.encode("utf-8")
    if stored == enc:
        return True
    # A name that does not fit ustar (too long, or not ASCII) lives in a PAX / GNU record; the
    # ustar field keeps a copy truncated to 100 bytes (UTF-8 for GNU, ASCII with '?' for PAX), or to
    # 99 by writers that keep the field NUL-terminated (GNU tar --format=oldgnu).
    long_or_unicode = len(enc) > 100 or not expected.isascii()
    copies = (enc[:100], expected.encode("ascii", "replace")[:100]) + ((enc[:99],) if len(enc) > 99 else ())
    return long_or_unicode and stored in copies



def _text(raw: bytes) -> str:
    # tarfile's default: the file-system encoding (UTF-8 here) with surrogateescape.
    return raw.decode("utf-8", "surrogateescape")


def _pax(payload: bytes) -> tuple[str | None, int | None]:
    path = size = None
    pos = 0
    while pos < len(payload) and payload[pos] != 0:
        m = _PAX_RECORD.match(payload, pos)
        if m is None:
            raise _Fallback
        length, key = int(m.group(1)), m.group(2)
        if length < 1 or pos + length > len(payload) or key not in _PAX_KEYS_OK:
            raise _Fallback       # hdrcharset, GNU.sparse.*, vendor keys: tarfile handles them
        value = payload[m.end():pos + length - 1]
        if key == b"path":
            try:
                path = value.decode("utf-8")
            except UnicodeDecodeError:
                raise _Fallback from None
        elif key == b"size":
            try:
                size = int(value)
            except ValueError:
                raise _Fallback from None
        pos += length
    return path, size
