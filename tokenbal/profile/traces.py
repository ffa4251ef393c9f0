"""Load the per-rank profiler traces of one run: ``torch.profiler`` Chrome/Kineto JSON, or torch_npu's export.

``torch.profiler`` (``export_chrome_trace`` or ``tensorboard_trace_handler``) writes one JSON file
per rank, optionally gzipped, with the rank and the world size in ``distributedInfo``. torch_npu's
profiler writes one ``*_ascend_pt`` folder per rank whose ``ASCEND_PROFILER_OUTPUT/trace_view.json``
is a Chrome trace (a bare event list) and whose ``profiler_info*.json`` carries ``rank_id``.

Only complete events (``"ph": "X"``) are kept, with the args the analysis reads; everything is in
microseconds, as the traces are.
A folder may hold traces of several runs; :mod:`tokenbal.profile.runs` tells them apart.
"""

from __future__ import annotations

import glob
import gzip
import json
import math
import os
import re
from collections.abc import Callable, Hashable, Iterator
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
    world_size: int | None = None    # as the trace records it (distributedInfo / profiler_info)
    notes: list[str] = field(default_factory=list)      # what reading it had to work around
    rank_assumed: bool = False       # the trace names no rank: 0, valid only alone in its run (runs.py)
    process_groups: int | None = None   # how many process groups the run had, where the trace records it


_TRACE_PATTERNS = ("*.json", "*.json.gz")
_STEP = re.compile(r"^ProfilerStep#(\d+)$")
_INFO_RANK = re.compile(r"profiler_info_(\d+)\.json$")
# The args of a complete event the analysis reads (kernel correlation, collective sizes, operator
# shapes, a collective's process group). Kineto writes many more (ids, strides, concrete inputs):
# most of a parsed trace's memory.
_ARGS_READ = ("correlation", "In msg nelems", "dtype", "Input Dims", "Input type", "Process Group Ranks",
              "Input dims")
# The first Kineto releases (torch 1.8 / 1.9, the ChromeTraceLogger of 2021) wrote other categories:
# every CPU event "Operator" (ProfilerStep#N, gloo:* and user ranges included), "Kernel", "Memcpy",
# "Memset", "Runtime", and "Input dims". They are read as today's; a CPU event is an operator
# (cpu_op) when its name is a dispatcher op's ("aten::mm", "c10d::allreduce_"), else a range.
_LEGACY_CATS = {"Kernel": "kernel", "Memcpy": "gpu_memcpy", "Memset": "gpu_memset", "Runtime": "cuda_runtime"}


def _slim_event(obj: dict) -> dict:
    """``json.load``'s object hook: a complete event keeps only the args the analysis reads, so the
    rest is freed while the file is parsed, not after (it is called on each object as it is built)."""
    if obj.get("ph") == "X":
        args = obj.get("args")
        if isinstance(args, dict) and args:
            obj["args"] = {k: args[k] for k in _ARGS_READ if k in args}
    return obj


class NotATrace(ValueError):
    """A file in a trace folder that is not a profiler trace (a config, a metrics file): skipped."""


