"""Old path of :mod:`collate.ops.rope.reference`; re-exports its names."""

from __future__ import annotations

from collate.ops.rope.reference import (
    FusedRotation,
    apply_mrope_reference,
    check_rope_args,
    mrope_angles,
    normalize_positions,
)

__all__ = ["FusedRotation", "apply_mrope_reference", "check_rope_args", "mrope_angles", "normalize_positions"]
