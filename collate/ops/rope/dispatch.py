"""``apply_mrope``: mixed 1-D / 3-D rotary embedding for packed ``(T, H, D)`` tensors.

Thin dispatch: the backend is chosen from the tensor's device, each backend in its own file and
imported lazily, so this module never imports triton or torch_npu; backends share common.py and
never import this file:

- ``cpu`` (cpu.py): PyTorch with per-token (T, R/2) cos/sin shared by q and k, writing into one
  output (bounded fp32 scratch for bf16/fp16), autograd backward = rotation by -theta. The default on
  CPU and on any device without a kernel backend.
- ``reference`` (reference.py): the plain vectorised formula; the oracle the others are tested
  against (and a debugging fallback).
- ``triton`` (triton.py): one fused kernel, cos/sin computed in-kernel from the positions;
  chosen on CUDA for fp32/bf16/fp16 when triton imports. On CPU it runs only when forced and
  ``TRITON_INTERPRET=1`` (how the tests run it).
- ``npu`` (npu.py): ``torch_npu.npu_rotary_mul`` on a merged (T, R) cos/sin; chosen on NPU.

``TOKENBAL_ROPE_IMPL`` = ``auto`` (default) | ``cpu`` | ``reference`` | ``triton`` | ``npu`` forces one.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Sequence
from functools import lru_cache

import torch

from collate.ops.rope.reference import apply_mrope_reference

MRopeFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

# Set to "reference" to force the PyTorch path on any device (debugging, bisecting a kernel).
IMPL_ENV = "TOKENBAL_ROPE_IMPL"
_IMPLS = ("auto", "cpu", "reference", "triton", "npu")
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when ``import triton`` succeeds (probed once, lazily)."""
    try:
        importlib.import_module("triton")
    except Exception:  # ImportError, or a broken install raising at import
        return False
    return True


def _reference_inplace_aware(
    q: torch.Tensor,
    k: torch.Tensor,
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    mrope_section: Sequence[int],
    interleaved: bool = False,
    attention_scaling: float = 1.0,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    q_out, k_out = apply_mrope_reference(
        q, k, position_ids, inv_freq, mrope_section, interleaved, attention_scaling
    )
    if not inplace:
        return q_out, k_out
    # Same semantics as the kernels' in-place mode (no memory saving on this path).
    return q.copy_(q_out), k.copy_(k_out)


def _cpu_fn() -> MRopeFn:
    from collate.ops.rope.cpu import apply_mrope_cpu

    return apply_mrope_cpu


def _triton_fn() -> MRopeFn:
    from collate.ops.rope.triton import apply_mrope_triton

    return apply_mrope_triton


def _select_backend(device: torch.device, dtype: torch.dtype | None = None) -> MRopeFn:
    forced = os.environ.get(IMPL_ENV, "auto").strip().lower() or "auto"
    if forced not in _IMPLS:
        raise ValueError(f"{IMPL_ENV}={forced!r}; expected one of {_IMPLS}")
    if forced == "reference":
        return _reference_inplace_aware
    if forced == "cpu":
        return _cpu_fn()
    if forced == "triton":
        if not triton_available():
            raise RuntimeError(f"{IMPL_ENV}=triton but triton is not importable (pip install triton)")
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "") != "1":
            raise RuntimeError(
                f"{IMPL_ENV}=triton on a CPU tensor needs TRITON_INTERPRET=1 (set before triton is imported)"
            )
        return _triton_fn()
    if forced == "npu":
        from collate.ops.rope.npu import apply_mrope_npu

        return apply_mrope_npu
    if device.type == "cuda" and (dtype is None or dtype in _TRITON_DTYPES) and triton_available():
        return _triton_fn()
    if device.type == "npu":
        from collate.ops.rope.npu import apply_mrope_npu

        return apply_mrope_npu
    return _cpu_fn()


def apply_mrope(
    q: torch.Tensor,
    k: torch.Tensor,
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    mrope_section: Sequence[int],
    interleaved: bool = False,
    attention_scaling: float = 1.0,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply M-RoPE (or plain RoPE) to packed queries and keys.

    Args:
        q: ``(T, Hq, D)``; k: ``(T, Hk, D)`` (``Hq != Hk`` allowed: GQA).
        position_ids: integer ``(3, T)`` / ``(3, 1, T)`` T/H/W positions per token (text tokens have
            t == h == w), ``(4, 1, T)`` HF layout (row 0 ignored), or ``(T,)`` / ``(1, T)`` for 1-D RoPE.
            Per-sample positions concatenated: packing needs nothing else.
        inv_freq: ``(R/2,)`` inverse frequencies (theta and any static scaling baked in);
            ``R = 2 * sum(mrope_section) <= D``, dims ``R..D`` pass through unchanged.
        mrope_section: ``(s_t, s_h, s_w)`` frequencies per axis, e.g. (16, 24, 24) for Qwen2-VL.
        interleaved: Qwen3-VL ``THWTHW...`` layout instead of Qwen2/2.5-VL's chunked ``TT..HH..WW``.
        attention_scaling: HF's post-scale of cos/sin (1.0 for the default rope type).
        inplace: write the result into ``q`` and ``k`` and return them (saves two allocations on the
            kernel backends; autograd still works, ``q``/``k`` must not be leaves that require grad).

    Returns:
        ``(q_out, k_out)``, new tensors in the input dtypes unless ``inplace``; differentiable.
        Angles are float32.
    """
    fn = _select_backend(q.device, q.dtype)
    return fn(q, k, position_ids, inv_freq, mrope_section, interleaved, attention_scaling, inplace)
