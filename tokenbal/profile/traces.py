"""Load the per-rank profiler traces of one run: ``torch.profiler`` Chrome/Kineto JSON, or torch_npu's export.

``torch.profiler`` (``export_chrome_trace`` or ``tensorboard_trace_handler``) writes one JSON file
per rank, optionally gzipped, with the rank in ``distributedInfo.rank``. torch_npu's profiler writes
one ``*_ascend_pt`` folder per rank whose ``ASCEND_PROFILER_OUTPUT/trace_view.json`` is a Chrome
trace (a bare event list) and whose ``profiler_info*.json`` carries ``rank_id``.

Only complete events (``"ph": "X"``) are kept; everything is in microseconds, as the traces are.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
from dataclasses import dataclass, field


@dataclass
class Trace:
    """One rank's trace: its complete events and the thread that ran the training loop."""

    rank: int
    path: str
    events: list[dict]
    host: str | None = None
    main_tid: object = None          # the thread holding the ProfilerStep#N annotations
    layout: str = "torch"            # "torch" (Kineto) or "npu" (torch_npu's trace_view.json)
    metadata: dict = field(default_factory=dict)
    process_names: dict = field(default_factory=dict)   # pid -> name (torch_npu: "Overlap Analysis", ...)


_TRACE_PATTERNS = ("*.json", "*.json.gz")
_STEP = re.compile(r"^ProfilerStep#(\d+)$")


class NotATrace(ValueError):
    """A file in a trace folder that is not a profiler trace (a config, a metrics file): skipped."""


def _read_json(path: str):
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            return json.load(f)
    except (OSError, EOFError, json.JSONDecodeError, UnicodeDecodeError) as e:
        if _looks_like_trace(path):
            raise ValueError(f"{path}: a damaged or truncated profiler trace ({e}); re-export it, or move "
                             "it out of the folder") from e
        raise NotATrace(f"{path}: not JSON ({e})") from e


