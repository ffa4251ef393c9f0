"""``varlen_attention`` and its backends: dispatch.py picks one per device (``TOKENBAL_ATTN_IMPL``
forces one); sdpa.py, flash.py and npu.py are the backends, segments.py reads a batch's segments."""

from __future__ import annotations

from collate.ops.attention.dispatch import IMPL_ENV, varlen_attention
from collate.ops.attention.segments import segment_ends

__all__ = ["IMPL_ENV", "segment_ends", "varlen_attention"]
