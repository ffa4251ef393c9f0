"""M-RoPE on Ascend NPUs through torch_npu's fused ops (``torch_npu`` is imported on first call).

Training path (default): build the merged per-token ``cos``/``sin`` of shape ``(T, R)`` once per call
with the reference's gather + fp32 trig (small torch ops on the device), then call
``torch_npu.npu_rotary_mul(x, cos, sin, rotary_mode="half")`` on ``(1, T, N, R)`` (BSND) views with
``(1, T, 1, R)`` cos/sin, for q and k. ``npu_rotary_mul`` computes ``x * r1 + rotate_half(x) * r2``
and has autograd (``npu_rotary_mul_backward``). Dims ``R..D`` pass through.

Inference path (opt-in): ``torch_npu.npu_mrope`` gathers cos/sin from a ``(max_pos, R)`` cache and
merges the sections inside one kernel, but it has no autograd and the op docs say inference only.
It is used only when ``TOKENBAL_NPU_MROPE_MAX_POS`` is set to the cache size (every position must be
below it; we never read positions back to check), no gradient is needed, and the documented limits
hold (sections, alignment, and ``s_h == s_w`` for the interleaved layout, because the op bounds both
H and W by ``3 * s_h``). Otherwise the training path runs.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from typing import Any

import torch

from collate.ops.rope.common import check_rope_args, mrope_angles, normalize_positions

MROPE_MAX_POS_ENV = "TOKENBAL_NPU_MROPE_MAX_POS"
# Sections listed in the npu_mrope docs (op-plugin @517f2e7d); others take the training path.
_NPU_MROPE_SECTIONS = ((16, 24, 24), (24, 20, 20), (8, 12, 12))
_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _torch_npu() -> Any:
    try:
        return importlib.import_module("torch_npu")
    except ImportError as exc:
        raise ModuleNotFoundError(
            "apply_mrope on NPU needs torch_npu (npu_rotary_mul); it is not importable. "
            "Set TOKENBAL_ROPE_IMPL=reference for the PyTorch path."
        ) from exc


def merged_cos_sin(
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    mrope_section: Sequence[int],
    interleaved: bool,
    num_tokens: int,
    attention_scaling: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``cos, sin`` of shape ``(T, R)`` in "half" layout (``cat(c, c)``), cast to ``dtype``."""
    angles = mrope_angles(position_ids, inv_freq, mrope_section, interleaved, num_tokens)  # fp32 (T, R/2)
    cos, sin = angles.cos(), angles.sin()
    if attention_scaling != 1.0:
        cos, sin = cos * attention_scaling, sin * attention_scaling
    return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((sin, sin), dim=-1).to(dtype)


def _rotary_mul(npu: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    num_tokens, _, d = x.shape
    rotary = cos.shape[-1]
    xr = x[..., :rotary] if rotary < d else x
    out = npu.npu_rotary_mul(
        xr.unsqueeze(0),  # (1, T, N, R): BSND
        cos.view(1, num_tokens, 1, rotary),
        sin.view(1, num_tokens, 1, rotary),
        rotary_mode="half",
    )[0]
    if rotary < d:
        out = torch.cat((out, x[..., rotary:]), dim=-1)
    return out


def _mrope_cache(inv_freq: torch.Tensor, max_pos: int, scale: float, dtype: torch.dtype) -> torch.Tensor:
    # Keyed by the tensor itself (held by the entry, so its id cannot pass to another tensor while
    # cached) and its version (an in-place change). An address key was not enough: a freed
    # inv_freq's block goes to the next tensor of its size, at version 0 too, which then got the
    # freed one's cos/sin.
    key = (id(inv_freq), inv_freq._version, inv_freq.device, max_pos, scale, dtype)
    entry = _cache.get(key)
    if entry is None or entry[0] is not inv_freq:
        pos = torch.arange(max_pos, device=inv_freq.device, dtype=torch.float32)
        ang = pos[:, None] * inv_freq.to(torch.float32)[None, :]
        table = (torch.cat((ang.cos(), ang.sin()), dim=-1) * scale).to(dtype)  # (max_pos, R): cos | sin
        if len(_cache) > 8:
            _cache.clear()
        entry = _cache[key] = (inv_freq, table)
    return entry[1]


def _npu_mrope_max_pos(
    q: torch.Tensor, k: torch.Tensor, section: tuple[int, int, int], interleaved: bool, rotary: int
) -> int:
    """The cache size if the inference op may run for this call, else 0."""
    raw = os.environ.get(MROPE_MAX_POS_ENV, "").strip()
    if not raw:
        return 0
    max_pos = int(raw)
    if max_pos <= 0:
        return 0
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return 0  # no autograd in npu_mrope
    if section not in _NPU_MROPE_SECTIONS or q.dtype != k.dtype:
        return 0
    if interleaved and section[1] != section[2]:
        return 0  # the op bounds W by 3 * s_h, transformers by 3 * s_w
    align = 16 if q.dtype == torch.float32 else 32
    if q.shape[-1] % align or rotary % align:
        return 0
    return max_pos


def apply_mrope_npu(
    q: torch.Tensor,
    k: torch.Tensor,
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    mrope_section: Sequence[int],
    interleaved: bool = False,
    attention_scaling: float = 1.0,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_npu M-RoPE; same arguments and results as :func:`collate.ops.rope.apply_mrope`."""
    section = check_rope_args(q, k, inv_freq, mrope_section)
    rotary = 2 * inv_freq.numel()
    npu = _torch_npu()
    num_tokens, hq, d = q.shape
    hk = k.shape[1]

    max_pos = _npu_mrope_max_pos(q, k, section, bool(interleaved), rotary)
    if max_pos:
        pos = normalize_positions(position_ids, num_tokens)
        cache = _mrope_cache(inv_freq, max_pos, float(attention_scaling), q.dtype)
        q_out, k_out = npu.npu_mrope(
            pos[0] if pos.shape[0] == 1 else pos,
            q.reshape(num_tokens, hq * d),
            k.reshape(num_tokens, hk * d),
            cache,
            d,
            mrope_section=list(section),
            rotary_mode="half",
            cache_mode="interleave" if interleaved else "default",
        )
        q_out, k_out = q_out.view(num_tokens, hq, d), k_out.view(num_tokens, hk, d)
    else:
        cos, sin = merged_cos_sin(
            position_ids, inv_freq, section, bool(interleaved), num_tokens, float(attention_scaling)
        )
        # npu_rotary_mul wants r1/r2 in x's dtype (the HF rounding of cos/sin).
        q_out = _rotary_mul(npu, q, cos.to(q.dtype), sin.to(q.dtype))
        k_out = _rotary_mul(npu, k, cos.to(k.dtype), sin.to(k.dtype))
    if inplace:
        return q.copy_(q_out), k.copy_(k_out)
    return q_out, k_out
