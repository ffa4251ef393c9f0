"""FSDP2 training pieces shared by ``scripts/train_fsdp2.py`` and ``tokenbal demo``.

- :func:`shard_qwen2_vl`: ``fully_shard`` per vision block and per decoder layer, then the root,
  with explicit layer prefetch (on Ascend, communication was hidden 6 % of the time without it
  versus 49 % with module-level buckets in one FSDP implementation; explicit prefetch closes that).
- :func:`train_step`: forward, global token-mean loss, backward, optimizer step.
- :func:`keep_freed_memory`: glibc keeps freed activations for the next step (CPU ranks), instead of
  page-faulting them in again every step.
- :func:`solo_compute_time`: a rank's own compute for a micro-batch, timed on an unsharded replica
  with no collective in it. Under FSDP every collective waits for the slowest rank, so the time a
  rank spends *computing* cannot be read off its own step; the replica gives it, and
  ``wait = step time - compute`` is then what the straggler costs that rank.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from collate.loss import GlobalTokenCount, global_token_mean


def _prefetch_chain(modules: Sequence[nn.Module], depth: int) -> None:
    """Forward: each module prefetches the next ``depth``; backward: the previous ``depth``
    (``depth < 0``: all of them)."""
    if depth == 0:
        return
    if depth < 0:
        depth = len(modules)
    for i, module in enumerate(modules):
        ahead = list(modules[i + 1:i + 1 + depth])
        behind = list(reversed(modules[max(0, i - depth):i]))
        if ahead:
            module.set_modules_to_forward_prefetch(ahead)
        if behind:
            module.set_modules_to_backward_prefetch(behind)


@dataclass(frozen=True)
class FSDPSettings:
    """How :func:`shard_qwen2_vl` overlaps FSDP2's collectives with compute."""

    prefetch_depth: int = 1  # layers whose all-gather is issued ahead (-1: all)
    async_unshard: bool = False
    async_reduce_scatter: bool = False
    reshard_after_forward: bool = True

    @classmethod
    def for_device(cls, device: torch.device | str) -> FSDPSettings:
        """FSDP2's own defaults on accelerators, whose streams overlap collectives with compute. On
        CPU gloo blocks the rank at every collective, so each would wait for the slowest rank:
        there every all-gather is issued at the first layer, asynchronously, gathered parameters
        stay until the backward (no second all-gather: the memory of the unsharded model, as DDP)
        and reduce-scatters are waited for at the end of the backward. On 2 CPU ranks that took a
        balanced step from 1.05-1.15x to 1.01-1.07x its compute (docs/BENCHMARKS.md, session 5)."""
        if torch.device(device).type == "cpu":
            return cls(prefetch_depth=-1, async_unshard=True, async_reduce_scatter=True,
                       reshard_after_forward=False)
        return cls()


def vision_blocks(model: nn.Module) -> list[nn.Module]:
    """The vision tower's repeated blocks (Qwen-VL ``visual.blocks``; the CLIP / SigLIP / InternViT
    encoder layers of LLaVA-NeXT, LLaVA-OneVision, InternVL), each an FSDP2 unit of its own."""
    inner = model.model
    if hasattr(inner, "visual"):
        return list(inner.visual.blocks)
    tower = getattr(inner, "vision_tower", None)
    tower = getattr(tower, "vision_model", tower)
    encoder = getattr(tower, "encoder", None)
    layers = getattr(encoder, "layers", None) or getattr(encoder, "layer", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__}: no vision blocks found (.model.visual.blocks or "
                        ".model.vision_tower.encoder.layers)")
    return list(layers)


