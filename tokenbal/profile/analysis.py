"""Per-rank, per-step breakdown of a distributed run's traces, and when each rank reached each collective.

Definitions (those of Holistic Trace Analysis where it has one, so numbers compare):
- compute: time the device runs non-communication kernels (host-only traces: time the training
  thread spends in operators other than collective launches);
- communication: time collective kernels run (host-only traces: gloo's collective work);
- exposed communication: communication not overlapped by compute; overlap ratio =
  1 - exposed / communication (HTA's "comm/comp overlap");
- idle: step time covered by neither.
Arrival skew of one collective: how much later the last rank reached it than the first, from each
rank's own timeline (``tokenbal.profile.arrival``); the waits it causes are split into unequal
work (the sampler's business) and arrival jitter (not).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from tokenbal.profile import arrival
from tokenbal.profile.arrival import collective_kind, event_bytes
from tokenbal.profile.intervals import as_intervals, clip, overlap, total, union
from tokenbal.profile.traces import Trace, step_windows

_DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
_COMM_NAME = re.compile(r"nccl|hccl|hcom|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|broadcast|"
                        r"send_?recv", re.I)
_HOST_COMM = re.compile(r"^(gloo|mpi|ucc):")          # host-side collective execution (CPU process groups)
_HOST_READ_OPS = {"aten::_local_scalar_dense"}       # .item(), a scalar read back to the host
_SYNC_CALLS = re.compile(r"^(cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventSynchronize|cudaMemcpy|"
                         r"cuStreamSynchronize|cuCtxSynchronize|aclrtSynchronize\w*|aclrtMemcpy)$")
_H2D = re.compile(r"HtoD|Host ?to ?Device|H2D", re.I)
_COPY_OPS = {"aten::cat", "aten::slice", "aten::split", "aten::split_with_sizes", "aten::narrow",
             "aten::index_select", "aten::index", "aten::copy_", "aten::clone", "aten::contiguous",
             "aten::stack", "aten::chunk", "aten::gather"}
# Rotary-embedding code, told by the words of a frame's function or module name (transformers'
# apply_rotary_pos_emb, rotate_half, Qwen2VLRotaryEmbedding, ..._mrope), never by a file path or a
# substring: a script rope_ablation.py or a function europe_step is not rotary code.
# A Python frame of tokenbal's packed model code: enable_packed's forwards, the fused ops.
_PACKED_FRAME = re.compile(r"(?:^|[/\\])collate[/\\](?:models|ops)[/\\][^(]*\.py\(")
_PY_FRAME = re.compile(r"\.py\(\d+\): (.*)$")
_ROTARY_WORDS = frozenset({"rotary", "rope", "mrope"})
_CAMEL_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")
_FUSED_FRAME = re.compile(r"collate/ops/|apply_mrope|liger|npu_rotary|triton", re.I)

@dataclass
class RankStep:
    """One rank's share of one step, in seconds."""

    rank: int
    step: int
    step_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    idle_s: float
    host_reads: int = 0           # scalar reads back to the host (.item()): a sync on an accelerator
    sync_calls: int = 0           # explicit stream/device synchronisations, blocking memcpys
    h2d_copies: int = 0
    sync_gap_s: float = 0.0       # device idle right after those syncs / copies
    rope_copy_s: float = 0.0      # slice / cat / index copies inside rotary-embedding code
    other_copy_s: float = 0.0     # the same ops elsewhere (or everywhere, without Python stacks)
    wait_s: float = 0.0           # waiting in collectives for a later rank (where it was not hidden)
    unequal_work_wait_s: float = 0.0   # the part of wait_s that the later rank's extra work explains

    @property
    def overlap(self) -> float:
        return 1.0 - self.exposed_comm_s / self.comm_s if self.comm_s > 0 else float("nan")

    @property
    def jitter_wait_s(self) -> float:
        return self.wait_s - self.unequal_work_wait_s


