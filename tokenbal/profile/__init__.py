"""`tokenbal profile`: read every rank's profiler trace and name the bottleneck.

``load_traces(dir)`` → ``analyze(traces)`` → ``format_report`` / ``verdict`` / ``format_compare`` /
``write_timeline``. Pure Python + numpy over the JSON the profilers write; no torch needed.
"""

from tokenbal.profile.analysis import CollectiveStats, RankStep, RunProfile, analyze, collective_kind
from tokenbal.profile.report import VerdictRow, format_compare, format_report, verdict, write_timeline
from tokenbal.profile.traces import Trace, load_trace, load_traces, step_windows


def profile_run(trace_dir: str) -> RunProfile:
    """``analyze(load_traces(trace_dir))``."""
    return analyze(load_traces(trace_dir), source=trace_dir)


__all__ = ["CollectiveStats", "RankStep", "RunProfile", "Trace", "VerdictRow", "analyze", "collective_kind",
           "format_compare", "format_report", "load_trace", "load_traces", "profile_run", "step_windows",
           "verdict", "write_timeline"]
