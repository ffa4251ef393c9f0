"""tokenbal.integrations.verl without verl: the parts its SFT trainer and balance_batch are made of
(the collate reorder, the unequal-count gather on 2 gloo ranks, the index checks, the resume rule,
the RL cost and partition). verl itself runs them in frameworks/test_verl.py."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.dist_utils import run_ranks
from tokenbal.integrations import verl as tb_verl
from tokenbal.integrations._resume import EpochFollowingSampler


def test_importing_the_module_imports_no_framework():
    code = ("import sys, tokenbal.integrations.verl, tokenbal.integrations.veomni, "
            "tokenbal.integrations.torchtitan; print(sorted(m for m in "
            "('verl', 'veomni', 'torchtitan', 'transformers', 'hydra') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _verl_like_collate(batch):
    # what verl 0.9.1's collate_variable_batch does: each key's type is read from batch[0]
    keys = set().union(*(d.keys() for d in batch))
    return {k: "tensor" if isinstance(batch[0][k], torch.Tensor) else [d.get(k) for d in batch]
            for k in keys}


def test_text_only_item_first_no_longer_breaks_the_collate():
    text = {"input_ids": torch.ones(3)}
    image = {"input_ids": torch.ones(5), "multi_modal_inputs": {"pixel_values": torch.ones(4, 2)}}
    with pytest.raises(KeyError, match="multi_modal_inputs"):
        _verl_like_collate([text, image])
    out = tb_verl.FirstItemComplete(_verl_like_collate)([text, image, text])
    assert out["input_ids"] == "tensor"
    assert out["multi_modal_inputs"][0] is image["multi_modal_inputs"]
    assert out["multi_modal_inputs"][1:] == [None, None]


def test_no_item_has_every_key():
    a = {"input_ids": torch.ones(2), "image_meta": {"x": 1}}
    b = {"input_ids": torch.ones(2), "video_meta": {"y": 2}}
    first, second = tb_verl.complete_first([a, b])
    assert first["image_meta"] == {"x": 1} and first["video_meta"] is None and second is b
    with pytest.raises(ValueError, match="tensor key 'pixel'.*items \\[0\\]"):
        tb_verl.complete_first([{"input_ids": torch.ones(1), "m": 1}, {"pixel": torch.ones(1)}])


def _gather(rank, world, counts):
    lengths = torch.arange(counts[rank], dtype=torch.int64) + 100 * rank
    return tb_verl.gather_lengths(lengths)


def test_gather_lengths_with_unequal_counts_on_two_ranks():
    out = run_ranks(_gather, 2, [3, 1], timeout=120)
    assert out[0] == out[1] == [0, 1, 2, 100]


def _parquet_index(folder):
    """Two Parquet files of verl-style chat rows (4 + 3) and `tokenbal index build` of both."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.helpers import chat_processors as cp
    from tokenbal.cli import main
    from tokenbal.index.store import TokenIndex

    model = cp.save_folder(cp.processor(), folder / "model")
    for name, n in (("a", 4), ("b", 3)):
        rows = [{"messages": [{"role": "user", "content": "hi " * (i + 1)},
                              {"role": "assistant", "content": "the fox"}]} for i in range(n)]
        pq.write_table(pa.Table.from_pylist(rows), folder / f"{name}.parquet")
    main(["index", "build", str(folder / "a.parquet"), str(folder / "b.parquet"), "--processor", str(model),
          "--out", str(folder / "index"), "-q"])
    return TokenIndex.open(folder / "index")


