"""Global token-mean loss for data-parallel training on token-balanced, unevenly split steps.

With packing, ranks hold different numbers of loss tokens. Averaging per-rank mean losses (what
DDP/FSDP gradient averaging does by default) weights a token on a rank with few tokens more than
one on a busy rank. Dividing every rank's loss *sum* by the token count of the whole step makes
the gradient equal to that of the global batch processed in one piece.

Sequence parallelism (dp data-parallel groups x S ranks, :mod:`collate.sp`): the ranks of an SP
group hold disjoint slices of one packed row, and each slice's ``num_loss_tokens`` counts only
its own targets (:func:`collate.sp.shard_batch`). So the sum over *all* ranks (the default
group) counts every token of every data-parallel group exactly once, and with the world size as
the factor (FSDP2 over dp x sp averages over all ranks) the gradient is that of the global token
mean: rank r's loss sum reaches every parameter through the Ulysses all-to-alls, and the sum of
all ranks' gradients is the gradient of the sum of all loss sums. Summing over the data-parallel
group only would miss the SP peers' tokens; summing full-row counts over the world would count
each row S times.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class GlobalTokenCount:
    """The step's loss-token count summed over the ranks, its all-reduce issued ahead of the loss.

    Started before the forward (:meth:`start`), the all-reduce completes while the ranks compute,
    so the loss does not wait for the slowest rank to finish *its* forward: under FSDP2 on CPU,
    where collectives block, an all-reduce at the loss is a synchronisation point in the middle
    of every step.

    Under tensor / sequence parallelism the ranks of one TP/SP group hold the same packed batch,
    so the count is summed over the *data-parallel* ranks only: pass ``group=`` (the DP process
    group), ``device_mesh=`` (its DP dimension, see :mod:`tokenbal.parallel`) or ``layout=`` (a
    :class:`tokenbal.parallel.ParallelLayout` with its groups). ``world`` is the
    factor :func:`global_token_mean` multiplies by to undo the gradient average: the size of that
    group by default; pass ``grad_world_size=`` when the gradients are averaged over more ranks
    (FSDP over a flattened dp x sp mesh, each SP rank's ``loss_sum`` covering only its slice).
    """

    tensor: torch.Tensor
    work: dist.Work | None
    world: int

    @classmethod
    def start(cls, num_loss_tokens: int, device: torch.device | str | None = None,
              group: dist.ProcessGroup | None = None, *, device_mesh: object = None,
              grad_world_size: int | None = None, layout: object = None) -> GlobalTokenCount:
        """``device``: where the count lives; by default the group's own device (the CPU for gloo,
        the current GPU for an NCCL-only group, see :func:`tokenbal.parallel.collective_device`)."""
        if not (dist.is_available() and dist.is_initialized()):
            tensor = torch.tensor(float(num_loss_tokens), dtype=torch.float32, device=device or "cpu")
            return cls(tensor, None, 1 if grad_world_size is None else int(grad_world_size))
        from tokenbal.parallel import collective_device, dp_group_of

        if layout is not None:
            group = _layout_group(layout, group, device_mesh)
        if device_mesh is not None:
            group = dp_group_of(group, device_mesh)
        device = collective_device(group) if device is None else device
        tensor = torch.tensor(float(num_loss_tokens), dtype=torch.float32, device=device)
        world = dist.get_world_size(group) if grad_world_size is None else int(grad_world_size)
        return cls(tensor, dist.all_reduce(tensor, group=group, async_op=True), world)

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.tensor


def _layout_group(layout: object, group: object, device_mesh: object) -> dist.ProcessGroup | None:
    """The data-parallel group of a :class:`tokenbal.parallel.ParallelLayout` (None: the world, right
    only without sequence parallelism)."""
    if group is not None or device_mesh is not None:
        raise ValueError("give layout= or group= / device_mesh=, not both")
    if layout.dp_group is None and layout.sp_size > 1:
        raise ValueError(f"layout has SP groups of {layout.sp_size} but no process groups (it was made "
                         "from numbers): build it with ParallelLayout.init(...) or .from_mesh(mesh)")
    return layout.dp_group


def global_token_mean(loss_sum: torch.Tensor, num_loss_tokens: int | GlobalTokenCount,
                      group: dist.ProcessGroup | None = None, grads_are_averaged: bool = True, *,
                      device_mesh: object = None, grad_world_size: int | None = None,
                      layout: object = None) -> torch.Tensor:
    """``loss_sum / (loss tokens over all ranks)``, ready for ``.backward()`` under FSDP/DDP.

    ``loss_sum`` is this rank's summed token loss (``out.loss * batch.num_loss_tokens`` for a
    mean-reducing model). FSDP2 and DDP average gradients over ranks, so by default the result is
    multiplied by the world size to undo that average. The count is all-reduced as a tensor on
    ``loss_sum``'s device, so no value is read back to the host; pass a
    :class:`GlobalTokenCount` started before the forward to keep that all-reduce off the step's
    critical path. Without an initialised process group this is the single-process token mean.
    ``group`` / ``device_mesh`` / ``layout`` (a :class:`tokenbal.parallel.ParallelLayout`) /
    ``grad_world_size``: the data-parallel dimension under TP/SP, as in :class:`GlobalTokenCount`.
    """
    if not isinstance(num_loss_tokens, GlobalTokenCount):
        num_loss_tokens = GlobalTokenCount.start(num_loss_tokens, loss_sum.device, group,
                                                 device_mesh=device_mesh, grad_world_size=grad_world_size,
                                                 layout=layout)
    world = num_loss_tokens.world if grads_are_averaged else 1
    return loss_sum * world / num_loss_tokens.wait().clamp_min(1.0)
