"""Which traces belong to one run, and which run a folder's traces are.

A folder may hold the traces of several runs: a run before and after a change, the cycles of one
``tensorboard_trace_handler`` schedule, a stray file copied in. Traces are one run when they agree
on what the run records about itself — the layout (Kineto / torch_npu), ``distributedInfo``'s
world size and backend — and were taken at the same time: their profiled steps overlap in wall
time (``baseTimeNanoseconds`` + the step's ``ts``, comparable across processes and, with synced
clocks, hosts) and share step numbers. Ranks of one run are in their steps together (they meet in
every collective); two runs, or two profiling cycles of one run, are not.

Two runs taken at the same time (two jobs side by side writing into one folder, with the same
world size and steps) overlap in wall time too. What tells them apart is that ranks of one run
*meet* in every collective: a collective ends on one member only after every member began it, so
the intervals of the same collective on two ranks of one run overlap (on one host, whose clock all
its processes share, exactly; across hosts, after one constant clock offset). Two traces whose
collectives do not are of different runs, whatever their metadata says — a Kineto trace records no
run identity of its own (``distributedInfo`` holds the backend, rank, world size and process-group
layout, identical in every run of one script; ``trace_id`` is per file, pids per process).

Within a run each rank has one trace: two different traces claiming one rank is an error naming
both; a byte-for-byte copy (the same Kineto ``trace_id``, e.g. a ``.json`` and its ``.json.gz``) is
read once, with a note. A rank the run's recorded world size expects but no file holds is
*missing*, and named as such.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import UTC, datetime

from tokenbal.profile.analysis import collective_events
from tokenbal.profile.arrival import collective_kind
from tokenbal.profile.traces import Trace

# Collectives no member can leave before every member has begun (a broadcast's root may leave
# before the others begin, a send before its receive).
SYMMETRIC = frozenset({"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "barrier"})
# How far apart two processes of one host may read one moment: timestamp rounding and each
# process's own calibration of its fast clock against the wall clock (µs apart), with room to spare.
# Two runs side by side drift apart by more within a few steps.
CLOCK_TOLERANCE_US = 1000.0
MEETINGS_CHECKED = 4                 # the ranks of a run a trace is checked against (never_met)
WORLD = "world"                      # the group of a collective in a trace whose only group is the world


@dataclass(frozen=True)
class TraceFile:
    """What grouping needs of one trace, kept after its events are gone."""

    path: str
    rank: int
    world_size: int | None
    layout: str
    backend: str | None
    trace_id: str | None
    start_us: float | None            # wall-clock µs where the trace records its time base
    end_us: float | None
    steps: frozenset[int]
    rank_assumed: bool = False        # the trace names no rank (taken as 0: only alone in its run)
    host: str | None = None
    # Per process group (its ranks, or WORLD), the collectives in the order they ran: (kind, start,
    # end) in wall-clock µs. Only groups the trace names, or all collectives where the world is the
    # trace's only group; empty where neither is known.
    meetings: dict = field(default_factory=dict, compare=False, hash=False)


def describe_file(trace: Trace, windows: dict[int, tuple[float, float]]) -> TraceFile:
    meta = trace.metadata
    base = meta.get("baseTimeNanoseconds")
    base_us = base / 1000 if isinstance(base, int | float) and not isinstance(base, bool) else 0.0
    dist = meta.get("distributedInfo") or {}
    backend = dist.get("backend") if isinstance(dist.get("backend"), str) else None
    trace_id = meta.get("trace_id") if isinstance(meta.get("trace_id"), str) else None
    start = min(w[0] for w in windows.values()) + base_us if windows else None
    end = max(w[1] for w in windows.values()) + base_us if windows else None
    host = trace.host if isinstance(trace.host, str) and trace.host else None
    return TraceFile(path=trace.path, rank=trace.rank, world_size=trace.world_size, layout=trace.layout,
                     backend=backend, trace_id=trace_id, start_us=start, end_us=end,
                     steps=frozenset(windows), rank_assumed=trace.rank_assumed, host=host,
                     meetings=_meetings(trace, base_us))


def _meetings(trace: Trace, base_us: float) -> dict:
    # Where the world is the run's only process group (Kineto's distributedInfo pg_config, torch_npu's
    # parallel_group_info), every collective in the trace is one all its ranks took part in.
    single = trace.process_groups == 1
    out: dict = {}
    for e in sorted(collective_events(trace), key=lambda e: e["ts"]):
        ranks = (e.get("args") or {}).get("Process Group Ranks")
        if isinstance(ranks, list) and ranks and all(type(r) is int for r in ranks):
            group = tuple(sorted(ranks))
        elif single:
            group = WORLD
        else:
            continue                  # a collective of an unknown group: no evidence either way
        out.setdefault(group, []).append((collective_kind(e.get("name", "")), e["ts"] + base_us,
                                          e["ts"] + e["dur"] + base_us))
    return out


class DuplicateRankError(ValueError):
    """Two different traces claim one rank of one run."""


class SeveralRunsError(ValueError):
    """The folder holds traces of more than one run and none was chosen."""


@dataclass
class Run:
    """The traces of one run, by rank."""

    files: dict[int, TraceFile]
    number: int = 0                   # 1-based, in order of start time (what --run names)
    notes: list[str] = field(default_factory=list)
    apart: list[str] = field(default_factory=list)   # why traces taken at its time are not of it

    @property
    def world_size(self) -> int | None:
        return next(iter(self.files.values())).world_size

    @property
    def missing(self) -> list[int]:
        """Ranks the run had but no file here holds: from the recorded world size, else the gaps."""
        size = self.world_size or max(self.files) + 1
        return [r for r in range(size) if r not in self.files]

    @property
    def start_us(self) -> float | None:
        starts = [f.start_us for f in self.files.values() if f.start_us is not None]
        return min(starts) if starts else None

    def folders(self, root: str) -> set[str]:
        """The folders (relative to ``root``) holding this run's traces."""
        return {os.path.dirname(self._relative(f.path, root)) or "." for f in self.files.values()}

    @staticmethod
    def _relative(path: str, root: str) -> str:
        return os.path.relpath(path, root) if os.path.isdir(root) else path

    def describe(self, root: str, name_files: bool = False) -> str:
        """One line: ranks (missing ones named), steps, start, and where its traces are: the folders,
        or with ``name_files`` the files (where runs share a folder, its name tells nothing apart)."""
        size = self.world_size
        present = f"{len(self.files)} of {size} ranks" if size else f"{len(self.files)} rank(s)"
        if self.missing:
            present += f" (rank {ranks_text(self.missing)} missing)"
        steps = sorted(set().union(*(f.steps for f in self.files.values())))
        if name_files:
            places = [self._relative(self.files[r].path, root) for r in sorted(self.files)]
            more = "files"
        else:
            places, more = sorted(self.folders(root)), "folders"
        where = ", ".join(places[:3]) + (f" +{len(places) - 3} more {more}" if len(places) > 3 else "")
        started = _utc(self.start_us)
        return (f"run {self.number}: {present}, steps {ranks_text(steps) if steps else '-'}"
                + (f", started {started}" if started else "") + f", in {where}")


