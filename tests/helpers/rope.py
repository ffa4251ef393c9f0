"""Oracles for the RoPE tests: transformers-5.x-style M-RoPE written out independently, a float64
1-D RoPE, and the packed Qwen2-VL-like positions and q/k tensors the backend tests share.

The M-RoPE oracle follows transformers 5.24 ``Qwen2VLRotaryEmbedding.forward`` +
``recomposition_frequencies`` (chunked) and ``Qwen3VLTextRotaryEmbedding.recomposition_frequencies``
(interleaved), then ``apply_rotary_pos_emb`` with ``rotate_half``, on HF's ``(B, H, L, D)`` layout.
"""

from __future__ import annotations

import torch


def _inv_freq(rotary_dim: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _recompose_chunked(freq: torch.Tensor, section: list[int]) -> torch.Tensor:
    freq = torch.cat([m[i % 3] for i, m in enumerate(freq.split(section, dim=-1))], dim=-1)
    return torch.cat((freq, freq), dim=-1)


def _recompose_interleaved(freq: torch.Tensor, section: list[int]) -> torch.Tensor:
    freqs_thw = freq[0].clone()
    for dim, offset in ((1, 1), (2, 2)):
        length = section[dim] * 3
        idx = slice(offset, length, 3)
        freqs_thw[..., idx] = freq[dim, ..., idx]
    return torch.cat((freqs_thw, freqs_thw), dim=-1)


def hf_mrope(q, k, pos3, inv_freq, section, interleaved=False, scaling=1.0):
    """transformers-5.x math on packed (T, H, D) inputs; pos3 is (3, T). Partial rotary: first R dims."""
    position_ids = pos3[:, None, :]  # (3, bs=1, T)
    freqs = position_ids[..., None].float() * inv_freq.float()  # (3, 1, T, R/2)
    cos, sin = freqs.cos() * scaling, freqs.sin() * scaling
    recompose = _recompose_interleaved if interleaved else _recompose_chunked
    cos, sin = recompose(cos, section).to(q.dtype), recompose(sin, section).to(q.dtype)  # (1, T, R)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # unsqueeze_dim=1 -> (1, 1, T, R)
    rotary = inv_freq.numel() * 2
    out = []
    for x in (q, k):
        xh = x.transpose(0, 1).unsqueeze(0)  # (1, H, T, D)
        xr, xp = xh[..., :rotary], xh[..., rotary:]
        y = torch.cat([xr * cos + _rotate_half(xr) * sin, xp], dim=-1)
        out.append(y[0].transpose(0, 1))
    return out[0], out[1]


def rope_1d_oracle(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Float64 1-D RoPE (Llama form) as an accuracy oracle."""
    ang = pos.double()[:, None] * inv_freq.double()[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :]
    xd = x.double()
    return xd * cos + _rotate_half(xd) * sin


def _vision_positions(start: int, t: int, h: int, w: int) -> torch.Tensor:
    tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start


def _sample_positions(text_a: int, grid: tuple[int, int, int], text_b: int, offset: int = 0) -> torch.Tensor:
    """Qwen2-VL-like positions: text, one vision block, text (HF 5.x: next text at start + max(h, w))."""
    t, h, w = grid
    a = torch.arange(text_a).expand(3, -1) + offset
    v = _vision_positions(offset + text_a, t, h, w)
    b = torch.arange(text_b).expand(3, -1) + offset + text_a + max(h, w)
    return torch.cat([a, v, b], dim=1)


def _qk(T: int, hq: int, hk: int, d: int, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, hq, d, generator=g, dtype=torch.float32).to(dtype)
    k = torch.randn(T, hk, d, generator=g, dtype=torch.float32).to(dtype)
    return q, k


def check_inplace_on_projection_views(rope, pos: torch.Tensor, inv: torch.Tensor) -> None:
    """``rope(q, k, pos, inv, [4, 6, 6], inplace=...)`` on q / k that are views of one projection's output
    (``q_proj(h).view(T, H, D)``, the usual way; autograd refuses an in-place function with two outputs
    on such views): the same projection gradients in place as out of place, q / k returned in place."""
    proj = torch.nn.Linear(16, 6 * 40)
    h = torch.randn(pos.shape[1], 16)
    grads = []
    for inplace in (True, False):
        proj.zero_grad()
        qkv = proj(h).view(pos.shape[1], 6, 40)
        q, k = qkv[:, :4], qkv[:, 4:]
        qo, ko = rope(q, k, pos, inv, [4, 6, 6], inplace=inplace)
        assert (qo is q) == inplace and (ko is k) == inplace
        (qo.square().sum() + ko.sum()).backward()
        grads.append(proj.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=0)