def test_index_lengths_checks_rows_and_order(tmp_path):
    idx = _parquet_index(tmp_path)
    n = len(idx)
    assert tb_verl.index_lengths(idx, n, [str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")]) is idx
    with pytest.raises(ValueError, match="has 7 rows, verl's dataset 6"):
        tb_verl.index_lengths(idx, n - 1)
    with pytest.raises(ValueError, match="in the order"):
        tb_verl.index_lengths(idx, n, ["b.parquet", "a.parquet"])
    assert list(tb_verl.index_lengths(idx, 3, max_samples=3)) == list(idx.lengths[:3])
    with pytest.raises(ValueError, match="shuffle"):
        tb_verl.index_lengths(idx, 3, max_samples=3, shuffle=True)


def test_index_lengths_takes_files_of_one_name_in_different_folders(tmp_path):
    # verl's usual mix of datasets: data.train_files=[gsm8k/train.parquet, math/train.parquet]
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.helpers import chat_processors as cp
    from tokenbal.cli import main
    from tokenbal.index.store import TokenIndex

    model = cp.save_folder(cp.processor(), tmp_path / "model")
    files = []
    for name, n in (("gsm8k", 4), ("math", 3)):
        (tmp_path / name).mkdir()
        rows = [{"messages": [{"role": "user", "content": "hi " * (i + 1)},
                              {"role": "assistant", "content": "the fox"}]} for i in range(n)]
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / name / "train.parquet")
        files.append(str(tmp_path / name / "train.parquet"))
    main(["index", "build", *files, "--processor", str(model), "--out", str(tmp_path / "index"), "-q"])
    idx = TokenIndex.open(tmp_path / "index")
    assert tb_verl.index_lengths(idx, 7, files) is idx


def test_a_checkpoint_at_an_epochs_end_resumes_at_the_next_epoch():
    lengths = np.arange(1, 17)
    a = EpochFollowingSampler(lengths, num_replicas=2, rank=0, global_batch_size=4, verify=False)
    a.set_epoch(0)
    epoch0 = list(a)
    state = a.state_dict()            # epoch 0, cursor = end
    b = EpochFollowingSampler(lengths, num_replicas=2, rank=0, global_batch_size=4, verify=False)
    b.set_epoch(1)                    # the framework computed start_epoch = 1 from its global step
    b.load_state_dict(state)          # then its StatefulDataLoader restores at the first iteration
    c = EpochFollowingSampler(lengths, num_replicas=2, rank=0, global_batch_size=4, verify=False)
    c.set_epoch(1)
    assert list(b) == list(c) and len(list(c)) == len(epoch0) and list(c) != epoch0
    # mid-epoch: exactly the rest
    d = EpochFollowingSampler(lengths, num_replicas=2, rank=0, global_batch_size=4, verify=False)
    d.set_epoch(0)
    it = iter(d)
    next(it)
    e = EpochFollowingSampler(lengths, num_replicas=2, rank=0, global_batch_size=4, verify=False)
    e.set_epoch(0)
    e.load_state_dict(d.state_dict())
    assert list(e) == epoch0[1:]


def test_a_resume_on_another_world_size_says_what_the_framework_user_can_do():
    # verl / VeOmni / torchtitan expose no elastic=True: the refusal must not point at it
    lengths = np.arange(1, 17)
    saved = EpochFollowingSampler(lengths, num_replicas=2, rank=0, global_batch_size=4, verify=False)
    saved.set_epoch(0)
    next(iter(saved))
    resumed = EpochFollowingSampler(lengths, num_replicas=4, rank=0, global_batch_size=4, verify=False)
    resumed.framework = "verl"
    with pytest.raises(ValueError) as refused:
        resumed.load_state_dict(saved.state_dict())
    text = str(refused.value)
    assert "num_replicas: checkpoint has 2, this sampler has 4" in text
    assert "elastic" not in text
    assert "verl loader resumes only with the checkpoint's data-parallel size" in text


class _Batch:
    """The two fields of verl's DataProto that balance_batch reads."""

    def __init__(self, mask, mm):
        self.batch = {"attention_mask": mask}
        self.non_tensor_batch = {"multi_modal_inputs": np.array(mm, dtype=object)}


def test_sample_costs_count_the_vision_tower():
    from tokenbal.balance.cost import FlopsModel

    model = FlopsModel.qwen2_vl_7b()
    mask = torch.zeros(3, 600, dtype=torch.int64)
    mask[:, :500] = 1      # the same 500 tokens each
    grid = torch.tensor([[1, 20, 20]])     # 400 patches -> 100 tokens
    batch = _Batch(mask, [None, {"image_grid_thw": grid}, {"image_grid_thw": torch.cat([grid, grid])}])
    costs = tb_verl.sample_costs(batch, model)
    assert costs[0] == model.token_equivalents(np.array([500]))[0]
    assert costs[0] < costs[1] < costs[2]
    assert list(tb_verl.sample_costs(batch)) == [500, 500, 500]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 10_000), min_size=1, max_size=40), st.integers(1, 4))
def test_balanced_partitions_equal_counts(costs, dp):
    costs = costs[: len(costs) - len(costs) % dp] or [1] * dp
    parts = tb_verl.balanced_partitions(np.array(costs), dp)
    assert sorted(i for p in parts for i in p) == list(range(len(costs)))
    assert {len(p) for p in parts} == {len(costs) // dp}


def test_balanced_partitions_refuses_uneven_batches():
    with pytest.raises(ValueError, match="5 samples.*2 DP ranks"):
        tb_verl.balanced_partitions(np.ones(5), 2)


def test_veomni_steps_batch_size_gives_veomnis_step_count():
    from tokenbal.balance.sampler import TokenBalancedBatchSampler
    from tokenbal.integrations.veomni import steps_batch_size

    rng = np.random.default_rng(0)
    for n, steps, k in ((40, 5, 2), (41, 5, 2), (103, 6, 1), (26, 3, 1)):
        lengths = rng.integers(1, 1000, n)
        size = steps_batch_size(lengths, steps, 2, k)
        s = TokenBalancedBatchSampler(lengths, num_replicas=2, rank=0, global_batch_size=size, grad_accum=k,
                                      verify=False)
        assert len(s) == steps * k
    with pytest.raises(ValueError, match="cannot fill"):
        steps_batch_size(np.ones(5), 3, 2)


def test_veomni_empty_micro_batch_is_named():
    from tokenbal.integrations.veomni import _CollateMicroBatches

    assert _CollateMicroBatches(len)([[[1], [2]], [[3]]]) == [2, 1]
    with pytest.raises(ValueError, match="micro-batch 1 of this rank's step is empty"):
        _CollateMicroBatches(len)([[[1]], []])
