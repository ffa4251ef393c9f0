"""Fused ops for packed batches: one package per op (rope/, attention/), one dispatcher and one file
per backend in each.

``apply_mrope`` (rope/dispatch.py -> rope/reference.py, cpu.py, ...) and ``varlen_attention``
(attention/dispatch.py -> sdpa.py / flash.py / npu.py). Backends that need triton, torch_npu or
flash_attn are imported lazily on first use on a matching device; the CPU path always works.
"""

from __future__ import annotations

from collate.ops.attention import varlen_attention
from collate.ops.rope import apply_mrope

__all__ = ["apply_mrope", "varlen_attention"]
