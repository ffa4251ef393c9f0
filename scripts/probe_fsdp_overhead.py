"""What one FSDP2 step of the demo's tiny Qwen2-VL costs on 2 local gloo ranks beyond its compute.

Two probes, both with the *same* micro-batch on every rank (perfect balance, so no straggler):

* ``--batch tiny`` (default): a 30-token text batch makes compute negligible, so what remains is
  FSDP2's own work (all-gathers, reduce-scatters, the sharded optimizer step). Prints forward /
  backward / optimizer milliseconds per rank for steps 2..5 (0 and 1 are warm-up).
* ``--batch heavy``: a document-sized image (5,120 patches) plus 1,500 tokens of text, the demo's
  heaviest kind of micro-batch. Alternates the unsharded replica's forward + backward (the
  "compute" of scripts/train_fsdp2.py) with a full FSDP2 step, ``--repeats`` times, and prints the
  median step / compute: the floor of ``epoch / ideal`` on this machine even with perfect balance.
* ``--batch many``: as heavy, with 16 images of 8x12 to 32x40 patches and 100 text tokens each.

The FSDP2 settings default to FSDP2's own (layer prefetch 1, blocking collectives, reshard after
forward); ``--prefetch-depth -1 --async-unshard --async-reduce-scatter --no-reshard-after-forward``
is what scripts/train_fsdp2.py uses on CPU ranks (``collate.train.FSDPSettings.for_device``).

    python scripts/probe_fsdp_overhead.py [--batch heavy --repeats 9] [--ranks 1] [--no-reshard-after-forward]
        [--async-unshard --async-reduce-scatter --prefetch-depth -1]
"""

from __future__ import annotations

import argparse
import statistics
import warnings

import torch
import torch.distributed as dist
from harness import environment_line, measure

from tokenbal.launch import run_ranks

_IDS = {"<|image_pad|>": 3, "<|video_pad|>": 4, "<|vision_start|>": 1, "<|vision_end|>": 2}


