"""prepare_loader in raw accelerate loops on real gloo ranks: accelerate does not shard tokenbal's
per-rank batches a second time, epochs reach the sampler, and accelerator.save_state / load_state
in the middle of an epoch resumes, in a fresh process, at the first batch not yet trained."""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate")

from tests.helpers.dist_utils import run_ranks  # noqa: E402

N, WORLD, GBS = 24, 2, 4
STEPS = N // GBS                   # 6 per epoch
SAVE_AT, CRASH_AT, EPOCHS = 8, 10, 2


def _run(rank: int, world: int, ckpt: str, resume: bool, tiny_vl: bool, grad_accum: int) -> dict:
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from collate.train.tiny import TinyVLDataset, pad_collate
    from tokenbal import TokenBalancedBatchSampler
    from tokenbal.integrations.accelerate import prepare_loader

    ds = TinyVLDataset(N)
    from accelerate.utils import DistributedDataParallelKwargs

    # a rank whose batch has no image leaves the vision tower without gradients this step
    acc = Accelerator(cpu=True, gradient_accumulation_steps=grad_accum,
                      kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
    if tiny_vl:
        from collate.train.tiny import tiny_qwen2_vl

        model = tiny_qwen2_vl()
    else:
        torch.manual_seed(0)
        model = torch.nn.Embedding(128, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    sampler = TokenBalancedBatchSampler(ds.lengths(), global_batch_size=GBS,
                                        grad_accum=grad_accum, seed=3)
    loader = prepare_loader(acc, DataLoader(ds, batch_sampler=sampler, collate_fn=pad_collate))
    model, opt = acc.prepare(model, opt)
    if resume:
        acc.load_state(ckpt)
    seen = []
    done = loader.epoch * len(loader) + loader.batches_received   # batches trained before this run
    for epoch in range(loader.epoch, EPOCHS):
        for batch in loader:
            idx = batch.pop("sample_idx").tolist()
            with acc.accumulate(model):
                if tiny_vl:
                    loss = model(**batch).loss
                else:
                    loss = model(batch["input_ids"]).sum() / batch["input_ids"].numel()
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
            seen.append((epoch, idx))
            done += 1
            if not resume and done == SAVE_AT * grad_accum:
                acc.save_state(ckpt)
            if not resume and done == CRASH_AT * grad_accum:
                return {"seen": seen, "len": len(loader), "crashed": True}
    return {"seen": seen, "len": len(loader), "crashed": False}


def _check(tmp_path, tiny_vl: bool, grad_accum: int) -> None:
    ckpt = str(tmp_path / "ckpt")
    first = run_ranks(_run, WORLD, ckpt, False, tiny_vl, grad_accum, timeout=300)
    resumed = run_ranks(_run, WORLD, ckpt, True, tiny_vl, grad_accum, timeout=300)
    k = grad_accum
    assert [r["len"] for r in first] == [STEPS * k] * WORLD        # every rank all of its own batches
    assert all(r["crashed"] for r in first) and not any(r["crashed"] for r in resumed)
    ep0 = [[i for e, b in r["seen"] if e == 0 for i in b] for r in first]
    assert [len([1 for e, _ in r["seen"] if e == 0]) for r in first] == [STEPS * k] * WORLD
    assert sorted(ep0[0] + ep0[1]) == list(range(N))              # exactly once across the ranks
    head = (SAVE_AT - STEPS) * k                                  # epoch-1 batches before the save
    ep1_before = [[i for b in [b for e, b in r["seen"] if e == 1][:head] for i in b] for r in first]
    ep1_after = [[i for e, b in r["seen"] if e == 1 for i in b] for r in resumed]
    assert [len([1 for e, _ in r["seen"] if e == 1]) for r in resumed] == [(2 * STEPS - SAVE_AT) * k] * WORLD
    assert sorted(sum(ep1_before + ep1_after, [])) == list(range(N))
    # the resumed run trains what the crashed one trained after its checkpoint, in the same order
    for r_first, r_res in zip(first, resumed, strict=True):
        lost = [b for e, b in r_first["seen"] if e == 1][head:]
        assert [b for e, b in r_res["seen"] if e == 1][:len(lost)] == lost
    # another order in epoch 1
    order = {e: [b for ep, b in first[0]["seen"] if ep == e][:head] for e in (0, 1)}
    assert order[0] != order[1]


@pytest.mark.slow   # two 2-rank launches: ~1-3 min on the loaded 2-core VM
def test_prepare_loader_exactly_once_and_resume(tmp_path):
    _check(tmp_path, tiny_vl=False, grad_accum=2)


@pytest.mark.slow
def test_prepare_loader_tiny_qwen2_vl(tmp_path):
    _check(tmp_path, tiny_vl=True, grad_accum=1)


def test_prepare_loader_rejects_other_loaders():
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from tokenbal.integrations.accelerate import prepare_loader

    with pytest.raises(TypeError, match="TokenBalancedBatchSampler"):
        prepare_loader(Accelerator(cpu=True), DataLoader(list(range(4)), batch_size=2))
    pytest.importorskip("torchdata")
    from accelerate.utils import DataLoaderConfiguration

    from tokenbal import TokenBalancedBatchSampler

    sampler = TokenBalancedBatchSampler([5, 6, 7, 8], 1, 0, global_batch_size=2)
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    with pytest.raises(ValueError, match="use_stateful_dataloader=True is not supported"):
        prepare_loader(acc, DataLoader(list(range(4)), batch_sampler=sampler, collate_fn=list))


def test_a_new_iteration_of_prepare_loaders_loader_after_a_break_misses_no_batch():
    # The reproduction: a real 2-worker DataLoader through prepare_loader, break after 10 batches
    # (an eval), iterate again. The sampler had run ahead by accelerate's look-ahead batch and the
    # workers' prefetch (5 batches, 20 of 200 samples were lost).
    import numpy as np
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from tokenbal import TokenBalancedBatchSampler
    from tokenbal.integrations.accelerate import prepare_loader

    lengths = np.random.default_rng(0).integers(10, 500, 200)
    sampler = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4, seed=1)
    loader = prepare_loader(Accelerator(cpu=True),
                            DataLoader(list(range(200)), batch_sampler=sampler, num_workers=2,
                                       collate_fn=list), register=False)
    seen = []
    for n, batch in enumerate(loader):
        seen += batch
        if n + 1 == 10:
            break
    assert sampler.cursor > 10 and sampler.state_dict()["cursor"] == loader.batches_received == 10
    seen += [i for batch in loader for i in batch]
    assert sorted(seen) == list(range(200))
    assert loader.epoch == 1, "the completed pass moves on to the next epoch"


def test_a_checkpoint_or_a_break_at_an_epochs_last_batch_moves_on_to_the_next_epoch(tmp_path):
    # save_state inside the loop at the epoch's last batch (the pass has not ended yet), then a new
    # process: the next epoch, not the finished one again; a break there, then a new pass: the same.
    import numpy as np
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from tokenbal import TokenBalancedBatchSampler
    from tokenbal.integrations.accelerate import prepare_loader

    lengths = np.random.default_rng(1).integers(10, 500, 12)

    def make():
        acc = Accelerator(cpu=True)
        sampler = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4, seed=2)
        return acc, prepare_loader(acc, DataLoader(list(range(12)), batch_sampler=sampler, collate_fn=list))

    acc, loader = make()
    epoch0 = []
    for batch in loader:
        epoch0.append(batch)
        if len(epoch0) == len(loader):
            acc.save_state(str(tmp_path / "ckpt"))
            break
    assert (loader.epoch, loader.batches_received) == (1, 0)
    epoch1 = list(loader)                                   # a new pass after the break: epoch 1
    assert sorted(i for b in epoch1 for i in b) == list(range(12)) and epoch1 != epoch0
    acc2, resumed = make()
    acc2.load_state(str(tmp_path / "ckpt"))
    assert (resumed.epoch, resumed.batches_received) == (1, 0)
    assert list(resumed) == epoch1
    resumed.set_epoch(0)                                    # the finished epoch asked for again: replayed
    assert list(resumed) == epoch0


