"""Oracles and inputs shared by the varlen-attention backend tests: a float64 full attention with a
block-diagonal mask, packed batches in the collator's form, and a tensor stand-in that fails on use."""

from __future__ import annotations

import math

import torch

from collate.ops.attention import segment_ends


def _batch(seq_lens: list[int]) -> dict:
    ends = segment_ends(seq_lens)
    return {
        "cu_seqlens": torch.tensor([0, *ends], dtype=torch.int32),
        "cu_seqlens_list": ends,
        "max_seqlen": max(seq_lens),
        "seq_lens": list(seq_lens),
    }


def masked_full_attention(q, k, v, seq_lens, causal=True, scale=None):
    """Oracle: one attention over all T tokens with a block-diagonal (causal) boolean mask, float64."""
    T, hq, d = q.shape
    seg = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens))
    allowed = seg[:, None] == seg[None, :]
    if causal:
        allowed &= torch.ones(T, T, dtype=torch.bool).tril()
    rep = hq // k.shape[1]
    kk = k.double().repeat_interleave(rep, dim=1)
    vv = v.double().repeat_interleave(rep, dim=1)
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    scores = torch.einsum("thd,shd->hts", q.double(), kk) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), vv)


def _qkv(T, hq, hk, d, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(T, hq, d, generator=g).to(dtype),
        torch.randn(T, hk, d, generator=g).to(dtype),
        torch.randn(T, hk, d, generator=g).to(dtype),
    )


class _Exploding:
    """A stand-in device tensor: any use means the CPU path read cu_seqlens instead of the host list."""

    def __getattr__(self, name):
        raise AssertionError(f"cu_seqlens.{name} touched on the CPU path")