def _batch(kind: str, config):
    from collate import PackedCollator

    collate = PackedCollator.from_config(config)
    if kind == "tiny":
        return collate([{"input_ids": torch.arange(10, 40)}])
    g = torch.Generator().manual_seed(0)
    if kind == "many":
        return collate([_image_sample(h, w, 100, g) for h, w in [(16, 20), (24, 32), (12, 12), (32, 40),
                                                                  (20, 28), (16, 16), (28, 36), (8, 12)] * 2])
    h, w = 64, 80                                     # patches; 1,280 image tokens after the 2x2 merge
    image = [_IDS["<|vision_start|>"]] + [_IDS["<|image_pad|>"]] * (h * w // 4) + [_IDS["<|vision_end|>"]]
    ids = torch.tensor(image + torch.randint(10, 800, (1500,), generator=g).tolist())
    labels = ids.clone()
    labels[: len(image)] = -100
    return collate([{"input_ids": ids, "labels": labels, "image_grid_thw": torch.tensor([[1, h, w]]),
                     "pixel_values": torch.randn(h * w, 3 * 2 * 14 * 14, generator=g)}])


def _image_sample(h: int, w: int, text: int, g: torch.Generator) -> dict:
    image = [_IDS["<|vision_start|>"]] + [_IDS["<|image_pad|>"]] * (h * w // 4) + [_IDS["<|vision_end|>"]]
    ids = torch.tensor(image + torch.randint(10, 800, (text,), generator=g).tolist())
    labels = ids.clone()
    labels[: len(image)] = -100
    return {"input_ids": ids, "labels": labels, "image_grid_thw": torch.tensor([[1, h, w]]),
            "pixel_values": torch.randn(h * w, 3 * 2 * 14 * 14, generator=g)}


def _rank(rank: int, world_size: int, kind: str, repeats: int, prefetch_depth: int, async_unshard: bool,
          reshard_after_forward: bool = True, async_reduce_scatter: bool = False,
          keep_freed: bool = False) -> list:
    from collate.loss import global_token_mean
    from collate.models import enable_packed
    from collate.train import keep_freed_memory, make_optimizer, shard_qwen2_vl, solo_compute_time, train_step
    from collate.train.builders import build_model, tiny_qwen2_vl_config

    if keep_freed:
        keep_freed_memory()

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    config = tiny_qwen2_vl_config(800, _IDS)
    model = shard_qwen2_vl(enable_packed(build_model(config, 0)), prefetch_depth, async_unshard=async_unshard,
                           reshard_after_forward=reshard_after_forward,
                           async_reduce_scatter=async_reduce_scatter)
    optim = make_optimizer(model, 1e-4)
    batch = _batch(kind, config)
    if kind != "tiny":
        solo = enable_packed(build_model(config, 0))
        solo_compute_time(solo, batch)
        train_step(model, optim, batch)
        return [_timed_alternation(model, optim, solo, batch) for _ in range(repeats)]
    times = []
    for step in range(6):
        dist.barrier()
        held: dict = {}

        def forward(held=held) -> None:
            held["out"] = model(**batch)

        def backward(held=held) -> None:
            global_token_mean(held["out"].loss * batch.num_loss_tokens, batch.num_loss_tokens).backward()

        def optimizer() -> None:
            optim.step()
            optim.zero_grad()

        # One timed call per phase, back to back: the step's own phases, not repeats.
        phases = tuple(measure(fn, repeats=1, warmup=0).wall[0] for fn in (forward, backward, optimizer))
        if step >= 2:
            times.append(phases)
    return times


def _timed_alternation(model, optim, solo, batch) -> tuple[float, float]:
    """(FSDP2 step, solo compute) seconds of one alternation, the ranks started together."""
    from collate.train import solo_compute_time, train_step

    dist.barrier()
    compute = solo_compute_time(solo, batch)
    dist.barrier()

    def step() -> None:
        train_step(model, optim, batch)
        dist.barrier()

    return measure(step, repeats=1, warmup=0).wall[0], compute


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", choices=["tiny", "heavy", "many"], default="tiny")
    ap.add_argument("--repeats", type=int, default=9, help="heavy: FSDP steps (each after a compute timing)")
    ap.add_argument("--prefetch-depth", type=int, default=1, help="FSDP2 layers prefetched ahead (0: off)")
    ap.add_argument("--async-unshard", action=argparse.BooleanOptionalAction, default=False,
                    help="all-gathers with async_op=True (collate.train.shard_qwen2_vl)")
    ap.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True,
                    help="FSDP2 frees gathered parameters after each layer's forward (its default)")
    ap.add_argument("--async-reduce-scatter", action=argparse.BooleanOptionalAction, default=False,
                    help="gradient reduce-scatters overlap the backward (collate.train.AsyncReduceScatter)")
    ap.add_argument("--keep-freed-memory", action=argparse.BooleanOptionalAction, default=False,
                    help="glibc keeps freed memory for reuse (collate.train.keep_freed_memory)")
    ap.add_argument("--ranks", type=int, default=2,
                    help="gloo ranks; 1 measures FSDP2's own cost without any cross-rank waiting")
    args = ap.parse_args()
    print(environment_line(ranks=args.ranks, batch=args.batch))
    results = run_ranks(_rank, args.ranks, args.batch, args.repeats, args.prefetch_depth, args.async_unshard,
                        args.reshard_after_forward, args.async_reduce_scatter, args.keep_freed_memory,
                        timeout=900, collective_timeout=600)
    if args.batch == "tiny":
        for rank, times in enumerate(results):
            ms = [tuple(round(x * 1e3, 1) for x in t) for t in times]
            print(f"rank {rank}: (forward, backward, optimizer) ms per step: {ms}")
        return
    steps = [max(r[i][0] for r in results) for i in range(args.repeats)]
    compute = [max(r[i][1] for r in results) for i in range(args.repeats)]
    ratios = [s / c for s, c in zip(steps, compute, strict=True)]
    print(f"identical heavy micro-batch on {args.ranks} rank(s), {args.repeats} alternations:")
    print(f"  compute (slower rank) median {statistics.median(compute):.3f} s, "
          f"FSDP2 step median {statistics.median(steps):.3f} s")
    print(f"  step / compute: median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
    # What scripts/train_fsdp2.py calls epoch / ideal: the step over the ranks' mean compute.
    mean_compute = [statistics.mean(r[i][1] for r in results) for i in range(args.repeats)]
    print(f"  step / mean compute (train_fsdp2's epoch/ideal for perfect balance): median "
          f"{statistics.median(s / c for s, c in zip(steps, mean_compute, strict=True)):.3f}")
    # The same micro-batch on both ranks: any max/mean above 1 is timing noise, which the
    # slowest-rank factor of scripts/train_fsdp2.py contains too.
    spread = [max(r[i][1] for r in results) / statistics.mean(r[i][1] for r in results)
              for i in range(args.repeats)]
    print(f"  compute max/mean over the ranks (identical work): mean {statistics.mean(spread):.3f}, "
          f"median {statistics.median(spread):.3f}")


if __name__ == "__main__":
    main()