@pytest.mark.parametrize("workers", [0, 2])
def test_load_state_inside_the_loop_goes_on_from_the_loaded_batch_dropping_those_in_flight(tmp_path, workers):
    # accelerator.load_state inside the loop (a rollback): the pass goes on from the loaded batch. The
    # batches fetched before the load (accelerate's look-ahead batch, the workers' prefetch) were counted
    # as loaded ones (trained 0-5, rolled back to 2, received 6 (in flight), 2 and 3, saved cursor 5
    # instead of 4, and a resume never trained batch 4); then they were trained but not counted; now the
    # pass drops them: the next batch after the load is the loaded one, as under sampler.track.
    import numpy as np
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from tokenbal import TokenBalancedBatchSampler
    from tokenbal.integrations.accelerate import prepare_loader

    lengths = np.random.default_rng(1).integers(10, 500, 80)
    full = list(TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4, seed=2))
    acc = Accelerator(cpu=True)
    sampler = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4, seed=2)
    kw = {"num_workers": workers, "prefetch_factor": 2} if workers else {}
    loader = prepare_loader(acc, DataLoader(list(range(80)), batch_sampler=sampler, collate_fn=list, **kw))
    trained, in_flight = [], None
    for n, batch in enumerate(loader):
        trained.append(full.index(batch))
        if n == 1:
            acc.save_state(str(tmp_path / "ckpt"))
        if n == 5:
            in_flight = sampler.cursor - 6
            acc.load_state(str(tmp_path / "ckpt"))
        if n == 7:
            state = loader.state_dict()
            break
    assert in_flight == (1 if workers == 0 else 1 + 2 * 2)
    assert trained == list(range(6)) + [2, 3] and state["cursor"] == 4
    fresh = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4, seed=2)
    fresh.load_state_dict(state)
    assert [full.index(b) for b in fresh] == list(range(4, len(full)))
    # a new pass after the break continues at the first loaded batch not received
    assert [full.index(b) for b in loader] == list(range(4, len(full)))