@dataclass
class CollectiveStats:
    kind: str
    count: int                    # per rank
    bytes: int | None             # per rank, summed over the calls
    skew_median_s: float
    skew_max_s: float
    waited_s: dict[int, float]    # per rank: time spent waiting for the last to arrive, summed
    last_arrivals: dict[int, int]  # per rank: how often it was the last to arrive


def _nanmean(values) -> float:
    arr = np.asarray(list(values), dtype=np.float64)
    arr = arr[~np.isnan(arr)]
    return float(arr.mean()) if len(arr) else float("nan")


@dataclass
class RunProfile:
    """What `tokenbal profile` reports about one run."""

    source: str
    ranks: list[int]
    steps: list[RankStep]
    collectives: list[CollectiveStats]
    device: bool                  # device kernels in the traces (else a host-only, e.g. gloo CPU, run)
    has_python_stacks: bool
    notes: list[str] = field(default_factory=list)
    arrival_source: str = ""      # which timeline the arrivals were read from (arrival.FROM_*)
    work_from_shapes: bool = False  # unequal work judged by operator sizes (else operator time)
    world_size: int | None = None   # as the traces record it (None: not recorded)
    missing_ranks: list[int] = field(default_factory=list)   # the run's ranks without a trace here
    files: dict[int, str] = field(default_factory=dict)      # rank -> the trace analysed
    packed_model: bool = False    # the step ran tokenbal's packed model code (enable_packed, collate.ops)

    def per_step(self) -> dict[int, list[RankStep]]:
        out: dict[int, list[RankStep]] = defaultdict(list)
        for s in self.steps:
            out[s.step].append(s)
        return dict(sorted(out.items()))

    def mean_step_s(self) -> float:
        return _nanmean(max(r.step_s for r in rs) for rs in self.per_step().values())

    def straggler_wait_s(self) -> float:
        """Per step, the mean over ranks of the time spent waiting in collectives for a later rank,
        counted only where it was not hidden (behind compute on a device; host-only traces: the
        training thread's time outside operators). Without collectives: the mean gap to the
        slowest rank's compute."""
        if not self.collectives:
            return _nanmean((max(r.compute_s for r in rs) - np.array([r.compute_s for r in rs])).mean()
                            for rs in self.per_step().values())
        return self.mean("wait_s")

    def unequal_work_s(self) -> float:
        """The part of :meth:`straggler_wait_s` explained by the later ranks' extra work."""
        return self.mean("unequal_work_wait_s") if self.collectives else self.straggler_wait_s()

    def jitter_s(self) -> float:
        """The rest of the wait: ranks arriving late without more work to do."""
        return max(0.0, self.straggler_wait_s() - self.unequal_work_s())

    def compute_imbalance(self) -> float:
        """Mean over steps of max / mean compute across ranks (1.0 = balanced)."""
        ratios = []
        for rs in self.per_step().values():
            c = np.array([r.compute_s for r in rs])
            if c.mean() > 0:
                ratios.append(c.max() / c.mean())
        return float(np.mean(ratios)) if ratios else float("nan")

    def mean(self, attr: str) -> float:
        return _nanmean(getattr(s, attr) for s in self.steps)


def _nest(events: list[dict]) -> dict[int, int | None]:
    """Parent (by list position) of each event on one thread: the innermost event containing it."""
    order = sorted(range(len(events)), key=lambda i: (events[i]["ts"], -events[i]["dur"]))
    parent: dict[int, int | None] = {}
    stack: list[int] = []
    for i in order:
        start = events[i]["ts"]
        while stack and events[stack[-1]]["ts"] + events[stack[-1]]["dur"] <= start:
            stack.pop()
        parent[i] = stack[-1] if stack else None
        stack.append(i)
    return parent


def _ancestors(i: int, parent: dict[int, int | None]):
    p = parent.get(i)
    while p is not None:
        yield p
        p = parent.get(p)


