import pytest
import torch
import torch.distributed as dist

from tests.helpers.dist_utils import run_ranks


def _sum_ranks(rank, world_size):
    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    return int(t)


def _fail_on_rank1(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()


def test_run_ranks_returns_each_rank_result():
    assert run_ranks(_sum_ranks, 2) == [3, 3]


def test_run_ranks_reports_a_failing_rank_instead_of_hanging():
    with pytest.raises(RuntimeError, match="boom on rank 1"):
        run_ranks(_fail_on_rank1, 2, timeout=60, collective_timeout=10)


def _crash_on_rank1(rank, world_size):
    if rank == 1:
        import faulthandler

        faulthandler._sigsegv()  # a native crash: no Python exception, no result file
    dist.barrier()


def test_run_ranks_shows_the_python_stacks_of_a_rank_that_crashed_natively():
    with pytest.raises(RuntimeError) as info:
        run_ranks(_crash_on_rank1, 2, timeout=60, collective_timeout=10)
    message = str(info.value)
    assert "rank 1 exited with code -11 and no result" in message
    assert "Fatal Python error: Segmentation fault" in message
    assert "_crash_on_rank1" in message  # the crashing frame is named


def _return_a_lock(rank, world_size):
    import threading

    dist.barrier()
    return {"rank": rank, "lock": threading.Lock()}


def test_run_ranks_names_a_result_that_cannot_be_sent_back():
    # Not an EOFError from a half-written result file: the rank and the reason are named.
    with pytest.raises(RuntimeError, match=r"rank 0 failed:\nrank 0 returned a value that cannot be "
                                           r"pickled.*_thread\.lock") as info:
        run_ranks(_return_a_lock, 2, timeout=60, collective_timeout=10)
    assert "rank 1 returned a value that cannot be pickled" in str(info.value)


def _fail_on_rank1_while_rank0_is_stuck(rank, world_size):
    import time

    if rank == 1:
        raise ValueError("boom on rank 1")
    time.sleep(300)   # stuck outside any collective (say, a data loader that never answers)


def test_a_rank_stuck_outside_a_collective_does_not_hide_another_ranks_failure():
    with pytest.raises(RuntimeError) as info:
        run_ranks(_fail_on_rank1_while_rank0_is_stuck, 2, timeout=30, collective_timeout=10)
    message = str(info.value)
    assert "rank 1 failed:" in message and "boom on rank 1" in message
    assert "1 of 2 ranks still running (ranks 0), killed" in message


def _sleep_after_writing_pid(rank, world_size, out_dir):
    import os
    import time

    with open(os.path.join(out_dir, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(90)


def test_an_interrupted_run_leaves_no_rank_behind(tmp_path):
    """SIGINT to the launching process alone (``kill -INT``, a scheduler): the ranks are killed and
    the process exits, instead of waiting at exit for ranks that go on running."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.helpers import paths

    code = ("import sys; from tests.tokenbal.test_launch import _sleep_after_writing_pid as f; "
            "from tokenbal.launch import run_ranks; run_ranks(f, 2, sys.argv[1], timeout=300)")
    env = {**os.environ, "PYTHONPATH": str(paths.REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    parent = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=str(paths.REPO), env=env,
                              stderr=subprocess.DEVNULL)
    pids = []
    try:
        for _ in range(1200):                    # the ranks have started (bounded: 120 s)
            if len(pids := sorted(tmp_path.glob("pid*"))) == 2:
                break
            time.sleep(0.1)
        assert len(pids) == 2, "the ranks did not start"
        pids = [int(p.read_text()) for p in pids]
        parent.send_signal(signal.SIGINT)
        parent.wait(45)                          # raises TimeoutExpired if it hangs at exit
    finally:
        parent.kill()
        for pid in pids:                         # never leave a rank behind, even when this fails
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for pid in pids:
        assert not _alive(pid), f"rank process {pid} outlived the interrupted run"


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:   # a zombie (exited, not yet reaped by its parent) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
