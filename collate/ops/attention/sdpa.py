"""Varlen attention as one ``scaled_dot_product_attention`` per packed segment.

The CPU backend, and the fallback on any device: segment boundaries come from the batch's *host*
list, so nothing is read back from the device. Cost is one SDPA launch per segment, fine on CPU and
for a handful of long segments on an accelerator; flash-attn is the fast path on CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def varlen_attention_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_list: Sequence[int],
    causal: bool = True,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """``q (T, Hq, D)``, ``k/v (T, Hk, D)``, ``cu_seqlens_list`` = segment ends (no leading 0)."""
    gqa = q.shape[1] != k.shape[1]
    outs = []
    start = 0
    for end in cu_seqlens_list:
        if end == start:
            continue  # an empty segment contributes no tokens
        # (L, H, D) -> (1, H, L, D): SDPA wants heads before the sequence and reads GQA groups at
        # dim -3. The batch dim matters: with 3-D inputs torch's CPU SDPA takes its math path,
        # 5-15x slower forward, 1.3-2.6x forward + backward (scripts/bench_attention.py).
        qs = q[start:end].transpose(0, 1)[None]
        ks = k[start:end].transpose(0, 1)[None]
        vs = v[start:end].transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(
            qs, ks, vs, dropout_p=dropout_p, is_causal=causal, scale=scale, enable_gqa=gqa
        )
        outs.append(o[0].transpose(0, 1))
        start = end
    if not outs:
        return q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    return torch.cat(outs, dim=0)
