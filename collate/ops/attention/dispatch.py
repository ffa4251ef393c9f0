"""``varlen_attention``: attention over packed ``(T, H, D)`` tensors, one segment per sample.

Thin dispatch over backends, each in its own file and imported lazily:

- ``sdpa`` (attention_sdpa.py): one SDPA per segment from the batch's host boundary list. The CPU
  path, and the fallback anywhere.
- ``flash_attn`` (attention_flash.py): ``flash_attn_varlen_func`` on CUDA, device ``cu_seqlens``.
- ``torch_varlen`` (attention_flash.py): torch's ``varlen_attn`` on CUDA when flash-attn is absent.
- ``npu`` (attention_npu.py): ``torch_npu.npu_fusion_attention`` in the TND layout, host ends list.

``auto`` (default) picks flash_attn > torch_varlen > sdpa on CUDA (fp16/bf16; fp32 -> sdpa), npu on
NPU, sdpa elsewhere.
``TOKENBAL_ATTN_IMPL`` forces one. Nothing here reads a device tensor back to the host.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

IMPL_ENV = "TOKENBAL_ATTN_IMPL"
_IMPLS = ("auto", "sdpa", "flash_attn", "torch_varlen", "npu")


def _field(batch: Any, name: str) -> Any:
    """``batch.name`` or ``batch[name]`` (dicts, dataclasses, mapping-like objects); None if absent."""
    value = getattr(batch, name, None)
    if value is not None:
        return value
    try:
        return batch[name]
    except (KeyError, TypeError, IndexError):
        return None


def _host_boundaries(batch: Any, num_tokens: int) -> list[int]:
    ends = _field(batch, "cu_seqlens_list")
    if ends is None:
        seq_lens = _field(batch, "seq_lens")
        cu = _field(batch, "cu_seqlens")
        if seq_lens is not None:
            ends = segment_ends(seq_lens)
        elif isinstance(cu, torch.Tensor) and cu.device.type == "cpu":
            ends = cu[1:].tolist()  # already on the host: no device sync
        else:
            raise ValueError(
                "varlen_attention needs the host list batch['cu_seqlens_list'] (segment ends, no leading 0) "
                "or batch['seq_lens']; it never reads cu_seqlens back from the device"
            )
    ends = [int(e) for e in ends]
    if ends and ends[0] == 0:
        raise ValueError(f"cu_seqlens_list must not start with 0 (ends only), got {ends[:4]}...")
    if not ends or ends[-1] != num_tokens:
        last = ends[-1] if ends else None
        raise ValueError(f"cu_seqlens_list ends at {last} but q has {num_tokens} tokens")
    return ends


def _select(device: torch.device, dtype: torch.dtype) -> str:
    forced = os.environ.get(IMPL_ENV, "auto").strip().lower() or "auto"
    if forced not in _IMPLS:
        raise ValueError(f"{IMPL_ENV}={forced!r}; expected one of {_IMPLS}")
    if forced != "auto":
        return forced
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        # Both CUDA kernels are half-precision only; fp32 (debug runs) takes the SDPA loop.
        from collate.ops.attention_flash import flash_attn_varlen_fn, torch_varlen_attn_fn

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
        from collate.ops.attention_sdpa import varlen_attention_sdpa

        ends = _host_boundaries(batch, q.shape[0])
        return varlen_attention_sdpa(q, k, v, ends, causal=causal, scale=scale, dropout_p=dropout_p)
    if impl == "npu":
        from collate.ops.attention_npu import varlen_attention_npu

        return varlen_attention_npu(q, k, v, batch, causal=causal, scale=scale, dropout_p=dropout_p)

    cu = _field(batch, "cu_seqlens")
    max_seqlen = _field(batch, "max_seqlen")
    if not isinstance(cu, torch.Tensor) or max_seqlen is None or isinstance(max_seqlen, torch.Tensor):
        # A tensor max_seqlen would force a device->host read in every layer.
        raise ValueError(
            f"{impl} varlen attention needs batch['cu_seqlens'] (int32 tensor) and batch['max_seqlen'] "
            f"(python int); got {type(cu).__name__} and {type(max_seqlen).__name__}"
        )
    max_seqlen = int(max_seqlen)
    if impl == "flash_attn":
        from collate.ops.attention_flash import varlen_attention_flash

        return varlen_attention_flash(
            q, k, v, cu, max_seqlen, causal=causal, scale=scale, dropout_p=dropout_p
        )
    from collate.ops.attention_flash import varlen_attention_torch

    if dropout_p != 0.0:
        raise ValueError(
            "torch varlen_attn has no dropout; install flash-attn or set TOKENBAL_ATTN_IMPL=sdpa"
        )
    return varlen_attention_torch(q, k, v, cu, max_seqlen, causal=causal, scale=scale)


def segment_ends(seq_lens: Sequence[int]) -> list[int]:
    """Cumulative segment ends (no leading 0) for a list of lengths: the ``cu_seqlens_list`` format."""
    ends, total = [], 0
    for n in seq_lens:
        total += int(n)
        ends.append(total)
    return ends