def _encoding(path: str) -> str:
    """The file's text encoding as ``json.loads`` would detect it from its first bytes: UTF-8 (with
    or without a byte-order mark: a trace saved by an editor), UTF-16 or UTF-32."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            head = f.read(4)
    except (OSError, EOFError):
        return "utf-8"                   # the read below reports it
    return json.detect_encoding(head) if len(head) >= 2 else "utf-8"


def _read_json(path: str):
    opener = gzip.open if path.endswith(".gz") else open
    try:
        # Decoded as it is read (not read as bytes, then decoded): the parse's peak stays one copy.
        with opener(path, "rt", encoding=_encoding(path)) as f:
            return json.load(f, object_hook=_slim_event)
    except RecursionError as e:       # json's C scanner recurses per nesting level
        if _looks_like_trace(path):
            raise ValueError(f"{path}: a damaged profiler trace (its JSON is nested deeper than Python's "
                             "recursion limit); re-export it, or move it out of the folder") from e
        raise NotATrace(f"{path}: JSON nested deeper than Python's recursion limit") from e
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
    """A bare Chrome event list (torch_npu's trace_view.json): dicts with a phase (an empty list is
    any JSON file's, e.g. metrics, not a trace)."""
    return (isinstance(data, list) and bool(data)
            and all(isinstance(e, dict) and "ph" in e for e in data[:100]))


def _whole(value, what: str, path: str, low: int = 0) -> int | None:
    """``value`` as an int >= ``low`` (``None`` stays ``None``); anything else is an error naming the file."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | str):
        value = repr(value)
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{path}: {what} is {value!r}, not an integer") from None
    if number < low:
        raise ValueError(f"{path}: {what} is {number}, not an integer >= {low}") from None
    return number


def _npu_rank(trace_view: str, notes: list[str]) -> tuple[int | None, int | None, int | None]:
    """(rank, world size, number of process groups) of a torch_npu trace_view.json from its run
    folder's ``profiler_info*.json`` (and ``profiler_metadata.json`` for the world size and groups).
    A damaged info file does not lose the trace: the rank then comes from the info file's name
    (``profiler_info_<rank>.json``), with a note."""
    run_dir = os.path.dirname(os.path.dirname(trace_view))      # .../<x>_ascend_pt
    rank = world = None
    for info in sorted(glob.glob(os.path.join(run_dir, "profiler_info*.json"))):
        try:
            data = _read_json(info)
        except ValueError as e:
            named = _INFO_RANK.search(os.path.basename(info))
            if named and rank is None:
                rank = int(named.group(1))
                notes.append(f"{info} is damaged ({e}); rank {rank} of {trace_view} taken from its file name")
            else:
                notes.append(f"{info} is damaged ({e}); not used for {trace_view}")
            continue
        if not isinstance(data, dict):
            continue
        found = _whole(data.get("rank_id", data.get("rank")), "rank_id", info, low=-1)
        if found is not None and found >= 0 and rank is None:
            rank = found
        world = world or _whole(data.get("world_size", data.get("rank_size")), "world_size", info, low=1)
    meta_world, groups = _npu_metadata(os.path.join(run_dir, "profiler_metadata.json"), notes)
    return rank, world or meta_world, groups


def _npu_metadata(path: str, notes: list[str]) -> tuple[int | None, int | None]:
    """(world size, number of process groups) as torch_npu's ``profiler_metadata.json`` records them,
    where it does: ``distributed_args`` ``world_size``, else the size of the ``default_group`` of
    ``parallel_group_info``; the groups that ``parallel_group_info`` lists."""
    if not os.path.isfile(path):
        return None, None
    try:
        data = _read_json(path)
    except ValueError as e:
        notes.append(f"{path} is damaged ({e}); the run's world size and groups are not known from it")
        return None, None
    if not isinstance(data, dict):
        return None, None
    world = None
    args = data.get("distributed_args")
    if isinstance(args, dict) and args.get("world_size") is not None:
        world = _whole(args["world_size"], "distributed_args.world_size", path, low=1)
    groups = data.get("parallel_group_info")
    if not isinstance(groups, dict):
        return world, None
    for group in groups.values():
        if world is None and isinstance(group, dict) and group.get("group_name") == "default_group" \
                and isinstance(group.get("global_ranks"), list):
            world = len(group["global_ranks"])
    return world, len(groups) or None


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
    files = sorted({p for pat in _TRACE_PATTERNS
                    for p in glob.glob(os.path.join(trace_dir, "**", pat), recursive=True)})
    files = [p for p in files if not os.path.basename(p).startswith(("profiler_info", "profiler_metadata"))]
    # The JSON files inside a torch_npu export folder (<x>_ascend_pt: communication.json, ...) are its
    # own; every other trace beside the exports (a Kineto run to compare with) is still read, so that
    # it is listed as another run rather than left out unseen.
    exports = tuple(os.path.dirname(os.path.dirname(p)) + os.sep for p in npu)
    return sorted({*npu, *(p for p in files if not p.startswith(exports))})


def _main_thread(events: list[dict]) -> object:
    steps: dict[object, int] = {}
    for e in events:
        # Kineto repeats each ProfilerStep#N on every GPU stream that ran its kernels
        # (gpu_user_annotation, as many per stream as on the CPU): those are not the training thread.
        if _STEP.match(e.get("name", "")) and e.get("cat") != "gpu_user_annotation":
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


def _clean_event(e: dict, path: str, i: int) -> dict:
    """One complete event with the types the analysis relies on: ``ts`` / ``dur`` floats, ``name`` /
    ``cat`` strings, ``pid`` / ``tid`` hashable, ``args`` a dict. What cannot be read so is an error
    naming the file and the event."""
    try:
        e["ts"] = float(e["ts"])
        e["dur"] = float(e.get("dur", 0.0))
        # json.load takes NaN / Infinity (and float() the strings "nan", "inf"): no profiler writes
        # them, and every sum and mean over the event would turn to NaN or drop it unseen.
        if not (math.isfinite(e["ts"]) and math.isfinite(e["dur"])):
            raise ValueError("not a finite number")
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: a damaged profiler trace (event {i} {e.get('name')!r} has ts "
                         f"{e.get('ts')!r}, dur {e.get('dur')!r}: {err})") from err
    for key in ("name", "cat"):
        value = e.get(key, "")
        if not isinstance(value, str):
            if isinstance(value, dict | list):
                raise ValueError(f"{path}: a damaged profiler trace (event {i} has {key} {value!r}, not a "
                                 "string)")
            e[key] = str(value)        # a number where a name belongs: still a name
    e.setdefault("name", "")
    if e.get("cat") == "Operator":
        e["cat"] = "cpu_op" if "::" in e["name"] or e["name"] == "record_param_comms" else "user_annotation"
    elif e.get("cat") in _LEGACY_CATS:
        e["cat"] = _LEGACY_CATS[e["cat"]]
    for key in ("pid", "tid"):
        if not isinstance(e.get(key), Hashable):
            e[key] = json.dumps(e[key], sort_keys=True)
    if not isinstance(e.get("args", {}), dict):
        e["args"] = {}
    elif "Input dims" in e.get("args", {}):
        e["args"].setdefault("Input Dims", e["args"].pop("Input dims"))
    return e


def _to_trace(path: str, data, rank: int | None) -> Trace:
    notes: list[str] = []
    world = groups = None
    if _events_list(data):              # torch_npu trace_view.json: a bare event list
        raw, meta, layout = data, {}, "npu"
        found, world, groups = _npu_rank(path, notes)
    elif isinstance(data, dict) and isinstance(data.get("traceEvents"), list):
        raw, layout = data["traceEvents"], "torch"
        meta = {k: v for k, v in data.items() if k != "traceEvents"}
        dist = meta.get("distributedInfo") or {}
        if not isinstance(dist, dict):
            raise ValueError(f"{path}: distributedInfo is {dist!r}, not an object")
        found = _whole(dist.get("rank"), "distributedInfo.rank", path)
        world = _whole(dist.get("world_size"), "distributedInfo.world_size", path, low=1)
        groups = _kineto_groups(dist)
    else:
        what = "an object without a traceEvents list" if isinstance(data, dict) else type(data).__name__
        raise NotATrace(f"{path}: JSON, but not a profiler trace ({what})")
    events = []
    process_names = {}
    for i, e in enumerate(raw):
        if not isinstance(e, dict):
            continue
        if e.get("ph") == "M" and e.get("name") == "process_name" and isinstance(e.get("pid"), Hashable):
            args = e.get("args") if isinstance(e.get("args"), dict) else {}
            process_names[e.get("pid")] = str(args.get("name", ""))
        if e.get("ph") == "X" and "ts" in e:
            events.append(_clean_event(e, path, i))
    if rank is None:
        rank = found if found is not None else _rank_from_name(path)
    assumed = rank is None
    if assumed:
        # A single-process run records no rank: 0, which the run grouping accepts only for a trace
        # alone in its run (runs.group_runs).
        rank = 0
    if world is not None and rank >= world:
        raise ValueError(f"{path}: rank {rank} is outside its recorded world size {world}")
    return Trace(rank=int(rank), path=path, events=events, host=meta.get("host_name"),
                 main_tid=_main_thread(events), layout=layout, metadata=meta, process_names=process_names,
                 world_size=world, notes=notes, rank_assumed=assumed, process_groups=groups)


def _kineto_groups(dist: dict) -> int | None:
    """How many process groups ``distributedInfo`` lists (``pg_config``, else ``pg_count``)."""
    config, count = dist.get("pg_config"), dist.get("pg_count")
    if isinstance(config, list):
        return len(config) or None
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else None


def read_traces(trace_dir: str, skipped: list[str],
                progress: Callable[[int, int, str], None] | None = None) -> Iterator[Trace]:
    """Each trace under ``trace_dir`` in turn (files in name order), read one at a time: the caller
    reduces a trace to what it keeps before asking for the next, so memory holds one trace's events.
    Files that are not traces, and traces with no complete events, are named in ``skipped``; a
    damaged trace raises ``ValueError`` naming it. A trace that names no rank is rank 0 where it is
    alone in its run (:mod:`tokenbal.profile.runs`). ``progress(done, total, "files")`` is called
    after each JSON file is read (a trace of hundreds of MB takes seconds, a run holds hundreds)."""
    files = _trace_files(trace_dir)
    wanted = "*.json, *.json.gz or ASCEND_PROFILER_OUTPUT/trace_view.json"
    if not files:
        raise FileNotFoundError(f"{trace_dir}: no profiler traces ({wanted}) found")
    found = 0
    for k, path in enumerate(files, 1):
        try:
            trace = _to_trace(path, _read_json(path), None)
        except NotATrace as e:
            skipped.append(f"skipped {e}")
            continue
        finally:
            if progress is not None:
                progress(k, len(files), "files")
        if not trace.events:
            # What a profiler writes when it recorded nothing (never stepped into an active phase,
            # a failed export): no step times it, so it would join any run and leave that run
            # with no step in common. Its rank is then reported missing.
            skipped.append(f"skipped {path}: a profiler trace with no complete events (rank {trace.rank}): "
                           "nothing was recorded")
            continue
        found += 1
        yield trace
        del trace                      # the caller has what it keeps: free it before the next read
    if not found:
        raise FileNotFoundError(f"{trace_dir}: no profiler traces ({wanted}) among {len(files)} JSON files: "
                                + "; ".join(skipped))


def step_windows(trace: Trace) -> dict[int, tuple[float, float]]:
    """``ProfilerStep#N`` → (start, end) on the training thread; the whole trace as step 0 if none."""
    steps = {}
    for e in trace.events:
        m = _STEP.match(e.get("name", ""))
        if m and e.get("tid") == trace.main_tid and e.get("cat") != "gpu_user_annotation":
            steps[int(m.group(1))] = (e["ts"], e["ts"] + e["dur"])
    if not steps and trace.events:
        start = min(e["ts"] for e in trace.events)
        steps[0] = (start, max(e["ts"] + e["dur"] for e in trace.events))
    return steps
