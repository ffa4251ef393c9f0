"""Padded micro-batches measured, and the samplers tokenbal's padded plan is compared with.

``padded_micro_tokens`` / ``padded_summary``: what every micro-batch of an
:class:`~tokenbal.balance.plan.EpochPlan` costs when a collator pads it to its longest sample;
``batch_rebalance_plan`` (transformers' ``BatchRebalanceSampler``, ``train_sampling_strategy=
"batch_rebalance"``) and ``distributed_sampler_plan`` (torch's ``DistributedSampler`` batches) as
plans of the same shape; ``padded_comparison``, all of them on one set of lengths (``tokenbal plan
simulate --padded``, ``scripts/bench_balance.py --padded``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

__all__ = ["padded_micro_tokens", "padded_summary", "padded_comparison", "batch_rebalance_plan",
           "distributed_sampler_plan", "distributed_sampler_indices"]


def padded_micro_tokens(plan: Any, lengths: np.ndarray) -> np.ndarray:
    """(num_steps, num_replicas, grad_accum) padded tokens of every micro-batch of an
    :class:`~tokenbal.balance.plan.EpochPlan`: samples × longest sample (0 when empty)."""
    lens = np.asarray(getattr(lengths, "lengths", lengths), np.int64)
    counts = np.diff(plan.offsets)
    vals = lens[plan.indices]
    longest = np.zeros(len(counts), np.int64)
    nonempty = counts > 0
    if vals.size:
        longest[nonempty] = np.maximum.reduceat(vals, plan.offsets[:-1][nonempty])
    return (counts * longest).reshape(plan.num_steps, plan.num_replicas, plan.grad_accum)


def padded_summary(plan: Any, lengths: np.ndarray) -> dict[str, float]:
    """What a padded step costs under this plan:

    * ``sum_max_padded``: Σ over steps and micro-batches of the slowest rank's padded tokens (the
      time every rank spends when each micro-batch waits for its largest one);
    * ``padded_over_real``: all padded tokens / all real tokens (1.0 = nothing padded);
    * ``peak_padded``: the largest micro-batch in padded tokens (what activation memory must hold);
    * ``real_max_over_mean``: mean over steps of the real-token max/mean across ranks.
    """
    lens = np.asarray(getattr(lengths, "lengths", lengths), np.int64)
    padded = padded_micro_tokens(plan, lens)
    real = plan.micro_tokens(lens)
    rank_real = real.sum(2).astype(np.float64)
    mean = rank_real.mean(1)
    ratio = np.divide(rank_real.max(1), mean, out=np.ones(len(mean)), where=mean > 0)
    return {"steps": int(plan.num_steps), "sum_max_padded": int(padded.max(1).sum()),
            "padded_over_real": float(padded.sum() / max(1, real.sum())),
            "peak_padded": int(padded.max(initial=0)),
            "real_max_over_mean": float(ratio.mean()) if ratio.size else 1.0}


def padded_comparison(lengths: Any, num_replicas: int, global_batch_size: int, grad_accum: int = 1, *,
                      seed: int = 0, progress: Callable[[int, int, str], None] | None = None) -> str:
    """The table ``tokenbal plan simulate --padded`` prints: padded and packed cost of
    DistributedSampler, transformers' BatchRebalanceSampler (when transformers has it) and tokenbal's
    plans (token cost, padded cost), on the same lengths. ``progress(done, total, unit)``: the
    DistributedSampler's ranks (once, all from one permutation), then the BatchRebalanceSampler's
    steps (the long part). Each row has its step count; a plan with no whole step reads n/a."""
    from tokenbal.balance.plan import plan_epoch

    lens = np.asarray(getattr(lengths, "lengths", lengths), np.int64)
    R, N, k = int(num_replicas), int(global_batch_size), int(grad_accum)
    if N % (R * k):
        raise ValueError(f"padded_comparison {padded_batch_error(R, N, k)}")
    b = N // (R * k)
    plans = {"DistributedSampler": distributed_sampler_plan(lens, R, b, k, seed=seed, progress=progress)}
    left_out = None
    try:
        plans["batch_rebalance (transformers)"] = batch_rebalance_plan(lens, R, b, k, seed=seed,
                                                                       progress=progress)
    except ImportError:
        # Said under the table: the row was silently absent (what --help promises was not there).
        left_out = _batch_rebalance_missing()
    plans["tokenbal (cost tokens)"] = plan_epoch(lens, R, global_batch_size=N, grad_accum=k, seed=seed)
    plans["tokenbal (cost padded)"] = plan_epoch(lens, R, global_batch_size=N, grad_accum=k, seed=seed,
                                                 cost="padded")
    lines = [f"padded micro-batches of {b} per rank (each padded to its longest sample), {k} per step; "
             "packed = the same batches with no padding",
             f"{'method':<34}{'Σ max padded':>14}{'padded/real':>12}{'peak':>9}{'Σ max packed':>14}"
             f"{'steps':>7}"]
    for name, plan in plans.items():
        if not plan.num_steps:
            # No whole step (DistributedSampler keeps whole optimizer steps only): zeros would read as
            # the best row, n/a as in the first table.
            lines.append(f"{name:<34}{'n/a':>14}{'n/a':>12}{'n/a':>9}{'n/a':>14}{0:7d}")
            continue
        r = padded_summary(plan, lens)
        packed = int(plan.micro_tokens(lens).max(1).sum())
        lines.append(f"{name:<34}{r['sum_max_padded']:14d}{r['padded_over_real']:12.3f}{r['peak_padded']:9d}"
                     f"{packed:14d}{plan.num_steps:7d}")
    if left_out:
        lines.append(f"note: no batch_rebalance (transformers) row: {left_out}")
    return "\n".join(lines)


def _batch_rebalance_missing() -> str:
    """Why transformers' BatchRebalanceSampler cannot run here."""
    try:
        import transformers
    except ImportError:
        return "transformers is not installed (pip install 'tokenbal[hf]')"
    return (f"transformers {getattr(transformers, '__version__', '?')} has no "
            "transformers.trainer_pt_utils.BatchRebalanceSampler (5.19, 5.24 and 5.25 have it)")


