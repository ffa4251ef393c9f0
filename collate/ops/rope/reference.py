"""Pure-PyTorch M-RoPE for packed ``(T, H, D)`` tensors: the oracle the other backends are tested against.

Semantics (transformers 5.24 Qwen2-VL / Qwen2.5-VL chunked layout, Qwen3-VL interleaved layout):
for token ``t`` and frequency ``j < R/2`` (``R = 2 * sum(mrope_section)``)::

    axis(j)  = chunked:     T if j < s_t, H if j < s_t + s_h, else W
               interleaved: H if j % 3 == 1 and j < 3*s_h; W if j % 3 == 2 and j < 3*s_w; else T
    theta    = float32(position[axis(j), t]) * float32(inv_freq[j])
    y[j]     = x[j] * cos(theta) * scale - x[j + R/2] * sin(theta) * scale
    y[j+R/2] = x[j + R/2] * cos(theta) * scale + x[j] * sin(theta) * scale
    y[R:]    = x[R:]                                  (partial rotary: pass-through)

Every token carries its own absolute positions, so packing needs no ``cu_seqlens`` here.
Plain autograd gives the backward (the rotation is linear in ``x``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from collate.ops.rope.common import FusedRotation, check_rope_args, mrope_angles, normalize_positions

__all__ = ["FusedRotation", "apply_mrope_reference", "check_rope_args", "mrope_angles", "normalize_positions"]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    half = rotary_dim // 2
    # Upcast so bf16/fp16 inputs are rotated in fp32 (HF multiplies in x.dtype; fp32 is more
    # accurate); float64 stays float64 so gradcheck sees exact arithmetic.
    compute = torch.promote_types(x.dtype, torch.float32)
    xc = x.to(compute)
    c = cos.to(compute)[:, None, :]
    s = sin.to(compute)[:, None, :]
    x1 = xc[..., :half]
    x2 = xc[..., half:rotary_dim]
    parts = [x1 * c - x2 * s, x2 * c + x1 * s]
    if rotary_dim < x.shape[-1]:
        parts.append(xc[..., rotary_dim:])
    return torch.cat(parts, dim=-1).to(x.dtype)


def apply_mrope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    mrope_section: Sequence[int],
    interleaved: bool = False,
    attention_scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate packed ``q (T, Hq, D)`` and ``k (T, Hk, D)``; returns new tensors of the input dtypes."""
    check_rope_args(q, k, inv_freq, mrope_section)
    rotary_dim = 2 * inv_freq.numel()
    angles = mrope_angles(position_ids, inv_freq, mrope_section, interleaved, q.shape[0])
    cos = angles.cos()
    sin = angles.sin()
    if attention_scaling != 1.0:
        cos = cos * attention_scaling
        sin = sin * attention_scaling
    return _rotate(q, cos, sin, rotary_dim), _rotate(k, cos, sin, rotary_dim)
