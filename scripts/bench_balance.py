"""Per-step rank balance of tokenbal's epoch planner vs DistributedSampler and per-step KK / LPT.

Data: a heavy-tailed multimodal mixture with :data:`tokenbal.synthetic.MIXTURE`'s proportions
(photos, documents, screenshots, icons, multi-image posts, short and long text) plus 2% long
videos, each sample's vision tokens computed with ``get_estimator("qwen2-vl")`` from its image /
video size (vectorised: the same formulas as the demo corpus, without rendering images).

    python scripts/bench_balance.py            # all points + planning time of 1M samples, 512 ranks
    python scripts/bench_balance.py --quick    # fewer steps per point
    python scripts/bench_balance.py --plan-only --compare-exact   # planning time only, batched vs exact
    python scripts/bench_balance.py --elastic  # resume on another world size: re-plan time, balance
    python scripts/bench_balance.py --budget   # token-budget mode vs trl's BFD pack_dataset (fill)
    python scripts/bench_balance.py --exhaustive 20   # tiny epochs: the best plan of all vs the target
    python scripts/bench_balance.py --padded   # padded batches: cost="padded" vs transformers'
                                               # BatchRebalanceSampler vs DistributedSampler (+ packed)

``--compare-exact`` also runs the planner with the exact one-item-at-a-time window fill (what
``plan_epoch`` did before PLAN_VERSION 3) at every point and in the timing, in the same run.

Every number is measured in this process; nothing is asserted. The metric is, per step,
max over ranks / mean over ranks of the step's tokens (1.00 = perfect). ``vs LB`` divides the
max by the step's lower bound max(mean, largest sample in the step), which no assignment of
that step's samples can beat.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import numpy as np
from harness import environment_line, measure, ratio, timed

import tokenbal.balance.plan
import tokenbal.balance.plan.common
import tokenbal.balance.plan.counts
import tokenbal.balance.plan.padded
import tokenbal.balance.plan.stages
from tokenbal.balance.plan import plan_epoch
from tokenbal.balance.simulate import balance_summary, count_sharded_step_tokens, per_step_partition_tokens
from tokenbal.estimate import get_estimator
from tokenbal.synthetic import MIXTURE

VIDEO_FRACTION = 0.02
_TOKENS_PER_WORD = 1.3
_TEMPLATE_TOKENS = 24          # chat template around every sample


def mixture_lengths(n: int, seed: int = 0, model: str = "qwen2-vl") -> np.ndarray:
    """Total tokens per sample for ``n`` samples of the demo mixture plus long videos (vectorised)."""
    return mixture_tokens(n, seed, model)[1]


def mixture_tokens(n: int, seed: int = 0, model: str = "qwen2-vl") -> tuple[np.ndarray, np.ndarray]:
    """(vision tokens, total tokens) per sample of :func:`mixture_lengths`' mixture."""
    est = get_estimator(model)
    rng = np.random.default_rng(seed)
    kinds = [k for k, _ in MIXTURE] + ["video"]
    w = np.array([p for _, p in MIXTURE]) * (1 - VIDEO_FRACTION)
    w = np.append(w / w.sum() * (1 - VIDEO_FRACTION), VIDEO_FRACTION)
    kind = rng.choice(len(kinds), size=n, p=w / w.sum())
    words = np.zeros(n, np.int64)
    vision = np.zeros(n, np.int64)
    wrap = est.wrapper_tokens

    def image(mask: np.ndarray, bw: int, bh: int, spread: float,
              swap: np.ndarray | None = None) -> np.ndarray:
        m = int(mask.sum())
        ww = np.maximum(8, np.round(bw * rng.uniform(1 - spread, 1 + spread, m))).astype(np.int64)
        hh = np.maximum(8, np.round(bh * rng.uniform(1 - spread, 1 + spread, m))).astype(np.int64)
        if swap is not None:
            ww, hh = np.where(swap, hh, ww), np.where(swap, ww, hh)
        return est.image_tokens_batch(ww, hh) + wrap

    k = {name: kind == i for i, name in enumerate(kinds)}
    m = k["photo"]
    vision[m] = image(m, 640, 480, 0.2, rng.random(int(m.sum())) >= 0.7)
    words[m] = rng.integers(8, 40, int(m.sum()))
    m = k["document"]
    vision[m] = image(m, 1700, 2300, 0.05)
    words[m] = rng.integers(20, 120, int(m.sum()))
    m = k["screenshot"]
    vision[m] = image(m, 1920, 1080, 0.0)
    words[m] = rng.integers(10, 60, int(m.sum()))
    m = k["icon"]
    side = rng.choice([16, 24, 32, 48, 64], int(m.sum()))
    vision[m] = est.image_tokens_batch(side, side) + wrap
    words[m] = rng.integers(3, 12, int(m.sum()))
    m = k["multi_image"]
    idx = np.flatnonzero(m)
    nimg = rng.integers(2, 5, idx.size)
    owner = np.repeat(idx, nimg)
    per = image(np.ones(owner.size, bool), 640, 480, 0.25)
    np.add.at(vision, owner, per)
    words[m] = rng.integers(10, 50, idx.size)
    m = k["text_short"]
    words[m] = rng.integers(5, 60, int(m.sum()))
    m = k["text_long"]
    words[m] = rng.integers(20, 80, int(m.sum())) * rng.integers(10, 30, int(m.sum()))
    m = k["video"]
    # 8..64 s at 2 fps, 640x360: ~1.2k..19k tokens
    frames = rng.integers(16, 129, int(m.sum()))
    table = {f: est.video_tokens(f, 640, 360, 2.0) + wrap for f in np.unique(frames).tolist()}
    vision[m] = np.array([table[f] for f in frames.tolist()], np.int64)
    words[m] = rng.integers(10, 60, int(m.sum()))
    return vision, vision + np.round(words * _TOKENS_PER_WORD).astype(np.int64) + _TEMPLATE_TOKENS


def _previous_default_window(num_replicas: int, global_batch_size: int | None = None, *,
                             max_tokens_per_rank: int | None = None, mean_length: float = 1.0) -> int:
    """default_window of PLAN_VERSION 5 (128 samples per rank per window), the baseline here."""
    import math

    if max_tokens_per_rank is not None:
        return _CURRENT_DEFAULT_WINDOW(num_replicas, max_tokens_per_rank=max_tokens_per_rank,
                                       mean_length=mean_length)
    R, N = int(num_replicas), int(global_batch_size)
    return int(min(256, max(16, math.ceil(128 * R / N), math.ceil(16384 / N))))


_CURRENT_DEFAULT_WINDOW = tokenbal.balance.plan.default_window


