"""What every packed-model test does with its transformers reference: the per-sample loss it is
compared with, the comparison of the two losses after backward, the recorded tower calls, and
FSDP2 sharding of the packed model."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn


def token_weighted_loss(model: nn.Module, samples: list[dict],
                        inputs: Callable[[dict], dict]) -> torch.Tensor:
    """Token-weighted mean of per-sample unpacked transformers losses (each sample alone,
    transformers computing positions; a sample's own first label is never a target: HF shifts).
    ``inputs(sample)``: the model's keyword arguments for one sample."""
    total, count = 0.0, 0
    for s in samples:
        n = int((s["labels"][1:] != -100).sum())
        total = total + model(**inputs(s)).loss * n
        count += n
    return total / count


def backward_and_compare(got: torch.Tensor, want: torch.Tensor) -> None:
    """Backward through the reference loss ``want`` and the packed loss ``got`` (each model gets
    its own gradients), then check the losses agree (relative 1e-5)."""
    want.backward()
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


@contextlib.contextmanager
def forward_calls(module: nn.Module, record: str = "output") -> Iterator[list]:
    """The outputs (``record="inputs"``: the positional inputs) of every forward of ``module``
    while the block runs; the hook is removed on exit."""
    calls: list = []
    inputs = record == "inputs"
    hook = module.register_forward_hook(lambda m, args, out: calls.append(args if inputs else out))
    try:
        yield calls
    finally:
        hook.remove()


def fully_shard_packed(packed: nn.Module, vision_blocks: Iterable[nn.Module] = ()) -> None:
    """FSDP2 units: each of ``vision_blocks``, each text layer, then the whole model."""
    from torch.distributed.fsdp import fully_shard

    for block in vision_blocks:
        fully_shard(block)
    for layer in packed.model.language_model.layers:
        fully_shard(layer)
    fully_shard(packed)


def assert_logits_match_per_sample(logits: torch.Tensor, batch, samples: list[dict], model: nn.Module,
                                   inputs: Callable[[dict], dict]) -> None:
    """Each sample's slice of the packed ``logits`` (1, T, vocab) equals ``model``'s unpacked logits of
    that sample alone (``inputs(sample)``: its keyword arguments), relative 1e-4."""
    starts = [0, *batch.cu_seqlens_list[:-1]]
    with torch.no_grad():
        for i, (s, start, end) in enumerate(zip(samples, starts, batch.cu_seqlens_list, strict=True)):
            want = model(**inputs(s)).logits[0]
            torch.testing.assert_close(logits[0, start:end], want, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, i=i: f"sample {i}: {m}")


def text_only_rank_grads(rank: int, world_size: int, reference: nn.Module, packed: nn.Module,
                         samples: list[dict], collate: Callable[[list[dict]], dict],
                         reference_loss: Callable[[nn.Module, list[dict]], torch.Tensor]) -> int:
    """One step of an FSDP2-sharded ``packed`` model where rank 0 gets the samples with images or
    videos and rank 1 only the text of all of them (its idle vision pass keeps the ranks' collectives
    paired); returns how many gradients equal the unsharded per-sample ``reference``'s (FSDP2
    averages the ranks' gradients)."""
    from tests.helpers.grads import assert_grads_match
    from tests.helpers.samples import text_only

    vision = [s for s in samples if "pixel_values" in s or "pixel_values_videos" in s]
    shares = [vision, text_only(samples)]
    packed(**collate(shares[rank])).loss.backward()
    want = sum(reference_loss(reference, share) for share in shares) / world_size
    want.backward()
    return assert_grads_match(packed, reference)
