"""Token-balanced Trainer loaders under tensor / context parallelism, on 4 real gloo ranks: a real
transformers ``Trainer`` and ``TokenBalancedTrainer`` whose accelerator holds a real accelerate
``ParallelismConfig`` and the device mesh it builds (``build_device_mesh``: dimension names, order and
flattened ``dp`` as on GPUs), each loader prepared by accelerate's own ``prepare_data_loader``.

accelerate refuses a ``ParallelismConfig`` on a CPU job at ``Accelerator`` init (``MULTI_CPU`` is not a
"multi device" type, accelerate 1.16 ``parallelism_config.py``:351-382 ``_validate_accelerator``), so the
config and its mesh are put into the accelerator's shared state after init, where
``Accelerator.__init__`` puts them on GPUs (``accelerator.py``:451-453). Everything downstream — the
Trainer's ``get_tp_size`` / ``get_cp_size``, accelerate's sharding of the Trainer's own loader and the
neutralised tokenbal loader — is the installed code.

For each layout, the peers of one TP / CP group get identical batches, the data-parallel ranks
disjoint ones covering the epoch exactly once, and tokenbal's split of the ranks is the one
accelerate gives the Trainer's own loader. DeepSpeed ALST / Ulysses ``sp_size`` > 1 and ``packed=True``
under TP / CP are refused by name, and a raw-accelerate ``prepare_loader`` whose sampler was planned
over the whole world is refused where accelerate's mesh shards over fewer ranks."""

from __future__ import annotations

from functools import partial

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("accelerate.parallelism_config")

from tests.helpers.dist_utils import run_ranks  # noqa: E402

N, WORLD = 16, 4
LAYOUTS = {   # ParallelismConfig sizes over 4 ranks -> data-parallel ranks
    "dp_shard2_tp2": ({"dp_shard_size": 2, "tp_size": 2}, 2),
    "dp_shard2_cp2": ({"dp_shard_size": 2, "cp_size": 2}, 2),
    "tp4": ({"tp_size": 4}, 1),
    "cp2_tp2": ({"cp_size": 2, "tp_size": 2}, 1),
    "hsdp2x2": ({"dp_replicate_size": 2, "dp_shard_size": 2}, 4),
}


def _split_of(loader, accelerator) -> tuple[int, int]:
    """How accelerate sharded a prepared loader: its BatchSamplerShard's (num_processes,
    process_index), or one data-parallel rank where it left the batch sampler unsharded."""
    shard = loader.batch_sampler
    if hasattr(shard, "num_processes"):
        return int(shard.num_processes), int(shard.process_index)
    return (1, 0) if accelerator.num_processes > 1 else (accelerator.num_processes, accelerator.process_index)


def _outcome(build, done: str) -> str:
    """``done`` when ``build()`` returns, else the text of the ``ValueError`` it raised."""
    try:
        build()
    except ValueError as e:
        return str(e)
    return done