@contextlib.contextmanager
def previous_planner() -> Iterator[None]:
    """Plan as PLAN_VERSION 5 did: windows of 128 samples per rank, equal lengths in dataset index
    order, and with stages the plain fill (no profile sub-windows) followed by the cross-step and
    in-step stage refinement."""
    plan = tokenbal.balance.plan
    where = ((plan, "default_window"), (plan.counts, "default_window"), (plan.padded, "default_window"),
             (plan.stages, "_STAGE_GROUP"), (plan.common, "_TIE_BY_POS"))
    saved = [getattr(m, k) for m, k in where]
    for (m, k), v in zip(where, (_previous_default_window,) * 3 + (0, 0), strict=True):
        setattr(m, k, v)
    try:
        yield
    finally:
        for (m, k), v in zip(where, saved, strict=True):
            setattr(m, k, v)


def _pairs_again(a, b) -> tuple[float, float]:
    """Share of the sample pairs sharing a step in plan ``a`` that share one in plan ``b``, and the
    share of all pairs that share a step in ``b`` (chance)."""
    sa, sb = _step_of_sample(a), _step_of_sample(b)
    again = _pairs(sa * (sb.max() + 1) + sb) / _pairs(sa)
    return again, _pairs(sb) / (len(sb) * (len(sb) - 1) / 2)


def bench_stages(R: int, N: int, steps: int, seed: int) -> None:
    """Qwen2-VL-7B FLOPs split into vision tower and LLM: FSDP waits for the slowest rank in each, so
    a step takes Σ_stage max_rank. Plans on the summed FLOPs, then with ``stages`` as PLAN_VERSION 5
    did (``previous``) and as now."""
    from types import SimpleNamespace

    from tokenbal.balance.cost import FlopsModel
    from tokenbal.balance.partition import stage_objective

    vision, total = mixture_tokens(steps * N, seed)
    samples = SimpleNamespace(lengths=total, vision_tokens=vision)
    model = FlopsModel.qwen2_vl_7b()
    parts = model.stage_token_equivalents(total, vision)
    ratios = {}
    for name, stages, ctx in (("flops", None, contextlib.nullcontext),
                              ("stages, previous", True, previous_planner),
                              ("flops + stages", True, contextlib.nullcontext)):
        with ctx():
            plan, _, cpu = timed(partial(plan_epoch, samples, R, global_batch_size=N, seed=seed,
                                                  cost=model, stages=stages))
            again, chance = float("nan"), float("nan")
            if stages:
                nxt = plan_epoch(samples, R, global_batch_size=N, seed=seed, epoch=1, cost=model,
                                 stages=stages)
                again, chance = _pairs_again(plan, nxt)
        r, lb = [], []
        for s in range(plan.num_steps):
            items = [plan.slot(s, q) for q in range(R)]
            bins = np.concatenate([np.full(len(x), q) for q, x in enumerate(items)]).astype(np.int64)
            c = parts[np.concatenate(items).astype(np.int64)]
            r.append(stage_objective(c, bins, R) / (c.sum() / R))
            # No split of this step's samples does better than each stage's mean or its largest sample.
            lb.append(np.maximum(c.sum(0) / R, c.max(0)).sum() / (c.sum() / R))
        ratios[name] = np.array(r)
        print(f"  ({R:3d}, {N:4d}) {name:16s} Σ_stage max / ideal: mean {np.mean(r):.4f} p95 "
              f"{np.percentile(r, 95):.4f} (this plan's steps cannot go below {np.mean(lb):.4f}); "
              f"plan CPU {cpu:.2f} s for {steps * N} samples"
              + (f"; repeat {again:.4f} vs chance {chance:.5f}" if stages else ""))


def bench_stage_plan_time(n: int, repeats: int, seed: int) -> None:
    """CPU seconds to plan ``n`` samples on 512 ranks with stages (the issue's <= 5 s target)."""
    from types import SimpleNamespace

    from tokenbal.balance.cost import FlopsModel

    vision, total = mixture_tokens(n, seed)
    samples = SimpleNamespace(lengths=total, vision_tokens=vision)
    model = FlopsModel.qwen2_vl_7b()
    epoch = iter(range(10**6))
    out = {}
    for name, ctx in (("previous", previous_planner), ("now", contextlib.nullcontext)):
        with ctx():
            t = measure(lambda: plan_epoch(samples, 512, global_batch_size=1024, seed=seed, epoch=next(epoch),
                                           cost=model, stages=True), repeats=repeats, warmup=0)
        out[name] = t.cpu_median
        print(f"plan_epoch of {n} samples, 512 ranks, N=1024, flops + stages, {name}: CPU median "
              f"{t.cpu_median:.2f} s, wall median {t.wall_median:.2f} s ({repeats} runs)")
    print(f"previous / now CPU: {ratio(out['previous'], out['now'])}")


POINTS = ((8, 16), (8, 64), (64, 128), (512, 1024))


def _trl_bfd_bins(lengths: np.ndarray, budget: int) -> np.ndarray:
    """Tokens per packed sequence of trl's best-fit-decreasing ``pack_dataset`` (its pyarrow
    helper, on an ``input_ids`` column of the given lengths), in trl's output order."""
    import pyarrow as pa
    from trl.data_utils import _pack_bfd

    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.zeros(int(offsets[-1]), np.int32)))
    packed = _pack_bfd(pa.Table.from_arrays([ids], names=["input_ids"]), budget)
    return np.array([sum(x) for x in packed["seq_lengths"].to_pylist()], np.int64)


