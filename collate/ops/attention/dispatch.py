"""``varlen_attention``: attention over packed ``(T, H, D)`` tensors, one segment per sample.

Thin dispatch over backends, each in its own file and imported lazily; the batch's segment fields
are read by segments.py, which the backends import instead of this file:

- ``sdpa`` (sdpa.py): one SDPA per segment from the batch's host boundary list. The CPU
  path, and the fallback anywhere.
- ``flash_attn`` (flash.py): ``flash_attn_varlen_func`` on CUDA, device ``cu_seqlens``.
- ``torch_varlen`` (flash.py): torch's ``varlen_attn`` on CUDA when flash-attn is absent.
- ``npu`` (npu.py): ``torch_npu.npu_fusion_attention`` in the TND layout, host ends list.

``auto`` (default) picks flash_attn > torch_varlen > sdpa on CUDA (fp16/bf16; fp32 -> sdpa), npu on
NPU, sdpa elsewhere.
``TOKENBAL_ATTN_IMPL`` forces one. Nothing here reads a device tensor back to the host.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from collate.ops.attention.segments import batch_field, host_boundaries, segment_ends

__all__ = ["IMPL_ENV", "segment_ends", "varlen_attention"]

IMPL_ENV = "TOKENBAL_ATTN_IMPL"
_IMPLS = ("auto", "sdpa", "flash_attn", "torch_varlen", "npu")


def _select(device: torch.device, dtype: torch.dtype) -> str:
    forced = os.environ.get(IMPL_ENV, "auto").strip().lower() or "auto"
    if forced not in _IMPLS:
        raise ValueError(f"{IMPL_ENV}={forced!r}; expected one of {_IMPLS}")
    if forced != "auto":
        return forced
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        # Both CUDA kernels are half-precision only; fp32 (debug runs) takes the SDPA loop.
        from collate.ops.attention.flash import flash_attn_varlen_fn, torch_varlen_attn_fn

        if flash_attn_varlen_fn() is not None:
            return "flash_attn"
        if torch_varlen_attn_fn() is not None:
            return "torch_varlen"
        return "sdpa"
    if device.type == "npu":
        return "npu"
    return "sdpa"


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: Any,
    causal: bool = True,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Attention restricted to each packed segment (block-diagonal, causal within a segment).

    Args:
        q: ``(T, Hq, D)``; k, v: ``(T, Hk, D)`` with ``Hq % Hk == 0`` (GQA).
        batch: mapping or object with ``cu_seqlens`` (int32 ``(n+1,)`` on q's device),
            ``cu_seqlens_list`` (host list of segment ends without the leading 0) and
            ``max_seqlen`` (python int). ``seq_lens`` can stand in for ``cu_seqlens_list``.
        causal: causal mask inside each segment.
        scale: softmax scale, default ``D ** -0.5``.
        dropout_p: attention dropout (training only; 0 in eval).

    Returns:
        ``(T, Hq, D)`` in q's dtype.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q/k/v must be (T, H, D); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]) or k.shape[1] != v.shape[1]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not line up")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads {q.shape[1]} must be a multiple of key/value heads {k.shape[1]}")

    impl = _select(q.device, q.dtype)
    if impl == "sdpa":
        from collate.ops.attention.sdpa import varlen_attention_sdpa

        ends = host_boundaries(batch, q.shape[0])
        return varlen_attention_sdpa(q, k, v, ends, causal=causal, scale=scale, dropout_p=dropout_p)
    if impl == "npu":
        from collate.ops.attention.npu import varlen_attention_npu

        return varlen_attention_npu(q, k, v, batch, causal=causal, scale=scale, dropout_p=dropout_p)

    cu = batch_field(batch, "cu_seqlens")
    max_seqlen = batch_field(batch, "max_seqlen")
    if not isinstance(cu, torch.Tensor) or max_seqlen is None or isinstance(max_seqlen, torch.Tensor):
        # A tensor max_seqlen would force a device->host read in every layer.
        raise ValueError(
            f"{impl} varlen attention needs batch['cu_seqlens'] (int32 tensor) and batch['max_seqlen'] "
            f"(python int); got {type(cu).__name__} and {type(max_seqlen).__name__}"
        )
    max_seqlen = int(max_seqlen)
    if impl == "flash_attn":
        from collate.ops.attention.flash import varlen_attention_flash

        return varlen_attention_flash(
            q, k, v, cu, max_seqlen, causal=causal, scale=scale, dropout_p=dropout_p
        )
    from collate.ops.attention.flash import varlen_attention_torch

    if dropout_p != 0.0:
        raise ValueError(
            "torch varlen_attn has no dropout; install flash-attn or set TOKENBAL_ATTN_IMPL=sdpa"
        )
    return varlen_attention_torch(q, k, v, cu, max_seqlen, causal=causal, scale=scale)
