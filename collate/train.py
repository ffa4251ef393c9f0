"""FSDP2 training pieces shared by ``scripts/train_fsdp2.py`` and ``tokenbal demo``.

- :func:`shard_qwen2_vl`: ``fully_shard`` per vision block and per decoder layer, then the root,
  with explicit layer prefetch (on Ascend, communication was hidden 6 % of the time without it
  versus 49 % with module-level buckets in one FSDP implementation; explicit prefetch closes that).
- :func:`train_step`: forward, global token-mean loss, backward, optimizer step.
- :func:`solo_compute_time`: a rank's own compute for a micro-batch, timed on an unsharded replica
  with no collective in it. Under FSDP every collective waits for the slowest rank, so the time a
  rank spends *computing* cannot be read off its own step; the replica gives it, and
  ``wait = step time - compute`` is then what the straggler costs that rank.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from collate.loss import global_token_mean


def _prefetch_chain(modules: Sequence[nn.Module], depth: int) -> None:
    """Forward: each module prefetches the next ``depth``; backward: the previous ``depth``."""
    if depth <= 0:
        return
    for i, module in enumerate(modules):
        ahead = list(modules[i + 1:i + 1 + depth])
        behind = list(reversed(modules[max(0, i - depth):i]))
        if ahead:
            module.set_modules_to_forward_prefetch(ahead)
        if behind:
            module.set_modules_to_backward_prefetch(behind)


def shard_qwen2_vl(model: nn.Module, prefetch_depth: int = 1, mesh=None) -> nn.Module:
    """Apply FSDP2 to a transformers Qwen2-VL / Qwen2.5-VL model (in place); returns it."""
    from torch.distributed.fsdp import fully_shard

    blocks = list(model.model.visual.blocks)
    layers = list(model.model.language_model.layers)
    for module in (*blocks, *layers):
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # The vision tower runs before the language model, so one chain covers the whole forward.
    _prefetch_chain([*blocks, *layers], prefetch_depth)
    return model


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch) -> torch.Tensor:
    """One optimizer step on a packed batch with the global token-mean loss; returns the detached loss.

    The loss is not read back to the host here, so the step issues no synchronisation of its own.
    """
    out = model(**batch)
    num_tokens = batch["num_loss_tokens"]
    global_token_mean(out.loss * num_tokens, num_tokens).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return out.loss.detach()


def solo_compute_time(replica: nn.Module, batch) -> float:
    """Seconds this micro-batch's forward + backward take on an unsharded ``replica``."""
    device = next(replica.parameters()).device
    _synchronize(device)
    t0 = time.perf_counter()
    replica(**batch).loss.backward()
    _synchronize(device)
    elapsed = time.perf_counter() - t0
    replica.zero_grad(set_to_none=True)
    return elapsed


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        getattr(torch, device.type).synchronize(device)


@dataclass(frozen=True)
class StepRecord:
    step: int
    rank: int
    samples: int
    tokens: int
    compute_s: float  # this rank's own compute (solo replica), or NaN when not measured
    step_s: float  # barrier to barrier: the same on every rank up to clock noise
    loss: float


def summarise(records: Sequence[StepRecord]) -> dict:
    """Epoch time, straggler overhead and each rank's wait fraction from every rank's records."""
    import numpy as np

    ranks = sorted({r.rank for r in records})
    steps = sorted({r.step for r in records})
    grid = {(r.rank, r.step): r for r in records}
    step_s = np.array([[grid[q, s].step_s for s in steps] for q in ranks])
    compute = np.array([[grid[q, s].compute_s for s in steps] for q in ranks])
    tokens = np.array([[grid[q, s].tokens for s in steps] for q in ranks])
    step_time = step_s.max(0)  # a step ends when its slowest rank ends
    ideal = compute.mean(0)  # perfect balance: the step's total compute spread evenly
    return dict(
        steps=len(steps),
        epoch_s=float(step_time.sum()),
        ideal_s=float(ideal.sum()),
        step_over_ideal=float(step_time.sum() / ideal.sum()),
        token_max_over_mean=float(np.mean(tokens.max(0) / np.maximum(tokens.mean(0), 1e-9))),
        compute_s=compute.sum(1).tolist(),
        wait_fraction=(1.0 - compute.sum(1) / step_time.sum()).clip(0).tolist(),
    )