def _step_of_sample(plan) -> np.ndarray:
    per = plan.num_replicas * plan.grad_accum
    step = np.repeat(np.arange(len(plan.offsets) - 1) // per, np.diff(plan.offsets))
    out = np.empty(len(plan.indices), np.int64)
    out[plan.indices] = step
    return out


def _pairs(key: np.ndarray) -> float:
    c = np.unique(key, return_counts=True)[1].astype(np.float64)
    return float((c * (c - 1)).sum() / 2)


def bench_budget(n: int, budget: int, ranks: tuple[int, ...], seed: int, repeats: int) -> None:
    """Token-budget mode (``max_tokens_per_rank``) next to trl's BFD ``pack_dataset`` on the same
    lengths (samples over the budget left out for both: trl would truncate them)."""
    lens = mixture_lengths(n, seed)
    over = int((lens > budget).sum())
    lens = lens[lens <= budget]
    tot = int(lens.sum())
    trl_bins, _, trl_cpu = timed(lambda: _trl_bfd_bins(lens, budget))
    assert int(trl_bins.sum()) == tot and trl_bins.max() <= budget
    lower = -(-tot // budget)
    print(f"{len(lens)} samples ({over} over the budget left out), {tot} tokens, budget {budget}: "
          f"at least {lower} rank-steps; trl BFD packs {len(trl_bins)} sequences in {trl_cpu:.2f} s CPU")
    print("  fill = tokens / (steps · R · budget); step fill = tokens / (R · Σ_steps max_rank tokens), "
          "i.e. with each step as long as its fullest rank; bound = ceil(ceil(tokens / budget) / R) steps")
    print("  repeat = share of the sample pairs sharing a step in epoch 0 that share one in epoch 1; "
          "chance = share of all pairs that share a step")
    for R in ranks:
        cpu = []
        for _ in range(repeats):
            plan, _, seconds = timed(partial(plan_epoch, lens, R, max_tokens_per_rank=budget, seed=seed,
                                                       epoch=0))
            cpu.append(seconds)
        S = plan.num_steps
        t = plan.step_rank_tokens(lens)
        assert t.max() <= budget and len(plan.indices) == len(lens)
        a = _step_of_sample(plan)
        b = _step_of_sample(plan_epoch(lens, R, max_tokens_per_rank=budget, seed=seed, epoch=1))
        again = _pairs(a * (b.max() + 1) + b) / _pairs(a)
        chance = _pairs(b) / (len(b) * (len(b) - 1) / 2)
        trl_S = -(-len(trl_bins) // R)
        trl_t = np.zeros(trl_S * R, np.int64)
        trl_t[:len(trl_bins)] = trl_bins          # trl's sequences dealt to ranks in its order
        trl_t = trl_t.reshape(trl_S, R)
        bound_S = -(-lower // R)
        fill, trl_fill = tot / (S * R * budget), tot / (trl_S * R * budget)
        print(f"  R={R:3d}: tokenbal {S} steps, fill {fill:.4f}, step fill {tot / (R * t.max(1).sum()):.4f}, "
              f"empty rank-steps {plan.num_empty}, plan CPU median {np.median(cpu):.3f} s | trl BFD {trl_S} "
              f"steps, fill {trl_fill:.4f}, step fill {tot / (R * trl_t.max(1).sum()):.4f} | bound {bound_S} "
              f"steps, fill {tot / (bound_S * R * budget):.4f} | minus trl {fill - trl_fill:+.4f} | "
              f"repeat {again:.4f} vs chance {chance:.4f} ({again / chance:.1f}x)")


@contextlib.contextmanager
def exact_fill() -> Iterator[None]:
    """Plan with the exact one-item-at-a-time window fill (the baseline of the batched fill)."""
    common = tokenbal.balance.plan.common
    saved = common._BATCH_PER_RANK
    common._BATCH_PER_RANK = 0        # batch 0 -> fill_windows' exact loop
    try:
        yield
    finally:
        common._BATCH_PER_RANK = saved


def _row(name: str, ratios: np.ndarray, lb: np.ndarray | None = None) -> str:
    s = balance_summary(ratios)
    out = f"  {name:<26} mean {s['mean']:6.4f}   p95 {s['p95']:6.4f}   max {s['max']:6.3f}"
    if lb is not None:
        v = balance_summary(ratios / lb)
        out += f"   | vs LB: mean {v['mean']:6.3f}  p95 {v['p95']:6.3f}  max {v['max']:6.3f}"
    return out


def bench_point(R: int, N: int, steps: int, baseline_steps: int, seed: int,
                windows: tuple[int, ...] = (), compare_exact: bool = False) -> dict[str, dict[str, float]]:
    from tokenbal.balance.simulate import step_balance, step_lower_bound

    n = N * steps
    lens = mixture_lengths(n, seed)
    print(f"(R, N) = ({R}, {N}): {n} samples, {steps} steps, mean {lens.mean():.0f} tokens/sample, "
          f"{N / R:.0f} samples per rank per step")
    res = {}
    ds = count_sharded_step_tokens(lens, R, N, seed)
    res["DistributedSampler"] = balance_summary(step_balance(ds))
    print(_row("DistributedSampler-style", step_balance(ds)))
    for method in ("lpt", "kk"):
        t, big = per_step_partition_tokens(lens, R, N, method=method, seed=seed, max_steps=baseline_steps,
                                           equal_counts=(method == "kk"))
        name = f"per-step {method.upper()}" + (" (equal, verl)" if method == "kk" else "")
        r = step_balance(t)
        res[name] = balance_summary(r)
        print(_row(name, r, step_lower_bound(t, big)))
    plan, dt, _ = timed(lambda: plan_epoch(lens, R, global_batch_size=N, seed=seed))
    t = plan.step_rank_tokens(lens)
    r = step_balance(t)
    lb = step_lower_bound(t, plan.step_max_item(lens))
    res["tokenbal"] = balance_summary(r)
    res["tokenbal vs LB"] = balance_summary(r / lb)
    with previous_planner():
        prev, pdt, _ = timed(lambda: plan_epoch(lens, R, global_batch_size=N, seed=seed))
    pt = prev.step_rank_tokens(lens)
    res["tokenbal previous"] = balance_summary(step_balance(pt))
    print(_row("tokenbal previous (v5)", step_balance(pt), step_lower_bound(pt, prev.step_max_item(lens)))
          + f"   ({pdt:.2f} s)")
    print(_row("tokenbal plan_epoch", r, lb) + f"   ({dt:.2f} s)")
    if compare_exact:
        with exact_fill():
            plan, dt, _ = timed(lambda: plan_epoch(lens, R, global_batch_size=N, seed=seed))
        t = plan.step_rank_tokens(lens)
        r = step_balance(t)
        res["tokenbal exact fill"] = balance_summary(r)
        print(_row("tokenbal exact fill", r, step_lower_bound(t, plan.step_max_item(lens)))
              + f"   ({dt:.2f} s)")
    for W in windows:
        plan, dt, _ = timed(partial(plan_epoch, lens, R, global_batch_size=N, seed=seed, window=W))
        t = plan.step_rank_tokens(lens)
        r = step_balance(t)
        res[f"tokenbal window={W}"] = balance_summary(r)
        print(_row(f"tokenbal window={W}", r, step_lower_bound(t, plan.step_max_item(lens)))
              + f"   ({dt:.2f} s)")
    return res


def bench_plan_time(n: int, R: int, N: int, repeats: int, seed: int) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds per plan. On a shared machine the CPU time (one thread) is the
    better measure of what one free core would take."""
    lens = mixture_lengths(n, seed)
    epoch = iter(range(10**6))
    t = measure(lambda: plan_epoch(lens, R, global_batch_size=N, seed=seed, epoch=next(epoch)),
                repeats=repeats, warmup=0)
    return t.wall, t.cpu


def bench_elastic(n: int, seed: int, repeats: int) -> None:
    """An elastic resume half-way through an epoch of ``n`` samples, 512 -> 384 ranks (2 samples per
    rank and step both times): the time ``load_state_dict`` + the re-plan take, and the remainder's
    balance next to a fresh 384-rank plan of the whole epoch."""

    from tokenbal import TokenBalancedBatchSampler

    lens = mixture_lengths(n, seed)
    old = TokenBalancedBatchSampler(lens, 512, 0, global_batch_size=1024, seed=seed)
    old.cursor = len(old) // 2
    state = old.state_dict()
    times = []
    for _ in range(repeats):
        new = TokenBalancedBatchSampler(lens, 384, 0, global_batch_size=768, seed=seed, elastic=True)
        def resume(new=new):
            new.load_state_dict(state)
            return new.plan()

        plan, _, seconds = timed(resume)
        times.append(seconds)
    fresh = TokenBalancedBatchSampler(lens, 384, 0, global_batch_size=768, seed=seed).plan()

    def balance(p) -> float:
        tokens = p.micro_tokens(lens).reshape(p.num_steps, p.num_replicas)[:-1]   # last step: partial
        return float((tokens.max(1) / tokens.mean(1)).mean())

    print(f"elastic resume of {n} samples at step {old.cursor} of {len(old)}, 512 -> 384 ranks: "
          f"load + re-plan CPU median {np.median(times):.2f} s ({repeats} runs); remainder "
          f"{plan.num_samples} samples in {plan.num_steps} steps, mean step max/mean {balance(plan):.4f} "
          f"(a fresh 384-rank plan of the whole epoch: {balance(fresh):.4f})")


# --- Issue 32: stage balance on random mixtures, the version-6 planner in the same run -------------

V6_COMMIT = "df34147"           # main with PLAN_VERSION 6 (tokenbal/balance as merged for issue 24)
V7_COMMIT = "8e630dd"           # main with PLAN_VERSION 7 (issue 32, part 1: stage composition)
V8_COMMIT = "54ee978"           # main with PLAN_VERSION 8 (issue 32, part 2: tokens mode; stage plans as v7)
V9_COMMIT = "96a634c"           # main with PLAN_VERSION 9 (issue 32, part 3: the grouped stage fill)
V10_COMMIT = "1f0ba66"          # main with PLAN_VERSION 10 (issue 32, part 4: short stage epochs leveled)
V11_COMMIT = "fc8c858"          # main with PLAN_VERSION 11 (issue 32, parts 7-8: heaviest steps pooled)
TOKEN_POINTS = ((8, 16, 4000), (64, 128, 1000), (512, 1024, 200), (512, 1024, 976), (4096, 8192, 60))
MIXTURE_POINTS = ((8, 16, 200), (64, 128, 100), (512, 1024, 40), (4096, 8192, 24))   # (R, N, steps)
GOALS = {8: 1.01, 64: 1.02, 512: 1.04, 4096: 1.06}


def planner_at(commit: str = V6_COMMIT):
    """``plan_epoch`` of tokenbal/balance at ``commit``, loaded from this repository's git objects into
    a private package (``_tokenbal_v<commit>``): the previous planner runs next to the current one in
    one process without a second checkout. Only tokenbal/balance's planning modules are taken; they
    import ``tokenbal._checks`` from the current tree (unchanged since)."""
    import importlib
    import subprocess
    import sys
    import tempfile

    root = Path(__file__).resolve().parents[1]
    name = f"_tokenbal_v{commit}"
    if name not in sys.modules:
        tmp = Path(tempfile.mkdtemp(prefix="tokenbal-planner-"))
        listing = subprocess.run(["git", "-C", str(root), "ls-tree", "-r", "--name-only", commit,
                                  "tokenbal/balance/"], check=True, capture_output=True, text=True)
        files = listing.stdout.split()
        files = [f.removeprefix("tokenbal/balance/") for f in files if f.endswith(".py")]
        for f in files:
            text = subprocess.run(["git", "-C", str(root), "show", f"{commit}:tokenbal/balance/{f}"],
                                  check=True, capture_output=True, text=True).stdout
            out = tmp / name / "balance" / f
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text.replace("tokenbal.balance.", f"{name}.balance."))
        (tmp / name / "__init__.py").write_text("")
        (tmp / name / "balance" / "__init__.py").write_text("")
        sys.path.insert(0, str(tmp))
    return importlib.import_module(f"{name}.balance.plan").plan_epoch


def _steps_of(plan, n: int) -> np.ndarray:
    out = np.full(n, -1, np.int64)
    out[plan.indices] = _step_of_sample(plan)[plan.indices]
    return out


def bench_mixtures(draws: int, points: tuple, model_name: str, repeat_draws: int,
                   previous: str = V11_COMMIT) -> None:
    """Worst / median over random mixture draws (tokenbal.balance.mixtures) of the epoch's stage figure
    Σ_steps Σ_stages max_rank / ideal: the plan now, the planner at git commit ``previous`` (same
    process; "prev"), and the floors of their compositions and of a length-grouped composition (HF's
    50-step mega-batches)."""
    from tokenbal.balance.cost import FlopsModel
    from tokenbal.balance.mixtures import draw_samples, random_mixture, stage_costs
    from tokenbal.balance.plan import PLAN_VERSION
    from tokenbal.balance.plan import plan_epoch as plan_now
    from tokenbal.balance.simulate import (
        composition_floor,
        epoch_stage_figure,
        equal_count_floor,
        length_grouped_steps,
        split_figure,
    )

    planners = [("now", plan_now)] + ([("prev", planner_at(previous))] if previous != "none" else [])
    model = "square" if model_name == "square" else FlopsModel.qwen2_vl_7b()
    print(f"stage costs: {model_name}; figure = Σ_steps Σ_stages max_rank / (Σ cost / ranks); "
          "floor = Σ_steps Σ_stages max(largest, sum / ranks) of a composition; LG = length-grouped "
          f"composition (random 50-step mega-batches sorted by cost); now = PLAN_VERSION {PLAN_VERSION}, "
          f"prev = {previous}")
    for R, N, steps in points:
        goal = GOALS.get(R, 1.06)
        rows = []
        for d in range(draws):
            s = draw_samples(random_mixture(d), steps * N, d)
            c = stage_costs(s, model)
            lg_steps = length_grouped_steps(c, N, d)
            row = {"lg": composition_floor(lg_steps, c, R), "lg eq": equal_count_floor(lg_steps, c, R),
                   "lg split": split_figure(lg_steps, c, R)}
            row.update({"prev": np.nan, "prev floor": np.nan, "prev cpu": np.nan})
            for name, fn in planners:
                try:
                    plan, _, cpu = timed(partial(fn, s.lengths, R, global_batch_size=N, seed=d, cost=c.sum(1),
                                                 stages=c))
                except ValueError as e:          # v6 overflowed int64 on some windows of large costs
                    row[name], row[name + " floor"], row[name + " cpu"] = float("nan"), float("nan"), 0.0
                    print(f"    ({R}, {N}) draw {d}: {name} failed: {e}")
                    continue
                row[name] = epoch_stage_figure(plan, c)
                row[name + " floor"] = composition_floor(_steps_of(plan, len(c)), c, R)
                row[name + " cpu"] = cpu
                if d < repeat_draws:
                    nxt = fn(s.lengths, R, global_batch_size=N, seed=d, epoch=1, cost=c.sum(1), stages=c)
                    row[name + " repeat"], row["chance"] = _pairs_again(plan, nxt)
            row["target"] = max(goal, row["lg"])
            rows.append(row)
            prev_part = ("" if previous == "none" else f" | prev {row['prev']:.4f} (floor "
                         f"{row['prev floor']:.4f}, {row['prev cpu']:.2f} s)")
            print(f"    ({R}, {N}) draw {d}: now {row['now']:.4f} (floor {row['now floor']:.4f}, "
                  f"{row['now cpu']:.2f} s){prev_part} | LG floor {row['lg']:.4f} "
                  f"(equal counts {row['lg eq']:.4f}, "
                  f"split by tokenbal {row['lg split']:.4f}) | target {row['target']:.4f}",
                  flush=True)

        def col(k: str, rows: list = rows) -> np.ndarray:
            return np.array([r[k] for r in rows])

        over_now = col("now") / col("target")
        prev = ""
        if previous != "none":
            over_prev = col("prev") / col("target")
            prev = (f"; prev worst {np.nanmax(col('prev')):.4f} median {np.nanmedian(col('prev')):.4f}, "
                    f"over target worst {np.nanmax(over_prev):.4f} "
                    f"({int((over_prev <= 1).sum())}/{draws} <= 1), "
                    f"plan CPU median {np.nanmedian(col('prev cpu')):.2f} s; now <= prev on "
                    f"{int((col('now') <= col('prev')).sum())}/{draws} draws")
        print(f"  ({R}, {N}), {steps} steps, {draws} draws, goal {goal}: now worst "
              f"{np.nanmax(col('now')):.4f} median {np.nanmedian(col('now')):.4f}, "
              f"figure / max(goal, LG floor) worst {np.nanmax(over_now):.4f} "
              f"({int((over_now <= 1).sum())}/{draws} <= 1), plan CPU median "
              f"{np.median(col('now cpu')):.2f} s; LG floor worst {col('lg').max():.4f} median "
              f"{np.median(col('lg')):.4f}{prev}")
        # What a length-grouped composition could reach at best with the same number of samples on
        # every rank (HF's per_device_train_batch_size): above the plan on a draw, no such split of
        # length-grouped steps beats the plan there.
        over_eq = col("now") / np.maximum(goal, col("lg eq"))
        print(f"  ({R}, {N}) now / LG floor with equal counts (equal_count_floor): worst "
              f"{np.max(col('now') / col('lg eq')):.4f}, median {np.median(col('now') / col('lg eq')):.4f}, "
              f"{int((col('now') <= col('lg eq')).sum())}/{draws} draws <= 1; "
              f"now / max(goal, that floor): worst {over_eq.max():.4f}, "
              f"{int((over_eq <= 1).sum())}/{draws} draws <= 1")
        # The compositions compared under one split: the plan against length-grouped steps split the
        # way the planner splits its own (a figure, not a bound).
        vs_split = col("now") / col("lg split")
        print(f"  ({R}, {N}) now / LG steps split by tokenbal: worst {vs_split.max():.4f}, median "
              f"{np.median(vs_split):.4f}, {int((vs_split <= 1).sum())}/{draws} draws <= 1")
        if repeat_draws:
            rep = rows[:repeat_draws]
            print(f"  ({R}, {N}) step mates meeting again next epoch (draws 0..{repeat_draws - 1}): now "
                  f"{np.mean([r['now repeat'] for r in rep]):.4f}, prev "
                  f"{np.nanmean([r.get('prev repeat', np.nan) for r in rep]):.4f}, chance "
                  f"{np.mean([r['chance'] for r in rep]):.5f}")


EXHAUSTIVE_POINTS = ((2, 4, 3), (2, 4, 4), (4, 4, 4))        # (R, N, steps): 12-16 samples


def bench_exhaustive(draws: int, model_name: str) -> None:
    """Issue 32's target max(goal, floor of a length-grouped composition) against the best figure of
    any plan (simulate.best_plan_figure: every composition, every split), on tiny epochs of the same
    random mixtures: where the best plan is above the target, no planner can meet it; and the plan's
    figure over that optimum."""
    from tokenbal.balance.cost import FlopsModel
    from tokenbal.balance.mixtures import draw_samples, random_mixture, stage_costs
    from tokenbal.balance.simulate import (
        best_plan_figure,
        composition_floor,
        epoch_stage_figure,
        length_grouped_steps,
        split_figure,
    )

    model = "square" if model_name == "square" else FlopsModel.qwen2_vl_7b()
    print(f"stage costs: {model_name}; best = lowest figure of any plan (exhaustive); target = max(goal, "
          "LG floor); goals 1.01 (strictest) and 1.06 (loosest of the issue's)")
    for R, N, steps in EXHAUSTIVE_POINTS:
        rows = []
        for d in range(draws):
            s = draw_samples(random_mixture(d), steps * N, d)
            c = stage_costs(s, model)
            best, best_steps = best_plan_figure(c, R, N)
            plan = plan_epoch(s.lengths, R, global_batch_size=N, seed=d, cost=c.sum(1), stages=c)
            lg = composition_floor(length_grouped_steps(c, N, d), c, R)
            rows.append((best, lg, epoch_stage_figure(plan, c), split_figure(best_steps, c, R)))
            print(f"    ({R}, {N}) draw {d}: best {best:.4f} | LG floor {lg:.4f} | plan {rows[-1][2]:.4f} | "
                  f"best composition split by tokenbal {rows[-1][3]:.4f}", flush=True)
        best, lg, now, split = np.array(rows).T
        tol = 1 + 1e-9
        print(f"  ({R}, {N}), {steps} steps, {draws} draws: best plan above max(1.01, LG floor) on "
              f"{int((best > np.maximum(1.01, lg) * tol).sum())}/{draws}, above max(1.06, LG floor) on "
              f"{int((best > np.maximum(1.06, lg) * tol).sum())}/{draws}; plan / best median "
              f"{np.median(now / best):.4f} worst {np.max(now / best):.4f}, at the best on "
              f"{int((now <= best * tol).sum())}/{draws}; the best composition split by tokenbal / best: "
              f"worst {np.max(split / best):.4f}")


def bench_token_mixtures(draws: int, points: tuple, repeat_draws: int) -> None:
    """Tokens mode (no stages) over random mixtures: per-step max/mean of rank tokens (mean and p95
    over steps), the epoch figure Σ_steps max_rank / ideal and planning CPU, now and PLAN_VERSION 7
    (loaded from git, same process); worst and median over the draws."""
    from tokenbal.balance.mixtures import draw_samples, random_mixture
    from tokenbal.balance.plan import PLAN_VERSION
    from tokenbal.balance.plan import plan_epoch as plan_now

    plan_v7 = planner_at(V7_COMMIT)
    print(f"tokens mode; now = PLAN_VERSION {PLAN_VERSION}, v7 = {V7_COMMIT}; per step max/mean over ranks")
    for R, N, steps in points:
        rows = {"now": [], "v7": []}
        again = {"now": [], "v7": []}
        for d in range(draws):
            lengths = draw_samples(random_mixture(d), steps * N, d).lengths
            for name, fn in (("now", plan_now), ("v7", plan_v7)):
                plan, _, cpu = timed(partial(fn, lengths, R, global_batch_size=N, seed=d))
                t = plan.step_rank_tokens(lengths).astype(np.float64)
                full = t[:-1] if len(t) > 1 else t
                r = full.max(1) / full.mean(1)
                rows[name].append((r.mean(), np.quantile(r, 0.95), t.max(1).sum() / (t.sum() / R), cpu))
                if d < repeat_draws:
                    nxt = fn(lengths, R, global_batch_size=N, seed=d, epoch=1)
                    again[name].append(_pairs_again(plan, nxt))
        for name in ("now", "v7"):
            v = np.array(rows[name])
            rep = (f"; step mates again next epoch {np.mean([a for a, _ in again[name]]):.4f} (chance "
                   f"{np.mean([c for _, c in again[name]]):.5f})") if again[name] else ""
            print(f"  ({R}, {N}), {steps} steps, {draws} draws, {name}: step max/mean mean worst "
                  f"{v[:, 0].max():.4f} median {np.median(v[:, 0]):.4f} | p95 worst {v[:, 1].max():.4f} "
                  f"median {np.median(v[:, 1]):.4f} | figure worst {v[:, 2].max():.4f} median "
                  f"{np.median(v[:, 2]):.4f} | CPU median {np.median(v[:, 3]):.2f} s{rep}", flush=True)


def bench_plan_scale(n: int, R: int, stages: bool, seed: int, previous: str | None,
                     mmap: bool = False) -> None:
    """CPU seconds (and this process's peak RSS) to plan ``n`` samples of mixture ``seed`` on ``R``
    ranks, 2 samples per rank per step, tokens or square stage costs; with ``previous`` (a git
    commit) that planner too;
    ``mmap``: tokens from an int32 .npy memory-mapped (the draw is written 1M samples at a time)."""
    import resource

    from tokenbal.balance.mixtures import draw_samples, random_mixture, stage_costs
    from tokenbal.balance.plan import plan_epoch as plan_now
    from tokenbal.balance.simulate import epoch_stage_figure

    kw = {}
    if mmap:
        # The lengths as a training run has them: an int32 column on disk (as TokenIndex keeps it),
        # memory-mapped; drawn 1M at a time so the draw itself stays small.
        import tempfile

        path = Path(tempfile.mkdtemp(prefix="tokenbal-scale-")) / "lengths.npy"
        out = np.lib.format.open_memmap(path, mode="w+", dtype=np.int32, shape=(n,))
        spec = random_mixture(seed)
        for i, a in enumerate(range(0, n, 1_000_000)):
            b = min(n, a + 1_000_000)
            out[a:b] = draw_samples(spec, b - a, seed * 100_003 + i).lengths
        out.flush()
        del out
        lengths = np.load(path, mmap_mode="r")
        print(f"lengths: {n} int32 memory-mapped from {path}", flush=True)
    else:
        s = draw_samples(random_mixture(seed), n, seed)
        if stages:
            c = stage_costs(s)
            kw = {"cost": c.sum(1), "stages": c}
        lengths = s.lengths
        del s
    runs = [("now", plan_now)] + ([(previous, planner_at(previous))] if previous else [])
    for name, fn in runs:
        plan, _, cpu = timed(partial(fn, lengths, R, global_batch_size=2 * R, seed=seed, **kw))
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        mode = "stages" if stages else "tokens"
        # With stages, the epoch figure (Σ_steps Σ_stages max_rank / ideal) of the plan timed.
        figure = f", epoch figure {epoch_stage_figure(plan, kw['stages']):.4f}" if stages else ""
        del plan
        print(f"plan_epoch {name}: {n} samples, {R} ranks, N={2 * R}, {mode}: CPU "
              f"{cpu:.2f} s; peak RSS so far {rss:.2f} GB{figure}", flush=True)


# Issue 49: (samples, ranks, samples per rank per step, grad_accum, budget); budget None: count mode
# (global batch = per rank x ranks x grad_accum), else max_tokens_per_rank = max(largest sample, budget x
# the mean sample) in each mode's units (the stage plan's resolved cost units), per rank not set. The
# issue's table first, then 16 / 64 / 4,096 ranks, 8 per rank, grad_accum and token-budget rows.
SCALE_TABLE = ((10_000, 8, 2, 1, None), (30_000, 8, 2, 1, None), (100_000, 8, 2, 1, None),
               (200_000, 8, 2, 1, None), (1_000_000, 8, 2, 1, None), (30_000, 64, 2, 1, None),
               (1_000_000, 512, 2, 1, None))
SCALE_MORE = ((30_000, 16, 2, 1, None), (40_960, 512, 2, 1, None), (196_608, 4096, 2, 1, None),
              (100_000, 8, 8, 1, None), (10_000, 8, 2, 2, None), (100_000, 8, 2, 2, None),
              (20_000, 8, None, 1, 4), (100_000, 8, None, 1, 4), (100_000, 8, None, 1, 16),
              (100_000, 8, None, 2, 4), (100_000, 64, None, 1, 16))
V12_COMMIT = "c8dd161"          # main with PLAN_VERSION 12 (issue 49, part 1: short epochs within a budget)


def bench_plan_scale_table(rows: tuple, seed: int, previous: str | None, repeats: int,
                           previous_max: int) -> None:
    """Issue 49: CPU seconds (``time.process_time``, median of ``repeats``) of ``plan_epoch`` on each row's
    samples of mixture ``seed`` (square stage costs): tokens mode, stages (``cost=``, ``stages=``) now,
    and stages by the planner at git commit ``previous`` (one run; skipped above ``previous_max``
    samples), all in this process; the ratios stages / tokens (the issue's target: <= 10, or <= 0.25 s)
    and previous / now."""
    from tokenbal.balance.cost import resolve
    from tokenbal.balance.mixtures import draw_samples, random_mixture, stage_costs
    from tokenbal.balance.plan import PLAN_VERSION
    from tokenbal.balance.plan import plan_epoch as plan_now
    from tokenbal.balance.simulate import epoch_stage_figure

    old = planner_at(previous) if previous else None
    print(f"now = PLAN_VERSION {PLAN_VERSION}, previous = {previous}; CPU s, median of {repeats} "
          "(previous: 1 run); figure = Σ_steps Σ_stages max_rank / ideal; budget = max_tokens_per_rank "
          "in mean samples (at least the largest)")
    print(f"{'samples':>9} {'ranks':>5} {'per rank':>8} {'ga':>3} {'budget':>6} | {'tokens':>7} "
          f"{'stages':>7} {'ratio':>6} {'ok':>3} | {'previous':>8} {'prev/now':>8} | {'figure now':>10} "
          f"{'previous':>9}", flush=True)
    for n, R, per, ga, budget in rows:
        s = draw_samples(random_mixture(seed), n, seed)
        c = stage_costs(s)
        lengths = s.lengths
        del s
        if budget is None:
            kw = kw_tok = {"global_batch_size": per * R * ga, "grad_accum": ga, "seed": seed}
        else:
            units = resolve(lengths, c.sum(1), c).costs
            kw = {"max_tokens_per_rank": int(max(units.max(), budget * units.mean())), "grad_accum": ga,
                  "seed": seed}
            kw_tok = {"max_tokens_per_rank": int(max(lengths.max(), budget * lengths.mean())),
                      "grad_accum": ga, "seed": seed}
        tokens_plan = partial(plan_now, lengths, R, **kw_tok)
        stage_plan = partial(plan_now, lengths, R, cost=c.sum(1), stages=c, **kw)
        tok = measure(tokens_plan, repeats=repeats, warmup=0).cpu_median
        plan, _, _ = timed(stage_plan)
        now = measure(stage_plan, repeats=repeats, warmup=0).cpu_median
        fig = epoch_stage_figure(plan, c)
        prev, pfig = float("nan"), float("nan")
        if old is not None and n <= previous_max:
            pplan, _, prev = timed(partial(old, lengths, R, cost=c.sum(1), stages=c, **kw))
            pfig = epoch_stage_figure(pplan, c)
        r = now / tok if tok > 0 else float("inf")
        ok = "yes" if now <= max(10 * tok, 0.25) else "NO"
        print(f"{n:>9} {R:>5} {per or '-':>8} {ga:>3} {budget or '-':>6} | {tok:7.3f} {now:7.2f} {r:6.1f} "
              f"{ok:>3} | {prev:8.2f} {prev / now:8.1f} | {fig:10.4f} {pfig:9.4f}", flush=True)


PADDED_POINTS = ((2, 4, 1), (8, 4, 1), (8, 2, 2), (2, 8, 1))   # (ranks, per-device batch, grad accum)


def _padded_mixtures(n: int, seed: int) -> list[tuple[str, np.ndarray]]:
    """Length mixtures for the padded comparison: the demo mixture and random families whose
    parameters are drawn from ``seed`` (not one hand-picked case)."""
    rng = np.random.default_rng(seed)
    out = [("demo mixture", mixture_lengths(n, seed))]
    mu, sigma = rng.uniform(4.5, 6.5), rng.uniform(0.6, 1.4)
    out.append((f"lognormal({mu:.1f}, {sigma:.1f})", rng.lognormal(mu, sigma, n).astype(np.int64) + 1))
    frac, long_lo = rng.uniform(0.05, 0.3), int(rng.integers(1000, 4000))
    long = rng.integers(long_lo, 3 * long_lo, n)
    out.append((f"text + {frac:.0%} long", np.where(rng.random(n) < frac, long, rng.integers(20, 400, n))))
    hi = int(rng.integers(500, 5000))
    out.append((f"uniform(1, {hi})", rng.integers(1, hi, n)))
    out.append(("four sizes", rng.choice([8, 80, 800, 8000], n, p=[0.4, 0.3, 0.2, 0.1])))
    return out


def bench_padded(n: int, seed: int, repeats: int) -> None:
    """Padded micro-batches (every one padded to its longest sample): Σ over steps (and micro-batches)
    of the slowest rank's padded tokens, padded ÷ real, and the same samplers' packed cost (Σ of the
    slowest rank's real tokens), for DistributedSampler, transformers' BatchRebalanceSampler
    (train_sampling_strategy="batch_rebalance"), tokenbal's token-balanced plan and cost="padded";
    all on the same lengths in this run."""
    from tokenbal.balance.baselines import (
        batch_rebalance_plan,
        distributed_sampler_plan,
        padded_summary,
    )
    from tokenbal.balance.plan import plan_epoch as plan

    print(environment_line())
    print(f"{n} samples per mixture; ratios are over batch_rebalance's value in the same run (< 1 = better)")
    wins = total = 0
    for R, b, k in PADDED_POINTS:
        N = R * b * k
        print(f"\n== {R} ranks, per-device batch {b}, grad_accum {k} (global batch {N})")
        print(f"{'mixture':<22}{'sampler':<22}{'Σmax padded':>13}{'÷ b_r':>7}{'padded÷real':>12}"
              f"{'real max/mean':>14}{'peak':>8}{'Σmax packed':>13}{'÷ b_r':>7}")
        for name, lens in _padded_mixtures(n, seed):
            plans = {"DistributedSampler": distributed_sampler_plan(lens, R, b, k, seed=seed),
                     "batch_rebalance": batch_rebalance_plan(lens, R, b, k, seed=seed),
                     "tokenbal tokens": plan(lens, R, global_batch_size=N, grad_accum=k, seed=seed),
                     "tokenbal padded": plan(lens, R, global_batch_size=N, grad_accum=k, seed=seed,
                                             cost="padded")}
            rows = {m: padded_summary(p, lens) for m, p in plans.items()}
            packed = {m: int(p.micro_tokens(lens).max(1).sum()) for m, p in plans.items()}
            ref, ref_packed = rows["batch_rebalance"], packed["batch_rebalance"]
            for m, r in rows.items():
                rel = r["sum_max_padded"] / ref["sum_max_padded"]
                print(f"{name:<22}{m:<22}{r['sum_max_padded']:13d}{rel:7.3f}"
                      f"{r['padded_over_real']:12.3f}{r['real_max_over_mean']:14.3f}{r['peak_padded']:8d}"
                      f"{packed[m]:13d}{packed[m] / ref_packed:7.3f}")
            ours = rows["tokenbal padded"]
            total += 1
            wins += (ours["sum_max_padded"] <= ref["sum_max_padded"]
                     and ours["padded_over_real"] <= ref["padded_over_real"])
    print(f"\ntokenbal padded <= batch_rebalance on both Σmax padded and padded÷real: {wins} of {total} "
          "cases")
    lens = mixture_lengths(n, seed)
    R, b, k = 8, 4, 1
    t_ours = measure(lambda: plan(lens, R, global_batch_size=R * b * k, seed=seed, cost="padded"),
                     repeats=repeats)
    t_br = measure(lambda: batch_rebalance_plan(lens, R, b, k, seed=seed), repeats=repeats)
    print(f"planning an epoch of {n} samples for all {R} ranks (median of {repeats}, CPU): tokenbal padded "
          f"{t_ours.cpu_median:.3f} s, BatchRebalanceSampler x {R} ranks {t_br.cpu_median:.3f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=400, help="steps per (R, N) point for tokenbal")
    ap.add_argument("--baseline-steps", type=int, default=200, help="steps for the per-step baselines")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="100 steps per point, 3 timing repeats")
    ap.add_argument("--plan-samples", type=int, default=1_000_000)
    ap.add_argument("--large-windows", default="64,128",
                    help="extra windows (steps) tried at (512, 1024): balance vs planning time")
    ap.add_argument("--plan-only", action="store_true", help="only the planning time of --plan-samples")
    ap.add_argument("--compare-exact", action="store_true",
                    help="also plan with the exact one-item-at-a-time fill (the pre-batching planner)")
    ap.add_argument("--repeats", type=int, default=None, help="timing runs (default 5, 3 with --quick)")
    ap.add_argument("--stages", action="store_true",
                    help="only the vision/LLM stage balance (Qwen2-VL-7B FLOPs) with and without stages=True")
    ap.add_argument("--elastic", action="store_true",
                    help="only an elastic resume (512 -> 384 ranks half-way through --plan-samples)")
    ap.add_argument("--budget", action="store_true",
                    help="only token-budget mode (max_tokens_per_rank=16384) next to trl's BFD pack_dataset")
    ap.add_argument("--mixtures", type=int, default=0, metavar="DRAWS",
                    help="issue 32: stage balance over DRAWS random mixtures at every scale, the planner "
                    "at --previous in the same run, against the length-grouped composition's floor, its "
                    "equal-count floor and its split by tokenbal's split (simulate.split_figure)")
    ap.add_argument("--previous", default=V11_COMMIT, metavar="COMMIT",
                    help=f"--mixtures / --plan-scale --with-previous: the git commit whose planner runs "
                    f"beside the current one (default {V11_COMMIT}, PLAN_VERSION 11; {V10_COMMIT}: "
                    f"PLAN_VERSION 10; {V9_COMMIT}: "
                    f"PLAN_VERSION 9; {V8_COMMIT}: "
                    f"PLAN_VERSION 8; {V6_COMMIT}: PLAN_VERSION 6; none: --mixtures without it)")
    ap.add_argument("--exhaustive", type=int, default=0, metavar="DRAWS",
                    help="issue 32: on tiny epochs (12-16 samples) of DRAWS random mixtures, the best "
                    "figure of any plan (exhaustive search) against max(goal, LG floor) and the plan")
    ap.add_argument("--token-mixtures", type=int, default=0, metavar="DRAWS",
                    help="issue 32: tokens-mode balance over DRAWS random mixtures at every scale, "
                    "PLAN_VERSION 7 in the same run")
    ap.add_argument("--fill-jitter", type=float, default=0.0,
                    help="--token-mixtures: jitter of the sizes the window-fill candidate sorts "
                    "(plan.counts._FILL_JITTER; 0 = the default plan)")
    ap.add_argument("--mixture-cost", default="square", choices=("square", "flops"))
    ap.add_argument("--mixture-points", default="", help="R values to run (default all), e.g. 8,64")
    ap.add_argument("--repeat-draws", type=int, default=3, help="draws whose next epoch is planned too")
    ap.add_argument("--plan-scale", default="", metavar="N,R,MODE",
                    help="planning time / RSS of N mixture samples on R ranks, MODE tokens or stages; "
                    "'table': issue 49's table (stages vs tokens vs --previous, CPU medians), 'more': its "
                    "16 / 4,096-rank, 8-per-rank, grad_accum and token-budget rows, 'all': both "
                    f"(issue 49's previous planner: --previous {V12_COMMIT}, PLAN_VERSION 12)")
    ap.add_argument("--previous-max", type=int, default=300_000,
                    help="--plan-scale table: run the --previous planner up to this many samples")
    ap.add_argument("--mmap", action="store_true",
                    help="--plan-scale tokens: lengths memory-mapped from an int32 .npy (100M samples)")
    ap.add_argument("--with-v6", action="store_true", help="--plan-scale: time the v6 planner too")
    ap.add_argument("--with-previous", action="store_true",
                    help="--plan-scale: time the planner at --previous too")
    ap.add_argument("--padded", action="store_true",
                    help="only padded batches: cost='padded' vs transformers' BatchRebalanceSampler")
    ap.add_argument("--padded-samples", type=int, default=4000)
    args = ap.parse_args()
    if args.mixtures:
        keep = {int(x) for x in args.mixture_points.split(",") if x}
        pts = tuple(p for p in MIXTURE_POINTS if not keep or p[0] in keep)
        print(environment_line())
        bench_mixtures(args.mixtures, pts, args.mixture_cost, args.repeat_draws, args.previous)
        return
    if args.exhaustive:
        print(environment_line())
        bench_exhaustive(args.exhaustive, args.mixture_cost)
        return
    if args.token_mixtures:
        tokenbal.balance.plan.counts._FILL_JITTER = args.fill_jitter
        keep = {int(x) for x in args.mixture_points.split(",") if x}
        print(environment_line())
        bench_token_mixtures(args.token_mixtures, tuple(p for p in TOKEN_POINTS if not keep or p[0] in keep),
                             args.repeat_draws)
        return
    if args.plan_scale in ("table", "more", "all"):
        print(environment_line())
        rows = {"table": SCALE_TABLE, "more": SCALE_MORE, "all": SCALE_TABLE + SCALE_MORE}[args.plan_scale]
        bench_plan_scale_table(rows, args.seed, None if args.previous == "none" else args.previous,
                               args.repeats or 3, args.previous_max)
        return
    if args.plan_scale:
        n, R, mode = args.plan_scale.split(",")
        print(environment_line())
        previous = V6_COMMIT if args.with_v6 else args.previous if args.with_previous else None
        bench_plan_scale(int(float(n)), int(R), mode == "stages", args.seed, previous, args.mmap)
        return
    if args.padded:
        bench_padded(args.padded_samples, args.seed, args.repeats or 3)
        return
    if args.budget:
        bench_budget(20_000, 16_384, (1, 8, 64), args.seed, args.repeats or 3)
        return
    if args.elastic:
        bench_elastic(args.plan_samples, args.seed, args.repeats or 3)
        return
    if args.stages:
        print(environment_line())
        print("per-step Σ_stage max_rank / (step FLOPs / ranks), 1.000 = perfect; repeat = share of the "
              "sample pairs sharing a step in epoch 0 that share one in epoch 1")
        for R, N in POINTS:
            bench_stages(R, N, 100 if args.quick else args.steps, args.seed)
        bench_stage_plan_time(args.plan_samples, args.repeats or 3, args.seed)
        return
    steps = 100 if args.quick else args.steps
    print(environment_line())
    print(f"python {platform.python_version()}, numpy {np.__version__}, {platform.machine()}; "
          "per-step max/mean of rank tokens (1.000 = perfect); 'vs LB' = max / max(mean, largest sample)")
    extra = tuple(int(w) for w in args.large_windows.split(",") if w)
    if not args.plan_only:
        for R, N in POINTS:
            bench_point(R, N, steps, min(steps, args.baseline_steps), args.seed, extra if R == 512 else (),
                        args.compare_exact)
    repeats = args.repeats or (3 if args.quick else 5)
    runs = [("batched fill", contextlib.nullcontext), ("previous (v5 window)", previous_planner)]
    if args.compare_exact:
        runs.append(("exact fill", exact_fill))
    cpu_median = {}
    for name, ctx in runs:
        with ctx():
            wall, cpu = bench_plan_time(args.plan_samples, 512, 1024, repeats, args.seed)
        cpu_median[name] = float(np.median(cpu))
        print(f"plan_epoch of {args.plan_samples} samples, 512 ranks, N=1024, {name} ({len(wall)} runs): "
              f"CPU median {np.median(cpu):.2f} s (min {min(cpu):.2f}, max {max(cpu):.2f}); "
              f"wall median {np.median(wall):.2f} s")
    if args.compare_exact:
        print(f"exact / batched CPU median: {cpu_median['exact fill'] / cpu_median['batched fill']:.1f}x")


if __name__ == "__main__":
    main()
