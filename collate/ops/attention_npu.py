"""Old path of :mod:`collate.ops.attention.npu`; re-exports its names."""

from __future__ import annotations

from collate.ops.attention.npu import varlen_attention_npu

__all__ = ["varlen_attention_npu"]
