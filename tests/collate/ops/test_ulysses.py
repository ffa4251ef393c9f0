"""Ulysses attention on real gloo ranks equals single-process varlen_attention (output and grads)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from collate.ops.attention import segment_ends, varlen_attention
from collate.ops.ulysses import all_to_all_rows, ulysses_attention, ulysses_kv_heads
from tests.helpers.dist_utils import run_ranks

SEQ_LENS = [5, 13, 1, 9, 4]  # 32 tokens; the SP cuts (16, or 8/16/24) fall inside segments
HEAD_DIM = 8


def _inputs(heads: int, kv_heads: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    total = sum(SEQ_LENS)
    q = torch.randn(total, heads, HEAD_DIM, generator=g, dtype=torch.float64).float()
    k = torch.randn(total, kv_heads, HEAD_DIM, generator=g, dtype=torch.float64).float()
    v = torch.randn(total, kv_heads, HEAD_DIM, generator=g, dtype=torch.float64).float()
    grad = torch.randn(total, heads, HEAD_DIM, generator=g, dtype=torch.float64).float()
    return q, k, v, grad


def _batch() -> dict:
    ends = segment_ends(SEQ_LENS)
    return {"cu_seqlens": torch.tensor([0, *ends], dtype=torch.int32), "cu_seqlens_list": ends,
            "max_seqlen": max(SEQ_LENS)}


def _reference(heads: int, kv_heads: int) -> dict[str, torch.Tensor]:
    q, k, v, grad = _inputs(heads, kv_heads)
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = varlen_attention(q, k, v, _batch(), causal=True, scale=0.3)
    out.backward(grad)
    return {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}


def _rank(rank: int, world: int, cases: list[tuple[int, int]]) -> dict:
    results = {}
    for heads, kv_heads in cases:
        q, k, v, grad = _inputs(heads, kv_heads)
        local = q.shape[0] // world
        cut = slice(rank * local, (rank + 1) * local)
        q, k, v = (x[cut].clone().requires_grad_() for x in (q, k, v))
        out = ulysses_attention(q, k, v, _batch(), dist.group.WORLD, causal=True, scale=0.3)
        out.backward(grad[cut])
        results[heads, kv_heads] = {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}
    errors = []
    for heads, kv_heads in ((3, 3), (6, 3)) if world == 2 else ((6, 6), (12, 6)):
        q, k, v, _ = _inputs(heads, kv_heads)
        try:
            ulysses_attention(q[:16], k[:16], v[:16], _batch(), dist.group.WORLD)
        except ValueError as e:
            errors.append(str(e))
    # Uneven all-to-all of rows (the vision features' exchange): rank r sends r+1 rows to rank 0
    # and 2 rows to every other rank; the backward returns each row's gradient to its sender.
    sends = [rank + 1] + [2] * (world - 1)
    recvs = [src + 1 for src in range(world)] if rank == 0 else [2] * world
    x = (torch.arange(sum(sends), dtype=torch.float32) + 100 * rank).requires_grad_()
    got = all_to_all_rows(x[:, None], dist.group.WORLD, recvs, sends)[:, 0]
    (got * (torch.arange(got.shape[0]) + 1 + 10 * rank)).sum().backward()
    results["rows"] = {"got": got.detach(), "grad": x.grad}
    results["errors"] = errors
    return results


@pytest.mark.parametrize("world,cases", [
    (2, [(4, 4), (4, 2), (4, 1), (6, 2)]),   # MHA, GQA split, GQA replicated (Hk < S), Hk/S = 1 of 3
    (4, [(4, 2), (8, 4), (4, 1)]),           # replicate 2 -> 4 and 1 -> 4
])
def test_ulysses_equals_single_process_varlen_attention(world, cases):
    results = run_ranks(_rank, world, cases, timeout=180, collective_timeout=60)
    for case in cases:
        want = _reference(*case)
        local = want["out"].shape[0] // world
        for rank, res in enumerate(results):
            cut = slice(rank * local, (rank + 1) * local)
            for key in ("out", "q", "k", "v"):
                torch.testing.assert_close(res[case][key], want[key][cut], rtol=1e-5, atol=1e-6,
                                           msg=f"{case} rank {rank} {key}")
    errors = results[0]["errors"]
    assert "attention heads are not divisible by the SP size" in errors[0]
    assert "key/value heads can neither be split over nor replicated" in errors[1]
    # rows: rank 0 receives rank s's first s+1 rows; rank d>0 receives rows from each sender's block d.
    assert results[0]["rows"]["got"].tolist() == [100.0 * s + i for s in range(world) for i in range(s + 1)]
    for rank, res in enumerate(results):
        # d(loss)/d(row) = the weight the receiver gave it: 1 + position at receiver + 10 * receiver
        sends = [rank + 1] + [2] * (world - 1)
        starts = [0, *torch.tensor(sends).cumsum(0).tolist()]
        for dest in range(world):
            before = sum(s + 1 for s in range(rank)) if dest == 0 else 2 * rank
            want = [1 + before + i + 10 * dest for i in range(sends[dest])]
            assert res["rows"]["grad"][starts[dest]:starts[dest + 1]].tolist() == want


def test_kv_head_plan():
    assert ulysses_kv_heads(8, 8, 4) == 1
    assert ulysses_kv_heads(8, 2, 4) == 2
    assert ulysses_kv_heads(8, 1, 8) == 8
    with pytest.raises(ValueError, match="14 attention heads are not divisible by the SP size 4"):
        ulysses_kv_heads(14, 2, 4)
    with pytest.raises(ValueError, match="6 key/value heads"):
        ulysses_kv_heads(12, 6, 4)
