"""What every M-RoPE backend shares: the packed positions they take, the argument rules, the angles
and the autograd wrapper of a fused kernel. Backends (reference.py, cpu.py, triton.py, npu.py) import
this file, never each other and never the dispatcher (dispatch.py).

Positions are the op's segments type: every packed token carries its own absolute (T/H/W) positions,
normalised to ``(A, T)`` by :func:`normalize_positions`, so packing needs no ``cu_seqlens`` here.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch

__all__ = ["FusedRotation", "check_rope_args", "frequency_axes", "mrope_angles", "normalize_positions"]


def normalize_positions(position_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Return positions as ``(A, T)`` with ``A`` = 1 (plain RoPE) or 3 (T/H/W rows).

    Accepts ``(T,)``, ``(1, T)``, ``(3, T)``, ``(3, 1, T)`` and HF's 4-row ``(4, T)`` / ``(4, 1, T)``
    (row 0 = text positions used only for masking, dropped here).
    """
    if position_ids.is_floating_point() or position_ids.is_complex():
        raise TypeError(f"position_ids must be an integer tensor, got {position_ids.dtype}")
    pos = position_ids
    if pos.dim() == 3:
        if pos.shape[1] != 1:
            raise ValueError(
                f"position_ids {tuple(pos.shape)}: packed tensors need batch dimension 1 (shape (3, 1, T))"
            )
        pos = pos[:, 0]
    elif pos.dim() == 1:
        pos = pos.unsqueeze(0)
    if pos.dim() != 2 or pos.shape[0] not in (1, 3, 4):
        raise ValueError(
            "position_ids must be (T,), (1, T), (3, T), (3, 1, T) or (4, 1, T); "
            f"got {tuple(position_ids.shape)}"
        )
    if pos.shape[0] == 4:
        pos = pos[1:]
    if pos.shape[1] != num_tokens:
        raise ValueError(f"position_ids cover {pos.shape[1]} tokens but q/k have {num_tokens}")
    return pos


@lru_cache(maxsize=64)
def _axis_map(section: tuple[int, int, int], interleaved: bool, device: torch.device) -> torch.Tensor:
    # Cached per device so the per-layer call never builds a host tensor and copies it (H2D) again.
    s_t, s_h, s_w = section
    half = s_t + s_h + s_w
    if interleaved:
        axes = []
        for j in range(half):
            if j % 3 == 1 and j < 3 * s_h:
                axes.append(1)
            elif j % 3 == 2 and j < 3 * s_w:
                axes.append(2)
            else:
                axes.append(0)
    else:
        axes = [0] * s_t + [1] * s_h + [2] * s_w
    return torch.tensor(axes, dtype=torch.long, device=device)


def frequency_axes(mrope_section: Sequence[int], interleaved: bool, device: torch.device) -> torch.Tensor:
    """The position row (0 = T, 1 = H, 2 = W) each rotary frequency reads, ``(R/2,)`` int64 on
    ``device``; cached per device, so a layer's call builds nothing on the host and copies nothing."""
    return _axis_map(tuple(int(s) for s in mrope_section), bool(interleaved), device)


def mrope_angles(
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    mrope_section: Sequence[int],
    interleaved: bool,
    num_tokens: int,
) -> torch.Tensor:
    """Rotation angles ``(T, R/2)`` in float32, picking each frequency's axis from the layout."""
    pos = normalize_positions(position_ids, num_tokens)
    freq = inv_freq.to(dtype=torch.float32)
    if pos.shape[0] == 1:
        # 1-D RoPE: every frequency reads the same row (equals M-RoPE with t == h == w).
        return pos[0].to(torch.float32)[:, None] * freq[None, :]
    axes = _axis_map(tuple(int(s) for s in mrope_section), bool(interleaved), pos.device)
    # (R/2, T) gather of the right row per frequency, then (T, R/2); same fp32 product as HF.
    return pos.index_select(0, axes).t().to(torch.float32) * freq[None, :]


class FusedRotation(torch.autograd.Function):
    """Autograd for a fused M-RoPE kernel (the CPU and Triton backends share it).

    ``kernel(q, k, q_out, k_out, pos, inv_freq, section, interleaved, scale, conjugate)`` rotates
    q and k into the outputs (in place when they are the inputs). The backward of a rotation R is
    Rᵀ g, a rotation by -θ with the same scale: the same kernel with ``conjugate=True``. Autograd
    materialises a missing output gradient as zeros, so both gradients are tensors there.
    """

    @staticmethod
    def forward(ctx, q, k, pos, inv_freq, section, interleaved, scale, inplace, kernel):
        q_out, k_out = (q, k) if inplace else (torch.empty_like(q), torch.empty_like(k))
        kernel(q, k, q_out, k_out, pos, inv_freq, section, interleaved, scale, False)
        ctx.save_for_backward(pos, inv_freq)
        ctx.section, ctx.interleaved, ctx.scale, ctx.kernel = section, interleaved, scale, kernel
        if inplace:
            ctx.mark_dirty(q, k)
        return q_out, k_out

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        pos, inv_freq = ctx.saved_tensors
        gq, gk = torch.empty_like(grad_q), torch.empty_like(grad_k)
        ctx.kernel(grad_q, grad_k, gq, gk, pos, inv_freq, ctx.section, ctx.interleaved, ctx.scale, True)
        return gq, gk, None, None, None, None, None, None, None


def fused_rotation(q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor,
                   section: tuple[int, int, int], interleaved: bool, scale: float, inplace: bool,
                   kernel) -> tuple[torch.Tensor, torch.Tensor]:
    """:class:`FusedRotation` for the backends. Autograd refuses a function that writes in place into a
    *view* that needs gradients and returns two tensors (the usual ``q_proj(h).view(T, H, D)``), so
    there the rotation runs out of place and is copied back into ``q`` and ``k`` (autograd tracks
    that copy): the same values and gradients, two temporaries more."""
    if inplace and torch.is_grad_enabled() and any(t.requires_grad and t._base is not None for t in (q, k)):
        q_out, k_out = FusedRotation.apply(q, k, pos, inv_freq, section, interleaved, scale, False, kernel)
        return q.copy_(q_out), k.copy_(k_out)
    return FusedRotation.apply(q, k, pos, inv_freq, section, interleaved, scale, inplace, kernel)


def check_rope_args(q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor,
                    mrope_section: Sequence[int]) -> tuple[int, int, int]:
    """The argument rules every backend shares; returns the section as a tuple of ints."""
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q and k must be (T, H, D); got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share T and D")
    section = tuple(int(s) for s in mrope_section)
    if len(section) != 3:
        raise ValueError(f"mrope_section must have 3 entries (t, h, w), got {list(mrope_section)}")
    half = inv_freq.numel()
    if sum(section) != half:
        raise ValueError(
            f"sum(mrope_section)={sum(section)} must equal len(inv_freq)={half} (= rotary_dim / 2)"
        )
    if 2 * half > q.shape[-1]:
        raise ValueError(f"rotary dim {2 * half} exceeds head dim {q.shape[-1]}")
    return section  # type: ignore[return-value]
