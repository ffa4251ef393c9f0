"""Old path of :mod:`collate.ops.rope.cpu`; re-exports its names."""

from __future__ import annotations

from collate.ops.rope.cpu import BLOCK_ELEMENTS, apply_mrope_cpu

__all__ = ["BLOCK_ELEMENTS", "apply_mrope_cpu"]
