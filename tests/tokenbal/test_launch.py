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
