"""A distributed step with a straggler and its ground truth, for `tokenbal profile`'s tests and
``scripts/bench_profile.py``: gloo ranks that each write down how long they worked between
collectives, traced with torch.profiler."""

import os
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, schedule

STEPS = 4                        # traced steps, after one warm-up step
BASE, EXTRA = 40, 400            # 64x64 matmuls before each all_reduce; the late rank's extra work
SLEEP_S = 0.05                   # how="sleep": the late rank sleeps this long instead


def trace_steps(path: str, step_fn, steps: int = STEPS, with_stack: bool = False) -> None:
    """Run ``step_fn`` once as the profiler's warm-up, then ``steps`` traced ProfilerStep#N steps."""
    plan = schedule(wait=0, warmup=1, active=steps, repeat=1)
    with profile(activities=[ProfilerActivity.CPU], schedule=plan,
                 with_stack=with_stack, record_shapes=True,
                 on_trace_ready=lambda p: p.export_chrome_trace(path)) as prof:
        for _ in range(steps + 1):
            step_fn()
            prof.step()


def matmuls(n: int, x: torch.Tensor) -> torch.Tensor:
    for _ in range(n):
        x = x @ x
        x = x / x.norm()
    return x


def late(pattern: str, rank: int, world_size: int, step: int) -> bool:
    """Whether ``rank`` is the straggler of ``step``: always the last rank, each rank in turn, or none."""
    return {"constant": rank == world_size - 1, "alternating": rank == step % world_size,
            "none": False}[pattern]


def straggler_rank(rank: int, world_size: int, out_dir: str, pattern: str, how: str,
                   steps: int = STEPS, on_warmup=None) -> dict[tuple[int, int], float]:
    """Each step: work, all_reduce, a little work, broadcast. The late rank does EXTRA more matmuls
    (how="work") or sleeps instead (how="sleep": late, with the same work). Returns, per (step,
    collective), the seconds this rank worked between resuming and the launch: the ground truth.
    ``on_warmup()`` is called at the start of the profiler's warm-up step (the profiler is running)."""
    x, y = torch.randn(64, 64), torch.randn(256)
    worked: dict[tuple[int, int], float] = {}
    step_no = [0]

    def step():
        s = step_no[0]
        if s == 0 and on_warmup is not None:
            on_warmup()
        t0 = time.perf_counter()
        matmuls(BASE, x)
        if late(pattern, rank, world_size, s):
            if how == "work":
                matmuls(EXTRA, x)
            else:
                time.sleep(SLEEP_S)
        worked[s, 0] = time.perf_counter() - t0
        dist.all_reduce(y)
        t1 = time.perf_counter()
        matmuls(4, x)
        worked[s, 1] = time.perf_counter() - t1
        dist.broadcast(y, src=0)
        step_no[0] += 1

    trace_steps(os.path.join(out_dir, f"rank{rank}.json"), step, steps)
    return worked


def concurrent_rank(rank: int, world_size: int, out_dir: str, pattern: str, how: str, steps: int,
                    ready_dir: str, runs: int, delay_s: float) -> dict[tuple[int, int], float]:
    """:func:`straggler_rank` for one of ``runs`` runs taken at the same time: in the profiler's
    warm-up step every rank of every run marks itself ready in ``ready_dir`` and waits for all of
    them, then this run goes on ``delay_s`` later, so the runs' profiled steps overlap whatever the
    load on the host (starting a profiler alone can take a second there)."""
    def wait_for_every_run():
        open(os.path.join(ready_dir, f"{os.getpid()}.ready"), "w").close()
        deadline = time.monotonic() + 120
        while len(os.listdir(ready_dir)) < runs * world_size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the other runs' ranks did not start: {os.listdir(ready_dir)}")
            time.sleep(0.005)
        time.sleep(delay_s)
    return straggler_rank(rank, world_size, out_dir, pattern, how, steps, on_warmup=wait_for_every_run)