def _is_rotary_frame(name: str) -> bool:
    """Whether a frame (``file.py(N): function``, ``nn.Module: Class_0``, an operator) is rotary-embedding
    code: its function or module name has the word rotary, rope or mrope (snake_case or CamelCase words,
    any case), or is ``rotate_half``."""
    m = _PY_FRAME.search(name)
    what = m.group(1) if m else name
    if "rotate_half" in what:
        return True
    for token in re.split(r"[^A-Za-z0-9]+", what):
        words = [token, *_CAMEL_WORDS.findall(token)]    # RoPE whole, and Qwen2VLRotaryEmbedding's words
        if any(w.lower() in _ROTARY_WORDS for w in words):
            return True
    return False


def _own_frames(names: list[str]) -> list[str]:
    """A copy's enclosing frames (innermost first) up to its nearest module (``nn.Module: ...``), where
    there is one: rotary code is the module's own (an attention or rotary-embedding module and the
    helpers its forward calls), while the frames around the module (the training loop, a script or test
    named after RoPE) run every copy of the step."""
    for i, n in enumerate(names):
        if n.startswith("nn.Module:"):
            return names[:i + 1]
    return names


def _copy_times(trace: Trace, kernel_time: dict) -> tuple[list[tuple[float, float, bool]], bool]:
    """(start, seconds, inside rotary code) for every outermost copy-like operator on any thread.

    With device kernels the time is the kernels each operator launched; without, its host time.
    """
    by_tid: dict[object, list[dict]] = defaultdict(list)
    for e in trace.events:
        if e.get("cat") in ("cpu_op", "python_function", "cuda_runtime", "cuda_driver", "user_annotation"):
            by_tid[e.get("tid")].append(e)
    stacks = any(e.get("cat") == "python_function" for e in trace.events)
    out = []
    for events in by_tid.values():
        parent = _nest(events)
        launched: dict[int, float] = defaultdict(float)
        for i, e in enumerate(events):
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None and corr in kernel_time:
                for a in _ancestors(i, parent):
                    if events[a].get("name") in _COPY_OPS:
                        launched[a] += kernel_time[corr]
        for i, e in enumerate(events):
            if e.get("cat") != "cpu_op" or e.get("name") not in _COPY_OPS:
                continue
            names = [events[a].get("name", "") for a in _ancestors(i, parent)]
            if any(events[a].get("name") in _COPY_OPS for a in _ancestors(i, parent)):
                continue                      # counted with its outermost copy operator
            if any(_FUSED_FRAME.search(n) for n in names):
                continue                      # inside a fused rotary op: its own business
            rotary = any(_is_rotary_frame(n) for n in _own_frames(names))
            seconds = launched[i] if kernel_time else e["dur"] * 1e-6
            out.append((e["ts"], seconds, rotary))
    return out, stacks


