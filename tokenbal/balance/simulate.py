"""Balance metrics and the simulator: what a plan buys against DistributedSampler-style sharding and
per-step partitioning (verl's Karmarkar–Karp, LPT), on the same samples (``tokenbal plan simulate``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tokenbal._checks import check_lengths
from tokenbal._checks import nonneg_int as _nonneg_int
from tokenbal._checks import positive_int as _positive_int
from tokenbal.balance.cost import resolve, to_int_costs
from tokenbal.balance.partition import partition
from tokenbal.balance.plan import EpochPlan, plan_epoch
from tokenbal.balance.plan.stages import _compose_fill, _step_times
from tokenbal.balance.settings import PlanSettings

__all__ = ["step_balance", "step_stage_balance", "plan_stage_costs", "step_lower_bound",
           "count_sharded_step_tokens", "per_step_partition_tokens", "balance_summary", "simulate",
           "Simulation", "epoch_stage_figure", "composition_floor", "equal_count_floor",
           "split_figure", "length_grouped_steps", "best_plan_figure"]


# progress(done, total, unit): what the CLI's progress bar takes (counted work, never time).
Progress = Callable[[int, int, str], None]


def step_balance(step_rank_tokens: np.ndarray) -> np.ndarray:
    """Per-step max/mean of rank tokens (1.0 = perfect). Steps with no tokens count as 1.0."""
    t = np.asarray(step_rank_tokens, np.float64)
    mean = t.mean(1)
    return np.divide(t.max(1), mean, out=np.ones(len(t)), where=mean > 0)


def step_stage_balance(step_rank_stage: np.ndarray) -> np.ndarray:
    """Per-step ``Σ_stage max_rank / (step total / ranks)`` from (steps, ranks, stages) costs: the step
    time when every stage waits for its slowest rank (FSDP: vision tower, then LLM), over the ideal."""
    t = np.asarray(step_rank_stage, np.float64)
    mean = t.sum((1, 2)) / t.shape[1]
    return np.divide(t.max(1).sum(1), mean, out=np.ones(len(t)), where=mean > 0)


def plan_stage_costs(plan: EpochPlan, stage_costs: np.ndarray) -> np.ndarray:
    """(steps, ranks · grad_accum, stages) cost of every micro-batch, for :func:`step_stage_balance`
    (micro-batch j of every rank is its own synchronised group, so each is a column)."""
    c = np.asarray(stage_costs, np.int64)
    per = [plan.micro_tokens(c[:, k]) for k in range(c.shape[1])]      # (S, R, k) each
    out = np.stack(per, -1)                                              # (S, R, k, K)
    if plan.grad_accum == 1:
        return out[:, :, 0, :]
    # Σ over micro-steps of Σ_stage max_rank: fold the micro index into the stage axis.
    return out.reshape(plan.num_steps, plan.num_replicas, -1)


def step_lower_bound(step_rank_tokens: np.ndarray, step_max_item: np.ndarray) -> np.ndarray:
    """Per-step ideal max/mean: max(mean, largest sample) / mean. No split of that step's samples
    over the ranks can do better, so ``step_balance / step_lower_bound`` is the planner's own slack."""
    t = np.asarray(step_rank_tokens, np.float64)
    mean = t.mean(1)
    ideal = np.maximum(mean, np.asarray(step_max_item, np.float64))
    return np.divide(ideal, mean, out=np.ones(len(t)), where=mean > 0)


