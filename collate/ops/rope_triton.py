"""Old path of :mod:`collate.ops.rope.triton`; re-exports its names."""

from __future__ import annotations

from collate.ops.rope.triton import apply_mrope_triton

__all__ = ["apply_mrope_triton"]