def _compute_comm(trace: Trace) -> tuple[np.ndarray, np.ndarray, list[dict], bool]:
    """Compute intervals, communication intervals, the collective events, and whether on a device."""
    names = trace.process_names
    overlap_pids = {pid for pid, name in names.items() if "overlap analysis" in str(name).lower()}
    if overlap_pids:   # torch_npu's own breakdown, from its device timeline
        ev = [e for e in trace.events if e.get("pid") in overlap_pids]
        compute = as_intervals((e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("name") == "Computing")
        comm = as_intervals((e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("name") == "Communication")
        hccl = {pid for pid, name in names.items() if str(name).upper().startswith("HCCL")}
        collectives = [e for e in trace.events
                       if e.get("pid") in hccl and _COMM_NAME.search(e.get("name", ""))]
        return compute, comm, collectives, True
    device = [e for e in trace.events if e.get("cat") in _DEVICE_CATS]
    if device:
        collectives = [e for e in device if e.get("cat") == "kernel" and _COMM_NAME.search(e.get("name", ""))]
        ids = {id(e) for e in collectives}
        compute = as_intervals((e["ts"], e["ts"] + e["dur"]) for e in device if id(e) not in ids)
        comm = as_intervals((e["ts"], e["ts"] + e["dur"]) for e in collectives)
        return compute, comm, collectives, True
    collectives = [e for e in trace.events if _HOST_COMM.match(e.get("name", ""))]
    compute = as_intervals((e["ts"], e["ts"] + e["dur"]) for e in trace.events
                           if e.get("cat") == "cpu_op" and e.get("tid") == trace.main_tid
                           and not arrival.LAUNCH.match(e.get("name", "")))
    comm = as_intervals((e["ts"], e["ts"] + e["dur"]) for e in collectives)
    return compute, comm, collectives, False


def collective_events(trace: Trace) -> list[dict]:
    """The collectives' own executions in ``trace``: gloo's ``gloo:*`` events (host-only traces), the
    collective kernels (device traces), torch_npu's HCCL operations; each ends only once every member
    of its group has begun it, which is what tells the ranks of one run apart from another's
    (:mod:`tokenbal.profile.runs`)."""
    return _compute_comm(trace)[2]


def _device_gap(device_busy: np.ndarray, start: float, end: float) -> float:
    """Device idle time from ``start`` until the device is next busy after ``end``."""
    if len(device_busy) == 0:
        return 0.0
    later = device_busy[device_busy[:, 0] >= end]
    stop = later[0, 0] if len(later) else end
    return max(0.0, (stop - start) - overlap(device_busy, as_intervals([(start, stop)]))) * 1e-6


def _rank_steps(trace: Trace, steps: list[int]) -> tuple[list[RankStep], list[dict], list[arrival.Call],
                                                      bool, bool, bool]:
    """(steps, collective events, calls with arrivals, on a device, Python stacks, operator shapes)."""
    windows = step_windows(trace)
    compute, comm, collectives, on_device = _compute_comm(trace)
    device_busy = union(np.concatenate([compute, comm])) if on_device else np.zeros((0, 2))
    kernel_time = {(e.get("args") or {}).get("correlation"): e["dur"] * 1e-6
                   for e in trace.events if e.get("cat") in _DEVICE_CATS
                   and (e.get("args") or {}).get("correlation") is not None}
    copies, stacks = _copy_times(trace, kernel_time)
    host_reads = [e for e in trace.events if e.get("name") in _HOST_READ_OPS]
    syncs = [e for e in trace.events if e.get("cat") in ("cuda_runtime", "cuda_driver", "cpu_op")
             and _SYNC_CALLS.match(e.get("name", ""))]
    h2d = [e for e in trace.events if e.get("cat") == "gpu_memcpy" and _H2D.search(e.get("name", ""))]
    out = []
    for step in steps:
        start, end = windows[step]

        def inside(evs, lo=start, hi=end):
            return [e for e in evs if lo <= e["ts"] < hi]

        c, m = clip(compute, start, end), clip(comm, start, end)
        step_us = end - start
        exposed = total(m) - overlap(m, c)
        busy = total(np.concatenate([c, m]))
        blocking = inside(host_reads) + inside(syncs)
        gaps = sum(_device_gap(device_busy, e["ts"], e["ts"] + e["dur"]) for e in blocking + inside(h2d))
        rope = sum(s for ts, s, rot in copies if start <= ts < end and rot)
        other = sum(s for ts, s, rot in copies if start <= ts < end and not rot)
        out.append(RankStep(rank=trace.rank, step=step, step_s=step_us * 1e-6, compute_s=total(c) * 1e-6,
                            comm_s=total(m) * 1e-6, exposed_comm_s=exposed * 1e-6,
                            idle_s=max(0.0, step_us - busy) * 1e-6, host_reads=len(inside(host_reads)),
                            sync_calls=len(inside(syncs)), h2d_copies=len(inside(h2d)),
                            sync_gap_s=gaps if on_device else 0.0, rope_copy_s=rope, other_copy_s=other))
    in_steps = [e for e in collectives if any(windows[s][0] <= e["ts"] < windows[s][1] for s in steps)]
    if on_device:
        calls, shapes = arrival.device_calls(windows, steps, collectives, compute), False
    else:
        calls, shapes = arrival.host_calls(trace, windows, steps, collectives)
    return out, in_steps, calls, on_device, stacks, shapes


def _stats(kind: str, rows: list[arrival.Matched], ranks: list[int]) -> CollectiveStats:
    skews = np.array([m.skew_s for m in rows])
    sizes = [m.bytes for m in rows]
    return CollectiveStats(
        kind=kind, count=len(rows), bytes=sum(sizes) if sizes and all(s is not None for s in sizes) else None,
        skew_median_s=float(np.median(skews)) if len(rows) else 0.0,
        skew_max_s=float(skews.max()) if len(rows) else 0.0,
        waited_s={r: float(sum(m.waited_s[r] for m in rows)) for r in ranks},
        last_arrivals={r: sum(m.last == r for m in rows) for r in ranks})


def _by_durations(per_rank: dict[int, list[dict]], steps: list[int], windows: dict[int, dict],
                  notes: list[str]) -> list[arrival.Matched]:
    """The fallback: each collective's duration read as how long the rank waited in it (the rank
    that arrived first stayed longest). Unequal work is not told apart here."""
    kinds: dict[str, dict[int, list[dict]]] = defaultdict(dict)
    for rank, events in per_rank.items():
        by_kind: dict[str, list[dict]] = defaultdict(list)
        for e in sorted(events, key=lambda e: e["ts"]):
            by_kind[collective_kind(e.get("name", ""))].append(e)
        for kind, evs in by_kind.items():
            kinds[kind][rank] = evs
    ranks = sorted(per_rank)
    out = []
    for kind, by_rank in sorted(kinds.items()):
        counts = {r: len(by_rank.get(r, [])) for r in ranks}
        if len(set(counts.values())) > 1:
            notes.append(f"{kind}: ranks issued different numbers of calls in the profiled steps {counts} "
                         "(a rank skipped a collective: the signature of a hang)")
        for i in range(min(counts.values())):
            row = {r: by_rank[r][i] for r in ranks}
            took = {r: e["dur"] * 1e-6 for r, e in row.items()}
            first = windows[ranks[0]]
            ts = row[ranks[0]]["ts"]
            step = next((s for s in steps if first[s][0] <= ts < first[s][1]), steps[0])
            out.append(arrival.Matched(step=step, kind=kind,
                                       arrival_s={r: max(took.values()) - d for r, d in took.items()},
                                       waited_s={r: d - min(took.values()) for r, d in took.items()},
                                       unequal_work_s=dict.fromkeys(ranks, 0.0),
                                       bytes=event_bytes(row[ranks[0]])))
    return out


def _charge_waits(steps: list[RankStep], matched: list[arrival.Matched], device: bool) -> None:
    """Each rank-step's wait for later ranks, counted where it was not hidden: behind compute on a
    device (its exposed communication), or, host-only, while its training thread ran operators."""
    waited: dict[tuple[int, int], float] = defaultdict(float)
    unequal: dict[tuple[int, int], float] = defaultdict(float)
    for m in matched:
        for r, w in m.waited_s.items():
            waited[r, m.step] += w
            unequal[r, m.step] += m.unequal_work_s[r]
    for s in steps:
        w = waited.get((s.rank, s.step), 0.0)
        cap = s.exposed_comm_s if device else max(0.0, s.step_s - s.compute_s)
        kept = min(w, cap)
        s.wait_s = kept
        s.unequal_work_wait_s = unequal.get((s.rank, s.step), 0.0) * (kept / w if w > 0 else 0.0)


@dataclass
class RankPart:
    """What the analysis keeps of one rank's trace once its events are gone: every step it traced,
    its collective events (the fields the fallback reads), its collective calls."""

    rank: int
    windows: dict[int, tuple[float, float]]
    steps: list[RankStep]
    collectives: list[dict]
    calls: list[arrival.Call]
    on_device: bool
    stacks: bool
    shapes: bool
    packed: bool = False          # tokenbal's packed model code ran (collate.models / collate.ops frames)


def rank_part(trace: Trace) -> RankPart:
    """One rank's share of the analysis, from its trace alone (every step it traced)."""
    windows = step_windows(trace)
    rows, coll, calls, dev, stacks, shapes = _rank_steps(trace, sorted(windows))
    slim = [{k: e[k] for k in ("name", "ts", "dur", "args") if k in e} for e in coll]
    packed = any(e.get("cat") == "python_function" and _PACKED_FRAME.search(e.get("name", ""))
                 for e in trace.events)
    return RankPart(rank=trace.rank, windows=windows, steps=rows, collectives=slim, calls=calls,
                    on_device=dev, stacks=stacks, shapes=shapes, packed=packed)


def analyze(traces: list[Trace], source: str = "", arrivals: str = "auto") -> RunProfile:
    """Break every rank's profiled steps down, and match collectives across ranks.

    ``arrivals="durations"`` forces the fallback (collective durations) even where the training
    thread's launches are there: for comparing the two readings of one run.
    """
    if arrivals not in ("auto", "durations"):
        raise ValueError(f"arrivals must be 'auto' or 'durations', not {arrivals!r}")
    if not traces:
        raise ValueError(f"{source or 'traces'}: no traces to analyse")
    return combine([rank_part(t) for t in traces], source, arrivals)


def combine(parts: list[RankPart], source: str = "", arrivals: str = "auto") -> RunProfile:
    """:func:`analyze` from the ranks' :class:`RankPart` (one run, one part per rank): the steps every
    rank traced, matched across ranks."""
    if arrivals not in ("auto", "durations"):
        raise ValueError(f"arrivals must be 'auto' or 'durations', not {arrivals!r}")
    if not parts:
        raise ValueError(f"{source or 'traces'}: no traces to analyse")
    parts = sorted(parts, key=lambda p: p.rank)
    windows = {p.rank: p.windows for p in parts}
    common = sorted(set.intersection(*(set(w) for w in windows.values())))
    notes: list[str] = []
    if not common:
        raise ValueError(f"{source}: the ranks' traces share no ProfilerStep#N: were they taken in one run?")
    if any(set(w) != set(common) for w in windows.values()):
        notes.append(f"only the {len(common)} steps every rank profiled are compared")
    keep = set(common)
    steps: list[RankStep] = []
    collectives, calls = {}, {}
    for p in parts:
        steps += [s for s in p.steps if s.step in keep]
        collectives[p.rank] = [e for e in p.collectives
                               if any(p.windows[s][0] <= e["ts"] < p.windows[s][1] for s in common)]
        calls[p.rank] = [c for c in p.calls if c.step in keep]
    on_device = any(p.on_device for p in parts)
    stacks = any(p.stacks for p in parts)
    shapes = any(p.shapes for p in parts)
    if not stacks:
        notes.append("no Python stacks in the traces (profile with with_stack=True): copy operators are "
                     "counted but cannot be attributed to rotary-embedding code")
    ranks = [p.rank for p in parts]
    if arrivals == "auto" and all(calls.values()):
        source_name = arrival.FROM_KERNELS if on_device else arrival.FROM_LAUNCHES
        matched = arrival.match(calls, common, notes)
        if not on_device and not shapes:
            notes.append("no operator shapes in the traces (profile with record_shapes=True): unequal work "
                         "is judged by operator time, which a loaded host also stretches")
    elif any(collectives.values()):
        source_name = arrival.FROM_DURATIONS
        matched = _by_durations(collectives, common, windows, notes)
        notes.append("arrivals read from the collectives' durations"
                     + (" (no launches on the training thread)" if arrivals == "auto" else "")
                     + ": on a loaded host these under-read the wait, and unequal work is not told apart")
    else:
        source_name, matched = "", []
    _charge_waits(steps, matched, on_device)
    by_kind: dict[str, list[arrival.Matched]] = defaultdict(list)
    for m in matched:
        by_kind[m.kind].append(m)
    return RunProfile(source=source, ranks=ranks, steps=steps,
                      collectives=[_stats(k, by_kind[k], ranks) for k in sorted(by_kind)], device=on_device,
                      has_python_stacks=stacks, notes=notes, arrival_source=source_name,
                      work_from_shapes=shapes and not on_device, packed_model=any(p.packed for p in parts))
