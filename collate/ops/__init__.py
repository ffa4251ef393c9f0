"""Fused ops for packed batches: one thin dispatch per op, one file per backend.

``apply_mrope`` (rope.py -> rope_reference.py, ...) and ``varlen_attention`` (attention.py ->
attention_sdpa.py / attention_flash.py / attention_npu.py). Backends that need triton, torch_npu or
flash_attn are imported lazily on first use on a matching device; the CPU path always works.
"""

from __future__ import annotations

from collate.ops.attention import varlen_attention
from collate.ops.rope import apply_mrope

__all__ = ["apply_mrope", "varlen_attention"]
