"""Varlen attention on Ascend NPUs: ``torch_npu.npu_fusion_attention`` in the ``TND`` layout.

``q (T, Nq, D)``, ``k/v (T, Nk, D)`` go in as they are (TND; GQA handled by the op when ``Nq % Nk == 0``).
Segment boundaries are the batch's *host* list of cumulative ends without the leading 0
(``actual_seq_qlen = actual_seq_kvlen = cu_seqlens_list``), which is the op's documented format;
transformers' shim builds it with ``cu_seqlens.cpu()`` (a device->host sync per layer), we never
read a device tensor back. Causal attention uses the documented varlen form: a 2048x2048 upper-
triangular bool mask (True = masked) with ``sparse_mode=3`` (right-down causal per segment); it is
built once per device and reused. ``torch_npu`` is imported on first call.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from collate.ops.attention.segments import host_boundaries

_MASK_SIZE = 2048
_masks: dict[torch.device, torch.Tensor] = {}


def _causal_mask(device: torch.device) -> torch.Tensor:
    mask = _masks.get(device)
    if mask is None:
        mask = torch.ones(_MASK_SIZE, _MASK_SIZE, dtype=torch.bool, device=device).triu(diagonal=1)
        _masks[device] = mask
    return mask


def varlen_attention_npu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: Any,
    causal: bool = True,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Per-segment (causal) attention over packed tokens; same contract as ``varlen_attention``."""
    try:
        npu = importlib.import_module("torch_npu")
    except ImportError as exc:
        raise ModuleNotFoundError(
            "varlen_attention on NPU needs torch_npu (npu_fusion_attention); it is not importable. "
            "Set TOKENBAL_ATTN_IMPL=sdpa for the per-segment SDPA fallback."
        ) from exc
    ends = host_boundaries(batch, q.shape[0])
    # Zero-length segments add no tokens; the op wants strictly increasing ends.
    ends = [e for i, e in enumerate(ends) if i == 0 or e != ends[i - 1]]
    if scale is None:
        scale = q.shape[-1] ** -0.5
    out = npu.npu_fusion_attention(
        q,
        k,
        v,
        q.shape[1],
        input_layout="TND",
        atten_mask=_causal_mask(q.device) if causal else None,
        scale=float(scale),
        keep_prob=1.0 - float(dropout_p),
        actual_seq_qlen=ends,
        actual_seq_kvlen=ends,
        sparse_mode=3 if causal else 0,
    )
    return out[0]
