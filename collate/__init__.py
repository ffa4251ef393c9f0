"""collate: everything about a batch on its way to the device.

``PackedCollator`` builds packed 1-D batches (``cu_seqlens``, ``max_seqlen``, M-RoPE position
ids) on the host, ``DevicePrefetcher`` copies them on a side stream, ``apply_mrope`` and
``varlen_attention`` consume them inside the model, and ``collate.models.enable_packed`` patches
real transformers model classes to do so. Backends (Triton, torch_npu, flash-attn) are probed
lazily; the CPU path always works.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "PackedCollator": "collate.packing",
    "PackedBatch": "collate.packing",
    "DevicePrefetcher": "collate.prefetch",
    "apply_mrope": "collate.ops",
    "varlen_attention": "collate.ops",
}

if TYPE_CHECKING:
    from collate.ops import apply_mrope, varlen_attention
    from collate.packing import PackedBatch, PackedCollator
    from collate.prefetch import DevicePrefetcher

__all__ = ["DevicePrefetcher", "PackedBatch", "PackedCollator", "apply_mrope", "varlen_attention"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'collate' has no attribute {name!r}")
