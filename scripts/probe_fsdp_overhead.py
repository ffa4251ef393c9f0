"""Fixed cost of one FSDP2 step of the demo's tiny Qwen2-VL on 2 local gloo ranks.

A 30-token text batch makes compute negligible, so what remains is FSDP2's own work (all-gathers,
reduce-scatters, the sharded optimizer step). Prints forward / backward / optimizer milliseconds per
rank for steps 2..5 (0 and 1 are warm-up).

    python scripts/probe_fsdp_overhead.py
"""

from __future__ import annotations

import time
import warnings

import torch
import torch.distributed as dist

from tokenbal.launch import run_ranks


def _rank(rank: int, world_size: int) -> dict[int, tuple[float, float, float]]:
    from collate import PackedCollator
    from collate.demo import build_model, tiny_qwen2_vl_config
    from collate.loss import global_token_mean
    from collate.models import enable_packed
    from collate.train import make_optimizer, shard_qwen2_vl

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    ids = {"<|image_pad|>": 3, "<|video_pad|>": 4, "<|vision_start|>": 1, "<|vision_end|>": 2}
    config = tiny_qwen2_vl_config(800, ids)
    model = shard_qwen2_vl(enable_packed(build_model(config, 0)))
    optim = make_optimizer(model, 1e-4)
    batch = PackedCollator.from_config(config)([{"input_ids": torch.arange(10, 40)}])
    times = {}
    for step in range(6):
        dist.barrier()
        t0 = time.perf_counter()
        out = model(**batch)
        t1 = time.perf_counter()
        global_token_mean(out.loss * batch.num_loss_tokens, batch.num_loss_tokens).backward()
        t2 = time.perf_counter()
        optim.step()
        optim.zero_grad()
        t3 = time.perf_counter()
        if step >= 2:
            times[step] = (t1 - t0, t2 - t1, t3 - t2)
    return times


if __name__ == "__main__":
    for rank, times in enumerate(run_ranks(_rank, 2, timeout=300)):
        ms = [tuple(round(x * 1e3, 1) for x in t) for t in times.values()]
        print(f"rank {rank}: (forward, backward, optimizer) ms per step: {ms}")
