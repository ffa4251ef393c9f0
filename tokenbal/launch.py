"""Run a function on several local ranks, each in its own process, and fail fast.

This is for single-machine jobs that spawn their own ranks (``tokenbal demo``, the tests);
multi-node training uses torchrun. :func:`run_ranks` picks a free loopback port, spawns
``world_size`` processes, sets a timeout on every collective, and raises in the parent if any
rank fails or the whole run exceeds ``timeout`` seconds, so a bug fails fast instead of hanging.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _crash_report(out_dir: str, rank: int) -> str:
    try:
        with open(os.path.join(out_dir, f"rank{rank}.crash")) as f:
            stacks = f.read().strip()
    except OSError:
        return ""
    return f"; its Python stacks at the crash:\n{stacks}" if stacks else ""


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out_dir: str,
            collective_timeout: float, backend: str, threads: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import torch

    # A native crash (SIGSEGV, SIGABRT) leaves no result; the Python stacks of every thread at the
    # moment of the crash go to this file, which the parent shows in its error.
    crash_log = open(os.path.join(out_dir, f"rank{rank}.crash"), "w")  # noqa: SIM115 - open until exit
    faulthandler.enable(file=crash_log, all_threads=True)
    torch.set_num_threads(threads)
    result: dict[str, Any]
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective_timeout))
        try:
            result = {"ok": True, "value": fn(rank, world_size, *args)}
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        result = {"ok": False, "error": traceback.format_exc()}
    try:
        blob = pickle.dumps(result)
    except Exception as e:  # noqa: BLE001 - a value the parent cannot receive is this rank's failure
        blob = pickle.dumps({"ok": False, "error": f"rank {rank} returned a value that cannot be pickled "
                                                   f"back to the parent ({type(e).__name__}: {e}); return "
                                                   "plain data (numbers, strings, lists, dicts, tensors)"})
    # Written whole, then renamed: the parent never reads half a result.
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    with open(path + ".tmp", "wb") as f:
        f.write(blob)
    os.replace(path + ".tmp", path)


# After one rank fails, how long the others get to end on their own (a peer blocked in a collective
# with the failed rank usually errors out at once) before they are killed and the failure is reported.
FAILURE_GRACE_S = 5.0


def _outcome(out_dir: str, rank: int, proc: Any) -> tuple[bool, Any]:
    """(ok, value or failure text) of a rank whose process has ended."""
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    if not os.path.exists(path):
        return False, (f"rank {rank} exited with code {proc.exitcode} and no result"
                       + _crash_report(out_dir, rank))
    try:
        with open(path, "rb") as f:
            res = pickle.load(f)
    except Exception as e:  # noqa: BLE001 - e.g. a class the parent cannot import
        return False, f"rank {rank} returned a value the parent cannot unpickle ({type(e).__name__}: {e})"
    return (True, res["value"]) if res["ok"] else (False, f"rank {rank} failed:\n{res['error']}")


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0,
              collective_timeout: float = 60.0, backend: str = "gloo", threads: int = 1) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return each rank's result.

    ``fn`` must be importable (module level) and its return value picklable. Each rank runs
    ``threads`` intra-op threads, so ranks do not fight over the cores. When a rank fails, the others
    get ``FAILURE_GRACE_S`` seconds to end, then are killed: the error names every failed rank and
    every rank that was still running, and a rank stuck outside a collective (which no collective
    timeout ends) does not hide the failure behind a ``TimeoutError``.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.get_context("spawn")
        port = free_port()
        procs = [ctx.Process(target=_worker,
                             args=(r, world_size, port, fn, args, out_dir, collective_timeout,
                                   backend, threads))
                 for r in range(world_size)]
        outcomes: dict[int, tuple[bool, Any]] = {}
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout
            first_failure: float | None = None
            while True:
                for r, p in enumerate(procs):
                    if r not in outcomes and not p.is_alive():
                        p.join()
                        outcomes[r] = _outcome(out_dir, r, p)
                        if not outcomes[r][0] and first_failure is None:
                            first_failure = time.monotonic()
                if len(outcomes) == world_size:
                    break
                now = time.monotonic()
                if now >= deadline or (first_failure is not None and now >= first_failure + FAILURE_GRACE_S):
                    break
                time.sleep(0.05)
        finally:
            # However the wait ends, a KeyboardInterrupt (SIGINT to this process alone) or an error
            # here included, no rank outlives it: spawned ranks are not daemons, so one left alive
            # would also hold this process at exit until it ended on its own.
            for p in procs:
                if p.pid is not None and p.is_alive():
                    p.kill()
                    p.join()
        alive = [r for r in range(world_size) if r not in outcomes]   # killed above
        # Every failing rank is shown: the first one to raise is often not rank 0.
        failures = [text for r, (ok, text) in sorted(outcomes.items()) if not ok]
        if alive:
            still = (f"{len(alive)} of {world_size} ranks still running (ranks "
                     f"{', '.join(map(str, alive))}), killed")
            if not failures:
                raise TimeoutError(f"distributed run did not finish within {timeout:.0f}s ({still})")
            failures.append(f"{still} {FAILURE_GRACE_S:g}s after the first failure")
        if failures:
            raise RuntimeError("\n".join(failures))
        return [outcomes[r][1] for r in range(world_size)]
