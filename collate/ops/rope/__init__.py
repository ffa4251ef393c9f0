"""``apply_mrope`` and its backends: dispatch.py picks one per device (``TOKENBAL_ROPE_IMPL`` forces
one); reference.py, cpu.py, triton.py and npu.py are the backends, common.py what they share."""

from __future__ import annotations

from collate.ops.rope.dispatch import IMPL_ENV, MRopeFn, apply_mrope, triton_available
from collate.ops.rope.reference import apply_mrope_reference

__all__ = ["IMPL_ENV", "MRopeFn", "apply_mrope", "apply_mrope_reference", "triton_available"]
