"""Which traces belong to one run, and which run a folder's traces are.

A folder may hold the traces of several runs: a run before and after a change, the cycles of one
``tensorboard_trace_handler`` schedule, a stray file copied in. Traces are one run when they agree
on what the run records about itself — the layout (Kineto / torch_npu), ``distributedInfo``'s
world size and backend — and were taken at the same time: their profiled steps overlap in wall
time (``baseTimeNanoseconds`` + the step's ``ts``, comparable across processes and, with synced
clocks, hosts) and share step numbers. Ranks of one run are in their steps together (they meet in
every collective); two runs, or two profiling cycles of one run, are not.

Within a run each rank has one trace: two different traces claiming one rank is an error naming
both; a byte-for-byte copy (the same Kineto ``trace_id``, e.g. a ``.json`` and its ``.json.gz``) is
read once, with a note. A rank the run's recorded world size expects but no file holds is
*missing*, and named as such.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import UTC, datetime

from tokenbal.profile.traces import Trace


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


def describe_file(trace: Trace, windows: dict[int, tuple[float, float]]) -> TraceFile:
    meta = trace.metadata
    base = meta.get("baseTimeNanoseconds")
    base_us = base / 1000 if isinstance(base, int | float) and not isinstance(base, bool) else 0.0
    dist = meta.get("distributedInfo") or {}
    backend = dist.get("backend") if isinstance(dist.get("backend"), str) else None
    trace_id = meta.get("trace_id") if isinstance(meta.get("trace_id"), str) else None
    start = min(w[0] for w in windows.values()) + base_us if windows else None
    end = max(w[1] for w in windows.values()) + base_us if windows else None
    return TraceFile(path=trace.path, rank=trace.rank, world_size=trace.world_size, layout=trace.layout,
                     backend=backend, trace_id=trace_id, start_us=start, end_us=end,
                     steps=frozenset(windows), rank_assumed=trace.rank_assumed)


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

    def describe(self, root: str) -> str:
        size = self.world_size
        present = f"{len(self.files)} of {size} ranks" if size else f"{len(self.files)} rank(s)"
        if self.missing:
            present += f" (rank {ranks_text(self.missing)} missing)"
        steps = sorted(set().union(*(f.steps for f in self.files.values())))
        folders = sorted({os.path.relpath(os.path.dirname(f.path), root) if os.path.isdir(root)
                          else os.path.dirname(f.path) for f in self.files.values()})
        where = ", ".join(folders[:3]) + (f" +{len(folders) - 3} more folders" if len(folders) > 3 else "")
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
    for f in sorted(kept, key=lambda f: (f.start_us is not None, f.start_us or 0.0, f.path)):
        kind = (f.layout, f.world_size, f.backend)
        home = next((r for r in kinds.get(kind, []) if any(_together(f, g) for g in r.files.values())), None)
        if home is None:
            home = Run(files={})
            kinds.setdefault(kind, []).append(home)
            runs.append(home)
        if f.rank in home.files:
            other = home.files[f.rank]
            if f.rank_assumed or other.rank_assumed:
                unranked = f if f.rank_assumed else other
                raise ValueError(_no_rank(unranked.path, other if unranked is f else f))
            raise DuplicateRankError(
                f"two traces claim rank {f.rank} of one run: {other.path} and {f.path} (same world size, "
                "overlapping steps); move one of them out of the folder")
        home.files[f.rank] = f
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


def _no_rank(path: str, beside: TraceFile) -> str:
    return (f"{path}: the trace names no rank (no distributedInfo.rank, no profiler_info rank_id, no "
            f"'rankN' in the file name), and {beside.path} was taken in the same steps, so which rank it "
            "was is unknown")


def choose_run(runs: list[Run], root: str, run: int | None, notes: list[str]) -> Run:
    """The run to analyse: the only one, or number ``run``; the files of the others are named in ``notes``."""
    listing = "; ".join(r.describe(root) for r in runs)
    if run is None:
        if len(runs) == 1:
            return runs[0]
        raise SeveralRunsError(f"{root} holds the traces of {len(runs)} runs: {listing}. Analyse one: "
                               "--run N (profile_run(dir, run=N)), or a folder holding one run")
    if not 1 <= run <= len(runs):
        raise ValueError(f"--run {run}: {root} holds {len(runs)} run(s): {listing}")
    for other in runs:
        if other is not runs[run - 1]:
            notes.append(f"not analysed: {other.describe(root)}: "
                         + ", ".join(f.path for f in other.files.values()))
    return runs[run - 1]
