"""Per-rank, per-step breakdown of a distributed run's traces, and the collectives' arrival skew.

Definitions (those of Holistic Trace Analysis where it has one, so numbers compare):
- compute: time the device runs non-communication kernels (host-only traces: time the training
  thread spends in operators other than collective launches);
- communication: time collective kernels run (host-only traces: gloo's collective work);
- exposed communication: communication not overlapped by compute; overlap ratio =
  1 - exposed / communication (HTA's "comm/comp overlap");
- idle: step time covered by neither.
Arrival skew of one collective: every rank leaves a blocking collective at about the same moment,
so the rank that arrived first spent the longest in it; ``max(duration) - min(duration)`` over
ranks is how long the earliest rank waited for the latest, without comparing clocks across hosts.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from tokenbal.profile.intervals import as_intervals, clip, overlap, total, union
from tokenbal.profile.traces import Trace, step_windows

_DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
_COMM_NAME = re.compile(r"nccl|hccl|hcom|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|broadcast|"
                        r"send_?recv", re.I)
_HOST_COMM = re.compile(r"^(gloo|mpi|ucc):")          # host-side collective execution (CPU process groups)
_LAUNCH = re.compile(r"^(c10d::|record_param_comms|nccl:|hccl:|c10d_)")
_HOST_READ_OPS = {"aten::_local_scalar_dense"}       # .item(), a scalar read back to the host
_SYNC_CALLS = re.compile(r"^(cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventSynchronize|cudaMemcpy|"
                         r"cuStreamSynchronize|cuCtxSynchronize|aclrtSynchronize\w*|aclrtMemcpy)$")
_H2D = re.compile(r"HtoD|Host ?to ?Device|H2D", re.I)
_COPY_OPS = {"aten::cat", "aten::slice", "aten::split", "aten::split_with_sizes", "aten::narrow",
             "aten::index_select", "aten::index", "aten::copy_", "aten::clone", "aten::contiguous",
             "aten::stack", "aten::chunk", "aten::gather"}
_ROTARY_FRAME = re.compile(r"rotary|rotate_half|rope", re.I)
_FUSED_FRAME = re.compile(r"collate/ops/|apply_mrope|liger|npu_rotary|triton", re.I)

_DTYPE_BYTES = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4,
                "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1, "Float": 4, "BFloat16": 2,
                "Half": 2, "Long": 8, "Int": 4, "Double": 8, "Byte": 1, "Bool": 1}


def collective_kind(name: str) -> str:
    """``gloo:all_reduce``, ``ncclDevKernel_AllReduce_Sum_f32_RING_LL``, ``hcom_allGather_`` → one name."""
    flat = re.sub(r"[^a-z]", "", name.lower())
    for key, kind in (("reducescatter", "reduce_scatter"), ("allgather", "all_gather"),
                      ("allreduce", "all_reduce"), ("alltoall", "all_to_all"), ("broadcast", "broadcast"),
                      ("barrier", "barrier"), ("sendrecv", "send_recv"), ("send", "send"), ("recv", "recv"),
                      ("reduce", "reduce"), ("gather", "gather"), ("scatter", "scatter")):
        if key in flat:
            return kind
    return "other"


def _event_bytes(e: dict) -> int | None:
    args = e.get("args") or {}
    nelems = args.get("In msg nelems")
    if nelems is not None:
        return int(nelems) * _DTYPE_BYTES.get(str(args.get("dtype")), 4)
    dims, types = args.get("Input Dims"), args.get("Input type")
    if not dims:
        return None
    out = 0
    for d, t in zip(dims, types or [], strict=False):
        if isinstance(d, list) and all(isinstance(x, int) for x in d):
            out += int(np.prod(d, dtype=np.int64)) * _DTYPE_BYTES.get(str(t), 4)
    return out or None


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

    @property
    def overlap(self) -> float:
        return 1.0 - self.exposed_comm_s / self.comm_s if self.comm_s > 0 else float("nan")


@dataclass
class CollectiveStats:
    kind: str
    count: int                    # per rank
    bytes: int | None             # per rank, summed over the calls
    skew_median_s: float
    skew_max_s: float
    waited_s: dict[int, float]    # per rank: time spent waiting for the last to arrive, summed
    last_arrivals: dict[int, int]  # per rank: how often it was the last to arrive


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

    def per_step(self) -> dict[int, list[RankStep]]:
        out: dict[int, list[RankStep]] = defaultdict(list)
        for s in self.steps:
            out[s.step].append(s)
        return dict(sorted(out.items()))

    def mean_step_s(self) -> float:
        return float(np.mean([max(r.step_s for r in rs) for rs in self.per_step().values()])) if self.steps \
            else float("nan")

    def straggler_wait_s(self) -> float:
        """Per step, the mean over ranks of the time spent waiting in collectives for a later rank,
        counted only where it was not overlapped by compute (it cannot exceed the rank's exposed
        communication). Without collectives: the mean gap to the slowest rank's compute."""
        per_step = self.per_step()
        if not per_step:
            return float("nan")
        if not self.collectives:
            return float(np.mean([(max(r.compute_s for r in rs) - np.array([r.compute_s for r in rs])).mean()
                                  for rs in per_step.values()]))
        waits = []
        for rank in self.ranks:
            waited = sum(c.waited_s.get(rank, 0.0) for c in self.collectives) / len(per_step)
            exposed = float(np.mean([s.exposed_comm_s for s in self.steps if s.rank == rank]))
            waits.append(min(waited, exposed))
        return float(np.mean(waits))

    def compute_imbalance(self) -> float:
        """Mean over steps of max / mean compute across ranks (1.0 = balanced)."""
        ratios = []
        for rs in self.per_step().values():
            c = np.array([r.compute_s for r in rs])
            if c.mean() > 0:
                ratios.append(c.max() / c.mean())
        return float(np.mean(ratios)) if ratios else float("nan")

    def mean(self, attr: str) -> float:
        return float(np.mean([getattr(s, attr) for s in self.steps])) if self.steps else float("nan")


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
            rotary = any(_ROTARY_FRAME.search(n) for n in names)
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
                           and not _LAUNCH.match(e.get("name", "")))
    comm = as_intervals((e["ts"], e["ts"] + e["dur"]) for e in collectives)
    return compute, comm, collectives, False


