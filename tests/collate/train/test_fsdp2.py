"""Packed FSDP2 training equals unpacked single-process training.

1. One packed batch mixing text-only, image and video samples: loss and every gradient equal the
   token-weighted sum of per-sample unpadded transformers forwards (fp32, relative 1e-5).
2. Two gloo ranks, FSDP2, tokenbal's sampler, the global token-mean loss: after two SGD steps the
   parameters equal one process training on the union of the ranks' batches.
"""

from __future__ import annotations

import copy
import platform
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from transformers import Qwen2VLForConditionalGeneration  # noqa: E402

from collate import PackedCollator  # noqa: E402
from collate.models import enable_packed  # noqa: E402
from collate.positions import mrope_positions  # noqa: E402
from collate.train import FSDPSettings  # noqa: E402
from tests.helpers.grads import assert_grads_match  # noqa: E402
from tests.helpers.paths import REPO  # noqa: E402
from tests.helpers.tiny_mix import IMG, VID, VSTART, make_samples, tiny_config  # noqa: E402
from tokenbal.hf_compat import qwen2_vl_video_text_resume  # noqa: E402

ROOT = REPO


def unpacked_loss_sum(model, sample: dict, config) -> torch.Tensor:
    """transformers' own forward on one unpadded sample, times its loss-token count.

    Positions are passed explicitly (the per-sample reference ids, with the installed transformers'
    rule for text after a video, as ``PackedCollator.from_config`` picks it): the model patch is
    what this test checks (tests/collate/test_positions.py checks the positions against
    transformers' own ``get_rope_index``).
    """
    ids = sample["input_ids"]
    pos = mrope_positions(ids.numpy(), sample.get("image_grid_thw"), sample.get("video_grid_thw"),
                          image_token_id=IMG, video_token_id=VID, vision_start_token_id=VSTART,
                          spatial_merge_size=2,
                          video_text_resume=qwen2_vl_video_text_resume(config.model_type))
    kwargs = {k: v for k, v in sample.items() if k not in ("input_ids", "labels")}
    out = model(input_ids=ids[None], labels=sample["labels"][None],
                position_ids=torch.from_numpy(pos)[:, None, :], **kwargs)
    return out.loss * int((sample["labels"][1:] != -100).sum())


def test_packed_text_image_video_batch_equals_per_sample_transformers():
    torch.manual_seed(0)
    config = tiny_config()
    reference = Qwen2VLForConditionalGeneration(config).float()
    packed = enable_packed(copy.deepcopy(reference))
    samples = make_samples()
    batch = PackedCollator.from_config(config)(samples)

    want_sum = sum(unpacked_loss_sum(reference, s, config) for s in samples)
    want = want_sum / batch["num_loss_tokens"]
    want.backward()
    got = packed(**batch).loss
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    assert assert_grads_match(packed, reference) > 20
    assert dict(reference.named_parameters())["model.visual.patch_embed.proj.weight"].grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------
# 2 ranks vs 1 process


STEPS, GLOBAL_BATCH, LR = 2, 4, 0.5


def _plans(world_size: int) -> list[list[list[int]]]:
    """Per step, per rank: the sample indices tokenbal's sampler assigns."""
    from tokenbal.balance.sampler import TokenBalancedBatchSampler

    lengths = np.array([len(s["input_ids"]) for s in make_samples(seed=1) + make_samples(seed=2)])
    per_rank = [list(TokenBalancedBatchSampler(lengths, num_replicas=world_size, rank=r,
                                               global_batch_size=GLOBAL_BATCH, seed=0))
                for r in range(world_size)]
    return [[per_rank[r][step] for r in range(world_size)] for step in range(STEPS)]


def _fsdp_rank(rank: int, world_size: int, settings) -> dict[str, torch.Tensor]:
    from dataclasses import asdict

    from collate.train import shard_qwen2_vl, train_step

    torch.manual_seed(0)
    config = tiny_config()
    model = shard_qwen2_vl(enable_packed(Qwen2VLForConditionalGeneration(config).float()), **asdict(settings))
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    samples = make_samples(seed=1) + make_samples(seed=2)
    collate = PackedCollator.from_config(config)
    for step_plan in _plans(world_size):
        train_step(model, optim, collate([samples[i] for i in step_plan[rank]]))
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("settings", [
    FSDPSettings(),
    FSDPSettings(async_unshard=True, reshard_after_forward=False),
    FSDPSettings(async_reduce_scatter=True),
    FSDPSettings.for_device("cpu"),
], ids=["fsdp2-defaults", "async-unshard,no-reshard-after-forward", "async-reduce-scatter",
        "cpu-defaults"])
def test_two_fsdp2_ranks_with_tokenbal_equal_one_process_on_the_union(settings):
    from tests.helpers.dist_utils import run_ranks

    results = run_ranks(_fsdp_rank, 2, settings, timeout=240, collective_timeout=60)

    torch.manual_seed(0)
    config = tiny_config()
    model = enable_packed(Qwen2VLForConditionalGeneration(config).float())
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    samples = make_samples(seed=1) + make_samples(seed=2)
    collate = PackedCollator.from_config(config)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step_plan in _plans(2):
        union = [samples[i] for rank_share in step_plan for i in rank_share]
        model(**collate(union)).loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    moved = 0
    for name, p in model.named_parameters():
        for params in results:
            torch.testing.assert_close(params[name], p.detach(), rtol=1e-5, atol=1e-6)
        moved += int(not torch.equal(p.detach(), initial[name]))
    assert moved > 20  # the steps really trained (a no-op run would also "match")


