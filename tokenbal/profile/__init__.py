"""`tokenbal profile`: read every rank's profiler trace and name the bottleneck.

``load_traces(dir)`` → ``analyze(traces)`` → ``format_report`` / ``verdict`` / ``format_compare`` /
``write_timeline``, or ``profile_as_dict`` / ``compare_as_dict`` for ``--json``. Pure Python + numpy
over the JSON the profilers write; no torch needed.
"""

from tokenbal.profile.analysis import CollectiveStats, RankStep, RunProfile, analyze, collective_kind
from tokenbal.profile.export import compare_as_dict, profile_as_dict
from tokenbal.profile.report import VerdictRow, format_compare, format_report, verdict, write_timeline
from tokenbal.profile.traces import Trace, load_trace, load_traces, step_windows


def profile_run(trace_dir: str) -> RunProfile:
    """``analyze(load_traces(trace_dir))``; files skipped as not traces are named in its notes."""
    skipped: list[str] = []
    run = analyze(load_traces(trace_dir, skipped), source=trace_dir)
    run.notes[:0] = skipped
    return run


__all__ = ["CollectiveStats", "RankStep", "RunProfile", "Trace", "VerdictRow", "analyze", "collective_kind",
           "compare_as_dict", "format_compare", "format_report", "load_trace", "load_traces",
           "profile_as_dict", "profile_run", "step_windows", "verdict", "write_timeline"]
