"""Old path of :mod:`collate.ops.attention.flash`; re-exports its names."""

from __future__ import annotations

from collate.ops.attention.flash import (
    flash_attn_varlen_fn,
    torch_varlen_attn_fn,
    varlen_attention_flash,
    varlen_attention_torch,
)

__all__ = ["flash_attn_varlen_fn", "torch_varlen_attn_fn", "varlen_attention_flash", "varlen_attention_torch"]
