"""A fast listing of a tar shard's members: 512-byte headers read with ``pread``, no ``TarInfo``.

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
from dataclasses import dataclass

BLOCK = 512
_ZERO_BLOCK = bytes(BLOCK)
_REGULAR = frozenset({b"0", b"\0", b"7"})        # tarfile.REGULAR_TYPES minus GNU sparse
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


def walk_members(fd, size: int) -> tuple[list[TarMember], int] | None:
    """``(members, end_of_members)`` of the uncompressed tar open as ``fd`` (``size`` bytes), or
    ``None`` when the shard needs ``tarfile`` (see the module docstring). ``fd`` is a file
    descriptor, or an object with ``pread(n, offset)`` (a remote shard: ``tokenbal.index.remote``)."""
    pread = fd.pread if hasattr(fd, "pread") else (lambda n, off: os.pread(fd, n, off))
    try:
        return _walk(pread, size)
    except _Fallback:
        return None


def _walk(pread, size: int) -> tuple[list[TarMember], int]:
    members: list[TarMember] = []
    pos = 0
    pax_path: str | None = None
    pax_size: int | None = None
    long_name: str | None = None
    while True:
        if pos + BLOCK > size:
            raise _Fallback   # EOF without end blocks, or a payload past EOF: tarfile's call
        buf = pread(BLOCK, pos)
        if len(buf) != BLOCK:
            raise _Fallback
        if buf == _ZERO_BLOCK:
            if pax_path is not None or pax_size is not None or long_name is not None:
                raise _Fallback   # an extended header with no member after it
            return members, pos
        chksum = _number(buf[148:156])
        if chksum != sum(buf) - sum(buf[148:156]) + 256:
            raise _Fallback       # bad checksum (or a signed-sum writer): tarfile decides
        kind = buf[156:157]
        n = _number(buf[124:136])
        data = pos + BLOCK
        blocks = -(-n // BLOCK) * BLOCK
        if kind in (b"x", b"L"):
            if data + blocks > size:
                raise _Fallback
            payload = pread(n, data)
            if len(payload) != n:
                raise _Fallback
            if kind == b"L":
                long_name = _text(payload.split(b"\0", 1)[0])
            else:
                pax_path, pax_size = _pax(payload)
            pos = data + blocks
            continue
        if kind not in _REGULAR and kind not in _SPECIAL:
            raise _Fallback       # sparse, long link, global PAX, vendor types
        # Name rules in tarfile's order (TarInfo.frombuf, _proc_gnulong, _apply_pax_info).
        name = _text(buf[0:100].split(b"\0", 1)[0])
        if kind == b"\0" and name.endswith("/"):
            kind = b"5"           # old V7 directory
        prefix = _text(buf[345:500].split(b"\0", 1)[0])
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
        members.append(TarMember(name, kind, n, data, chksum, _number(buf[136:148])))
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
        return _number(block[148:156]), _number(block[136:148])
    except _Fallback:
        return -1, -1


def _number(field: bytes) -> int:
    if field[:1] in (b"\x80", b"\xff"):
        raise _Fallback           # base-256 (members > 8 GiB): rare, let tarfile parse it
    try:
        return int(field.split(b"\0", 1)[0].strip() or b"0", 8)
    except ValueError:
        raise _Fallback from None


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
