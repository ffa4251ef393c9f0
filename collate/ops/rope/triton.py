"""M-RoPE for packed ``(T, H, D)`` tensors as one Triton kernel (CUDA; CPU under ``TRITON_INTERPRET=1``).

One program handles ``BLOCK_T`` tokens and every head of q and k (GQA: ``Hq != Hk``). It reads the
token's T/H/W positions (12-24 bytes per token) and ``inv_freq`` and computes the angles, cos and sin
in registers: no ``(T, D)`` cos/sin tensors are ever written to memory, and the trig cost is shared
by all ``Hq + Hk`` heads. Per frequency ``j < R/2`` (``R = 2 * sum(mrope_section)``)::

    axis(j)  = chunked:     T if j < s_t, H if j < s_t + s_h, else W             (Qwen2/2.5-VL)
               interleaved: H if j % 3 == 1 and j < 3*s_h; W if j % 3 == 2 and j < 3*s_w; else T
    theta    = float32(pos[axis(j)]) * float32(inv_freq[j])      (the same fp32 product as transformers)
    y[j]     = x[j] * c - x[j + R/2] * s        c = cos(theta) * scale, s = sin(theta) * scale
    y[j+R/2] = x[j + R/2] * c + x[j] * s        dims R..D pass through

The backward of a rotation is the rotation by ``-theta``: the same kernel with ``CONJUGATE`` (s -> -s).
Offsets are int64 (no overflow past 2**31 elements); token, head and dim strides are arguments, so
views straight out of a fused QKV projection work without ``.contiguous()``. I/O in fp32, bf16 or
fp16; all arithmetic in fp32. Head counts, sections and layout are compile-time constants (one
specialisation per model); token count and strides are runtime arguments.

``triton`` is imported when this module is imported; :mod:`collate.ops.rope` imports this module
only after probing that triton is importable.

Trig precision: ``tl.cos``/``tl.sin`` on fp32 lower, on NVIDIA, through MLIR's GPU-to-NVVM patterns
to libdevice ``__nv_cosf``/``__nv_sinf`` (full range reduction), read from Triton's source, not
measured here; the interpreter uses numpy. Tests cover positions up to 30k against the reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from collate.ops.rope.common import check_rope_args, fused_rotation, normalize_positions

_IO_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _rotate_heads(
    x_ptr,
    y_ptr,
    sx_t,
    sx_h,
    sx_d,
    sy_t,
    sy_h,
    sy_d,
    t_off,
    cos,
    sin,
    tmask,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    PASS: tl.constexpr,
    PASS_PAD: tl.constexpr,
    COPY_PASS: tl.constexpr,
):
    j = tl.arange(0, HALF_PAD)
    mask = tmask[:, None] & (j < HALF)[None, :]
    # int64 token offsets (t_off is int64) so T * stride may exceed 2**31.
    x_base = t_off[:, None] * sx_t + j[None, :] * sx_d
    y_base = t_off[:, None] * sy_t + j[None, :] * sy_d
    if COPY_PASS:
        jp = tl.arange(0, PASS_PAD)
        pmask = tmask[:, None] & (jp < PASS)[None, :]
        xp_base = t_off[:, None] * sx_t + (2 * HALF + jp)[None, :] * sx_d
        yp_base = t_off[:, None] * sy_t + (2 * HALF + jp)[None, :] * sy_d
    # Walk the heads by pointer increments: 64-bit pointer arithmetic, no int32 h * stride product.
    xh = x_ptr
    yh = y_ptr
    for _ in range(NUM_HEADS):
        x1 = tl.load(xh + x_base, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(xh + x_base + HALF * sx_d, mask=mask, other=0.0).to(tl.float32)
        y1 = x1 * cos - x2 * sin
        y2 = x2 * cos + x1 * sin
        tl.store(yh + y_base, y1.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(yh + y_base + HALF * sy_d, y2.to(y_ptr.dtype.element_ty), mask=mask)
        if COPY_PASS:
            xp = tl.load(xh + xp_base, mask=pmask, other=0.0)
            tl.store(yh + yp_base, xp.to(y_ptr.dtype.element_ty), mask=pmask)
        xh += sx_h
        yh += sy_h


@triton.jit
def _mrope_kernel(
    q_ptr,
    k_ptr,
    qo_ptr,
    ko_ptr,
    pos_ptr,
    inv_ptr,
    num_tokens,
    sq_t,
    sq_h,
    sq_d,
    sk_t,
    sk_h,
    sk_d,
    sqo_t,
    sqo_h,
    sqo_d,
    sko_t,
    sko_h,
    sko_d,
    sp_a,
    sp_t,
    scale,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    S_T: tl.constexpr,
    S_H: tl.constexpr,
    S_W: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    CONJUGATE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    PASS: tl.constexpr,
    PASS_PAD: tl.constexpr,
    COPY_PASS: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    t_off = pid * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    tmask = t_off < num_tokens
    j = tl.arange(0, HALF_PAD)

    # Positions of the three axes (for 1-D RoPE the caller passes sp_a = 0: three equal rows).
    p_t = tl.load(pos_ptr + t_off * sp_t, mask=tmask, other=0).to(tl.float32)
    p_h = tl.load(pos_ptr + sp_a + t_off * sp_t, mask=tmask, other=0).to(tl.float32)
    p_w = tl.load(pos_ptr + 2 * sp_a + t_off * sp_t, mask=tmask, other=0).to(tl.float32)
    if INTERLEAVED:
        use_h = ((j % 3) == 1) & (j < 3 * S_H)
        use_w = ((j % 3) == 2) & (j < 3 * S_W)
    else:
        use_h = (j >= S_T) & (j < S_T + S_H)
        use_w = j >= S_T + S_H
    pos = tl.where(use_h[None, :], p_h[:, None], tl.where(use_w[None, :], p_w[:, None], p_t[:, None]))
    inv = tl.load(inv_ptr + j, mask=j < HALF, other=0.0)
    theta = pos * inv[None, :]
    cos = tl.cos(theta)
    sin = tl.sin(theta)
    if HAS_SCALE:
        cos = cos * scale
        sin = sin * scale
    if CONJUGATE:
        sin = -sin

    _rotate_heads(
        q_ptr, qo_ptr, sq_t, sq_h, sq_d, sqo_t, sqo_h, sqo_d, t_off, cos, sin, tmask, NUM_Q_HEADS,
        HALF, HALF_PAD, PASS, PASS_PAD, COPY_PASS,
    )  # fmt: skip
    _rotate_heads(
        k_ptr, ko_ptr, sk_t, sk_h, sk_d, sko_t, sko_h, sko_d, t_off, cos, sin, tmask, NUM_K_HEADS,
        HALF, HALF_PAD, PASS, PASS_PAD, COPY_PASS,
    )  # fmt: skip


def _block_t(half: int) -> int:
    # Keep the (BLOCK_T, HALF_PAD) fp32 tiles (cos, sin, x1, x2, y1, y2) within a few KB of registers.
    return max(1, min(16, 1024 // triton.next_power_of_2(max(half, 1))))


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    pos: torch.Tensor,
    inv_freq: torch.Tensor,
    section: tuple[int, int, int],
    interleaved: bool,
    scale: float,
    conjugate: bool,
) -> None:
    num_tokens, hq, d = q.shape
    hk = k.shape[1]
    half = sum(section)
    rotary = 2 * half
    if num_tokens == 0 or (hq == 0 and hk == 0):
        return
    if half == 0:
        # Nothing rotates (a zero-width arange does not compile): every channel passes through.
        if not (q_out is q and k_out is k):
            q_out.copy_(q)
            k_out.copy_(k)
        return
    sp_a = pos.stride(0) if pos.shape[0] == 3 else 0
    inplace = q_out is q and k_out is k
    block_t = _block_t(half)
    grid = (triton.cdiv(num_tokens, block_t),)
    _mrope_kernel[grid](
        q, k, q_out, k_out, pos, inv_freq,
        num_tokens,
        *q.stride(), *k.stride(), *q_out.stride(), *k_out.stride(),
        sp_a, pos.stride(1),
        float(scale),
        NUM_Q_HEADS=hq, NUM_K_HEADS=hk,
        S_T=section[0], S_H=section[1], S_W=section[2],
        INTERLEAVED=bool(interleaved),
        CONJUGATE=bool(conjugate),
        HAS_SCALE=float(scale) != 1.0,
        PASS=d - rotary,
        PASS_PAD=triton.next_power_of_2(max(d - rotary, 1)),
        COPY_PASS=(d > rotary) and not inplace,
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        BLOCK_T=block_t,
    )  # fmt: skip


def apply_mrope_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    mrope_section: Sequence[int],
    interleaved: bool = False,
    attention_scaling: float = 1.0,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton M-RoPE; same arguments and results as :func:`collate.ops.rope.apply_mrope`.

    ``inplace=True`` writes the result into ``q`` and ``k`` (and returns them).
    """
    section = check_rope_args(q, k, inv_freq, mrope_section)
    if q.dtype not in _IO_DTYPES or k.dtype not in _IO_DTYPES:
        raise TypeError(f"triton M-RoPE takes fp32/bf16/fp16 q and k, got {q.dtype} and {k.dtype}")
    if q.device != k.device:
        raise ValueError(f"q on {q.device} but k on {k.device}")
    pos = normalize_positions(position_ids, q.shape[0])
    if pos.device != q.device:
        raise ValueError(f"position_ids on {pos.device} but q on {q.device}")
    inv = inv_freq.to(device=q.device, dtype=torch.float32).contiguous()
    return fused_rotation(q, k, pos, inv, section, bool(interleaved), float(attention_scaling), inplace,
                          _launch)