def count_sharded_step_tokens(lengths: np.ndarray, num_replicas: int, global_batch_size: int,
                              seed: int = 0) -> np.ndarray:
    """(steps, ranks) tokens of ``DistributedSampler``-style sharding: a seeded permutation, rank r
    takes every R-th sample, then ``global_batch_size // R`` consecutive samples per step (the
    baseline tokenbal replaces; same structure as torch's, numpy permutation)."""
    lens = check_lengths(lengths)
    R = int(num_replicas)
    per_rank = max(1, int(global_batch_size) // R)
    perm = np.random.default_rng(seed).permutation(len(lens))
    rows = len(perm) // R
    steps = rows // per_rank
    t = lens[perm[:steps * per_rank * R]].reshape(steps, per_rank, R)
    return t.sum(1)


def per_step_partition_tokens(lengths: np.ndarray, num_replicas: int, global_batch_size: int,
                              method: str = "kk", seed: int = 0, max_steps: int | None = None,
                              equal_counts: bool = True, progress: Progress | None = None
                              ) -> tuple[np.ndarray, np.ndarray]:
    """Per-step rebalancing (what verl does with Karmarkar–Karp each step): a seeded permutation cut
    into steps of N samples, each step partitioned over the ranks on its own. ``progress(done, total,
    unit)`` is told the steps partitioned (0 first, then after each step; unit ``"<METHOD> steps"``).

    Returns ``((steps, ranks) tokens, (steps,) largest sample per step)``."""
    lens = check_lengths(lengths)
    R, N = int(num_replicas), int(global_batch_size)
    perm = np.random.default_rng(seed).permutation(len(lens))
    S = len(perm) // N if max_steps is None else min(len(perm) // N, int(max_steps))
    out = np.zeros((S, R), np.int64)
    big = np.zeros(S, np.int64)
    unit = f"{method.upper()} steps"
    if progress is not None:
        progress(0, S, unit)
    for s in range(S):
        c = lens[perm[s * N:(s + 1) * N]]
        out[s] = np.bincount(partition(c, R, method=method, equal_counts=equal_counts), weights=c,
                             minlength=R).astype(np.int64)
        big[s] = c.max(initial=0)
        if progress is not None:
            progress(s + 1, S, unit)
    return out, big


def balance_summary(ratios: np.ndarray) -> dict[str, float]:
    """mean / p95 / max of per-step max/mean ratios."""
    r = np.asarray(ratios, np.float64)
    if not r.size:
        return {"mean": 1.0, "p95": 1.0, "max": 1.0}
    return {"mean": float(r.mean()), "p95": float(np.percentile(r, 95)), "max": float(r.max())}


@dataclass(frozen=True)
class Simulation:
    """What ``tokenbal plan simulate`` prints: per-step max/mean of rank costs per method."""

    num_samples: int
    world_size: int
    global_batch_size: int
    grad_accum: int
    cost: str
    plan_seconds: float
    ratios: dict[str, np.ndarray]          # method -> per-step max/mean
    # method -> per-step Σ_stage max_rank / ideal, when simulated with stages
    stage_ratios: dict[str, np.ndarray] = field(default_factory=dict)
    stage_plan_seconds: float = float("nan")
    # Why the methods' step counts differ (dropped tails, a merged last step, the baseline cap), and
    # methods with no step at all: printed under the table so that 6 vs 7 steps is not a mystery.
    notes: tuple[str, ...] = ()

    def summary(self) -> dict[str, dict[str, float]]:
        return {name: balance_summary(r) for name, r in self.ratios.items()}

    def table(self) -> str:
        lines = [f"{self.num_samples} samples, {self.world_size} ranks, global batch {self.global_batch_size}"
                 f", grad_accum {self.grad_accum}, cost {self.cost}; per-step max/mean over ranks "
                 "(1.000 = perfect)",
                 *(f"note: {n}" for n in self.notes),
                 f"{'method':<34}{'mean':>8}{'p95':>8}{'max':>8}{'steps':>8}"]
        lines += [_row(name, r) for name, r in self.ratios.items()]
        lines.append(f"tokenbal plan time: {self.plan_seconds:.3f} s")
        if self.stage_ratios:
            lines.append("per-step Σ_stage max_rank / ideal (vision tower, then LLM, each waiting for its "
                         "slowest rank under FSDP)")
            lines += [_row(name, r) for name, r in self.stage_ratios.items()]
            lines.append(f"tokenbal + stages plan time: {self.stage_plan_seconds:.3f} s")
        return "\n".join(lines)


def _row(name: str, r: np.ndarray) -> str:
    if not len(r):   # no step at all: a ratio of 1.000 would read as perfect balance
        return f"{name:<34}{'n/a':>8}{'n/a':>8}{'n/a':>8}{0:8d}"
    s = balance_summary(r)
    return f"{name:<34}{s['mean']:8.3f}{s['p95']:8.3f}{s['max']:8.3f}{len(r):8d}"


def step_count_notes(num_samples: int, world_size: int, global_batch_size: int, plan_step_sizes: np.ndarray,
                     baseline_steps: int | None, grad_accum: int = 1) -> tuple[str, ...]:
    """Why the simulated methods have different step counts, worded for ``Simulation.table``.

    DistributedSampler-style sharding gives each rank ``n // R`` samples and ``N // R`` of them per
    step, dropping the incomplete tail (``drop_last``, as training loaders do); the per-step LPT/KK
    baselines cut the permutation into full steps of ``N``; tokenbal plans every sample, its last step
    partial (merged into the one before when it would leave ranks empty)."""
    n, R, N = int(num_samples), int(world_size), int(global_batch_size)
    per_rank = max(1, N // R)
    ds_steps = (n // R) // per_rank
    ds_dropped = n - ds_steps * per_rank * R
    kk_steps = n // N
    sizes = [int(x) for x in plan_step_sizes]
    notes = []
    if N % R:
        notes.append(f"DistributedSampler takes {N} // {R} = {per_rank} samples per rank per step "
                     f"(a global batch of {per_rank * R}, not {N})")
    if ds_steps == 0 or kk_steps == 0:
        notes.append(f"n/a: {n} samples do not fill one step of {N if kk_steps == 0 else per_rank * R} "
                     "samples, and the baselines drop an incomplete step")
    kk_dropped = n - kk_steps * N
    if ds_dropped or kk_dropped or len({ds_steps, kk_steps, len(sizes)}) > 1:
        why = []
        if N % R and ds_steps != kk_steps:
            why.append(f"DistributedSampler has {ds_steps} step(s) of {per_rank * R} samples")
        if ds_dropped:
            why.append(f"DistributedSampler drops the last {ds_dropped} of {n} samples (drop_last)")
        if kk_dropped:
            why.append(f"per-step LPT/KK drop the last {kk_dropped} (they cut the epoch into full steps "
                       f"of {N})")
        plan = (f"tokenbal plans every sample: {len(sizes)} step(s)"
                + (f", the last with {sizes[-1]} samples" if sizes and sizes[-1] != N else ""))
        if sizes and len(sizes) < -(-n // N):
            # The planner merges a last step with fewer samples than micro-batches (ranks x grad_accum).
            slots = f"the {R} ranks" if grad_accum == 1 else f"the {R} ranks x {grad_accum} micro-batches"
            plan += f" (a last step of {n % N} samples, fewer than {slots}, is merged into it)"
        notes.append(f"step counts differ: {'; '.join(why + [plan])}")
    if baseline_steps is not None and kk_steps > baseline_steps:
        notes.append(f"per-step LPT/KK: only the first {baseline_steps} of their {kk_steps} steps are "
                     "simulated (--baseline-steps)")
    return tuple(notes)


def simulate(lengths: object, world_size: int, global_batch_size: int, *, grad_accum: int = 1,
             cost: object = None, seed: int = 0, baseline_steps: int | None = 500,
             stages: object = None, progress: Progress | None = None) -> Simulation:
    """Compare DistributedSampler-style sharding, per-step LPT and KK (verl) and tokenbal's plan on
    the same samples. Balance is measured on the cost being balanced (tokens by default).
    ``baseline_steps`` caps the per-step partition baselines (pure Python) to keep this quick.
    ``stages`` (as in :func:`plan_epoch`): also report the per-step stage time over its ideal for
    DistributedSampler, tokenbal's plan, and tokenbal's plan made with ``stages``.
    Raises ``ValueError`` when there are fewer samples than ranks (every method would leave ranks
    idle in every step). ``Simulation.notes`` says why the methods' step counts differ.
    ``progress(done, total, unit)`` (e.g. the CLI's progress bar) is told the work done, counted: each
    per-step baseline's steps (``"LPT steps"``, ``"KK steps"``), then tokenbal's plans (``"plans"``: 1,
    or 2 with ``stages``; reported before and after each, the planner being one call)."""
    resolved = resolve(lengths, cost, stages)
    c = resolved.costs
    # Checked before any baseline runs: the baselines divide by these (0 was a ZeroDivisionError).
    R, N = _positive_int("world_size", world_size), _positive_int("global_batch_size", global_batch_size)
    k = _positive_int("grad_accum", grad_accum)
    settings = PlanSettings(num_replicas=R, global_batch_size=N, grad_accum=k)   # checked once
    seed = _nonneg_int("seed", seed)
    if baseline_steps is not None:
        baseline_steps = _nonneg_int("baseline_steps", baseline_steps)
    if len(c) < R:
        # Every method would leave ranks idle in every step; its ratios would compare nothing.
        raise ValueError(f"{R} ranks but only {len(c)} samples: every step would leave at least {R - len(c)} "
                         f"rank(s) without a sample; simulate at most {len(c)} (data-parallel) ranks, or a "
                         "larger index")
    ratios: dict[str, np.ndarray] = {}
    ratios["DistributedSampler"] = step_balance(count_sharded_step_tokens(c, R, N, seed))
    for method, equal in (("lpt", False), ("kk", True)):
        t, _ = per_step_partition_tokens(c, R, N, method=method, seed=seed, max_steps=baseline_steps,
                                         equal_counts=equal, progress=progress)
        ratios[f"per-step {method.upper()}" + (" (equal counts, verl)" if equal else "")] = step_balance(t)
    plans = 1 if resolved.stages is None else 2

    def planned(done: int) -> None:
        if progress is not None:
            progress(done, plans, "plans")

    planned(0)
    t0 = time.perf_counter()
    plan = plan_epoch(dataclasses.replace(resolved, stages=None), settings=settings, seed=seed)
    dt = time.perf_counter() - t0
    planned(1)
    ratios["tokenbal"] = step_balance(plan.step_rank_tokens(c))
    if k > 1:
        ratios["tokenbal micro-batches"] = step_balance(plan.micro_tokens(c).reshape(plan.num_steps, -1))
    name = resolved.cost_name
    stage_ratios: dict[str, np.ndarray] = {}
    stage_dt = float("nan")
    if resolved.stages is not None:
        sc = resolved.stages
        sharded = np.stack([count_sharded_step_tokens(sc[:, j], R, N, seed) for j in range(sc.shape[1])], -1)
        stage_ratios["DistributedSampler"] = step_stage_balance(sharded)
        stage_ratios["tokenbal"] = step_stage_balance(plan_stage_costs(plan, sc))
        t0 = time.perf_counter()
        staged = plan_epoch(resolved, settings=settings, seed=seed)
        stage_dt = time.perf_counter() - t0
        planned(2)
        stage_ratios["tokenbal + stages"] = step_stage_balance(plan_stage_costs(staged, sc))
    notes = step_count_notes(len(c), R, N, plan.counts().sum(1), baseline_steps, grad_accum=k)
    return Simulation(num_samples=len(c), world_size=R, global_batch_size=N, grad_accum=k, cost=str(name),
                      plan_seconds=dt, ratios=ratios, stage_ratios=stage_ratios, stage_plan_seconds=stage_dt,
                      notes=notes)


def epoch_stage_figure(plan: EpochPlan, stage_costs: np.ndarray) -> float:
    """The epoch's stage time over its ideal: ``Σ_steps Σ_stages max_rank / (Σ cost / ranks)``.

    Unlike the mean of :func:`step_stage_balance`, expensive steps weigh by what they cost, so this
    is what an epoch of FSDP training (each stage waiting for its slowest rank) takes over perfect.
    ``stage_costs`` may be float (the exact costs a plan was made from after rounding)."""
    c = np.asarray(stage_costs, np.float64)
    if c.ndim == 1:
        c = c[:, None]
    R = plan.num_replicas * plan.grad_accum
    slot = np.repeat(np.arange(len(plan.offsets) - 1), np.diff(plan.offsets))
    loads = np.zeros((len(plan.offsets) - 1, c.shape[1]))
    np.add.at(loads, slot, c[plan.indices])
    total = c[plan.indices].sum()
    return float(loads.reshape(-1, R, c.shape[1]).max(1).sum() / (total / R)) if total > 0 else 1.0


def _planned(step_of_item: np.ndarray, stage_costs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(step, (n, K) float64 costs) of the planned samples (step >= 0)."""
    c = np.asarray(stage_costs, np.float64)
    if c.ndim == 1:
        c = c[:, None]
    step = np.asarray(step_of_item, np.int64)
    keep = step >= 0
    return step[keep], c[keep]


def composition_floor(step_of_item: np.ndarray, stage_costs: np.ndarray, num_ranks: int) -> float:
    """What the best split of given steps could reach: ``Σ_steps Σ_stages max(largest sample,
    stage sum / ranks)`` over the ideal. ``step_of_item``: step per sample (-1: not planned)."""
    step, c = _planned(step_of_item, stage_costs)
    S = int(step.max(initial=-1)) + 1
    R = int(num_ranks)
    sums = np.zeros((S, c.shape[1]))
    big = np.zeros((S, c.shape[1]))
    np.add.at(sums, step, c)
    np.maximum.at(big, step, c)
    total = c.sum()
    return float(np.maximum(big, sums / R).sum() / (total / R)) if total > 0 else 1.0


def equal_count_floor(step_of_item: np.ndarray, stage_costs: np.ndarray, num_ranks: int) -> float:
    """A lower bound on what any split of given steps with the same number of samples on every rank
    (``k = step size / ranks``, as ``per_device_train_batch_size`` gives a length-grouped sampler)
    could reach, over the ideal: ``Σ_steps Σ_stages`` of

    - ``k == 2``: the largest-with-smallest pairing's largest pair, the least any pairing's largest
      pair can be in that stage (sort, pair the i-th largest with the i-th smallest);
    - other ``k``: ``max(largest + the k - 1 smallest, stage sum / ranks)``;
    - a step whose size ranks do not divide: ``max(largest, stage sum / ranks)``, as
      :func:`composition_floor`.

    Each stage is bounded on its own, so no split reaches the bound unless one split is best in every
    stage; it is at least :func:`composition_floor`. ``step_of_item``: step per sample (-1: not planned)."""
    step, c = _planned(step_of_item, stage_costs)
    R = int(num_ranks)
    total = c.sum()
    if total <= 0:
        return 1.0
    size = np.bincount(step)
    out = 0.0
    for m in np.unique(size[size > 0]):
        rows = np.flatnonzero(size == m)
        mine = np.isin(step, rows)
        s_of = np.searchsorted(rows, step[mine])
        for k in range(c.shape[1]):
            x = c[mine, k]
            v = x[np.lexsort((x, s_of))].reshape(len(rows), m)        # each step's samples, ascending
            mean = v.sum(1) / R
            if m % R:
                out += np.maximum(v[:, -1], mean).sum()
            elif m == 2 * R:
                out += (v[:, :R] + v[:, ::-1][:, :R]).max(1).sum()
            else:
                out += np.maximum(v[:, -1] + v[:, :m // R - 1].sum(1), mean).sum()
    return float(out / (total / R))


def split_figure(step_of_item: np.ndarray, stage_costs: np.ndarray, num_ranks: int) -> float:
    """The epoch figure (as :func:`epoch_stage_figure`) of given steps split the way the planner splits
    the steps it composes (version 7's split: largest first into the least loaded rank, or the profile
    fill, whichever ends faster after stage swaps and moves inside each step; any number of samples
    per rank), with no sample changing step. Against a plan's figure it compares two compositions
    under one split; unlike :func:`composition_floor` it is a split someone gets, not a bound.
    ``step_of_item``: step per sample (-1: not planned; labels need not be contiguous)."""
    step, c = _planned(step_of_item, stage_costs)
    total = c.sum()
    if total <= 0:
        return 1.0
    R = int(num_ranks)
    _, step = np.unique(step, return_inverse=True)
    S = int(step.max()) + 1
    ints = to_int_costs(c.reshape(-1)).reshape(c.shape)
    perm = np.argsort(step, kind="stable")
    caps = np.bincount(step, minlength=S)[:, None]
    # Every step its own window of one step: the composition has nothing left to choose, only the split.
    p, _, _, rank = _compose_fill(ints.sum(1), ints, perm, step[perm], caps, R, None)
    return float(_step_times(c[p], step[p] * R + rank, S, R).sum() / (total / R))


def length_grouped_steps(costs: np.ndarray, global_batch_size: int, seed: int = 0, mega_steps: int = 50
                         ) -> np.ndarray:
    """Step per sample of a length-grouped composition, the way transformers' ``LengthGroupedSampler``
    groups: a seeded permutation cut into mega-batches of ``mega_steps`` steps, each sorted by cost
    (largest first) and cut into steps of ``global_batch_size``; the last partial step is dropped
    (-1). The baseline a stage planner's step composition is compared against."""
    c = np.asarray(costs, np.float64)
    if c.ndim == 2:
        c = c.sum(1)
    N = int(global_batch_size)
    n = len(c)
    perm = np.random.default_rng(seed).permutation(n)
    mega = np.arange(n) // (N * int(mega_steps))
    order = perm[np.lexsort((-c[perm], mega))]
    out = np.full(n, -1, np.int64)
    S = n // N
    out[order[:S * N]] = np.arange(S * N) // N
    return out


def best_plan_figure(stage_costs: np.ndarray, num_ranks: int, global_batch_size: int,
                     max_samples: int = 16) -> tuple[float, np.ndarray]:
    """The lowest epoch figure (as :func:`epoch_stage_figure`) of **any** plan of a tiny epoch, by
    exhaustive search: every way to cut the samples into steps of ``global_batch_size``, each step
    split over the ranks in every way (any count per rank, empty ranks too). Returns the figure and
    the best composition's step per sample.

    A reference, not a planner: it shows where a bound such as ``max(goal, composition floor of
    length-grouped steps)`` is below what every plan reaches, so no planner can meet it. The epoch
    figure is a sum over steps, so each ``global_batch_size``-subset's best split is found once and
    the composition by a search over subsets holding the lowest unplaced sample. Limited to
    ``max_samples`` samples (16: 4 steps of 4 take ~1 s) and ``ranks ** global_batch_size <= 4096``.
    """
    from itertools import combinations, product

    c = np.asarray(stage_costs, np.float64)
    if c.ndim == 1:
        c = c[:, None]
    n, R, N = len(c), int(num_ranks), int(global_batch_size)
    if n == 0 or N <= 0 or n % N or n > max_samples or R ** N > 4096:
        raise ValueError(f"best_plan_figure searches tiny epochs only: {n} samples must be a positive "
                         f"multiple of global_batch_size={N}, at most max_samples={max_samples}, and "
                         f"ranks ** global_batch_size = {R}**{N} at most 4096")
    total = c.sum()
    if total <= 0:
        return 1.0, np.arange(n) // N
    subsets = np.array(list(combinations(range(n), N)), np.int64)               # (M, N)
    onehot = np.eye(R)[np.array(list(product(range(R), repeat=N)))]            # (R**N, N, R)
    # Σ_stage max_rank of every split of every subset, its best split kept.
    loads = np.einsum("anr,mnk->mark", onehot, c[subsets])                      # (M, R**N, R, K)
    best = loads.max(2).sum(-1).min(1)
    masks = (1 << subsets).sum(1)
    by_low: dict[int, list[tuple[int, float]]] = {}
    for m, v, low in zip(masks.tolist(), best.tolist(), subsets[:, 0].tolist(), strict=True):
        by_low.setdefault(low, []).append((m, v))

    memo: dict[int, tuple[float, int]] = {0: (0.0, 0)}

    def solve(left: int) -> float:
        if left not in memo:
            low = (left & -left).bit_length() - 1
            memo[left] = min((v + solve(left & ~m), m) for m, v in by_low[low] if m & left == m)
        return memo[left][0]

    full = (1 << n) - 1
    figure = solve(full) / (total / R)
    step = np.empty(n, np.int64)
    left, s = full, 0
    while left:
        m = memo[left][1]
        step[[i for i in range(n) if m >> i & 1]] = s
        left, s = left & ~m, s + 1
    return float(figure), step