def _on_rank(rank: int, world: int, out_dir: str) -> dict:
    from accelerate import ParallelismConfig
    from torch.utils.data import DataLoader
    from transformers import Trainer, TrainingArguments

    from collate.train.tiny import TinyVLDataset, pad_collate, tiny_qwen2_vl
    from tokenbal import TokenBalancedBatchSampler
    from tokenbal.integrations.accelerate import prepare_loader
    from tokenbal.integrations.hf import TokenBalancedTrainer

    ds = TinyVLDataset(N)
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=2, report_to=[], use_cpu=True,
                             remove_unused_columns=False, ddp_backend="gloo", disable_tqdm=True, seed=0,
                             dataloader_num_workers=0)
    model = tiny_qwen2_vl()
    own = Trainer(model=model, args=args, train_dataset=ds, data_collator=pad_collate)
    ours = TokenBalancedTrainer(model=model, args=args, train_dataset=ds, data_collator=pad_collate,
                                token_lengths=ds.lengths())
    packed = TokenBalancedTrainer(model=tiny_qwen2_vl(), args=args, train_dataset=ds, packed=True,
                                  max_tokens_per_rank=4096, token_lengths=ds.lengths())
    state = ours.accelerator.state
    out: dict = {}
    for name, (sizes, _) in LAYOUTS.items():
        config = ParallelismConfig(**sizes)
        state.parallelism_config, state.device_mesh = config, config.build_device_mesh("cpu")
        own_loader = own.get_train_dataloader()
        ours._tokenbal_sampler = None          # planned anew for this layout
        ours_loader = ours.get_train_dataloader()
        sampler = ours.tokenbal_sampler
        row = {"own_split": _split_of(own_loader, own.accelerator),
               "ours_split": (sampler.num_replicas, sampler.rank),
               "own": [b["sample_idx"].tolist() for b in own_loader],
               "ours": [b["sample_idx"].tolist() for b in ours_loader]}
        packed._tokenbal_sampler = None
        row["packed"] = _outcome(packed.get_train_dataloader, "built")
        # a raw accelerate loop whose sampler was planned over the whole world (its default)
        whole = DataLoader(ds, batch_sampler=TokenBalancedBatchSampler(ds.lengths(), global_batch_size=8),
                           collate_fn=pad_collate)
        row["whole_world"] = _outcome(partial(prepare_loader, ours.accelerator, whole, register=False),
                                      "prepared")
        dp_size, dp_rank = row["own_split"]
        right = DataLoader(ds, batch_sampler=TokenBalancedBatchSampler(
            ds.lengths(), global_batch_size=8, num_replicas=dp_size, rank=dp_rank), collate_fn=pad_collate)
        prepared = prepare_loader(ours.accelerator, right, register=False)
        row["right"] = [b["sample_idx"].tolist() for b in prepared]
        out[name] = row
    # DeepSpeed ALST / Ulysses sequence parallelism (not in accelerate 1.11): no mesh, the Trainer re-batches
    # the loader
    out["sp"] = None
    if "sp_size" in ParallelismConfig.__dataclass_fields__:
        config = ParallelismConfig(dp_shard_size=2, sp_size=2)
        state.parallelism_config, state.device_mesh = config, config.build_device_mesh("cpu")
        ours._tokenbal_sampler = None
        out["sp"] = _outcome(ours.get_train_dataloader, "built")
    state.parallelism_config, state.device_mesh = None, None
    return out


def _assert_split(batches_per_rank: list[list[list[int]]], dp_of: list[int], dp_size: int) -> None:
    """Ranks of one data-parallel rank got identical batches; the data-parallel ranks disjoint ones,
    every sample exactly once in the epoch; every rank the same number of steps."""
    assert len({len(b) for b in batches_per_rank}) == 1
    firsts = {}
    for r, batches in enumerate(batches_per_rank):
        firsts.setdefault(dp_of[r], batches)
        assert batches == firsts[dp_of[r]], f"rank {r} differs from its data-parallel peers ({dp_of[r]})"
    assert sorted(firsts) == list(range(dp_size))
    seen = [i for batches in firsts.values() for b in batches for i in b]
    assert sorted(seen) == list(range(N))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_on_rank, WORLD, str(tmp_path_factory.mktemp("par")), timeout=600)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_trainer_plans_over_the_data_parallel_ranks_of_accelerates_mesh(results, layout):
    _, dp_size = LAYOUTS[layout]
    rows = [r[layout] for r in results]
    # the split is accelerate's for the Trainer's own loader, which it gives TP / CP peers one batch by
    assert [row["ours_split"] for row in rows] == [row["own_split"] for row in rows]
    dp_of = [row["own_split"][1] for row in rows]
    assert {row["own_split"][0] for row in rows} == {dp_size}
    _assert_split([row["own"] for row in rows], dp_of, dp_size)      # the framework's own loader
    _assert_split([row["ours"] for row in rows], dp_of, dp_size)     # tokenbal's, the same grouping
    _assert_split([row["right"] for row in rows], dp_of, dp_size)    # raw accelerate, DP-planned sampler
    for row in rows:
        if dp_size < WORLD:
            assert "accelerate shards this loader over" in row["whole_world"]
            assert f"num_replicas={dp_size}, rank={row['own_split'][1]}" in row["whole_world"]
            assert f"planned for num_replicas={WORLD}" in row["whole_world"]
        else:
            assert row["whole_world"] == "prepared"
        if dp_size < WORLD:     # some tensor / context parallelism
            said = "tokenbal: packed=True is not supported under tensor / context"
            assert row["packed"].startswith(said), row["packed"]
        else:
            assert row["packed"] == "built"


def test_deepspeed_sequence_parallelism_is_refused(results):
    if results[0]["sp"] is None:
        pytest.skip("this accelerate's ParallelismConfig has no sp_size (accelerate 1.11 has none)")
    for r in results:
        said = "tokenbal: TrainingArguments.parallelism_config sp_size=2 (DeepSpeed ALST"
        assert r["sp"].startswith(said), r["sp"]
