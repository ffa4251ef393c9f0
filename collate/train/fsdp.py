"""FSDP2 sharding of the supported VLMs, and the overlap of its collectives with compute.

- :func:`shard_qwen2_vl`: ``fully_shard`` per vision block and per decoder layer, then the root,
  with explicit layer prefetch (on Ascend, communication was hidden 6 % of the time without it
  versus 49 % with module-level buckets in one FSDP implementation; explicit prefetch closes that).
- :class:`FSDPSettings`: the overlap settings per device (``for_device``).
- :class:`AsyncReduceScatter`: gradient reduce-scatters that overlap the backward on CPU (gloo).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

__all__ = ["AsyncReduceScatter", "FSDPSettings", "shard_qwen2_vl", "use_async_reduce_scatter",
           "vision_blocks"]


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
        balanced step from 1.05-1.15x to 1.01-1.07x its compute (docs/BENCHMARKS.md, section "no
        synchronisation inside the step on CPU ranks")."""
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