def padded_batch_error(num_replicas: int, global_batch_size: int, grad_accum: int) -> str:
    """Why a global batch the padded baselines cannot split into per-device batches is refused."""
    R, k = int(num_replicas), int(grad_accum)
    return (f"needs a global batch size divisible by ranks x grad_accum ({R} x {k} = {R * k}), got "
            f"{global_batch_size}: the padded baselines take per-device batches of global / (ranks x "
            "grad_accum)")


def _plan_from_lists(per_rank: list[list[list[int]]], R: int, k: int) -> Any:
    """An EpochPlan holding ``per_rank[r]`` = rank r's micro-batches (all ranks the same count)."""
    from tokenbal.balance.plan import EpochPlan

    steps = len(per_rank[0]) // k
    flat, offsets = [], [0]
    for s in range(steps):
        for r in range(R):
            for j in range(k):
                mb = per_rank[r][s * k + j]
                flat.extend(mb)
                offsets.append(offsets[-1] + len(mb))
    return EpochPlan(R, np.asarray(flat, np.int64), np.asarray(offsets, np.int64), grad_accum=k)


def batch_rebalance_plan(lengths: np.ndarray, num_replicas: int, per_device_batch: int, grad_accum: int = 1,
                         *, seed: int = 42, drop_last: bool = False, epoch: int = 0,
                         progress: Callable[[int, int, str], None] | None = None) -> Any:
    """transformers' own ``BatchRebalanceSampler`` (``train_sampling_strategy="batch_rebalance"``) run
    for every rank, as the Trainer builds it (effective batch = per-device × ranks × accumulation),
    collected into an EpochPlan. Needs transformers >= 5.24.

    Every rank's sampler computes every rank's micro-batches of a step (``_assign``) and keeps its
    own, so R samplers would do R times one sampler's work (1M samples on 512 ranks: ~90 s each, hours
    in all): where the class has that per-step hook, one sampler runs and hands out every rank's
    part of each step; otherwise each rank's sampler runs. ``progress(done, total, "steps")``."""
    from transformers.trainer_pt_utils import BatchRebalanceSampler

    R, k = int(num_replicas), int(grad_accum)
    lens = [int(x) for x in np.asarray(getattr(lengths, "lengths", lengths))]

    def sampler(cls: type, rank: int) -> Any:
        s = cls(lengths=lens, effective_batch_size=int(per_device_batch) * R * k, dp_size=R, grad_accum=k,
                seed=seed, rank=rank, drop_last=drop_last)
        s.set_epoch(epoch)
        return s

    one_pass = _hands_out_steps(BatchRebalanceSampler)
    steps = len(sampler(BatchRebalanceSampler, 0)) // k          # (its len: steps x grad_accum)
    marks = _StepMarks(progress, steps if one_pass else steps * R)
    per_rank: list[list[list[int]]] = [[] for _ in range(R)]
    if one_pass:
        class EveryRank(BatchRebalanceSampler):
            # transformers' own epoch order, tail padding and per-step _assign; each step's rank_mbs
            # (rank -> its grad_accum micro-batches) whole instead of rank `rank`'s part of it.
            def _yield_global_batch(self, batch_indices: list[int]) -> Iterator[Any]:
                yield self._assign(batch_indices, [self.lengths[i] for i in batch_indices])

        if _balance_is_ported(BatchRebalanceSampler):
            # The same balancing, on arrays (the class's own recomputes every group's cost in Python
            # at each one-sample move: ~85 % of this baseline at 1M samples on 512 ranks).
            EveryRank._balance_groups = _balance_groups_on_arrays

        for rank_mbs in sampler(EveryRank, 0):
            for r in range(R):
                per_rank[r].extend(list(mb) for mb in rank_mbs[r])
            marks.step()
    else:
        for r in range(R):
            for n, mb in enumerate(sampler(BatchRebalanceSampler, r)):
                per_rank[r].append(list(mb))
                if n % k == k - 1:
                    marks.step()
    marks.end()
    return _plan_from_lists(per_rank, R, k)