def shard_qwen2_vl(model: nn.Module, prefetch_depth: int = 1, mesh=None, async_unshard: bool = False,
                   reshard_after_forward: bool = True, async_reduce_scatter: bool = False) -> nn.Module:
    """Apply FSDP2 to a transformers Qwen2-VL / Qwen2.5-VL / Qwen3-VL model (in place); returns it:
    every vision block and decoder layer its own unit, the rest (embeddings, patch embedding,
    mergers, head) in the root's.

    :meth:`FSDPSettings.for_device` picks the overlap settings below for a device.

    ``prefetch_depth``: how many of the next layers' all-gathers each layer issues (-1: all).

    ``async_unshard``: issue the all-gathers with ``async_op=True``. On accelerators FSDP2 overlaps
    them through its side streams either way; on CPU (gloo) there are no streams, so by default
    every all-gather, prefetched or not, blocks its rank until the peers arrive, and prefetch only
    reorders the waits. Asynchronous, a prefetched layer's all-gather runs on gloo's thread while
    the current layer computes, so a rank that is ahead no longer stops at every layer.

    ``reshard_after_forward=False`` keeps every layer's gathered parameters from its forward to its
    backward (ZeRO-2-like): one all-gather per layer and step instead of two, for the memory of
    the unsharded model.

    ``async_reduce_scatter``: each layer's gradient reduce-scatter runs on gloo's thread while the
    backward goes on, and the backward waits for all of them once, at its end
    (:class:`AsyncReduceScatter`). On CPU FSDP2 otherwise blocks every rank at every layer's
    reduce-scatter; accelerators get this overlap from FSDP2's reduce-scatter stream.
    """
    from torch.distributed.fsdp import fully_shard

    blocks = vision_blocks(model)
    layers = list(model.model.language_model.layers)
    for module in (*blocks, *layers):
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    # The vision tower runs before the language model, so one chain covers the whole forward.
    _prefetch_chain([*blocks, *layers], prefetch_depth)
    if async_unshard:
        model._set_unshard_async_op(True)  # FSDPModule's (private) switch; every submodule's groups
    if async_reduce_scatter:
        use_async_reduce_scatter(model)
    return model


class _InFlight:
    """Reduce-scatters issued during a backward that nobody has waited for yet."""

    def __init__(self) -> None:
        self.pending: list[tuple[dist.Work, tuple[torch.Tensor, ...]]] = []

    def add(self, work: dist.Work, *buffers: torch.Tensor) -> None:
        self.pending.append((work, buffers))  # the buffers live until the collective is done
        # One callback per collective, not per backward: a backward that raised never runs its
        # callbacks, and a flag saying "already queued" would then skip the next backward's wait.
        Variable._execution_engine.queue_callback(self.wait)

    def wait(self) -> None:
        pending, self.pending = self.pending, []
        for work, _ in pending:
            work.wait()


class AsyncReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter without the wait: the collective is issued with ``async_op=True``
    and the end of the backward waits for it (an autograd final callback, queued after FSDP2's
    own, so the root's reduce-scatter from that callback is waited for too).

    FSDP2 hands the output buffer to the sharded parameters as their gradient right after the
    call, so going asynchronous is only correct when nothing reads that buffer before the
    backward ends. It falls back to a blocking reduce-scatter when something would: a gradient
    already present (accumulation adds to it at once), a reduction dtype other than the
    parameters' (FSDP2 casts at once), or a SUM reduction (FSDP2 divides afterwards). Off the
    CPU it is FSDP2's plain reduce-scatter: there the reduce-scatter stream does the overlapping,
    and an un-waited asynchronous collective would escape that stream's ordering.
    """

    def __init__(self, params: Sequence[nn.Parameter], in_flight: _InFlight) -> None:
        self.params = list(params)
        self.in_flight = in_flight

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False) -> dist.Work | None:
        if output_tensor.device.type != "cpu":  # FSDP2's reduce-scatter stream already overlaps it
            return dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group,
                                              async_op=async_op)
        work = dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=True)
        read_at_once = (op == dist.ReduceOp.SUM
                        or any(p.grad is not None or p.dtype != output_tensor.dtype for p in self.params))
        if read_at_once:
            work.wait()
        else:
            self.in_flight.add(work, output_tensor, input_tensor)
        return None


def use_async_reduce_scatter(model: nn.Module) -> None:
    """Give every FSDP2 unit of ``model`` (``fully_shard`` already applied) an
    :class:`AsyncReduceScatter` sharing one wait at the end of each backward."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        raise ValueError("use_async_reduce_scatter needs a model with fully_shard applied")
    in_flight = _InFlight()
    for unit in units:
        inner = {id(p) for m in unit.modules() if m is not unit and isinstance(m, FSDPModule)
                 for p in m.parameters()}
        own = [p for p in unit.parameters() if id(p) not in inner]  # this unit's parameter group
        unit.set_custom_reduce_scatter(AsyncReduceScatter(own, in_flight))


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # mallopt parameters, glibc's <malloc.h>


def keep_freed_memory(trim_threshold: int = 2**31 - 1) -> bool:
    """Make glibc's malloc keep freed memory for reuse instead of handing it back to the kernel.

    A CPU training step allocates and frees the same few hundred MB of activations every step. By
    default glibc serves large blocks with ``mmap`` and unmaps them when freed, and trims its heap
    once the free top exceeds a threshold, so the next step page-faults that memory in again: the
    demo model's forward + backward on scripts/probe_fsdp_overhead.py's 16-image batch took 83k-166k
    minor faults per 6 steps. Here every block comes from the heap and up to ``trim_threshold``
    bytes of free heap are kept: 4k-7.5k faults (the heap's growth); on one core the step's median
    of 4 alternating runs fell from 0.92 to 0.87 s and its maxima from 0.96-1.17 to 0.90-1.00 s
    (docs/BENCHMARKS.md, session 6). What jemalloc or tcmalloc (the PyTorch CPU tuning guide's
    advice) do, without an ``LD_PRELOAD``. Process-wide, from the next allocation on; the price is
    that the process's resident memory stays at its peak.

    Returns False, changing nothing, where the C library has no ``mallopt`` (not glibc).
    """
    import ctypes
    import ctypes.util

    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, trim_threshold))


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW, fused where torch has the kernel (CPU, CUDA): one kernel per step instead of ~10 ops per
    (sharded) parameter, which on the demo model cost more than all of FSDP's all-gathers (≈ 40 vs
    3 ms per step on 2 CPU ranks, scripts/probe_fsdp_overhead.py)."""
    device = next(model.parameters()).device
    fused = True if device.type in ("cpu", "cuda") else None
    return torch.optim.AdamW(model.parameters(), lr=lr, fused=fused)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch) -> torch.Tensor:
    """One optimizer step on a packed batch with the global token-mean loss; returns the detached loss.

    The loss is not read back to the host here, so the step issues no synchronisation of its own;
    the global loss-token count's all-reduce is issued before the forward, so it is done by the
    time the loss needs it.
    """
    num_tokens = batch["num_loss_tokens"]
    total = GlobalTokenCount.start(num_tokens, batch["input_ids"].device)  # completes during the forward
    out = model(**batch)
    global_token_mean(out.loss * num_tokens, total).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return out.loss.detach()


def solo_compute_time(replica: nn.Module, batch) -> float:
    """Seconds this micro-batch's forward + backward take on an unsharded ``replica``."""
    return solo_stage_times(replica, batch)[0]


def solo_stage_times(replica: nn.Module, batch) -> tuple[float, float]:
    """(total, vision tower) seconds of this micro-batch's forward + backward on ``replica``.

    The vision part is timed with hooks: its forward from the tower's pre-hook to its output, its
    backward from the moment the gradient reaches the tower's output to the end of ``backward()``
    (the tower is the first module of the forward, so it is the last of the backward). Under FSDP
    every layer's all-gather synchronises the ranks, so the vision and the language stages each
    wait for their own slowest rank; these two numbers show that.
    """
    device = next(replica.parameters()).device
    visual = getattr(getattr(replica, "model", None), "visual", None)
    marks: dict[str, float] = {}
    handles = []
    if visual is not None:
        def before(module, args, kwargs):
            marks["vf0"] = _now(device)

        def after(module, args, kwargs, out):
            marks["vf1"] = _now(device)
            tensor = out.pooler_output if hasattr(out, "pooler_output") else out
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(lambda grad: marks.__setitem__("vb0", _now(device)))

        handles = [visual.register_forward_pre_hook(before, with_kwargs=True),
                   visual.register_forward_hook(after, with_kwargs=True)]
    try:
        _synchronize(device)
        t0 = time.perf_counter()
        replica(**batch).loss.backward()
        _synchronize(device)
        t1 = time.perf_counter()
    finally:
        for h in handles:
            h.remove()
    replica.zero_grad(set_to_none=True)
    vision = 0.0
    if "vf1" in marks:
        vision = marks["vf1"] - marks["vf0"] + (t1 - marks["vb0"] if "vb0" in marks else 0.0)
    return t1 - t0, vision


