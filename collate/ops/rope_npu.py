"""Old path of :mod:`collate.ops.rope.npu`; re-exports its names."""

from __future__ import annotations

from collate.ops.rope.npu import MROPE_MAX_POS_ENV, apply_mrope_npu, merged_cos_sin

__all__ = ["MROPE_MAX_POS_ENV", "apply_mrope_npu", "merged_cos_sin"]