def _hands_out_steps(cls: type) -> bool:
    """Whether transformers' ``BatchRebalanceSampler`` makes every step through
    ``_yield_global_batch(batch_indices)`` with ``_assign(indices, lengths)`` returning every rank's
    micro-batches (5.24-5.25's, read there; private, so checked before it is relied on)."""
    import inspect

    try:
        hook = inspect.signature(cls._yield_global_batch).parameters
        assign = inspect.signature(cls._assign).parameters
    except (AttributeError, TypeError, ValueError):
        return False
    return list(hook) == ["self", "batch_indices"] and list(assign) == ["self", "indices", "lengths"]


# transformers' BatchRebalanceSampler balancing (5.19-5.25, the same source in each, read there):
# sha256 of the source of these methods, which _balance_groups_on_arrays ports. A class whose source
# differs runs its own (slow, but its own result).
_BALANCE_METHODS = ("_cost", "_group_cost", "_groups_costs_from", "_slot_groups", "_relieve_and_freeze",
                    "_balance_groups")
_BALANCE_SOURCE_SHA256 = "b110b9b6aa63d6fcfe9ad5c3677c6a0175fae449e84e2f7495948c992e1c863d"


def _balance_is_ported(cls: type) -> bool:
    """Whether ``cls``'s balancing is the source :func:`_balance_groups_on_arrays` ports."""
    import hashlib
    import inspect

    try:
        source = "".join(inspect.getsource(getattr(cls, name)) for name in _BALANCE_METHODS)
    except (AttributeError, OSError, TypeError):
        return False
    return (hashlib.sha256(source.encode()).hexdigest() == _BALANCE_SOURCE_SHA256
            and getattr(cls, "QUADRATIC_COST_COEF", None) == 0.001)


