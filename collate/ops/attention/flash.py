"""Varlen attention on CUDA: flash-attn's ``flash_attn_varlen_func``, else torch's ``varlen_attn``.

Both take the device ``cu_seqlens`` tensor and a host ``max_seqlen`` int, so no host sync happens.
Imports are lazy: importing this module never imports flash_attn.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import lru_cache

import torch


@lru_cache(maxsize=1)
def flash_attn_varlen_fn() -> Callable | None:
    """``flash_attn.flash_attn_varlen_func`` if flash-attn imports cleanly, else None."""
    try:
        module = importlib.import_module("flash_attn")
    except Exception:  # ImportError, or a broken CUDA build raising at import
        return None
    return getattr(module, "flash_attn_varlen_func", None)


@lru_cache(maxsize=1)
def torch_varlen_attn_fn() -> Callable | None:
    """``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10, CUDA only) if present, else None."""
    try:
        module = importlib.import_module("torch.nn.attention.varlen")
    except Exception:
        return None
    return getattr(module, "varlen_attn", None)


def _device_cu_seqlens(cu_seqlens: torch.Tensor, device: torch.device) -> torch.Tensor:
    # Kernels want int32 on the device. Normally the prefetcher already put it there; if it is
    # still on the host this is an H2D copy (asynchronous from pinned memory), never a D2H read.
    if cu_seqlens.device != device or cu_seqlens.dtype != torch.int32:
        cu_seqlens = cu_seqlens.to(device=device, dtype=torch.int32, non_blocking=True)
    return cu_seqlens


def varlen_attention_flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    causal: bool = True,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    fn = flash_attn_varlen_fn()
    if fn is None:
        raise RuntimeError("flash_attn is not importable")
    cu = _device_cu_seqlens(cu_seqlens, q.device)
    # flash-attn handles GQA natively when Hq is a multiple of Hk.
    return fn(
        q, k, v, cu, cu, max_seqlen, max_seqlen, dropout_p=dropout_p, softmax_scale=scale, causal=causal
    )


def varlen_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    fn = torch_varlen_attn_fn()
    if fn is None:
        raise RuntimeError("torch.nn.attention.varlen.varlen_attn is not available")
    cu = _device_cu_seqlens(cu_seqlens, q.device)
    # window (-1, 0) = causal in varlen_attn's convention; (-1, -1) = full.
    window = (-1, 0) if causal else (-1, -1)
    return fn(
        q,
        k,
        v,
        cu,
        cu,
        max_seqlen,
        max_seqlen,
        scale=scale,
        window_size=window,
        enable_gqa=q.shape[1] != k.shape[1],
    )
