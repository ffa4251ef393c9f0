"""A rank the sampler gives no sample (fewer samples than ranks, or a token budget) still trains:
``PackedCollator(...)([])`` is a dummy row with no loss token, the packed model runs forward and
backward on it (loss 0, zero gradients, every FSDP collective issued), and the step equals
training on the other ranks' samples alone."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from transformers import Qwen2VLForConditionalGeneration  # noqa: E402

from collate import PackedCollator  # noqa: E402
from collate.models import enable_packed  # noqa: E402
from tests.helpers.tiny_qwen2_vl import IMG, tiny_config  # noqa: E402


def test_empty_list_is_a_dummy_row_the_packed_model_trains_on_with_zero_loss():
    torch.manual_seed(0)
    config = tiny_config()
    model = enable_packed(Qwen2VLForConditionalGeneration(config).float())
    batch = PackedCollator.from_config(config)([])
    assert batch.num_loss_tokens == 0 and batch.seq_lens == [1] and batch.cu_seqlens_list == [1]
    assert batch.input_ids.shape == (1, 1) and batch.labels.tolist() == [[-100]]
    assert batch.input_ids[0, 0] != IMG and batch.pixel_values is None
    out = model(**batch)
    assert out.loss.item() == 0.0            # not HF's NaN mean over zero tokens
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    # Every parameter, vision tower included (its idle image), gets a gradient: under FSDP each
    # one's reduce-scatter is issued, as on the ranks with data.
    assert all(g is not None for g in grads.values()), [n for n, g in grads.items() if g is None]
    assert any(n.startswith("model.visual.") for n in grads)
    assert all(torch.count_nonzero(g) == 0 for g in grads.values())


def test_one_d_collator_dummy_row():
    batch = PackedCollator(rope="1d")([])
    assert batch.num_loss_tokens == 0 and batch.position_ids.tolist() == [[0]]


LR = 0.5


def _fsdp_rank(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    from collate.train import shard_qwen2_vl, train_step
    from tests.helpers.tiny_mix import make_samples
    from tests.helpers.tiny_mix import tiny_config as fsdp_config
    from tokenbal import TokenBalancedBatchSampler

    torch.manual_seed(0)
    config = fsdp_config()
    model = shard_qwen2_vl(enable_packed(Qwen2VLForConditionalGeneration(config).float()))
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    samples = make_samples(seed=1)[1:2]          # one sample (an image), two ranks
    sampler = TokenBalancedBatchSampler([len(s["input_ids"]) for s in samples], global_batch_size=2)
    steps = list(sampler)
    collate = PackedCollator.from_config(config)
    for indices in steps:
        train_step(model, optim, collate([samples[i] for i in indices]))
    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return {"steps": steps, "params": params}


def test_fsdp2_rank_without_samples_joins_the_step_and_changes_nothing():
    from tests.helpers.dist_utils import run_ranks
    from tests.helpers.tiny_mix import make_samples
    from tests.helpers.tiny_mix import tiny_config as fsdp_config

    results = run_ranks(_fsdp_rank, 2, timeout=240, collective_timeout=60)
    assert sorted(len(r["steps"][0]) for r in results) == [0, 1], "one rank really had no sample"

    torch.manual_seed(0)
    config = fsdp_config()
    model = enable_packed(Qwen2VLForConditionalGeneration(config).float())
    initial = copy.deepcopy(model.state_dict())
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    model(**PackedCollator.from_config(config)(make_samples(seed=1)[1:2])).loss.backward()
    optim.step()
    moved = 0
    for name, p in model.named_parameters():
        for r in results:
            assert torch.isfinite(r["params"][name]).all(), name
            torch.testing.assert_close(r["params"][name], p.detach(), rtol=1e-5, atol=1e-6)
        moved += int(not torch.equal(p.detach(), initial[name]))
    assert moved > 20


def test_sampler_gives_an_empty_list_when_there_are_fewer_samples_than_ranks():
    from tokenbal import TokenBalancedBatchSampler

    per_rank = [list(TokenBalancedBatchSampler(np.array([5]), 2, r, global_batch_size=2)) for r in (0, 1)]
    assert sorted(map(len, (steps[0] for steps in per_rank))) == [0, 1]
