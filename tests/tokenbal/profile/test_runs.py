"""`tokenbal profile` never mixes runs or loses a rank silently (issue 51, findings 1-4): traces are
grouped by run (recorded world size and backend, overlapping steps in wall time), one run is
analysed and named, duplicates and missing ranks are named, traces are read one at a time.

The runs are real: two 2-rank gloo runs traced with torch.profiler, one after the other, and two
taken at the same time."""

import dataclasses
import gc
import gzip
import json
import os
import shutil
import threading
import weakref

import pytest

from tests.helpers.dist_utils import run_ranks
from tests.helpers.stragglers import concurrent_rank, straggler_rank
from tests.scripts.test_cli_errors import run as run_cli
from tests.tokenbal.profile.test_profile import _npu_trace
from tokenbal.profile import DuplicateRankError, SeveralRunsError, format_report, profile_run, traces


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Run A (rank 1 late, a straggler verdict) and then run B (no straggler), 2 ranks each."""
    root = tmp_path_factory.mktemp("runs")
    for name, pattern in (("A", "constant"), ("B", "none")):
        os.makedirs(root / name)
        run_ranks(straggler_rank, 2, str(root / name), pattern, "work", 2, timeout=240,
                  collective_timeout=120)
    return root


@pytest.fixture(scope="module")
def concurrent_runs(tmp_path_factory):
    """Run A (rank 1 sleeps 50 ms before each all_reduce) and run B (no straggler), 2 ranks and 4 steps
    each, taken at the same time on this host: B starts 0.1 s after A, within A's profiled steps."""
    root = tmp_path_factory.mktemp("concurrent")
    os.makedirs(root / "ready")
    failures = []

    def launch(name, pattern, delay_s):
        os.makedirs(root / name)
        try:
            run_ranks(concurrent_rank, 2, str(root / name), pattern, "sleep", 4, str(root / "ready"), 2,
                      delay_s, timeout=240, collective_timeout=120)
        except Exception as e:  # noqa: BLE001 - reported by the fixture below
            failures.append(e)
    threads = [threading.Thread(target=launch, args=a) for a in (("A", "constant", 0.0), ("B", "none", 0.1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    return root


def _copy(src, dst, host=None):
    data = json.loads(src.read_text())
    if host is not None:
        data["host_name"] = host
    dst.write_text(json.dumps(data))


def test_ranks_of_two_runs_taken_at_the_same_time_are_two_runs_not_one(concurrent_runs, tmp_path, capsys):
    """Two jobs side by side writing rank{r}.json into one folder leave rank 0 of one and rank 1 of the
    other: same world size, backend and steps, overlapping in time. They were analysed as one run."""
    a, b = concurrent_runs / "A", concurrent_runs / "B"
    for run in (a, b):                 # each run alone is one run: its ranks met in every collective
        assert profile_run(str(run)).ranks == [0, 1]
    for first, second in ((a, b), (b, a)):
        mixed = tmp_path / f"mixed_{first.name}0"
        mixed.mkdir()
        shutil.copy(first / "rank0.json", mixed / "rank0.json")
        shutil.copy(second / "rank1.json", mixed / "rank1.json")
        with pytest.raises(SeveralRunsError) as e:
            profile_run(str(mixed))
        message = str(e.value)
        assert "holds the traces of 2 runs" in message
        assert "1 of 2 ranks (rank 1 missing)" in message and "1 of 2 ranks (rank 0 missing)" in message
        assert "is not the run it overlaps in time: all_reduce #" in message
        assert str(mixed / "rank0.json") in message and str(mixed / "rank1.json") in message
        assert "on one host's clock" in message
        code, out, err = run_cli(["profile", str(mixed), "-q"], capsys)
        assert code == 2 and out == "" and err.startswith("tokenbal profile: error: ")
        assert err.count("\n") == 1
        p = profile_run(str(mixed), run=1)
        assert p.ranks in ([0], [1]) and p.missing_ranks == [1 - p.ranks[0]]
        assert any(n.startswith("run 2 is not the run it overlaps in time") for n in p.notes)


def test_all_ranks_of_two_runs_taken_at_the_same_time_are_two_whole_runs(concurrent_runs, tmp_path):
    """tensorboard_trace_handler names each file after its host and pid: both runs' ranks land side by
    side. They used to be one run whose ranks clashed (DuplicateRankError)."""
    for name in ("A", "B"):
        for r in (0, 1):
            shutil.copy(concurrent_runs / name / f"rank{r}.json", tmp_path / f"{name}_w{r}.pt.trace.json")
    with pytest.raises(SeveralRunsError, match=r"run 1: 2 of 2 ranks, steps 1-4, .*run 2: 2 of 2 ranks, "
                                               r"steps 1-4"):
        profile_run(str(tmp_path))
    a, b = profile_run(str(tmp_path), run=1), profile_run(str(tmp_path), run=2)
    assert a.files == {r: str(tmp_path / f"A_w{r}.pt.trace.json") for r in (0, 1)}
    assert b.files == {r: str(tmp_path / f"B_w{r}.pt.trace.json") for r in (0, 1)}
    assert a.straggler_wait_s() > 0.02 > b.straggler_wait_s()     # A's rank 1 sleeps 50 ms a step


def _summary(name, rank, intervals):
    """What grouping keeps of a trace: rank ``rank`` of a 2-rank NCCL run on one host whose world
    all-reduces ran at ``intervals`` [(start, end)] µs."""
    from tokenbal.profile.runs import WORLD, TraceFile

    return TraceFile(path=name, rank=rank, world_size=2, layout="torch", backend="nccl", trace_id=name,
                     start_us=intervals[0][0] - 100, end_us=intervals[-1][1] + 100, steps=frozenset({1}),
                     host="h", meetings={WORLD: [("all_reduce", a, b) for a, b in intervals]})


def test_the_ranks_of_runs_started_interleaved_find_their_own_run():
    """Started in the order A0, B0, A1, B1: B0 came when run A held only rank 0 (nothing to compare
    it with: a rank is never compared with itself) and was a duplicate rank 0 of run A."""
    from tokenbal.profile.runs import group_runs

    a = [[(10_000 * k + 800 * r, 10_000 * k + 9000) for k in range(3)] for r in (0, 1)]
    b = [[(7_000 * k + 3000 + 10 + 200 * r, 7_000 * k + 4000) for k in range(3)] for r in (0, 1)]
    a0, a1, b0, b1 = _summary("A0", 0, a[0]), _summary("A1", 1, a[1]), _summary("B0", 0, b[0]), _summary(
        "B1", 1, b[1])
    a1 = dataclasses.replace(a1, start_us=b0.start_us + 1)       # A0, B0, A1, B1 in start order
    for files in ([a0, b0, a1, b1], [a0, b0, b1]):
        runs = group_runs(files, [])
        assert [sorted(f.path for f in r.files.values()) for r in runs] == \
            [["A0", "A1"] if a1 in files else ["A0"], ["B0", "B1"]]
        assert runs[-1].apart and "ended on rank" in runs[-1].apart[0]


def test_runs_on_other_hosts_are_told_apart_under_any_clock_offset(concurrent_runs, tmp_path):
    """Across hosts the clocks may differ: two ranks are one run when one offset lets every collective
    meet. A real run whose second host's clock is 3 ms ahead stays one run; the mix does not."""
    skewed = tmp_path / "skewed"
    skewed.mkdir()
    _copy(concurrent_runs / "A" / "rank0.json", skewed / "rank0.json", host="node0")
    data = json.loads((concurrent_runs / "A" / "rank1.json").read_text())
    data["host_name"] = "node1"
    for e in data["traceEvents"]:
        if "ts" in e:
            e["ts"] += 3000
    (skewed / "rank1.json").write_text(json.dumps(data))
    assert profile_run(str(skewed)).ranks == [0, 1]
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    _copy(concurrent_runs / "A" / "rank0.json", mixed / "rank0.json", host="node0")
    _copy(concurrent_runs / "B" / "rank1.json", mixed / "rank1.json", host="node1")
    with pytest.raises(SeveralRunsError, match=r"each on its host's clock: for both to have met, rank 1's "
                                               r"clock would be at least .* ms ahead of rank 0's and at "
                                               r"least .* ms behind"):
        profile_run(str(mixed))


def _device_rank(path, rank, world, kernels, groups=None, pg_count=1):
    """A GPU rank's trace: one step, NCCL all_reduce kernels at ``kernels`` [(start, end)] µs, each in
    the process group ``groups[i]`` where given (Kineto's "Process Group Ranks" arg)."""
    step = {"ph": "X", "name": "ProfilerStep#1", "cat": "user_annotation", "pid": 1, "tid": 1, "ts": 0,
            "dur": 10_000}
    events = [step]
    for i, (a, b) in enumerate(kernels):
        args = {"Process Group Ranks": groups[i]} if groups else {}
        events.append({"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
                       "pid": 0, "tid": 7, "ts": a, "dur": b - a, "args": args})
    info = {"backend": "nccl", "rank": rank, "world_size": world, "pg_count": pg_count}
    path.write_text(json.dumps(_trace(events, distributedInfo=info, host_name="gpu0",
                                      baseTimeNanoseconds=1_700_000_000_000_000_000, trace_id=f"t{rank}")))


def test_only_collectives_of_a_group_holding_both_ranks_tell_runs_apart(tmp_path):
    """Kernels of a group both ranks are in must overlap; a trace with several process groups and
    collectives that name none gives no evidence (an FSDP rank's collectives on its own shard group)."""
    cases = {  # rank 1's kernels: [(start, end)], the groups of rank 0's / rank 1's kernels, pg_count
        "met": ([(900, 1500), (3000, 3100)], None, None, 1),
        "within_clock_tolerance": ([(1600, 1700), (3000, 3100)], None, None, 1),
        "apart": ([(2600, 2700), (3000, 3100)], None, None, 1),
        "apart_in_a_named_group": ([(2600, 2700), (3000, 3100)], [[0, 1], [0, 1]], [[0, 1], [0, 1]], 2),
        "other_groups": ([(2600, 2700), (3000, 3100)], [[0, 2], [0, 1]], [[1, 3], [0, 1]], 3),
        "groups_unknown": ([(2600, 2700), (3000, 3100)], None, None, 2),
    }
    for name, (kernels, groups0, groups1, count) in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        _device_rank(folder / "rank0.json", 0, 4, [(1000, 1500), (3000, 3100)], groups0, count)
        _device_rank(folder / "rank1.json", 1, 4, kernels, groups1, count)
        if name.startswith("apart"):
            with pytest.raises(SeveralRunsError, match=r"all_reduce #1 (of group \[0, 1\] )?ended on rank 0 "
                                                       r".* 1\.1 ms before it began on rank 1 .*, on one "
                                                       r"host's clock"):
                profile_run(str(folder))
        else:
            assert profile_run(str(folder)).ranks == [0, 1], name


# What the first Kineto releases (torch 1.8 / 1.9) wrote for today's categories; no baseTimeNanoseconds,
# no trace_id, "Input dims".
_LEGACY = {"cpu_op": "Operator", "user_annotation": "Operator", "kernel": "Kernel", "gpu_memcpy": "Memcpy",
           "gpu_memset": "Memset", "cuda_runtime": "Runtime"}


def _as_legacy(src, dst):
    data = json.loads(src.read_text())
    data.pop("baseTimeNanoseconds", None)
    data.pop("trace_id", None)
    for e in data["traceEvents"]:
        e["cat"] = _LEGACY.get(e.get("cat"), e.get("cat"))
        if "Input Dims" in (e.get("args") or {}):
            e["args"]["Input dims"] = e["args"].pop("Input Dims")
    dst.write_text(json.dumps(data))


def test_traces_in_the_first_kineto_categories_read_as_todays(two_runs, tmp_path):
    """torch 1.8 / 1.9 traces: every CPU event "Operator", GPU work "Kernel" / "Memcpy" / "Runtime". They
    were read as a trace with no compute (0.0 ms on every rank, arrivals from the fallback) or, with
    GPU kernels, as a host-only trace."""
    for r in (0, 1):
        _as_legacy(two_runs / "A" / f"rank{r}.json", tmp_path / f"rank{r}.json")
    old, new = profile_run(str(tmp_path)), profile_run(str(two_runs / "A"))
    assert old.steps == new.steps and old.collectives == new.collectives
    assert old.arrival_source == new.arrival_source == "training-thread launches" and old.work_from_shapes
    gpu = tmp_path / "gpu"
    gpu.mkdir()
    for r in (0, 1):
        _device_rank(tmp_path / f"k{r}.json", r, 2, [(1000, 1500), (3000, 3100)])
        _as_legacy(tmp_path / f"k{r}.json", gpu / f"rank{r}.json")
    p = profile_run(str(gpu))
    assert p.device and p.steps[0].comm_s == pytest.approx(600e-6)


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16"])
def test_a_trace_saved_with_a_byte_order_mark_or_in_utf16_is_read(two_runs, tmp_path, encoding):
    """A trace saved again by an editor (UTF-8 with a BOM) was "a damaged or truncated profiler trace
    ... re-export it"; one saved as UTF-16 (PowerShell) was skipped as "not JSON"."""
    for r in (0, 1):
        text = (two_runs / "A" / f"rank{r}.json").read_text()
        (tmp_path / f"rank{r}.json").write_bytes(text.encode(encoding))
    p, original = profile_run(str(tmp_path)), profile_run(str(two_runs / "A"))
    assert p.ranks == [0, 1] and p.steps == original.steps and p.collectives == original.collectives


@pytest.mark.parametrize("stream, gpu_first", [(7, True), (100, False)])
def test_the_gpu_copy_of_a_profiler_step_is_not_the_training_thread(tmp_path, stream, gpu_first):
    """Kineto repeats ProfilerStep#N on each GPU stream (gpu_user_annotation, spanning the step's kernels):
    as many there as on the CPU thread, the stream listed first was taken as the training thread and the
    step timed by its kernels (9 ms of a 10 ms step); a stream numbered as the training thread's tid
    gave its step window where listed after it."""
    for r in (0, 1):
        cpu_step = {"ph": "X", "name": "ProfilerStep#1", "cat": "user_annotation", "pid": 100, "tid": 100,
                    "ts": 0, "dur": 10_000}
        gpu_step = dict(cpu_step, cat="gpu_user_annotation", pid=0, tid=stream, ts=2000, dur=9000)
        kernels = [{"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur}
                   for name, ts, dur in (("gemm", 2000, 3000 + 2000 * r),
                                         ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 7000, 4000))]
        events = [gpu_step, *kernels, cpu_step] if gpu_first else [cpu_step, *kernels, gpu_step]
        (tmp_path / f"rank{r}.json").write_text(json.dumps(_trace(
            events, distributedInfo={"backend": "nccl", "rank": r, "world_size": 2})))
    p = profile_run(str(tmp_path))
    assert [(s.rank, s.step_s) for s in p.steps] == [(0, 0.01), (1, 0.01)]
    assert [s.idle_s for s in p.steps] == pytest.approx([0.004, 0.002])


def test_ranks_of_two_runs_in_one_folder_are_two_runs_each_missing_a_rank(two_runs, tmp_path, capsys):
    shutil.copy(two_runs / "A" / "rank0.json", tmp_path / "rank0.json")
    shutil.copy(two_runs / "B" / "rank1.json", tmp_path / "rank1.json")
    with pytest.raises(SeveralRunsError) as e:
        profile_run(str(tmp_path))
    message = str(e.value)
    assert "holds the traces of 2 runs" in message and "--run N" in message
    assert message.count("1 of 2 ranks (rank 1 missing)") == 1 and message.count("(rank 0 missing)") == 1
    code, out, err = run_cli(["profile", str(tmp_path), "-q"], capsys)
    assert code == 2 and out == "" and err.startswith("tokenbal profile: error: ") and err.count("\n") == 1
    # --run 1 (run A, the older): analysed as 1 of 2 ranks, rank 1 named missing, B's file named
    p = profile_run(str(tmp_path), run=1)
    assert p.ranks == [0] and p.world_size == 2 and p.missing_ranks == [1]
    assert p.files == {0: str(tmp_path / "rank0.json")}
    assert any(n.startswith("not analysed: run 2") and "rank1.json" in n for n in p.notes)
    assert any("no trace of rank 1" in n for n in p.notes)
    code, out, _ = run_cli(["profile", str(tmp_path), "--run", "1"], capsys)
    assert code == 0 and "1 of 2 ranks (no trace of rank 1)" in out.splitlines()[0]
    code, _, err = run_cli(["profile", str(tmp_path), "--run", "3"], capsys)
    assert code == 2 and "--run 3:" in err and "holds 2 run(s)" in err


def test_runs_mixed_in_one_folder_are_listed_with_their_files(two_runs, tmp_path, capsys):
    # Both runs "in ." told the reader nothing: the listing names each run's files when runs share a
    # folder (and stays by folder where each run has its own, as test_runs_in_subfolders_... checks).
    shutil.copy(two_runs / "A" / "rank0.json", tmp_path / "a_rank0.json")
    shutil.copy(two_runs / "B" / "rank1.json", tmp_path / "b_rank1.json")
    os.makedirs(tmp_path / "sub")
    shutil.copy(two_runs / "B" / "rank0.json", tmp_path / "sub" / "rank0.json")
    code, out, err = run_cli(["profile", str(tmp_path), "-q"], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "run 1: 1 of 2 ranks (rank 1 missing), steps 1-2, started " in err
    assert "UTC, in a_rank0.json; run 2: 2 of 2 ranks, steps 1-2, started " in err
    assert f"UTC, in {os.path.join('sub', 'rank0.json')}, b_rank1.json. Analyse one" in err


def test_a_missing_rank_is_named_from_the_recorded_world_size(two_runs, tmp_path, capsys):
    shutil.copy(two_runs / "A" / "rank1.json", tmp_path / "rank1.json")
    p = profile_run(str(tmp_path))
    assert p.ranks == [1] and p.world_size == 2 and p.missing_ranks == [0]
    assert "1 of 2 ranks (no trace of rank 0)" in format_report(p).splitlines()[0]
    code, out, _ = run_cli(["profile", str(tmp_path), "--json"], capsys)
    assert code == 0 and json.loads(out)["missing_ranks"] == [0] and json.loads(out)["world_size"] == 2


def test_runs_in_subfolders_are_listed_not_the_newest_file_per_rank(two_runs, capsys):
    with pytest.raises(SeveralRunsError, match=r"run 1: 2 of 2 ranks, steps 1-2, started .* UTC, in A; "
                                                r"run 2: 2 of 2 ranks, steps 1-2, started .* UTC, in B"):
        profile_run(str(two_runs))
    p = profile_run(str(two_runs), run=2)
    assert p.files == {0: str(two_runs / "B" / "rank0.json"), 1: str(two_runs / "B" / "rank1.json")}
    a = profile_run(str(two_runs / "A"))
    assert a.ranks == [0, 1] and not a.missing_ranks
    code, out, _ = run_cli(["profile", "--compare", str(two_runs), str(two_runs), "--run", "1", "2"], capsys)
    assert code == 0 and "A ms/step" in out
    code, _, err = run_cli(["profile", "--compare", str(two_runs), str(two_runs), "--run", "1"], capsys)
    assert code == 2 and "--run takes two run numbers (A B) here, got 1" in err


def test_a_newer_gz_from_another_run_does_not_win(two_runs, tmp_path):
    for r in (0, 1):
        shutil.copy(two_runs / "A" / f"rank{r}.json", tmp_path / f"rank{r}.json")
    with open(two_runs / "B" / "rank0.json", "rb") as f, gzip.open(tmp_path / "rank0.json.gz", "wb") as g:
        g.write(f.read())
    os.utime(tmp_path / "rank0.json", (1, 1))      # the plain file is the older one
    with pytest.raises(SeveralRunsError,
                       match=r"run 1: 2 of 2 ranks.*run 2: 1 of 2 ranks \(rank 1 missing\)"):
        profile_run(str(tmp_path))
    assert profile_run(str(tmp_path), run=1).files[0] == str(tmp_path / "rank0.json")


def test_a_trace_that_recorded_nothing_is_skipped_and_its_rank_named_missing(two_runs, tmp_path):
    """A trace with no complete events (a profiler that never reached an active step) has no step
    time: it used to join the run and fail its analysis with "share no ProfilerStep#N", naming no file."""
    shutil.copy(two_runs / "A" / "rank0.json", tmp_path / "rank0.json")
    data = json.loads((two_runs / "A" / "rank1.json").read_text())
    data["traceEvents"] = [e for e in data["traceEvents"] if e.get("ph") != "X"]
    (tmp_path / "rank1.json").write_text(json.dumps(data))
    p = profile_run(str(tmp_path))
    assert p.ranks == [0] and p.world_size == 2 and p.missing_ranks == [1]
    assert f"skipped {tmp_path / 'rank1.json'}: a profiler trace with no complete events (rank 1): nothing " \
           "was recorded" in p.notes
    assert any("no trace of rank 1" in n for n in p.notes)


def test_two_traces_claiming_one_rank_are_an_error_naming_both(two_runs, tmp_path):
    for r in (0, 1):
        shutil.copy(two_runs / "A" / f"rank{r}.json", tmp_path / f"rank{r}.json")
    # A copy of one trace (the same trace_id, here gzipped) is read once, with a note.
    with open(tmp_path / "rank0.json", "rb") as f, gzip.open(tmp_path / "rank0.json.gz", "wb") as g:
        g.write(f.read())
    p = profile_run(str(tmp_path))
    assert p.ranks == [0, 1]
    assert any("rank0.json.gz is a copy of" in n and "read once" in n for n in p.notes)
    # Another trace claiming rank 0 of the same steps: which is right cannot be told.
    data = json.loads((tmp_path / "rank1.json").read_text())
    data["distributedInfo"]["rank"], data["trace_id"] = 0, "another"
    (tmp_path / "other.json").write_text(json.dumps(data))
    with pytest.raises(DuplicateRankError) as e:
        profile_run(str(tmp_path))
    assert f"two traces claim rank 0 of one run: {tmp_path / 'other.json'} and {tmp_path / 'rank0.json'}" \
        in str(e.value) or f"{tmp_path / 'rank0.json'} and {tmp_path / 'other.json'}" in str(e.value)


def test_npu_ranks_claimed_twice_and_a_damaged_profiler_info(tmp_path):
    _npu_trace(tmp_path / "dup", 0, compute=[(0, 600)], comm=[(500, 900)])
    _npu_trace(tmp_path / "dup" / "again", 0, compute=[(0, 300)], comm=[(200, 900)])
    with pytest.raises(DuplicateRankError,
                       match=r"rank 0 of one run: .*trace_view.json and .*trace_view.json"):
        profile_run(str(tmp_path / "dup"))
    _npu_trace(tmp_path / "npu", 0, compute=[(0, 600)], comm=[(500, 900)])
    _npu_trace(tmp_path / "npu", 1, compute=[(0, 300)], comm=[(200, 900)])
    info = tmp_path / "npu" / "node_1_ascend_pt" / "profiler_info_1.json"
    info.write_text('{"rank_id": 1, "config": {')
    p = profile_run(str(tmp_path / "npu"))
    assert p.ranks == [0, 1]
    view = tmp_path / "npu" / "node_1_ascend_pt" / "ASCEND_PROFILER_OUTPUT" / "trace_view.json"
    assert any(str(info) in n and str(view) in n and "rank 1" in n for n in p.notes)


def test_kineto_traces_beside_torch_npu_exports_are_another_run_not_left_out(two_runs, tmp_path):
    """A folder holding torch_npu exports and a Kineto run (a GPU run to compare with): the Kineto
    traces used to be passed over unseen, and the NPU run analysed as the folder's only one."""
    _npu_trace(tmp_path, 0, compute=[(0, 600)], comm=[(500, 900)])
    _npu_trace(tmp_path, 1, compute=[(0, 300)], comm=[(200, 900)])
    (tmp_path / "gpu").mkdir()
    for r in (0, 1):
        shutil.copy(two_runs / "A" / f"rank{r}.json", tmp_path / "gpu" / f"rank{r}.json")
    listing = r"holds the traces of 2 runs: run 1: 2 rank\(s\), steps 1, in node_0_ascend_pt.*run 2: 2 of 2 "
    with pytest.raises(SeveralRunsError, match=listing + r"ranks, steps 1-2, .* in gpu"):
        profile_run(str(tmp_path))
    p = profile_run(str(tmp_path), run=2)
    assert p.files == {r: str(tmp_path / "gpu" / f"rank{r}.json") for r in (0, 1)}
    npu = profile_run(str(tmp_path), run=1)
    assert npu.ranks == [0, 1] and npu.device
    # torch_npu's own JSON files inside an export folder are not read as traces
    assert not any("skipped" in n for n in npu.notes)


def test_npu_world_size_from_profiler_metadata_names_a_missing_rank(tmp_path):
    _npu_trace(tmp_path, 0, compute=[(0, 600)], comm=[(500, 900)])
    (tmp_path / "node_0_ascend_pt" / "profiler_metadata.json").write_text(json.dumps(
        {"parallel_group_info": {"group_name_0": {"group_name": "default_group", "group_rank": 0,
                                                  "global_ranks": [0, 1, 2, 3]}}}))
    p = profile_run(str(tmp_path))
    assert p.world_size == 4 and p.missing_ranks == [1, 2, 3]


def test_npu_ranks_of_two_runs_at_the_same_time_are_told_apart_where_the_world_is_the_only_group(tmp_path):
    """torch_npu's export records no host and no group per HCCL operation; where profiler_metadata.json
    lists the world as the only group, its collectives must meet under one clock offset."""
    groups = {"group_name_0": {"group_name": "default_group", "group_rank": 0, "global_ranks": [0, 1]}}
    for name, second in (("one", (5000, 5200)), ("two", (8000, 8100))):
        _npu_trace(tmp_path / name, 0, compute=[(0, 600)], comm=[(100, 200), (5000, 5100)])
        _npu_trace(tmp_path / name, 1, compute=[(0, 300)], comm=[(150, 250), second])
        for r in (0, 1):
            (tmp_path / name / f"node_{r}_ascend_pt" / "profiler_metadata.json").write_text(
                json.dumps({"parallel_group_info": groups}))
    assert profile_run(str(tmp_path / "one")).ranks == [0, 1]
    with pytest.raises(SeveralRunsError, match=r"run 2 is not the run it overlaps in time: all_reduce #2 "
                                               r"ended on rank 0 .* 2\.9 ms before it began on rank 1 .* "
                                               r"each on its host's clock"):
        profile_run(str(tmp_path / "two"))


def _trace(events, **meta):
    return {"schemaVersion": 1, **meta, "traceEvents": events}


STEP = {"ph": "X", "name": "ProfilerStep#1", "cat": "user_annotation", "pid": 1, "tid": 1, "ts": 0,
        "dur": 100}


@pytest.mark.parametrize("event", [
    {"ph": "X", "name": 7, "cat": "cpu_op", "pid": 1, "tid": 1, "ts": 10, "dur": 5},
    {"ph": "X", "name": "aten::mm", "cat": 3, "pid": 1, "tid": [1], "ts": 10, "dur": 5, "args": "x"},
])
def test_odd_event_fields_are_read_not_a_traceback(tmp_path, capsys, event):
    (tmp_path / "rank0.json").write_text(json.dumps(_trace([STEP, event])))
    code, out, _ = run_cli(["profile", str(tmp_path)], capsys)
    assert code == 0 and "1 ranks, 1 steps" in out


@pytest.mark.parametrize("field, text", [("ts", "NaN"), ("dur", "Infinity"), ("ts", '"nan"')])
def test_a_time_that_is_not_a_finite_number_names_the_event(tmp_path, capsys, field, text):
    """json.load reads NaN / Infinity: a step or operator with such a time used to be reported as a
    'nan' step or silently left out of the sums."""
    op = {"ph": "X", "name": "aten::mm", "cat": "cpu_op", "pid": 1, "tid": 1, "ts": 10, "dur": 5}
    body = json.dumps(_trace([STEP, op])).replace(f'"{field}": {op[field]}', f'"{field}": {text}')
    (tmp_path / "rank0.json").write_text(body)
    code, out, err = run_cli(["profile", str(tmp_path)], capsys)
    assert code == 2 and out == ""
    assert f"{tmp_path / 'rank0.json'}: a damaged profiler trace (event 1 'aten::mm' has ts " in err
    assert "not a finite number" in err


def test_steps_of_zero_length_give_no_share_not_a_traceback(tmp_path, capsys):
    """Every ProfilerStep#N closed as it opened: the mean step is 0 s, and each verdict row's share of
    it used to be a ZeroDivisionError."""
    step = dict(STEP, dur=0)
    op = {"ph": "X", "name": "aten::mm", "cat": "cpu_op", "pid": 1, "tid": 1, "ts": 0, "dur": 0}
    (tmp_path / "rank0.json").write_text(json.dumps(_trace([step, op])))
    code, out, _ = run_cli(["profile", str(tmp_path)], capsys)
    assert code == 0 and "mean step 0.0 ms" in out
    assert "       -      0.00 ms  stragglers (unequal work per rank)" in out
    code, out, _ = run_cli(["profile", str(tmp_path), "--json"], capsys)
    assert code == 0 and all(row["share"] is None for row in json.loads(out)["verdict"])


def test_deeply_nested_json_and_bad_ranks_name_the_file(tmp_path, capsys):
    deep = tmp_path / "deep"
    deep.mkdir()
    (deep / "rank0.json").write_text('{"traceEvents": [' + "[" * 200_000 + "]" * 200_000 + "]}")
    code, _, err = run_cli(["profile", str(deep)], capsys)
    assert code == 2 and err.count("\n") == 1
    assert f"{deep / 'rank0.json'}: a damaged profiler trace (its JSON is nested deeper" in err
    for rank, message in (("a", "distributedInfo.rank is 'a', not an integer"),
                          (-2, "distributedInfo.rank is -2, not an integer >= 0"),
                          (5, "rank 5 is outside its recorded world size 2")):
        bad = tmp_path / f"bad{rank}"
        bad.mkdir()
        info = {"rank": rank, "world_size": 2}
        (bad / "t.json").write_text(json.dumps(_trace([STEP], distributedInfo=info)))
        code, _, err = run_cli(["profile", str(bad)], capsys)
        assert code == 2 and err == f"tokenbal profile: error: {bad / 't.json'}: {message}\n"


def _single_process(path, base_ns, trace_id):
    # What a profiled script without torch.distributed writes: no distributedInfo, so no rank.
    mm = {**STEP, "name": "aten::mm", "cat": "cpu_op", "ts": 10, "dur": 50}
    path.write_text(json.dumps(_trace([STEP, mm], baseTimeNanoseconds=base_ns, trace_id=trace_id)))


def test_a_trace_naming_no_rank_is_rank_0_alone_in_its_run_whatever_else_is_in_the_folder(tmp_path):
    # Beside files that are not traces (a config, an empty metrics list) it is still the run's only trace.
    alone = tmp_path / "alone"
    alone.mkdir()
    _single_process(alone / "before.json", 1_700_000_000_000_000_000, "a")
    (alone / "config.json").write_text(json.dumps({"lr": 1e-4}))
    (alone / "metrics.json").write_text("[]")
    p = profile_run(str(alone))
    assert p.ranks == [0]
    assert any("config.json: JSON, but not a profiler trace" in n for n in p.notes)
    assert any("metrics.json: JSON, but not a profiler trace" in n for n in p.notes)
    assert any("before.json names no rank and is alone in its run: read as rank 0" in n for n in p.notes)
    # Two single-process runs, one after the other: two runs, listed, either one analysed on request.
    _single_process(alone / "after.json", 1_700_000_100_000_000_000, "b")
    with pytest.raises(SeveralRunsError, match=r"holds the traces of 2 runs"):
        profile_run(str(alone))
    assert profile_run(str(alone), run=2).files == {0: str(alone / "after.json")}
    # Two traces without ranks taken in the same steps: which rank each was is unknown.
    _single_process(alone / "beside.json", 1_700_000_100_000_000_000, "c")
    with pytest.raises(ValueError, match=r"the trace names no rank .* was taken in the same steps"):
        profile_run(str(alone))


def test_a_folder_with_compare_is_a_usage_error(tmp_path, capsys):
    code, _, err = run_cli(["profile", str(tmp_path), "--compare", str(tmp_path), str(tmp_path)], capsys)
    assert code == 2
    assert f"tokenbal profile: error: give a trace folder or --compare A B, not both ({tmp_path}" in err


def test_traces_are_read_one_rank_at_a_time(two_runs, monkeypatch):
    """Memory: while a trace is read, no other rank's events (nor its raw JSON) are alive."""
    live_traces: list[weakref.ref] = []
    live_json: list[weakref.ref] = []

    def alive(refs):
        return sum(r() is not None for r in refs)
    reads, real_read, real_to_trace = [], traces._read_json, traces._to_trace

    class Obj(dict):    # json.load's dict and list cannot be weakly referenced; these can
        pass

    class Arr(list):
        pass

    def counted_read(path):
        gc.collect()
        reads.append((path, alive(live_traces), alive(live_json)))
        data = real_read(path)
        data = Obj(data) if isinstance(data, dict) else Arr(data) if isinstance(data, list) else data
        if isinstance(data, Obj | Arr):
            live_json.append(weakref.ref(data))
        return data

    def counted_to_trace(*args, **kwargs):
        trace = real_to_trace(*args, **kwargs)
        live_traces.append(weakref.ref(trace))
        return trace

    monkeypatch.setattr(traces, "_read_json", counted_read)
    monkeypatch.setattr(traces, "_to_trace", counted_to_trace)
    p = profile_run(str(two_runs), run=1)
    assert p.ranks == [0, 1] and len(reads) == 4        # every file of both runs read once
    assert [(alive_traces, alive_json) for _, alive_traces, alive_json in reads] == [(0, 0)] * 4