def ranks_text(numbers: list[int]) -> str:
    """``[0, 1, 2, 5]`` → ``0-2, 5``."""
    out, start = [], None
    for i, n in enumerate(numbers):
        if start is None:
            start = n
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            out.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(out)


def _utc(us: float | None) -> str | None:
    """A wall-clock time, where the trace's clock is one (after 2001, before 2096)."""
    if us is None or not 1e15 < us < 4e15:
        return None
    return datetime.fromtimestamp(us / 1e6, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _together(a: TraceFile, b: TraceFile) -> bool:
    """Whether two traces were taken in the same steps of one run."""
    if a.start_us is None or b.start_us is None or a.end_us is None or b.end_us is None:
        return True
    return a.start_us <= b.end_us and b.start_us <= a.end_us and bool(a.steps & b.steps)


def _ms(us: float) -> str:
    return f"{us / 1000:.1f} ms"


def never_met(a: TraceFile, b: TraceFile) -> str | None:
    """Why ``a`` and ``b`` (two ranks, taken at the same time) cannot be of one run: a collective of a
    group holding both that did not overlap on the two (on one host: on the shared clock; across
    hosts: under any one clock offset). ``None`` where they met, or where nothing tells."""
    return _meeting(a, b)[1]


def _meeting(a: TraceFile, b: TraceFile) -> tuple[bool, str | None]:
    """(whether any collective of ``a`` and ``b`` could be compared, :func:`never_met`'s reason)."""
    if a.rank == b.rank or a.steps != b.steps:
        return False, None
    compared = False
    same_host = a.host is not None and a.host == b.host
    low = (-float("inf"), "")          # b's clock minus a's must be at least this ...
    high = (float("inf"), "")          # ... and at most this, for every collective to overlap
    for group, mine in a.meetings.items():
        theirs = b.meetings.get(group)
        if theirs is None or (group != WORLD and not {a.rank, b.rank} <= set(group)):
            continue
        if len(mine) != len(theirs) or [k for k, _, _ in mine] != [k for k, _, _ in theirs]:
            continue                  # not the same sequence (a hang, another schedule): not paired
        seen: dict[str, int] = {}
        for (kind, a_start, a_end), (_, b_start, b_end) in zip(mine, theirs, strict=True):
            seen[kind] = n = seen.get(kind, 0) + 1
            if kind not in SYMMETRIC:
                continue
            compared = True
            what = f"{kind} #{n}" + ("" if group == WORLD else f" of group {list(group)}")
            if b_start - a_end > low[0]:
                low = (b_start - a_end, f"{what} ended on rank {a.rank} ({a.path}) {_ms(b_start - a_end)} "
                                        f"before it began on rank {b.rank} ({b.path})")
            if b_end - a_start < high[0]:
                high = (b_end - a_start, f"{what} ended on rank {b.rank} ({b.path}) {_ms(a_start - b_end)} "
                                         f"before it began on rank {a.rank} ({a.path})")
    if same_host:
        if low[0] > CLOCK_TOLERANCE_US:
            return compared, f"{low[1]}, on one host's clock ({a.host})"
        if high[0] < -CLOCK_TOLERANCE_US:
            return compared, f"{high[1]}, on one host's clock ({a.host})"
        return compared, None
    if low[0] > high[0] + CLOCK_TOLERANCE_US:
        return compared, (f"{low[1]}, and {high[1]}, each on its host's clock: for both to have met, rank "
                          f"{b.rank}'s clock would be at least {_ms(low[0])} ahead of rank {a.rank}'s and at "
                          f"least {_ms(-high[0])} behind it")
    return compared, None


def group_runs(files: list[TraceFile], notes: list[str]) -> list[Run]:
    """The runs among ``files``, oldest first, numbered from 1. Copies of one trace are read once
    (a note names both); two different traces claiming one rank of one run raise
    :class:`DuplicateRankError` naming both."""
    by_id: dict[str, TraceFile] = {}
    kept: list[TraceFile] = []
    for f in sorted(files, key=lambda f: (f.path.endswith(".gz"), f.path)):
        if f.trace_id is not None and f.trace_id in by_id:
            notes.append(f"{f.path} is a copy of {by_id[f.trace_id].path} (the same trace_id): read once")
            continue
        if f.trace_id is not None:
            by_id[f.trace_id] = f
        kept.append(f)
    runs: list[Run] = []
    kinds: dict[tuple, list[Run]] = {}
    # A trace whose rank a run already has, and that no collective ties to that run's other ranks (it
    # may be the same rank of a run taken beside it, whose other ranks come later in start order), is
    # placed after the others: then it meets its own run's ranks, or is a duplicate.
    order = sorted(kept, key=lambda f: (f.start_us is not None, f.start_us or 0.0, f.path))
    postponed = [f for f in order if not _place(f, kinds, runs, final=False)]
    for f in postponed:
        _place(f, kinds, runs, final=True)
    for r in runs:
        unranked = next((f for f in r.files.values() if f.rank_assumed), None)
        if unranked is not None and len(r.files) > 1:
            raise ValueError(_no_rank(unranked.path, next(f for f in r.files.values() if f is not unranked)))
        if unranked is not None:
            notes.append(f"{unranked.path} names no rank and is alone in its run: read as rank 0")
    runs.sort(key=lambda r: (r.start_us is not None, r.start_us or 0.0))
    for n, r in enumerate(runs, 1):
        r.number = n
        r.files = dict(sorted(r.files.items()))
    return runs


def _place(f: TraceFile, kinds: dict[tuple, list[Run]], runs: list[Run], final: bool) -> bool:
    """Put ``f`` in the run it was taken with (a new one if none); ``False``: postponed (above)."""
    kind = (f.layout, f.world_size, f.backend)
    met, unknown, apart = [], [], []      # runs taken with f: its collectives met theirs / nothing tells
    for r in kinds.get(kind, []):
        if not any(_together(f, g) for g in r.files.values()):
            continue
        # Ranks of one run all met: a few of its ranks tell as well as all of them (and 512 ranks of
        # 1,000 collectives each stay seconds, not minutes).
        compared, why = False, None
        for g in list(r.files.values())[:MEETINGS_CHECKED]:
            checked, why = _meeting(g, f)
            compared = compared or checked
            if why is not None:
                break
        if why is not None:
            apart.append(why)
        else:
            (met if compared else unknown).append(r)
    free = [r for r in unknown if f.rank not in r.files]
    if not met and not free and unknown and not final:
        return False
    home = (met or free or unknown or [None])[0]
    if home is None:
        home = Run(files={})
        kinds.setdefault(kind, []).append(home)
        runs.append(home)
    home.apart += apart
    if f.rank in home.files:
        other = home.files[f.rank]
        if f.rank_assumed or other.rank_assumed:
            unranked = f if f.rank_assumed else other
            raise ValueError(_no_rank(unranked.path, other if unranked is f else f))
        raise DuplicateRankError(
            f"two traces claim rank {f.rank} of one run: {other.path} and {f.path} (same world size, "
            "overlapping steps); move one of them out of the folder")
    home.files[f.rank] = f
    return True


def _no_rank(path: str, beside: TraceFile) -> str:
    return (f"{path}: the trace names no rank (no distributedInfo.rank, no profiler_info rank_id, no "
            f"'rankN' in the file name), and {beside.path} was taken in the same steps, so which rank it "
            "was is unknown")


def choose_run(runs: list[Run], root: str, run: int | None, notes: list[str]) -> Run:
    """The run to analyse: the only one, or number ``run``; the files of the others are named in ``notes``."""
    # Runs whose traces share a folder are told apart by their files' names ("in ." says nothing).
    seen: set[str] = set()
    shared = False
    for r in runs:
        folders = r.folders(root)
        shared = shared or bool(folders & seen)
        seen |= folders
    listing = "; ".join(r.describe(root, name_files=shared) for r in runs)
    apart = [f"run {r.number} is not the run it overlaps in time: {why}" for r in runs for why in r.apart[:1]]
    if run is None:
        if len(runs) == 1:
            return runs[0]
        why = "".join(f"{a}. " for a in apart)
        raise SeveralRunsError(f"{root} holds the traces of {len(runs)} runs: {listing}. {why}Analyse one: "
                               "--run N (profile_run(dir, run=N)), or a folder holding one run")
    if not 1 <= run <= len(runs):
        raise ValueError(f"--run {run}: {root} holds {len(runs)} run(s): {listing}")
    for other in runs:
        if other is not runs[run - 1]:
            notes.append(f"not analysed: {other.describe(root)}: "
                         + ", ".join(f.path for f in other.files.values()))
    notes += apart
    return runs[run - 1]