def _device_gap(device_busy: np.ndarray, start: float, end: float) -> float:
    """Device idle time from ``start`` until the device is next busy after ``end``."""
    if len(device_busy) == 0:
        return 0.0
    later = device_busy[device_busy[:, 0] >= end]
    stop = later[0, 0] if len(later) else end
    return max(0.0, (stop - start) - overlap(device_busy, as_intervals([(start, stop)]))) * 1e-6


def _rank_steps(trace: Trace, steps: list[int]) -> tuple[list[RankStep], list[dict], bool, bool]:
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
    return out, in_steps, on_device, stacks


def _collective_stats(per_rank: dict[int, list[dict]], notes: list[str]) -> list[CollectiveStats]:
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
        n = min(counts.values())
        durs = np.array([[by_rank[r][i]["dur"] for i in range(n)] for r in ranks]) * 1e-6 if n else \
            np.zeros((len(ranks), 0))
        skew = durs.max(axis=0) - durs.min(axis=0) if n else np.zeros(0)
        waited = durs - durs.min(axis=0, keepdims=True) if n else durs
        last = np.argmin(durs, axis=0) if n else np.zeros(0, dtype=int)
        sizes = [_event_bytes(e) for e in by_rank[ranks[0]][:n]] if n else []
        out.append(CollectiveStats(
            kind=kind, count=n, bytes=sum(sizes) if sizes and all(s is not None for s in sizes) else None,
            skew_median_s=float(np.median(skew)) if n else 0.0, skew_max_s=float(skew.max()) if n else 0.0,
            waited_s={r: float(waited[i].sum()) for i, r in enumerate(ranks)},
            last_arrivals={r: int((last == i).sum()) for i, r in enumerate(ranks)}))
    return out


def analyze(traces: list[Trace], source: str = "") -> RunProfile:
    """Break every rank's profiled steps down, and match collectives across ranks."""
    if not traces:
        raise ValueError(f"{source or 'traces'}: no traces to analyse")
    windows = {t.rank: step_windows(t) for t in traces}
    common = sorted(set.intersection(*(set(w) for w in windows.values())))
    notes: list[str] = []
    if not common:
        raise ValueError(f"{source}: the ranks' traces share no ProfilerStep#N: were they taken in one run?")
    if any(set(w) != set(common) for w in windows.values()):
        notes.append(f"only the {len(common)} steps every rank profiled are compared")
    steps, collectives = [], {}
    on_device = stacks = False
    for t in traces:
        rank_steps, coll, dev, st = _rank_steps(t, common)
        steps += rank_steps
        collectives[t.rank] = coll
        on_device |= dev
        stacks |= st
    if not stacks:
        notes.append("no Python stacks in the traces (profile with with_stack=True): copy operators are "
                     "counted but cannot be attributed to rotary-embedding code")
    return RunProfile(source=source, ranks=[t.rank for t in traces], steps=steps,
                      collectives=_collective_stats(collectives, notes), device=on_device,
                      has_python_stacks=stacks, notes=notes)