def _balance_groups_on_arrays(sampler: Any, sorted_pairs: list[tuple[int, int]]
                              ) -> list[list[tuple[int, int]]]:
    """``BatchRebalanceSampler._balance_groups(sorted_pairs)`` step for step, its group counts and
    costs held in arrays: the same moves, ties broken the same way (first index of a max / min, a
    stable sort for the cost ranking, the slot's groups visited in the order of the same Python
    set), the same float costs (``bs * L + coef * bs * L * L``, evaluated in that order), so the same
    groups (``test_padded.py::test_balance_groups_on_arrays_is_the_class_own``)."""
    n = len(sorted_pairs)
    K = sampler.dp_size * sampler.grad_accum
    if n < K:
        # the class refuses this too (a ValueError): every group needs a sample
        raise ValueError(f"BatchRebalanceSampler baseline: {n} samples cannot fill {K} groups "
                         f"({sampler.dp_size} ranks x {sampler.grad_accum} micro-batches) with one each")
    coef = sampler.QUADRATIC_COST_COEF
    longest = np.zeros(n + 1, np.int64)         # a group's first (longest) sample; 0 past the end
    longest[:n] = [length for _, length in sorted_pairs]
    counts = np.full(K, n // K, np.int64)
    counts[:n % K] += 1
    starts = np.zeros(K, np.int64)

    def group_costs(c: np.ndarray) -> np.ndarray:
        np.cumsum(c[:-1], out=starts[1:])
        top = longest[starts]
        return c * top + coef * c * top * top      # 0.0 for an empty group, as _group_cost

    frozen = np.zeros(K, bool)
    seen: set[bytes] = set()
    best_spread, best_counts = float("inf"), counts.copy()
    for _ in range(max(K * 30, sampler.effective_batch_size)):
        key = counts.tobytes()
        if key in seen:
            break
        seen.add(key)
        costs = group_costs(counts)
        active = np.flatnonzero(~frozen)
        if len(active) <= 1:
            break
        active_costs = costs[active]
        hi, lo = active[int(np.argmax(active_costs))], active[int(np.argmin(active_costs))]
        spread = costs[hi] - costs[lo]
        if spread < best_spread:
            best_spread, best_counts = spread, counts.copy()
        if costs[hi] == costs[lo]:
            break
        if counts[hi] > 1:
            # The cheapest active group (first of a stable ascending sort) takes one sample.
            counts[hi] -= 1
            counts[lo] += 1
            continue
        # _slot_groups: hi's slot in the descending cost ranking, as the same set.
        ranking = np.argsort(-costs, kind="stable").tolist()
        slot = ranking.index(int(hi)) // sampler.dp_size * sampler.dp_size
        members = set(ranking[slot:slot + sampler.dp_size])
        cap = costs[hi]
        outside = np.ones(K, bool)
        outside[list(members)] = False
        for gi in members:   # _relieve_and_freeze
            if frozen[gi] or gi == hi:
                continue
            while True:
                costs_now = group_costs(counts)
                top = int(longest[counts[:gi].sum()]) if counts[gi] > 0 else 0
                if sampler._cost(int(counts[gi]) + 1, top) > cap:
                    break
                donors = np.flatnonzero(~frozen & outside & (counts > 1))
                if not len(donors):
                    break
                donor = donors[int(np.argmin(costs_now[donors]))]
                counts[gi] += 1
                counts[donor] -= 1
        frozen[list(members)] = True
    bounds = np.concatenate([[0], np.cumsum(best_counts)]).tolist()
    return [sorted_pairs[bounds[i]:bounds[i + 1]] for i in range(K)]


class _StepMarks:
    """``progress(done, total, "steps")`` about every 1 % of ``total`` steps, and once at the end."""

    def __init__(self, progress: Callable[[int, int, str], None] | None, total: int) -> None:
        self.progress, self.total, self.done = progress, max(int(total), 0), 0
        self.every = max(1, self.total // 100)

    def step(self) -> None:
        self.done += 1
        if self.progress is not None and self.done % self.every == 0 and self.done < self.total:
            self.progress(self.done, self.total, "steps")

    def end(self) -> None:
        if self.progress is not None:
            self.progress(self.total, self.total, "steps")


def distributed_sampler_indices(num_samples: int, num_replicas: int, *, shuffle: bool = True, seed: int = 0,
                                epoch: int = 0, drop_last: bool = False) -> np.ndarray:
    """(num_replicas, per-rank count) int64: row r is what torch's ``DistributedSampler(range(num_samples),
    num_replicas, rank=r, shuffle, seed, drop_last)`` yields after ``set_epoch(epoch)``, every rank from
    one permutation (a real sampler per rank draws the same permutation R times: 20 s at 1M samples on
    512 ranks). Its steps, read in torch 2.13's ``DistributedSampler.__iter__``: ``randperm(n)`` from a
    generator seeded ``seed + epoch`` (``arange`` without shuffle); without drop_last, padded to a
    multiple of the ranks by repeating the order from its head (cyclically, when it is shorter than
    the padding); with drop_last, cut to that multiple; then rank r takes ``[r::R]``."""
    import torch

    n, R = int(num_samples), int(num_replicas)
    if R < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if n < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    if drop_last and n % R:
        per_rank = math.ceil((n - R) / R)          # torch's expression (0 when n < R)
    else:
        per_rank = math.ceil(n / R)
    total = per_rank * R
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        order = torch.randperm(n, generator=g).numpy().astype(np.int64, copy=False)
    else:
        order = np.arange(n, dtype=np.int64)
    # np.resize repeats the order cyclically to `total` (the padding) or cuts it (drop_last).
    order = np.resize(order, total) if total else np.zeros(0, np.int64)
    return order.reshape(per_rank, R).T


def distributed_sampler_plan(lengths: np.ndarray, num_replicas: int, per_device_batch: int,
                             grad_accum: int = 1, *, seed: int = 0, epoch: int = 0,
                             progress: Callable[[int, int, str], None] | None = None) -> Any:
    """``DistributedSampler(shuffle=True, drop_last=False)`` + ``per_device_batch`` batches per rank,
    as the Trainer's default loader does: a seeded permutation padded by repeating its head to a
    multiple of the ranks, rank r taking every R-th sample; a last short batch is kept. Every rank's
    part comes from one permutation (:func:`distributed_sampler_indices`);
    ``progress(R, R, "ranks")`` once, when all ranks are done."""
    R, k, b = int(num_replicas), int(grad_accum), int(per_device_batch)
    if b < 1 or k < 1:
        raise ValueError(f"per_device_batch and grad_accum must be >= 1, got {b} and {k}")
    n = len(np.asarray(getattr(lengths, "lengths", lengths)))
    rows = distributed_sampler_indices(n, R, seed=seed, epoch=epoch)
    per_rank = rows.shape[1]
    batches = -(-per_rank // b)                         # BatchSampler(drop_last=False): a short last one
    # Whole optimizer steps only (the Trainer also runs a last partial one, with fewer micro-batches).
    kept = batches - batches % k
    steps = kept // k
    # Every rank's batches as (R, kept, b), the short last one padded with -1 and the holes dropped.
    padded = np.full((R, batches * b), -1, np.int64)
    padded[:, :per_rank] = rows
    grid = padded.reshape(R, batches, b)[:, :kept].reshape(R, steps, k, b).transpose(1, 0, 2, 3)
    sizes = (grid >= 0).sum(3).ravel()
    flat = grid.ravel()
    offsets = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    if progress is not None:
        progress(R, R, "ranks")
    from tokenbal.balance.plan import EpochPlan

    return EpochPlan(R, flat[flat >= 0], offsets, grad_accum=k)
