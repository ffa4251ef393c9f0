"""The verdict: which bottleneck costs how much of the step, and the tokenbal feature that removes it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenbal.profile.analysis import RunProfile


@dataclass
class VerdictRow:
    bottleneck: str
    seconds: float           # per step, averaged over ranks
    share: float             # of the mean step time
    evidence: str
    remedy: str


def _late_ranks(c) -> str:
    """The ranks that were last to arrive, most often first: 'rank 1 (4/4)', 'rank 0 (2/4), rank 1 (2/4)'."""
    late = sorted((n, -r) for r, n in c.last_arrivals.items() if n)
    shown = [f"rank {-r} ({n}/{c.count})" for n, r in reversed(late[-3:])]
    more = len(late) - len(shown)
    return ", ".join(shown) + (f" +{more} more" if more > 0 else "") if shown else "-"


def verdict(p: RunProfile) -> list[VerdictRow]:
    step = p.mean_step_s()

    def share(seconds: float) -> float:
        # Steps of zero length (a trace whose ProfilerStep#N annotations closed as they opened) have
        # no share to give: NaN, shown as '-' (None in --json), not a ZeroDivisionError.
        return seconds / step if step > 0 else float("nan")
    straggler, unequal, jitter = p.straggler_wait_s(), p.unequal_work_s(), p.jitter_s()
    per_step_syncs = (p.mean("host_reads") + p.mean("sync_calls") + p.mean("h2d_copies"))
    exposed = p.mean("exposed_comm_s")
    skew = max((c.skew_median_s for c in p.collectives), default=0.0)
    source = f" ({p.arrival_source})" if p.arrival_source else ""
    explained = f"{unequal / straggler:.0%}" if straggler > 0 else "-"
    judged = "operator sizes" if p.work_from_shapes else "operator time"
    overlaps = [s.overlap for s in p.steps if s.comm_s > 0]
    rope_remedy = "collate.apply_mrope via collate.models.enable_packed (one fused op)"
    if p.packed_model:
        rope_remedy = ("already in use (collate.models / collate.ops ran): what is left is transformers' "
                       "own, its rotary cos / sin table and the vision tower's rotation, which "
                       "enable_packed keeps")
    rows = [
        VerdictRow("stragglers (unequal work per rank)", unequal, share(unequal),
                   f"collective arrival skew median up to {skew * 1e3:.1f} ms{source}; the late ranks' extra "
                   f"work ({judged}) explains {explained} of the wait; compute max/mean "
                   f"{p.compute_imbalance():.3f}",
                   "TokenBalancedBatchSampler over a `tokenbal index build` index "
                   "(cost='flops', stages=True)"),
        VerdictRow("arrival jitter (late ranks without more work)", jitter, share(jitter),
                   "ranks reach collectives at different times with the same operator work: host stalls, "
                   "data loading, or other processes on the cores; balancing samples does not remove it",
                   "not the sampler: more DataLoader workers / DevicePrefetcher, one rank per core set "
                   "(torch.set_num_threads), no other load on the hosts"),
        VerdictRow("host syncs and H2D copies in the step", p.mean("sync_gap_s"), share(p.mean("sync_gap_s")),
                   f"{per_step_syncs:.1f} per step ({p.mean('host_reads'):.1f} scalar reads, "
                   f"{p.mean('sync_calls'):.1f} syncs, {p.mean('h2d_copies'):.1f} H2D copies)"
                   + ("" if p.device else "; host-only trace: no device to stall here, each one stalls the "
                      "launch queue on an accelerator"),
                   "PackedCollator (cu_seqlens / positions built on the host) + DevicePrefetcher "
                   "(side stream)"),
        VerdictRow("RoPE slice / cat copies", p.mean("rope_copy_s"), share(p.mean("rope_copy_s")),
                   "copy operators inside rotary-embedding code" if p.has_python_stacks else
                   "no Python stacks: not attributable (profile with with_stack=True)",
                   rope_remedy),
        # Waiting for a straggler shows up as exposed communication too; count it once, above.
        VerdictRow("exposed communication (not overlapped)", max(0.0, exposed - straggler),
                   share(max(0.0, exposed - straggler)),
                   f"communication {p.mean('comm_s') * 1e3:.1f} ms/step, overlap "
                   + (f"{np.mean(overlaps):.0%}" if overlaps else "-"),
                   "collate.train.FSDPSettings.for_device (layer prefetch, async reduce-scatter)"),
    ]
    return sorted(rows, key=lambda r: -r.seconds)


def format_report(p: RunProfile) -> str:
    kind = "device" if p.device else "host-only (CPU)"
    ranks = f"{len(p.ranks)} ranks"
    if p.missing_ranks:
        ranks = (f"{len(p.ranks)} of {p.world_size or len(p.ranks) + len(p.missing_ranks)} ranks (no trace "
                 f"of rank {', '.join(map(str, p.missing_ranks))})")
    lines = [f"{p.source}: {ranks}, {len(p.per_step())} steps, {kind} trace, "
             f"mean step {p.mean_step_s() * 1e3:.1f} ms"
             + (f"; arrivals from {p.arrival_source}" if p.arrival_source else ""), "",
             "per rank (ms, mean over steps): step  compute  comm  exposed  overlap  idle  wait  "
             "syncs  rope-copies"]
    for r in p.ranks:
        mine = [s for s in p.steps if s.rank == r]

        def m(attr, mine=mine):
            return float(np.mean([getattr(s, attr) for s in mine]))
        overlaps = [s.overlap for s in mine if s.comm_s > 0]
        overlap = f"{np.mean(overlaps):8.0%}" if overlaps else f"{'-':>8s}"
        lines.append(f"  rank {r:3d}  {m('step_s') * 1e3:8.1f} {m('compute_s') * 1e3:8.1f} "
                     f"{m('comm_s') * 1e3:6.1f} "
                     f"{m('exposed_comm_s') * 1e3:8.1f} {overlap} "
                     f"{m('idle_s') * 1e3:6.1f} {m('wait_s') * 1e3:6.1f} "
                     f"{m('host_reads') + m('sync_calls') + m('h2d_copies'):6.1f} "
                     f"{m('rope_copy_s') * 1e3:8.2f}")
    if p.collectives:
        lines += ["", "collectives (per rank): kind  count  MiB  arrival skew median / max (ms)  "
                      "last to arrive"]
        for c in p.collectives:
            size = f"{c.bytes / 2**20:8.2f}" if c.bytes is not None else "       ?"
            lines.append(f"  {c.kind:15s} {c.count:5d} {size} {c.skew_median_s * 1e3:10.2f} / "
                         f"{c.skew_max_s * 1e3:8.2f}   {_late_ranks(c)}")
    lines += ["", "verdict (share of the mean step; the feature that addresses it):"]
    for v in verdict(p):
        share = f"{v.share:6.1%}" if np.isfinite(v.share) else f"{'-':>6s}"
        lines.append(f"  {share}  {v.seconds * 1e3:8.2f} ms  {v.bottleneck}: {v.evidence}")
        lines.append(f"  {'':6s}  {'':8s}     -> {v.remedy}")
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)


def format_compare(a: RunProfile, b: RunProfile) -> str:
    va = {v.bottleneck: v for v in verdict(a)}
    vb = {v.bottleneck: v for v in verdict(b)}
    width = max(len(k) for k in va)
    lines = [f"A = {a.source}", f"B = {b.source}", "",
             f"{'':{width}s}  {'A ms/step':>10s} {'A share':>8s}  {'B ms/step':>10s} {'B share':>8s}"]
    rows = [("step", a.mean_step_s(), 1.0, b.mean_step_s(), 1.0),
            ("compute max/mean", a.compute_imbalance(), float("nan"), b.compute_imbalance(), float("nan"))]
    for k in va:
        rows.append((k, va[k].seconds, va[k].share, vb[k].seconds, vb[k].share))
    for name, sa, ra, sb, rb in rows:
        scale = 1.0 if name == "compute max/mean" else 1e3
        fa = f"{sa * scale:10.3f}" if scale == 1.0 else f"{sa * scale:10.1f}"
        fb = f"{sb * scale:10.3f}" if scale == 1.0 else f"{sb * scale:10.1f}"
        share_a = f"{ra:8.1%}" if np.isfinite(ra) else " " * 8
        share_b = f"{rb:8.1%}" if np.isfinite(rb) else " " * 8
        lines.append(f"{name:{width}s}  {fa} {share_a}  {fb} {share_b}")
    if a.mean_step_s() > 0 and b.mean_step_s() > 0:
        lines.append(f"\nB's mean step is {a.mean_step_s() / b.mean_step_s():.2f}x as fast as A's")
    return "\n".join(lines)


def write_timeline(profiles: list[RunProfile], path: str) -> Any:
    """A PNG (matplotlib, the ``plot`` extra): one row per (run, rank), one bar per step along a
    time axis in seconds -- blue compute, orange exposed communication / wait, grey idle. Returns
    the (closed) matplotlib Figure."""
    from tokenbal.plot import finish_timeline, pyplot, save

    plt = pyplot()
    rows = [(p, r) for p in profiles for r in p.ranks]
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.35 * max(len(rows), 1)), dpi=100, layout="constrained")
    colors = {"compute": (0.16, 0.35, 0.67), "exposed communication / wait": (1.0, 0.63, 0.35),
              "idle": (0.78, 0.78, 0.78)}
    for y, (p, r) in enumerate(rows):
        x = 0.0
        for s in sorted((s for s in p.steps if s.rank == r), key=lambda s: s.step):
            compute = min(s.compute_s, s.step_s)
            wait = max(0.0, min(s.step_s, s.compute_s + s.exposed_comm_s) - compute)
            idle = max(0.0, s.step_s - compute - wait)
            for (name, color), (start, length) in zip(colors.items(), ((x, compute), (x + compute, wait),
                                                                       (x + compute + wait, idle)),
                                                      strict=True):
                if length > 0:
                    ax.barh(y, length, left=start, height=0.8, color=color, edgecolor="white",
                            linewidth=0.5, label=name)
            x += s.step_s
    finish_timeline(ax, [f"{p.source[-30:]} rank {r}" for p, r in rows],
                    "time since the first profiled step (s)",
                    "per-rank steps: compute, exposed communication / wait, idle")
    save(fig, path)
    return fig
