"""Ulysses sequence parallelism (DeepSpeed-Ulysses style) around :func:`varlen_attention`.

Each rank of an SP group of size ``S`` holds a contiguous slice of ``T / S`` tokens of one packed
row (:func:`collate.sp.shard_batch`) with all heads. One all-to-all turns that into the *whole*
row for ``H / S`` of the heads; :func:`varlen_attention` then runs over the row's real segments
(the full-row ``cu_seqlens`` the slice carries), and a second all-to-all brings the output back to
the rank's own slice with all heads. Attention is per head, so this is exactly the unsplit
attention. Both all-to-alls are autograd functions (the backward of an all-to-all is the reverse
all-to-all), built on ``torch.distributed.all_to_all_single``; nothing is read back from the device.

Heads: ``H`` must be divisible by ``S``. Grouped-query attention with ``Hk`` key/value heads:
``Hk % S == 0`` splits them like the queries (query group ``s`` keeps its own key/value heads);
``S % Hk == 0`` replicates every key/value head ``S / Hk`` times first (so each rank gets the one
its queries use); anything else is an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from collate.ops.attention import varlen_attention

__all__ = ["all_to_all_rows", "heads_to_seq", "seq_to_heads", "ulysses_attention", "ulysses_kv_heads"]


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` along dim 0 with host split sizes; backward: the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, out_splits: list[int] | None,
                in_splits: list[int] | None) -> torch.Tensor:
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        x = x.contiguous()
        rows = x.shape[0] if out_splits is None else sum(out_splits)
        out = x.new_empty((rows, *x.shape[1:]))
        dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        grad = grad.contiguous()
        rows = grad.shape[0] if ctx.in_splits is None else sum(ctx.in_splits)
        out = grad.new_empty((rows, *grad.shape[1:]))
        dist.all_to_all_single(out, grad, ctx.in_splits, ctx.out_splits, group=ctx.group)
        return out, None, None, None


def all_to_all_rows(x: torch.Tensor, group: Any, out_splits: Sequence[int] | None = None,
                    in_splits: Sequence[int] | None = None) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` of ``x``'s rows: ``in_splits[d]`` rows go to rank ``d``,
    ``out_splits[s]`` come from rank ``s`` (host ints; None: equal splits)."""
    return _AllToAll.apply(x, group, None if out_splits is None else [int(n) for n in out_splits],
                           None if in_splits is None else [int(n) for n in in_splits])


def seq_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``(T/S, H, D)`` slice, all heads -> ``(T, H/S, D)`` whole row, this rank's head group."""
    size = dist.get_world_size(group)
    t_local, heads, dim = x.shape
    chunks = x.reshape(t_local, size, heads // size, dim).transpose(0, 1)  # (S, T/S, H/S, D)
    out = all_to_all_rows(chunks.reshape(size * t_local, heads // size, dim), group)
    return out  # rows of rank s's slice arrive in block s: the row's order


def heads_to_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Inverse of :func:`seq_to_heads`: ``(T, H/S, D)`` -> ``(T/S, H, D)``."""
    size = dist.get_world_size(group)
    total, heads, dim = x.shape
    out = all_to_all_rows(x, group)  # block s: this rank's slice, head group s
    blocks = out.reshape(size, total // size, heads, dim).transpose(0, 1)
    return blocks.reshape(total // size, size * heads, dim)


def ulysses_kv_heads(num_heads: int, num_kv_heads: int, sp_size: int) -> int:
    """How many times each key/value head is replicated before the exchange (1: none); raises a
    ``ValueError`` naming the head counts when the heads cannot be split over ``sp_size`` ranks."""
    if num_heads % sp_size:
        raise ValueError(f"Ulysses: {num_heads} attention heads are not divisible by the SP size {sp_size}")
    if num_kv_heads % sp_size == 0:
        return 1
    if sp_size % num_kv_heads == 0:
        return sp_size // num_kv_heads
    raise ValueError(f"Ulysses: {num_kv_heads} key/value heads can neither be split over nor replicated to "
                     f"the SP size {sp_size} (one must divide the other)")


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Any, group: Any,
                      causal: bool = True, scale: float | None = None, dropout_p: float = 0.0
                      ) -> torch.Tensor:
    """:func:`varlen_attention` of a sequence-parallel slice: ``q (T/S, H, D)``, ``k``/``v``
    ``(T/S, Hk, D)`` of this rank's slice; ``batch`` carries the *whole row's* segments (``cu_seqlens``,
    ``cu_seqlens_list``, ``max_seqlen``). Returns ``(T/S, H, D)``, equal to the slice of the
    unsplit attention."""
    size = dist.get_world_size(group)
    if size == 1:
        return varlen_attention(q, k, v, batch, causal=causal, scale=scale, dropout_p=dropout_p)
    repeat = ulysses_kv_heads(q.shape[1], k.shape[1], size)
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    hq, hk = q.shape[1] // size, k.shape[1] // size
    if q.shape[-1] == v.shape[-1] == k.shape[-1]:
        # One exchange for q, k and v: per destination rank, its query heads then its key/value heads.
        t_local, dim = q.shape[0], q.shape[-1]
        joint = torch.cat([q.reshape(t_local, size, hq, dim), k.reshape(t_local, size, hk, dim),
                           v.reshape(t_local, size, hk, dim)], dim=2)
        qkv = seq_to_heads(joint.reshape(t_local, size * (hq + 2 * hk), dim), group)
        q_h, k_h, v_h = qkv.split([hq, hk, hk], dim=1)
    else:
        q_h, k_h, v_h = (seq_to_heads(x, group) for x in (q, k, v))
    out = varlen_attention(q_h, k_h, v_h, batch, causal=causal, scale=scale, dropout_p=dropout_p)
    return heads_to_seq(out, group)
