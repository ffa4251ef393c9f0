"""The contract MindSpeed-MM's FSDP2 trainer relies on, with tokenbal's loader, in plain torch (no
MindSpeed install): 2 gloo ranks driven the way ``mindspeed_mm/fsdp/train`` drives its loader at
commit 57069cd55a8ab16d5affe379a2e2c5f0a4d962b9 (restated below from ``trainer.py``
``_validate_and_set_train_iters``, ``train_engine.py`` ``train`` / ``train_step`` / ``save`` / ``load``
and ``data/data_utils/utils.py`` ``build_iterations``). docs/integrations.md names what was run
against MindSpeed-MM's own files (scripts/mindspeed_mm_contract.py)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.dist_utils import run_ranks
from tokenbal.integrations.mindspeed_mm import build_dataloader

GLOBAL, MICRO, EPOCHS = 8, 2, 2           # dp 2 -> gradient_accumulation_steps 2
LENGTHS = np.random.default_rng(4).integers(10, 2000, 36)


def _cyclic(loader):
    # build_iterations(..., iterator_type="cyclic")
    while True:
        yield from loader


def _loader(rank, world):
    return build_dataloader(list(range(len(LENGTHS))), LENGTHS, global_batch_size=GLOBAL,
                            micro_batch_size=MICRO, dp_size=world, dp_rank=rank, collate_fn=list)


def _train(rank, world, start_state=None, start_iteration=0, save_at=()):
    loader = _loader(rank, world)
    # Trainer._validate_and_set_train_iters (drop_last): iters per epoch from len(loader) in samples
    iters_per_epoch = len(loader) // GLOBAL
    train_iters = EPOCHS * iters_per_epoch
    accum = GLOBAL // (MICRO * world)
    if start_state is not None:
        loader.load_state_dict(start_state)             # TrainEngine.load, before the first iteration
    it, iteration, steps, saved = _cyclic(loader), start_iteration, [], {}
    while iteration < train_iters:
        steps.append([next(it) for _ in range(accum)])  # train_step: one micro-batch per accumulation step
        iteration += 1
        if iteration in save_at:
            saved[iteration] = loader.state_dict()     # TrainEngine.save: extra_state["train_dataloader"]
    return {"iters_per_epoch": iters_per_epoch, "steps": steps, "saved": saved}


def _run(rank, world):
    full = _train(rank, world, save_at=(2, 5))
    mid = _train(rank, world, full["saved"][2], 2)
    edge = _train(rank, world, full["saved"][5], 5)
    return full, mid, edge


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_run, 2, timeout=180)


def test_steps_per_epoch_from_mindspeeds_formula_cover_every_sample_once(ranks):
    (full0, _, _), (full1, _, _) = ranks
    per_epoch = full0["iters_per_epoch"]
    # 36 samples, 8 per step: 4 full steps and one of the 4 left (every rank still gets one per micro-batch)
    assert per_epoch == 5
    assert len(full0["steps"]) == len(full1["steps"]) == EPOCHS * per_epoch
    for e in range(EPOCHS):
        rows = [i for full in (full0, full1) for step in full["steps"][e * per_epoch:(e + 1) * per_epoch]
                for micro in step for i in micro]
        assert sorted(rows) == list(range(len(LENGTHS)))
    assert full0["steps"][:per_epoch] != full0["steps"][per_epoch:]      # the next epoch's plan


def test_every_micro_batch_is_balanced_across_ranks(ranks):
    (full0, _, _), (full1, _, _) = ranks
    pairs = zip(full0["steps"], full1["steps"], strict=True)
    loads = [(LENGTHS[a].sum(), LENGTHS[b].sum()) for s0, s1 in pairs for a, b in zip(s0, s1, strict=True)]
    assert all(len(m) > 0 for s in full0["steps"] + full1["steps"] for m in s)
    ratio = np.mean([max(a, b) / ((a + b) / 2) for a, b in loads])
    assert ratio < 1.1, ratio


@pytest.mark.parametrize("which, done", [(1, 2), (2, 5)])       # mid-epoch; after epoch 0's last step
def test_resume_from_the_saved_loader_state(ranks, which, done):
    for full, *resumed in ranks:
        assert resumed[which - 1]["steps"] == full["steps"][done:]


def test_bad_batch_sizes_are_refused():
    with pytest.raises(ValueError, match="not micro_batch_size 2 x dp 2"):
        build_dataloader(list(range(10)), np.ones(10), global_batch_size=6, micro_batch_size=2, dp_size=2,
                         dp_rank=0)
    with pytest.raises(ValueError, match="9 lengths for a dataset of 10"):
        build_dataloader(list(range(10)), np.ones(9), global_batch_size=4, micro_batch_size=2, dp_size=2,
                         dp_rank=0)


def test_the_index_folder_may_be_a_path(tmp_path):
    from tests.tokenbal.integrations.test_verl_parts import _parquet_index

    index = _parquet_index(tmp_path)      # 7 rows
    for folder in (tmp_path / "index", str(tmp_path / "index")):
        loader = build_dataloader(list(range(7)), folder, global_batch_size=4, micro_batch_size=2,
                                  dp_size=2, dp_rank=0, collate_fn=list)
        assert list(loader.sampler_plan.lengths) == list(index.lengths)


def test_a_new_iterator_after_a_stop_near_the_end_continues_the_epoch_with_workers():
    # With DataLoader workers the sampler hands out the epoch's last batches before the loop receives
    # them: a new iter() after the loop stopped 2 batches short used to start the next epoch, and those
    # 2 batches were never trained.
    lengths = np.random.default_rng(0).integers(1, 500, 64)
    loader = build_dataloader(list(range(64)), lengths, global_batch_size=8, micro_batch_size=4, dp_size=1,
                              dp_rank=0, collate_fn=list, num_workers=2)
    sampler = loader.sampler_plan
    seen = []
    for n, batch in enumerate(iter(loader)):
        seen += batch
        if n + 1 == len(sampler) - 2:
            break
    assert sampler.cursor == len(sampler), "the workers had asked for the whole epoch"
    rest = iter(loader)
    seen += next(rest) + next(rest)
    assert sorted(seen) == list(range(64)) and sampler.epoch == 0
    assert next(rest, None) is None
    assert next(iter(loader)) and sampler.epoch == 1   # then the cyclic iterator's next epoch