def _async_reduce_scatter_rank(rank: int, world_size: int) -> dict:
    """Two backwards without zero_grad (gradient accumulation) on two copies of one model, FSDP2's
    blocking reduce-scatter vs AsyncReduceScatter; how many reduce-scatters each backward left in
    flight, and whether any was still pending when backward() returned."""
    import collate.train.fsdp as train

    issued: list = []  # the _InFlight that took each asynchronous reduce-scatter
    add = train._InFlight.add

    def counting_add(self, work, *buffers):
        issued.append(self)
        add(self, work, *buffers)

    train._InFlight.add = counting_add
    config = tiny_config()
    models = []
    for async_rs in (False, True):
        torch.manual_seed(0)
        models.append(train.shard_qwen2_vl(enable_packed(Qwen2VLForConditionalGeneration(config).float()),
                                           async_reduce_scatter=async_rs))
    collate = PackedCollator.from_config(config)
    in_flight_per_backward, pending_after = [], []
    for micro in range(2):
        batch = collate(make_samples(seed=10 * rank + micro))
        for model in models:
            before = len(issued)
            model(**batch).loss.backward()
            if model is models[1]:
                in_flight_per_backward.append(len(issued) - before)
                pending_after.append(sum(len(in_flight.pending) for in_flight in set(issued)))
    grads = [{n: p.grad.full_tensor() for n, p in m.named_parameters() if p.grad is not None} for m in models]
    return dict(in_flight=in_flight_per_backward, pending=pending_after, grads=grads)


def test_async_reduce_scatter_overlaps_backward_and_blocks_when_accumulating():
    from tests.helpers.dist_utils import run_ranks

    units = 2 + 2 + 1  # vision blocks, decoder layers, root
    for result in run_ranks(_async_reduce_scatter_rank, 2, timeout=240, collective_timeout=60):
        # First backward: every unit's reduce-scatter left in flight, all waited for by the end of
        # backward(). Second: gradients exist, FSDP2 adds to them at once, so it blocks instead.
        assert result["in_flight"] == [units, 0]
        assert result["pending"] == [0, 0]
        blocking, asynchronous = result["grads"]
        assert blocking.keys() == asynchronous.keys() and len(blocking) > 20
        for name, grad in blocking.items():
            torch.testing.assert_close(asynchronous[name], grad, rtol=0, atol=0, msg=name)


_ALLOCATOR_PROBE = """
import ctypes, ctypes.util, json, sys

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
if not hasattr(libc, "mallinfo2"):
    print("null")            # glibc < 2.33
    sys.exit(0)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
SIZE = 64 << 20   # above glibc's largest dynamic mmap threshold (32 MiB): mmapped by default

def probe():
    # One large block, as a step's activation: where it came from, and what freeing it kept.
    before = libc.mallinfo2()
    block = libc.malloc(SIZE)
    during = libc.mallinfo2()
    libc.free(block)
    after = libc.mallinfo2()
    return dict(mmapped=during.hblkhd - before.hblkhd, heap_in_use=during.uordblks - before.uordblks,
                heap_grew=during.arena - before.arena, trimmed=during.arena - after.arena,
                free_in_heap=after.fordblks, mmapped_after=after.hblkhd - before.hblkhd)

out = {"default": probe()}
from collate.train import keep_freed_memory
out["returned"] = keep_freed_memory()
out["keep"] = probe()
out["keep_again"] = probe()   # the kept block is reused: the heap does not grow a second time
print(json.dumps(out))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_keep_freed_memory_makes_glibc_keep_a_freed_large_block_in_its_heap():
    """What keep_freed_memory changes, read back from glibc itself (mallinfo2): a large block is
    served from the heap instead of mmap, and freeing it keeps it there for the next step, so the
    next step's allocation faults nothing in. Counts of bytes, not of time-like events."""
    import json

    proc = subprocess.run([sys.executable, "-c", _ALLOCATOR_PROBE], cwd=ROOT, text=True, capture_output=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if out is None:
        pytest.skip("glibc before 2.33 has no mallinfo2")
    size = 64 << 20
    default, keep, again = out["default"], out["keep"], out["keep_again"]
    # glibc's default: the block is mmapped and unmapped again on free (the next step faults it in).
    assert default["mmapped"] >= size and default["mmapped_after"] == 0 and default["heap_in_use"] < size
    assert out["returned"] is True
    # Kept: from the heap, and not trimmed away on free: it stays as free heap memory.
    assert keep["mmapped"] == 0 and keep["heap_in_use"] >= size
    assert keep["trimmed"] == 0 and keep["free_in_heap"] >= size
    # The next allocation of that size reuses it: the heap does not grow, nothing is mmapped.
    assert again["mmapped"] == 0 and again["heap_in_use"] >= size and again["heap_grew"] == 0
