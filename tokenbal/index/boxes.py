"""Top-level box sizes of ISO-BMFF files (mp4 / mov videos, AVIF / HEIF images) and JPEG 2000: whether
they tile the file. Such a file opens from its first boxes, so a copy cut short (or a box that declares
a size it cannot have) shows only when the lost data is decoded; the box sizes tell at index time."""

from __future__ import annotations

from collections.abc import Callable


def boxes_fault(read: Callable[[int, int], bytes], size: int, whole: str = "file") -> str | None:
    """Why a file of ``size`` bytes whose top-level boxes do not tile it is cut short or damaged
    (``"cut short: its 'mdat' box at byte N declares M bytes, but the file ends at byte K ..."``,
    ``whole`` naming the file in it), or ``None`` when they tile it. ``read(n, at)``: up to ``n`` of its
    bytes from ``at``. A box of size 0 runs to the end of the file, which then cannot tell; a few bytes
    after the last box are left to the decoder (padding, or a box header cut)."""
    pos = 0
    while pos + 8 <= size:
        head = read(16, pos)
        length, kind = int.from_bytes(head[:4], "big"), head[4:8].decode("latin-1")
        if length == 1:
            if len(head) < 16:
                return f"cut short: its {kind!r} box header at byte {pos} is incomplete"
            length = int.from_bytes(head[8:16], "big")
        elif length == 0:
            return None
        if length < 8:
            return f"damaged: its {kind!r} box at byte {pos} declares {length} bytes"
        if pos + length > size:
            return (f"cut short: its {kind!r} box at byte {pos} declares {length} bytes, but the {whole} "
                    f"ends at byte {size} ({pos + length - size} bytes missing)")
        pos += length
    return None


# A meta box larger than this is not read for its item locations (real ones are a few hundred bytes).
_META_LIMIT = 1 << 20


def item_data_fault(read: Callable[[int, int], bytes], size: int, whole: str = "file") -> str | None:
    """Why an ISO-BMFF image file (AVIF, HEIF) of ``size`` bytes lacks the data of one of its items,
    from the ``iloc`` box of its top-level ``meta`` (ISO/IEC 14496-12, 8.11.3: each item's extents, as
    offsets into this file): boxes that tile the file can still end before an item's pixels (a copy cut
    at a box boundary, or inside the last box's header), which the decoder finds only when it reads
    them. ``None`` when every extent in this file lies within it, or no ``iloc`` is found."""
    meta = _top_level_box(read, size, b"meta")
    if meta is None:
        return None
    start, end = meta
    if end - start > _META_LIMIT:
        return None
    body = read(end - start, start)[4:]            # after the FullBox version and flags
    iloc = _child_box(body, b"iloc")
    if iloc is None:
        return None
    try:
        for item, last in _iloc_file_extents(iloc):
            if last > size:
                return (f"cut short: item {item}'s data runs to byte {last}, but the {whole} ends at byte "
                        f"{size} ({last - size} bytes missing)")
    except IndexError:                             # an iloc cut or damaged itself: the decoder decides
        return None
    return None


def _top_level_box(read: Callable[[int, int], bytes], size: int, kind: bytes) -> tuple[int, int] | None:
    """(payload start, end) of the first top-level box of ``kind`` lying wholly within the ``size``
    bytes ``read`` gives (a file, or a box's payload: its child boxes)."""
    pos = 0
    while pos + 8 <= size:
        head = read(16, pos)
        length, header = int.from_bytes(head[:4], "big"), 8
        if length == 1 and len(head) >= 16:
            length, header = int.from_bytes(head[8:16], "big"), 16
        elif length == 0:
            length = size - pos
        if length < header or pos + length > size:
            return None
        if head[4:8] == kind:
            return pos + header, pos + length
        pos += length
    return None


def _child_box(body: bytes, kind: bytes) -> bytes | None:
    """The payload of the first box of ``kind`` among the boxes that make up ``body``."""
    found = _top_level_box(lambda n, at: body[at:at + n], len(body), kind)
    return None if found is None else body[found[0]:found[1]]


def _iloc_file_extents(iloc: bytes):
    """(item id, end offset) of every extent an ``iloc`` payload places in this file (construction
    method 0, data reference 0) with a known length; ``IndexError`` when the payload is cut."""
    version = iloc[0]
    pos = 4                                        # version and flags
    offset_size, length_size = iloc[pos] >> 4, iloc[pos] & 15
    base_size, index_size = iloc[pos + 1] >> 4, (iloc[pos + 1] & 15) if version in (1, 2) else 0
    pos += 2

    def number(width: int) -> int:
        nonlocal pos
        if pos + width > len(iloc):
            raise IndexError("iloc cut")
        value = int.from_bytes(iloc[pos:pos + width], "big")
        pos += width
        return value

    count = number(2 if version < 2 else 4)
    for _ in range(count):
        item = number(2 if version < 2 else 4)
        method = number(2) & 15 if version in (1, 2) else 0
        reference = number(2)
        base = number(base_size)
        for _ in range(number(2)):
            number(index_size)
            offset, length = number(offset_size), number(length_size)
            if method == 0 and reference == 0 and length > 0:
                yield item, base + offset + length
