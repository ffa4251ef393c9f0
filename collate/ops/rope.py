"""``apply_mrope``: mixed 1-D / 3-D rotary embedding for packed ``(T, H, D)`` tensors.

Thin dispatch: the backend is chosen from the tensor's device. Only the PyTorch reference exists
today; Triton (CUDA) and torch_npu backends slot into :func:`_select_backend` later, each in its own
file, each imported lazily so this module never imports triton or torch_npu.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

from collate.ops.rope_reference import apply_mrope_reference

MRopeFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

# Set to "reference" to force the PyTorch path on any device (debugging, bisecting a kernel).
IMPL_ENV = "TOKENBAL_ROPE_IMPL"


def _select_backend(device: torch.device) -> MRopeFn:
    forced = os.environ.get(IMPL_ENV, "").strip().lower()
    if forced not in ("", "auto", "reference"):
        raise ValueError(f"{IMPL_ENV}={forced!r}: only 'reference' (or unset) is available")
    # Future: device.type == "cuda" and triton importable -> rope_triton; "npu" -> rope_npu.
    return apply_mrope_reference


def apply_mrope(
    q: torch.Tensor,
    k: torch.Tensor,
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    mrope_section: Sequence[int],
    interleaved: bool = False,
    attention_scaling: float = 1.0,
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

    Returns:
        ``(q_out, k_out)``, new tensors in the input dtypes; differentiable. Angles are float32.
    """
    fn = _select_backend(q.device)
    return fn(q, k, position_ids, inv_freq, mrope_section, interleaved, attention_scaling)
