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
