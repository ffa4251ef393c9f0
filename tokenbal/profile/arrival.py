"""When each rank arrived at each collective, read from its own timeline (no clock comparison).

Every rank leaves a blocking collective at about the same moment, so the time a rank spends from
its last sync point to its next collective launch is its *arrival offset*: the rank with the
largest offset arrives last, and every other rank waits the difference. Offsets are durations on
one rank's own clock, so traces of different hosts compare without clock alignment.

Where a trace has them, the offsets come from the training thread (host-only traces: the
``c10d::*`` / ``record_param_comms`` launches; device traces: the collective kernels' starts on
the device timeline). The durations of gloo's own ``gloo:*`` events are only the fallback: they
start when gloo's thread gets a core, not when the rank arrived, so on a loaded host they
under-read the wait.

A rank arriving late because it had more to do (a longer sequence, more images) is *unequal work*,
which the sampler removes; a rank arriving late with the same work (a host stall, data loading, the
OS scheduling another process) is *arrival jitter*, which it does not. The two are told apart by
the work each rank's operators did between the sync points: their input sizes when the trace has
shapes (``record_shapes=True``: contention stretches an operator's time, not its size), else their
time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from tokenbal.profile.intervals import as_intervals, clip, total
from tokenbal.profile.traces import Trace

LAUNCH = re.compile(r"^(c10d::|record_param_comms|nccl:|hccl:|c10d_)")

_DTYPE_BYTES = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4,
                "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1, "Float": 4, "BFloat16": 2,
                "Half": 2, "Long": 8, "Int": 4, "Double": 8, "Byte": 1, "Bool": 1}


# Which timeline the arrival offsets were read from (RunProfile.arrival_source).
FROM_LAUNCHES = "training-thread launches"
FROM_KERNELS = "device collective kernels"
FROM_DURATIONS = "collective durations (fallback)"


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


def event_bytes(e: dict) -> int | None:
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
class Call:
    """One collective call on one rank."""

    step: int
    kind: str
    start: float              # launch (or kernel start), µs on this rank's clock
    end: float                # when it completed on this rank
    arrival_s: float          # from the rank's last sync point to ``start``
    compute_s: float          # operator (or kernel) time in that stretch
    work: float               # operator work in that stretch: sizes with shapes, else compute_s
    bytes: int | None = None


def _outermost(events: list[dict]) -> list[dict]:
    """The events not nested inside another one of the list (one thread's events, any order)."""
    out, end = [], -np.inf
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= end:
            out.append(e)
            end = e["ts"] + e["dur"]
    return out


def _numel(shape: list[int]) -> float:
    return float(np.prod(shape, dtype=np.float64))


def _op_size(e: dict) -> float | None:
    """An operator's work from its input shapes: matmul FLOPs, else its inputs' element count."""
    dims = (e.get("args") or {}).get("Input Dims")
    if not dims:
        return None
    shapes = [d if isinstance(d, list) and all(isinstance(x, int) for x in d) else [] for d in dims]
    name = e.get("name")
    operands = {"aten::mm": (0, 1), "aten::bmm": (0, 1), "aten::matmul": (0, 1), "aten::addmm": (1, 2),
                "aten::baddbmm": (1, 2)}.get(name)
    if operands and len(shapes) > operands[1] and shapes[operands[0]] and len(shapes[operands[1]]) >= 2:
        return 2.0 * _numel(shapes[operands[0]]) * shapes[operands[1]][-1]
    if name == "aten::linear" and len(shapes) >= 2 and shapes[0] and shapes[1]:
        return 2.0 * _numel(shapes[0]) * shapes[1][0]
    sizes = [_numel(s) for s in shapes if s]
    return float(sum(sizes)) if sizes else None


def _segments(starts: list[float], ends: list[float], step_start: float,
              resumes: np.ndarray) -> list[float]:
    """Each call's last sync point: when the rank resumed after the latest call that ended before
    this one started (the first training-thread event from then on), else the step's start."""
    out = []
    done = -np.inf
    order_by_end = sorted(ends)
    for s in starts:
        finished = [t for t in order_by_end if t <= s]
        done = finished[-1] if finished else -np.inf
        if done < step_start:
            out.append(step_start)
            continue
        later = resumes[resumes >= done]
        out.append(float(min(later[0], s)) if len(later) else done)
    return out


def host_calls(trace: Trace, windows: dict[int, tuple[float, float]], steps: list[int],
               collective_events: list[dict]) -> tuple[list[Call], bool]:
    """Calls from the training thread's launches; (calls, whether shapes were recorded).

    Each launch is paired, in order, with the collective's own event (``gloo:*``) for its end; a
    rank whose counts differ keeps the launch's own end.
    """
    main = [e for e in trace.events if e.get("tid") == trace.main_tid and e.get("cat") == "cpu_op"]
    launches = _outermost([e for e in main if LAUNCH.match(e.get("name", ""))])
    ops = _outermost([e for e in main if not LAUNCH.match(e.get("name", ""))])
    executed = sorted(collective_events, key=lambda e: e["ts"])
    paired = len(executed) == len(launches)
    sizes = [_op_size(e) for e in ops]
    has_shapes = any(s is not None for s in sizes)
    op_start = np.array([e["ts"] for e in ops])
    op_iv = as_intervals((e["ts"], e["ts"] + e["dur"]) for e in ops)
    resumes = np.array(sorted([e["ts"] for e in trace.events if e.get("tid") == trace.main_tid]))
    ends = [max(launch["ts"] + launch["dur"], executed[i]["ts"] + executed[i]["dur"]) if paired
            else launch["ts"] + launch["dur"] for i, launch in enumerate(launches)]
    calls = []
    for step in steps:
        lo, hi = windows[step]
        idx = [i for i, e in enumerate(launches) if lo <= e["ts"] < hi]
        marks = _segments([launches[i]["ts"] for i in idx], ends, lo, resumes)
        for i, seg in zip(idx, marks, strict=True):
            launch = launches[i]
            inside = (op_start >= seg) & (op_start < launch["ts"])
            compute = total(clip(op_iv, seg, launch["ts"])) * 1e-6
            if has_shapes:
                work = float(sum(s for s, keep in zip(sizes, inside, strict=True) if keep and s))
            else:
                work = compute
            name = executed[i].get("name", "") if paired else launch.get("name", "")
            calls.append(Call(step=step, kind=collective_kind(name), start=launch["ts"], end=ends[i],
                              arrival_s=max(0.0, launch["ts"] - seg) * 1e-6, compute_s=compute, work=work,
                              bytes=event_bytes(executed[i] if paired else launch)))
    return calls, has_shapes


def device_calls(windows: dict[int, tuple[float, float]], steps: list[int], collective_events: list[dict],
                 compute: np.ndarray) -> list[Call]:
    """Calls from the device timeline: each collective kernel's start after the previous one ended.

    The work between is the device's compute time there, which host contention does not stretch.
    """
    kernels = sorted(collective_events, key=lambda e: e["ts"])
    ends = [e["ts"] + e["dur"] for e in kernels]
    calls = []
    for step in steps:
        lo, hi = windows[step]
        idx = [i for i, e in enumerate(kernels) if lo <= e["ts"] < hi]
        marks = _segments([kernels[i]["ts"] for i in idx], ends, lo, np.zeros(0))
        for i, seg in zip(idx, marks, strict=True):
            k = kernels[i]
            busy = total(clip(compute, seg, k["ts"])) * 1e-6
            calls.append(Call(step=step, kind=collective_kind(k.get("name", "")), start=k["ts"], end=ends[i],
                              arrival_s=max(0.0, k["ts"] - seg) * 1e-6, compute_s=busy, work=busy,
                              bytes=event_bytes(k)))
    return calls


@dataclass
class Matched:
    """One collective matched across ranks (the i-th call of a step on every rank)."""

    step: int
    kind: str
    arrival_s: dict[int, float]
    waited_s: dict[int, float]          # max arrival - own arrival
    unequal_work_s: dict[int, float]    # the part of the wait the late rank's extra work explains
    bytes: int | None

    @property
    def skew_s(self) -> float:
        return max(self.arrival_s.values()) - min(self.arrival_s.values())

    @property
    def last(self) -> int:
        return max(self.arrival_s, key=self.arrival_s.get)


def match(calls: dict[int, list[Call]], steps: list[int], notes: list[str]) -> list[Matched]:
    """Pair the ranks' calls step by step, in launch order; the unequal-work part of each wait is the
    late rank's extra work converted to its own seconds (its arrival time per unit of work, so the
    Python between its operators counts with them)."""
    ranks = sorted(calls)
    out = []
    for step in steps:
        mine = {r: [c for c in calls[r] if c.step == step] for r in ranks}
        counts = {r: len(v) for r, v in mine.items()}
        if len(set(counts.values())) > 1:
            notes.append(f"step {step}: ranks launched different numbers of collectives {counts} "
                         "(a rank skipped a collective: the signature of a hang); the first "
                         f"{min(counts.values())} are compared")
        for i in range(min(counts.values(), default=0)):
            row = {r: mine[r][i] for r in ranks}
            arrival = {r: c.arrival_s for r, c in row.items()}
            late = max(arrival, key=arrival.get)
            slow = row[late]
            rate = slow.arrival_s / slow.work if slow.work > 0 else 0.0
            waited = {r: arrival[late] - a for r, a in arrival.items()}
            explained = {r: float(np.clip((slow.work - row[r].work) * rate, 0.0, waited[r])) for r in ranks}
            kinds = {c.kind for c in row.values()}
            out.append(Matched(step=step, kind=row[ranks[0]].kind if len(kinds) == 1 else "mixed",
                               arrival_s=arrival, waited_s=waited, unequal_work_s=explained,
                               bytes=row[ranks[0]].bytes))
    return out
