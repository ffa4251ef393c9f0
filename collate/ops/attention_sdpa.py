"""Old path of :mod:`collate.ops.attention.sdpa`; re-exports its names."""

from __future__ import annotations

from collate.ops.attention.sdpa import varlen_attention_sdpa

__all__ = ["varlen_attention_sdpa"]
