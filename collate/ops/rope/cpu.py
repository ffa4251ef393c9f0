"""M-RoPE in plain PyTorch with few allocations: the CPU backend (and fallback on any other device).

Same math as :mod:`collate.ops.rope.reference` (the oracle), arranged like the Triton kernel:

- per-token ``(T, R/2)`` cos/sin from the positions, computed once per call and shared by q and k
  (never ``(T, D)`` tables, never per head);
- the rotation writes straight into one preallocated output with ``out=`` / ``addcmul_`` (fp32 and
  fp64), or through token blocks of dense fp32 scratch for bf16/fp16 (one conversion in, one
  rounding out, like the kernel), so the temporaries are O(block), not O(T * H * D);
- a ``torch.autograd.Function`` whose backward is the same rotation by ``-theta``; nothing but the
  positions is saved for backward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from collate.ops.rope.common import check_rope_args, fused_rotation, mrope_angles, normalize_positions

# Elements per block of fp32 scratch for half-precision inputs (two such blocks live at once: 16 MiB).
# Bigger blocks mean fewer, larger ops (much faster on a busy CPU); this bounds the temporaries.
BLOCK_ELEMENTS = 1 << 21


def _cos_sin(pos, inv_freq, section, interleaved, scale, conjugate, dtype):
    angles = mrope_angles(pos, inv_freq, section, interleaved, pos.shape[-1])  # fp32 (T, R/2)
    cos, sin = angles.cos(), angles.sin()
    if scale != 1.0:
        cos.mul_(scale)
        sin.mul_(scale)
    if conjugate:
        sin.neg_()
    return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def _rotate_into(
    x: torch.Tensor, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inplace: bool
) -> None:
    """``out[..., :R] = rotate(x[..., :R])``; copies the pass-through dims unless in place."""
    half = cos.shape[-1]
    rotary = 2 * half
    compute = cos.dtype
    if x.dtype == compute and not inplace:
        x1, x2 = x[..., :half], x[..., half:rotary]
        o1, o2 = out[..., :half], out[..., half:rotary]
        torch.mul(x1, cos, out=o1)
        o1.addcmul_(x2, sin, value=-1.0)
        torch.mul(x2, cos, out=o2)
        o2.addcmul_(x1, sin)
    else:
        # Half precision (or in place): convert a token block to `compute` once (a dense copy, so
        # in place is safe), rotate into a dense scratch block, round once into out.
        block = max(1, BLOCK_ELEMENTS // max(1, x.shape[1] * rotary))
        for start in range(0, x.shape[0], block):
            end = min(start + block, x.shape[0])
            xb = x[start:end, :, :rotary].to(compute, copy=True)
            yb = torch.empty_like(xb)
            x1, x2 = xb[..., :half], xb[..., half:]
            y1, y2 = yb[..., :half], yb[..., half:]
            c, s = cos[start:end], sin[start:end]
            torch.mul(x1, c, out=y1).addcmul_(x2, s, value=-1.0)
            torch.mul(x2, c, out=y2).addcmul_(x1, s)
            out[start:end, :, :rotary].copy_(yb)
    if rotary < x.shape[-1] and not inplace:
        out[..., rotary:].copy_(x[..., rotary:])


def _apply(q, k, q_out, k_out, pos, inv_freq, section, interleaved, scale, conjugate):
    compute = torch.promote_types(torch.promote_types(q.dtype, k.dtype), torch.float32)
    cos, sin = _cos_sin(pos, inv_freq, section, interleaved, scale, conjugate, compute)
    inplace = q_out is q and k_out is k
    _rotate_into(q, q_out, cos, sin, inplace)
    _rotate_into(k, k_out, cos, sin, inplace)


def apply_mrope_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    mrope_section: Sequence[int],
    interleaved: bool = False,
    attention_scaling: float = 1.0,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same arguments and results as :func:`collate.ops.rope.apply_mrope`; any device, any float dtype."""
    section = check_rope_args(q, k, inv_freq, mrope_section)
    pos = normalize_positions(position_ids, q.shape[0])
    scale = float(attention_scaling)
    return fused_rotation(q, k, pos, inv_freq, section, bool(interleaved), scale, inplace, _apply)
