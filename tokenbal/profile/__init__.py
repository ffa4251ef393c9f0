"""`tokenbal profile`: read every rank's profiler trace and name the bottleneck.

``profile_run(dir)`` reads the folder's traces one at a time (each reduced to its rank's part of
the analysis before the next is read), groups them into runs (``tokenbal.profile.runs``) and
analyses one; ``load_traces(dir)`` → ``analyze(traces)`` does the same holding every trace.
Then ``format_report`` / ``verdict`` / ``format_compare`` / ``write_timeline``, or
``profile_as_dict`` / ``compare_as_dict`` for ``--json``. Pure Python + numpy over the JSON the
profilers write; no torch needed.
"""

from collections.abc import Callable

from tokenbal.profile.analysis import (
    CollectiveStats,
    RankStep,
    RunProfile,
    analyze,
    collective_kind,
    combine,
    rank_part,
)
from tokenbal.profile.export import compare_as_dict, profile_as_dict
from tokenbal.profile.report import VerdictRow, format_compare, format_report, verdict, write_timeline
from tokenbal.profile.runs import (
    DuplicateRankError,
    Run,
    SeveralRunsError,
    choose_run,
    describe_file,
    group_runs,
)
from tokenbal.profile.traces import Trace, load_trace, read_traces, step_windows


def _runs(trace_dir: str, skipped: list[str], notes: list[str], keep, progress=None):
    """Read every trace under ``trace_dir`` once: ``keep(trace)`` is what is kept of it; the runs found."""
    kept, files = [], []
    for trace in read_traces(trace_dir, skipped, progress):
        notes += trace.notes
        kept.append(keep(trace))
        files.append(describe_file(trace, kept[-1][1]))
        del trace                      # else the loop variable holds it while the next one is read
    return kept, files, group_runs(files, notes)


def _chosen(trace_dir: str, run: int | None, keep, progress=None):
    skipped: list[str] = []
    notes: list[str] = []
    kept, files, runs = _runs(trace_dir, skipped, notes, keep, progress)
    chosen = choose_run(runs, trace_dir, run, notes)
    mine = [k for k, f in zip(kept, files, strict=True) if chosen.files.get(f.rank) is f]
    return mine, chosen, skipped + notes


def profile_run(trace_dir: str, run: int | None = None, arrivals: str = "auto",
                progress: Callable[[int, int, str], None] | None = None) -> RunProfile:
    """The analysis of the run whose traces are under ``trace_dir`` (searched recursively).

    Traces are read one at a time. A folder holding several runs raises ``SeveralRunsError``
    listing them, unless ``run`` (1-based, as listed: oldest first) picks one; the files of the
    others, files that are not traces, and copies read once are named in the notes. A rank the
    run's recorded world size expects but no file holds is in ``missing_ranks`` and a note.
    ``progress(done, total, "files")`` is called after each JSON file under ``trace_dir`` is read.
    """
    parts, chosen, notes = _chosen(trace_dir, run, lambda t: (p := rank_part(t), p.windows), progress)
    p = combine([part for part, _ in parts], source=trace_dir, arrivals=arrivals)
    p.world_size, p.missing_ranks = chosen.world_size, chosen.missing
    p.files = {r: f.path for r, f in chosen.files.items()}
    if p.missing_ranks:
        notes.append(f"the run had {chosen.world_size or max(chosen.files) + 1} ranks; no trace of rank "
                     f"{', '.join(map(str, p.missing_ranks))} here: its waits and arrivals are not in "
                     "these numbers, and a rank it kept waiting may look slow")
    p.notes[:0] = notes
    return p


def load_traces(trace_dir: str, skipped: list[str] | None = None, run: int | None = None) -> list[Trace]:
    """Every rank's trace of the one run under ``trace_dir`` (or run number ``run``), sorted by rank,
    all in memory (``profile_run`` holds one at a time). Files that are not traces are named in
    ``skipped``; see :func:`profile_run` for runs."""
    _, chosen, notes = _chosen(trace_dir, run, lambda t: (None, step_windows(t)))
    if skipped is not None:
        skipped += notes
    return [load_trace(f.path, rank=f.rank) for f in chosen.files.values()]


__all__ = ["CollectiveStats", "DuplicateRankError", "RankStep", "Run", "RunProfile", "SeveralRunsError",
           "Trace", "VerdictRow", "analyze", "collective_kind", "combine", "compare_as_dict",
           "format_compare", "format_report", "load_trace", "load_traces", "profile_as_dict", "profile_run",
           "rank_part", "step_windows", "verdict", "write_timeline"]