def test_load_state_of_another_epoch_inside_the_loop_continues_that_epoch(tmp_path):
    # The load ends the pass (the sampler's plan changed) after the look-ahead batch; the wrapper took the
    # pass's end for the end of the loaded epoch: state (1, 0), the next pass epoch 1 again, epoch 0's
    # rest never trained.
    import numpy as np
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from tokenbal import TokenBalancedBatchSampler
    from tokenbal.integrations.accelerate import prepare_loader

    lengths = np.random.default_rng(1).integers(10, 500, 40)

    def plan(epoch):
        s = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4, seed=2)
        s.set_epoch(epoch)
        return list(s)

    acc = Accelerator(cpu=True)
    sampler = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4, seed=2)
    loader = prepare_loader(acc, DataLoader(list(range(40)), batch_sampler=sampler, collate_fn=list))
    for n, _ in enumerate(loader):
        if n == 1:
            acc.save_state(str(tmp_path / "ckpt"))   # epoch 0 after 2 batches
            break
    loader.set_epoch(1)
    got = []
    for n, batch in enumerate(loader):
        got.append(batch)
        if n == 3:
            acc.load_state(str(tmp_path / "ckpt"))
    assert got == plan(1)[:4]                     # the look-ahead batch fetched before the load is dropped
    assert (loader.epoch, loader.batches_received) == (0, 2)
    assert list(loader) == plan(0)[2:]
    assert list(loader) == plan(1)


@pytest.mark.parametrize("workers", [0, 2])
def test_load_state_inside_the_loop_after_the_last_batch_was_fetched_goes_on_in_the_same_pass(workers):
    # A rollback late in the epoch, after the sampler had handed out its last batch (accelerate's
    # look-ahead, the workers' prefetch): the DataLoader had nothing more to ask for, the pass ended, and
    # the loop's set_epoch(1) dropped the rollback with a warning (workers=2, load of batch 2 after batch
    # 6: trained 0-6, then epoch 1; with num_workers=0 at batch 9 the same). The wrapper now goes on at the
    # loaded batch in the same pass, as num_workers=0 does in the middle of an epoch.
    import warnings

    import numpy as np
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from tokenbal import TokenBalancedBatchSampler
    from tokenbal.integrations.accelerate import prepare_loader

    lengths = np.random.default_rng(1).integers(10, 500, 40)
    full = list(TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4, seed=2))
    acc = Accelerator(cpu=True)
    kw = {"num_workers": workers, "prefetch_factor": 2} if workers else {}
    for load_at in (6, 9):
        sampler = TokenBalancedBatchSampler(lengths, 1, 0, global_batch_size=4, seed=2)
        plain = DataLoader(list(range(40)), batch_sampler=sampler, collate_fn=list, **kw)
        loader = prepare_loader(acc, plain, register=False)
        ckpt = loader.state_dict() | {"cursor": 2}
        trained = []
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for epoch in range(2):
                loader.set_epoch(epoch)
                for n, batch in enumerate(loader):
                    trained.append((epoch, full.index(batch) if epoch == 0 else None))
                    if epoch == 0 and n == load_at:
                        loader.load_state_dict(ckpt)
        first = [i for e, i in trained if e == 0]
        assert first == list(range(load_at + 1)) + list(range(2, len(full))), f"load at {load_at}"
        assert len(trained) - len(first) == len(full)