def _looks_like_trace(path: str) -> bool:
    """Whether the file's first bytes are those of a Chrome / Kineto trace."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            head = f.read(4096)
    except (OSError, EOFError):
        return path.endswith(".gz")      # a gzip that will not open was written as a trace
    return any(key in head for key in (b'"traceEvents"', b'"schemaVersion"', b'"ph"'))


def _events_list(data) -> bool:
    """A bare Chrome event list (torch_npu's trace_view.json): dicts with a phase."""
    return isinstance(data, list) and all(isinstance(e, dict) and "ph" in e for e in data[:100])


def _npu_rank(trace_view: str) -> int | None:
    run_dir = os.path.dirname(os.path.dirname(trace_view))      # .../<x>_ascend_pt
    for info in sorted(glob.glob(os.path.join(run_dir, "profiler_info*.json"))):
        data = _read_json(info)
        rank = data.get("rank_id", data.get("rank")) if isinstance(data, dict) else None
        if rank is not None and int(rank) >= 0:
            return int(rank)
    return None


def _rank_from_name(path: str) -> int | None:
    numbers = re.findall(r"(?:rank|_r|-r)[_-]?(\d+)", os.path.basename(path))
    return int(numbers[-1]) if numbers else None


def _trace_files(trace_dir: str) -> list[str]:
    if os.path.isfile(trace_dir):
        return [trace_dir]
    if not os.path.isdir(trace_dir):
        raise FileNotFoundError(f"{trace_dir}: no such trace folder")
    npu = sorted(glob.glob(os.path.join(trace_dir, "**", "ASCEND_PROFILER_OUTPUT", "trace_view.json"),
                           recursive=True))
    if npu:
        return npu
    files = sorted({p for pat in _TRACE_PATTERNS
                    for p in glob.glob(os.path.join(trace_dir, "**", pat), recursive=True)})
    return [p for p in files if not os.path.basename(p).startswith("profiler_info")]


def _main_thread(events: list[dict]) -> object:
    steps: dict[object, int] = {}
    for e in events:
        if _STEP.match(e.get("name", "")):
            steps[e.get("tid")] = steps.get(e.get("tid"), 0) + 1
    if steps:
        return max(steps, key=steps.get)
    busy: dict[object, float] = {}
    for e in events:
        if e.get("cat") == "cpu_op":
            busy[e.get("tid")] = busy.get(e.get("tid"), 0.0) + float(e.get("dur", 0.0))
    return max(busy, key=busy.get) if busy else None


def load_trace(path: str, rank: int | None = None) -> Trace:
    """Read one trace file; ``rank`` overrides what the file says."""
    return _to_trace(path, _read_json(path), rank)


def _to_trace(path: str, data, rank: int | None) -> Trace:
    if _events_list(data):              # torch_npu trace_view.json: a bare event list
        raw, meta, layout = data, {}, "npu"
        found = _npu_rank(path)
    elif isinstance(data, dict) and isinstance(data.get("traceEvents"), list):
        raw, layout = data["traceEvents"], "torch"
        meta = {k: v for k, v in data.items() if k != "traceEvents"}
        found = (meta.get("distributedInfo") or {}).get("rank")
    else:
        what = "an object without a traceEvents list" if isinstance(data, dict) else type(data).__name__
        raise NotATrace(f"{path}: JSON, but not a profiler trace ({what})")
    events = []
    process_names = {}
    for e in raw:
        if not isinstance(e, dict):
            continue
        if e.get("ph") == "M" and e.get("name") == "process_name":
            process_names[e.get("pid")] = (e.get("args") or {}).get("name", "")
        if e.get("ph") == "X" and "ts" in e:
            try:
                e["ts"] = float(e["ts"])
                e["dur"] = float(e.get("dur", 0.0))
            except (TypeError, ValueError) as err:
                raise ValueError(f"{path}: a damaged profiler trace (event {e.get('name')!r} has ts "
                                 f"{e.get('ts')!r}, dur {e.get('dur')!r}: {err})") from err
            events.append(e)
    if rank is None:
        rank = found if found is not None else _rank_from_name(path)
    if rank is None:
        raise ValueError(f"{path}: the trace names no rank (no distributedInfo.rank, no profiler_info "
                         "rank_id, no 'rankN' in the file name)")
    return Trace(rank=int(rank), path=path, events=events, host=meta.get("host_name"),
                 main_tid=_main_thread(events), layout=layout, metadata=meta, process_names=process_names)


def load_traces(trace_dir: str, skipped: list[str] | None = None) -> list[Trace]:
    """Every rank's trace under ``trace_dir`` (searched recursively), sorted by rank.

    One trace per rank: when a rank has several (several ``tensorboard_trace_handler`` cycles),
    the newest file is taken. Files that are not traces (other JSON beside them) are skipped, each
    with a line in ``skipped``; a damaged trace raises ``ValueError`` naming it.
    """
    files = _trace_files(trace_dir)
    wanted = "*.json, *.json.gz or ASCEND_PROFILER_OUTPUT/trace_view.json"
    if not files:
        raise FileNotFoundError(f"{trace_dir}: no profiler traces ({wanted}) found")
    skipped = [] if skipped is None else skipped
    loaded = []
    for path in files:
        try:
            loaded.append((path, _read_json(path)))
        except NotATrace as e:
            skipped.append(f"skipped {e}")
    by_rank: dict[int, Trace] = {}
    single = len(loaded) == 1
    for path, data in loaded:
        try:
            trace = _to_trace(path, data, rank=0 if single and _rank_from_name(path) is None else None)
        except NotATrace as e:
            skipped.append(f"skipped {e}")
            continue
        old = by_rank.get(trace.rank)
        if old is None or os.path.getmtime(path) > os.path.getmtime(old.path):
            by_rank[trace.rank] = trace
    if not by_rank:
        raise FileNotFoundError(f"{trace_dir}: no profiler traces ({wanted}) among {len(files)} JSON files: "
                                + "; ".join(skipped))
    return [by_rank[r] for r in sorted(by_rank)]


def step_windows(trace: Trace) -> dict[int, tuple[float, float]]:
    """``ProfilerStep#N`` → (start, end) on the training thread; the whole trace as step 0 if none."""
    steps = {}
    for e in trace.events:
        m = _STEP.match(e.get("name", ""))
        if m and e.get("tid") == trace.main_tid:
            steps[int(m.group(1))] = (e["ts"], e["ts"] + e["dur"])
    if not steps and trace.events:
        start = min(e["ts"] for e in trace.events)
        steps[0] = (start, max(e["ts"] + e["dur"] for e in trace.events))
    return steps