def calibration_batches(candidates: Sequence[int], num_batches: int, max_samples: int = 4, seed: int = 0
                        ) -> list[list[int]]:
    """``num_batches`` micro-batches of 1..``max_samples`` samples drawn from ``candidates``.

    Varying the batch size is what lets :meth:`tokenbal.cost.StageCostModel.fit` tell the
    per-sample cost from the per-batch constant.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    pool = np.asarray(candidates, np.int64)
    if not len(pool):
        raise ValueError("no samples to calibrate on")
    sizes = rng.integers(1, max_samples + 1, num_batches)
    return [sorted(rng.choice(pool, min(int(k), len(pool)), replace=False).tolist()) for k in sizes]


def profile_stage_costs(replica: nn.Module, collator, dataset, features, batches: Sequence[Sequence[int]],
                        repeats: int = 3):
    """Time each micro-batch of ``batches`` on ``replica`` (forward + backward, vision and language
    apart, median of ``repeats``). Returns ``(batch_features (B, 2, 3), batch_seconds (B, 2))`` for
    :meth:`tokenbal.cost.StageCostModel.fit`; ``features`` is :func:`tokenbal.cost.stage_features`
    of the dataset's index."""
    import numpy as np

    feats = np.zeros((len(batches), 2, 3))
    secs = np.zeros((len(batches), 2))
    for b, idx in enumerate(batches):
        batch = collator([dataset[i] for i in idx])
        if b == 0:
            solo_stage_times(replica, batch)    # warm-up: allocator, lazy initialisation
        times = np.array([solo_stage_times(replica, batch) for _ in range(repeats)])
        total, vision = np.median(times, 0)
        feats[b] = np.asarray(features)[list(idx)].sum(0)
        secs[b] = vision, total - vision
    return feats, secs


def _now(device: torch.device) -> float:
    _synchronize(device)
    return time.perf_counter()


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
    vision_s: float = float("nan")  # the vision tower's part of compute_s


def median_records(repeats: Sequence[Sequence[StepRecord]]) -> list[StepRecord]:
    """One record per (step, rank): the median step, compute and vision times over repeated epochs
    of the same batches (tokens, samples and loss from the first)."""
    import statistics

    by_key: dict[tuple[int, int], list[StepRecord]] = {}
    for records in repeats:
        for r in records:
            by_key.setdefault((r.step, r.rank), []).append(r)
    out = []
    for key in sorted(by_key):
        rs = by_key[key]
        if len({(r.tokens, r.samples) for r in rs}) > 1:
            raise ValueError(f"step {key[0]} rank {key[1]} got different batches in repeated epochs")
        out.append(replace(rs[0], step_s=statistics.median(r.step_s for r in rs),
                           compute_s=statistics.median(r.compute_s for r in rs),
                           vision_s=statistics.median(r.vision_s for r in rs)))
    return out


def summarise(records: Sequence[StepRecord]) -> dict:
    """Epoch time, straggler overhead and each rank's wait fraction from every rank's records."""
    import numpy as np

    ranks = sorted({r.rank for r in records})
    steps = sorted({r.step for r in records})
    grid = {(r.rank, r.step): r for r in records}
    step_s = np.array([[grid[q, s].step_s for s in steps] for q in ranks])
    compute = np.array([[grid[q, s].compute_s for s in steps] for q in ranks])
    tokens = np.array([[grid[q, s].tokens for s in steps] for q in ranks])
    vision = np.array([[grid[q, s].vision_s for s in steps] for q in ranks])
    step_time = step_s.max(0)  # a step ends when its slowest rank ends
    ideal = compute.mean(0)  # perfect balance: the step's total compute spread evenly
    # Under FSDP the vision tower and the language model each wait for their own slowest rank.
    stages = vision.max(0) + (compute - vision).max(0)
    return dict(
        steps=len(steps),
        epoch_s=float(step_time.sum()),
        ideal_s=float(ideal.sum()),
        slowest_s=float(compute.max(0).sum()),
        stages_s=float(stages.sum()),
        step_over_ideal=float(step_time.sum() / ideal.sum()),
        token_max_over_mean=float(np.mean(tokens.max(0) / np.maximum(tokens.mean(0), 1e-9))),
        compute_s=compute.sum(1).tolist(),
        wait_fraction=(1.0 - compute.sum(1) / step_time.sum()).clip(0).tolist(),
    )
