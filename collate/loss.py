"""Global token-mean loss for data-parallel training on token-balanced, unevenly split steps.

With packing, ranks hold different numbers of loss tokens. Averaging per-rank mean losses (what
DDP/FSDP gradient averaging does by default) weights a token on a rank with few tokens more than
one on a busy rank. Dividing every rank's loss *sum* by the token count of the whole step makes
the gradient equal to that of the global batch processed in one piece.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def global_token_mean(loss_sum: torch.Tensor, num_loss_tokens: int, group: dist.ProcessGroup | None = None,
                      grads_are_averaged: bool = True) -> torch.Tensor:
    """``loss_sum / (loss tokens over all ranks)``, ready for ``.backward()`` under FSDP/DDP.

    ``loss_sum`` is this rank's summed token loss (``out.loss * batch.num_loss_tokens`` for a
    mean-reducing model). FSDP2 and DDP average gradients over ranks, so by default the result is
    multiplied by the world size to undo that average. The count is all-reduced as a tensor on
    ``loss_sum``'s device, so no value is read back to the host. Without an initialised process
    group this is the single-process token mean.
    """
    count = torch.tensor(float(num_loss_tokens), dtype=torch.float32, device=loss_sum.device)
    world = 1
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(count, group=group)
        world = dist.get_world_size(group) if grads_are_averaged else 1
    return loss_sum * world / count.clamp_min(1.0)
