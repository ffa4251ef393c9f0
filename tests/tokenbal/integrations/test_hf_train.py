"""The packed Trainer / trl path and what a Trainer user sees: ``TokenBalancedTrainer(packed=True,
max_tokens_per_rank=B)`` over raw chat rows rendered by a real Qwen2VLProcessor (on 2 gloo ranks),
trl's SFTTrainer with the mixin, padded batches planned for their padded cost, resume restoring the
weights (loss continuity), and tokenbal's log lines reaching stderr under the Trainer.

Samples are identified by what the model received: every packed row is cut at its ``cu_seqlens``
and each piece matched to the processor's own rendering of one row."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.helpers.dist_utils import run_ranks  # noqa: E402

N_ROWS, BUDGET, WORLD = 20, 260, 2


def _rendered(rows, proc):
    """The processor's own input_ids of every row (the oracle), and a lookup from them to the row."""
    from tokenbal.integrations.trainer_support import process_row

    ids = [tuple(process_row(r, proc)["input_ids"].tolist()) for r in rows]
    assert len(set(ids)) == len(ids)
    return ids, {t: i for i, t in enumerate(ids)}


def _samples_in(inputs, lookup) -> list[int]:
    """Which rows a packed batch holds: its input_ids cut at cu_seqlens, each piece looked up."""
    ids, cu = inputs["input_ids"][0].tolist(), inputs["cu_seqlens"].tolist()
    return [lookup[tuple(ids[a:b])] for a, b in zip(cu[:-1], cu[1:], strict=True)]


def _packed_rank(rank: int, world: int, out_dir: str) -> dict:
    from transformers import TrainingArguments

    from collate.train.tiny import tiny_qwen2_vl
    from tests.helpers.tiny_processor import chat_rows, tiny_qwen2_vl_processor
    from tokenbal.integrations.hf import TokenBalancedTrainer

    proc = tiny_qwen2_vl_processor()
    rows = chat_rows(N_ROWS, seed=1)
    ids, lookup = _rendered(rows, proc)
    steps: list[dict] = []

    class Recording(TokenBalancedTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            steps.append({"step": self.state.global_step + 1, "samples": _samples_in(inputs, lookup),
                          "tokens": int(inputs["input_ids"].shape[1]), "seq_lens": list(inputs["seq_lens"])})
            return super().training_step(model, inputs, num_items_in_batch)

    args = TrainingArguments(output_dir=out_dir, num_train_epochs=1, report_to=[], use_cpu=True,
                             save_strategy="no", disable_tqdm=True, learning_rate=1e-3, ddp_backend="gloo",
                             dataloader_num_workers=0)
    trainer = Recording(model=tiny_qwen2_vl(), args=args, train_dataset=rows, processing_class=proc,
                        token_lengths=np.array([len(t) for t in ids]), packed=True,
                        max_tokens_per_rank=BUDGET)
    result = trainer.train()
    return {"steps": steps, "loss": result.training_loss, "lengths": [len(t) for t in ids]}


@pytest.mark.slow   # ~2.5 min on the loaded 2-core VM: two ranks each importing transformers
def test_packed_trainer_two_ranks_every_sample_once_under_the_budget(tmp_path):
    ranks = run_ranks(_packed_rank, WORLD, str(tmp_path), timeout=300)
    assert len({len(r["steps"]) for r in ranks}) == 1 and ranks[0]["steps"]      # same steps everywhere
    trained = [i for r in ranks for s in r["steps"] for i in s["samples"]]
    assert sorted(trained) == list(range(N_ROWS))                                  # every sample once
    lengths = ranks[0]["lengths"]
    for r in ranks:
        for s in r["steps"]:
            assert s["tokens"] <= BUDGET                                          # no row over the budget
            assert s["seq_lens"] == [lengths[i] for i in s["samples"]]            # cu_seqlens = the samples
        assert math.isfinite(r["loss"])


def _fast_rank(rank: int, world: int) -> dict:
    """One rank of the fast 2-rank check: the samplers the Trainer builds (padded cost; token budget)
    under a real gloo group (their cross-rank plan check runs), and the packed Trainer collator."""
    from collate import PackedCollator
    from collate.train.tiny import IMG, VID, VSTART, TinyVLDataset
    from tokenbal.balance.sampler import TokenBalancedBatchSampler
    from tokenbal.integrations.trainer_support import IndexedDataset, PackedTrainCollator

    ds = IndexedDataset(TinyVLDataset(30, seed=5))
    lens = ds.dataset.lengths()
    padded = TokenBalancedBatchSampler(lens, global_batch_size=8, cost="padded", verify=True, seed=1)
    budget = TokenBalancedBatchSampler(lens, max_tokens_per_rank=90, verify=True, seed=1)
    packer = PackedTrainCollator(PackedCollator(image_token_id=IMG, video_token_id=VID,
                                                vision_start_token_id=VSTART), lens, 90)
    rows = []
    for batch in budget:
        b = packer([ds[i] for i in batch])
        rows.append({"samples": batch, "tokens": int(b["input_ids"].shape[1]),
                     "cu": b["cu_seqlens"].tolist()})
    return {"padded": [list(b) for b in padded], "rows": rows, "lens": lens.tolist()}


def test_two_ranks_padded_and_packed_plans_fast():
    """Fast 2-rank check (no Trainer): both ranks agree on the plans (the samplers' verify collective),
    every sample once in each, every packed row within the budget with one cu_seqlens entry per sample."""
    ranks = run_ranks(_fast_rank, WORLD, timeout=300)
    lens = ranks[0]["lens"]
    for key in ("padded", "rows"):
        assert len(ranks[0][key]) == len(ranks[1][key])
    assert sorted(i for r in ranks for b in r["padded"] for i in b) == list(range(len(lens)))
    assert sorted(i for r in ranks for row in r["rows"] for i in row["samples"]) == list(range(len(lens)))
    for r in ranks:
        for row in r["rows"]:
            assert row["tokens"] == sum(lens[i] for i in row["samples"]) <= 90
            assert len(row["cu"]) == len(row["samples"]) + 1 or (not row["samples"] and len(row["cu"]) == 2)


@pytest.mark.slow   # ~50 s on the loaded 2-core VM (trl + datasets imports, a real processor per row)
def test_trl_sft_trainer_with_the_mixin_packed(tmp_path):
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from trl import SFTConfig, SFTTrainer

    from collate.train.tiny import tiny_qwen2_vl
    from tests.helpers.tiny_processor import chat_rows, tiny_qwen2_vl_processor
    from tokenbal.integrations.hf import TokenBalancingMixin

    proc = tiny_qwen2_vl_processor()
    rows = chat_rows(12, seed=2)
    ids, lookup = _rendered(rows, proc)
    trained: list[list[int]] = []

    class TokenBalancedSFT(TokenBalancingMixin, SFTTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            assert "cu_seqlens" in inputs and inputs["input_ids"].shape[0] == 1
            trained.append(_samples_in(inputs, lookup))
            return super().training_step(model, inputs, num_items_in_batch)

    ds = datasets.Dataset.from_list(rows)
    ds = ds.add_column("length", [len(t) for t in ids])     # the length column is picked up
    args = SFTConfig(output_dir=str(tmp_path), num_train_epochs=1, report_to=[], use_cpu=True,
                     save_strategy="no", disable_tqdm=True, remove_unused_columns=False)
    trainer = TokenBalancedSFT(model=tiny_qwen2_vl(), args=args, train_dataset=ds, processing_class=proc,
                               packed=True, max_tokens_per_rank=BUDGET)
    trainer.train()
    assert sorted(i for b in trained for i in b) == list(range(12))
    assert all(sum(len(ids[i]) for i in b) <= BUDGET for b in trained)


def test_packed_row_over_the_budget_names_the_short_samples(tmp_path):
    from transformers import TrainingArguments

    from collate.train.tiny import tiny_qwen2_vl
    from tests.helpers.tiny_processor import chat_rows, tiny_qwen2_vl_processor
    from tokenbal.integrations.hf import TokenBalancedTrainer

    proc = tiny_qwen2_vl_processor()
    rows = chat_rows(6, seed=3)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no",
                             disable_tqdm=True, num_train_epochs=1)
    # lengths 6 tokens short per sample: the chat-template tokens a text-only count would miss
    ids, _ = _rendered(rows, proc)
    short = np.array([len(t) - 6 for t in ids])
    budget = int(short.max()) + 3      # the longest sample's row is over it, whatever shares it
    trainer = TokenBalancedTrainer(model=tiny_qwen2_vl(), args=args, train_dataset=rows,
                                   processing_class=proc, token_lengths=short, packed=True,
                                   max_tokens_per_rank=budget)
    with pytest.raises(ValueError, match=r"over max_tokens_per_rank=.*sample \d+: planned \d+, real \d+"):
        trainer.train()


def _padded_args(out_dir, **kw):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=out_dir, per_device_train_batch_size=2, report_to=[], use_cpu=True,
                             remove_unused_columns=False, learning_rate=1e-2, disable_tqdm=True,
                             logging_steps=1, seed=0, dataloader_num_workers=0, **kw)


def test_padded_batches_plan_for_the_padded_cost(tmp_path):
    from collate.train.tiny import TinyVLDataset, pad_collate, tiny_qwen2_vl
    from tokenbal.integrations.hf import TokenBalancedTrainer

    ds = TinyVLDataset(8)
    t = TokenBalancedTrainer(model=tiny_qwen2_vl(), args=_padded_args(str(tmp_path)), train_dataset=ds,
                             data_collator=pad_collate, token_lengths=ds.lengths())
    assert t.tokenbal_sampler.cost_name == "padded"
    t = TokenBalancedTrainer(model=tiny_qwen2_vl(), args=_padded_args(str(tmp_path)), train_dataset=ds,
                             data_collator=pad_collate, token_lengths=ds.lengths(),
                             sampler_options={"cost": "tokens"})
    assert t.tokenbal_sampler.cost_name == "tokens"


def _run(out_dir, model, ds, collate, resume=None):
    from tokenbal.integrations.hf import TokenBalancedTrainer

    args = _padded_args(out_dir, max_steps=4, save_strategy="steps", save_steps=2)
    t = TokenBalancedTrainer(model=model, args=args, train_dataset=ds, data_collator=collate,
                             token_lengths=ds.lengths())
    t.train(resume_from_checkpoint=resume)
    return {h["step"]: h["loss"] for h in t.state.log_history if "loss" in h}, t


def test_resume_restores_the_weights_loss_continuity(tmp_path, caplog):
    """The resumed run's loss at steps 3 and 4 equals the uninterrupted run's (rel 1e-5): the
    weights, not only the sample order, come back, although transformers 5.24's own loading of this
    checkpoint reports every Qwen2-VL weight missing (transformers#43701)."""
    import torch

    from collate.train.tiny import TinyVLDataset, pad_collate, tiny_qwen2_vl

    def collate(features):
        batch = pad_collate(features)
        batch.pop("sample_idx")
        return batch

    ds = TinyVLDataset(16)
    full, _ = _run(str(tmp_path), tiny_qwen2_vl(seed=0), ds, collate)
    with caplog.at_level(logging.INFO, logger="tokenbal"):
        resumed, t = _run(str(tmp_path), tiny_qwen2_vl(seed=1), ds, collate, str(tmp_path / "checkpoint-2"))
    assert sorted(resumed) == [1, 2, 3, 4]      # 1, 2: the checkpoint's own log history
    for step in (3, 4):
        assert resumed[step] == pytest.approx(full[step], rel=1e-5)
    assert any("transformers#43701" in r.message for r in caplog.records)

    # A checkpoint whose names match nothing fails loudly instead of training from initial weights.
    from safetensors.torch import save_file

    from tokenbal.integrations.trainer_support import load_checkpoint_weights

    bad = tmp_path / "bad"
    bad.mkdir()
    save_file({"no.such.weight": torch.zeros(2)}, str(bad / "model.safetensors"))
    with pytest.raises(RuntimeError, match="cannot restore the weights"):
        load_checkpoint_weights(t.model, str(bad))


def test_warnings_reach_stderr_under_the_trainer(tmp_path, monkeypatch, capfd):
    from tokenbal.integrations import trainer_support
    from tokenbal.integrations.trainer_support import configure_logging

    tb = logging.getLogger("tokenbal")
    before, level = list(tb.handlers), tb.level
    monkeypatch.setattr(logging.getLogger(), "handlers", [])     # an application that set up nothing
    try:
        monkeypatch.setenv("TOKENBAL_VERBOSITY", "info")
        assert configure_logging() == logging.INFO
        configure_logging()                                      # idempotent: one handler
        assert sum(isinstance(h, trainer_support._TrainerHandler) for h in tb.handlers) == 1
        tb.info("tokenbal: plan line")
        tb.debug("tokenbal: hidden")
        err = capfd.readouterr().err
        assert "plan line" in err and "hidden" not in err
        monkeypatch.setenv("TOKENBAL_VERBOSITY", "loud")
        with pytest.raises(ValueError, match="TOKENBAL_VERBOSITY"):
            configure_logging()
        monkeypatch.delenv("TOKENBAL_VERBOSITY")
        from transformers.utils import logging as hf_logging

        hf_level = hf_logging.get_verbosity()
        try:
            hf_logging.set_verbosity_error()
            assert configure_logging() == logging.ERROR and tb.level == logging.ERROR   # follows transformers
        finally:
            hf_logging.set_verbosity(hf_level)
    finally:
        tb.handlers[:] = before
        tb.setLevel(level)


def _recipes() -> dict[str, str]:
    """The python blocks of docs/integrations.md that follow a ``<!-- recipe: NAME`` marker."""
    import re

    from tests.helpers.paths import REPO

    text = (REPO / "docs" / "integrations.md").read_text()
    return {m.group(1): m.group(2) for m in re.finditer(r"<!-- recipe: ([\w-]+).*?-->\s*```python\n(.*?)```",
                                                         text, re.S)}


@pytest.mark.slow   # trains each recipe once (~1.5 min on the loaded VM, trl's import included)
@pytest.mark.parametrize("name", ["trainer-packed", "trl-packed"])
def test_doc_recipes_run(name, tmp_path, monkeypatch):
    """The recipes at the top of docs/integrations.md, run as written on the tiny Qwen2-VL, its real
    processor and a datasets.Dataset of chat rows (no token_lengths: the trainer gets them itself)."""
    if name.startswith("trl"):
        trl = pytest.importorskip("trl")
        import functools

        import torch

        if not torch.cuda.is_available():   # SFTConfig defaults to bf16 on a GPU; here it runs on the CPU
            monkeypatch.setattr(trl, "SFTConfig", functools.partial(trl.SFTConfig, use_cpu=True, bf16=False))
    datasets = pytest.importorskip("datasets")
    import tokenbal.integrations.hf as hf
    from collate.train.tiny import chat_rows, tiny_qwen2_vl, tiny_qwen2_vl_processor

    proc = tiny_qwen2_vl_processor()
    rows = chat_rows(8, seed=4)
    if not hasattr(hf, "dataset_lengths"):
        # Before issue 30 part A's dataset_lengths is merged: the processor's own counts stand in.
        from tokenbal.integrations.trainer_support import process_row

        monkeypatch.setattr(hf, "dataset_lengths", lambda ds, p: np.array(
            [len(process_row(ds[i], p)["input_ids"]) for i in range(len(ds))]), raising=False)
    code = _recipes()[name]
    monkeypatch.chdir(tmp_path)
    scope = {"model": tiny_qwen2_vl(), "processor": proc, "train_dataset": datasets.Dataset.from_list(rows)}
    exec(compile(code, f"docs/integrations.md:{name}", "exec"), scope)
    trainer = scope["trainer"]
    assert trainer.state.global_step == len(trainer.tokenbal_sampler) > 0
    assert trainer.tokenbal_sampler.max_tokens_per_rank == 4096


def test_token_budget_epochs_of_different_plans_each_train_every_sample_once_and_resume(tmp_path):
    # Token-budget plans differ by a step from epoch to epoch (here 33 and 34), while the Trainer takes
    # every epoch's length from the first: each epoch is planned into the most steps any needs, so
    # epoch 1 is not cut short (a sample never trained) and a resume in it lands where it left off.
    from collate.train.tiny import TinyVLDataset, pad_collate, tiny_qwen2_vl
    from tokenbal import TokenBalancedBatchSampler
    from tokenbal.integrations.hf import TokenBalancedTrainer

    ds = TinyVLDataset(60, max_text=120, image_sides=(1, 4))
    budget = 128
    natural = TokenBalancedBatchSampler(ds.lengths(), max_tokens_per_rank=budget, seed=0)
    assert [natural.natural_steps(e) for e in range(2)] == [33, 34]
    seen: list[list[int]] = []

    class Recording(TokenBalancedTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            seen.append(inputs.pop("sample_idx").tolist())
            return super().training_step(model, inputs, num_items_in_batch)

    def run(resume=None):
        seen.clear()
        args = _padded_args(str(tmp_path), num_train_epochs=2, save_strategy="steps", save_steps=40)
        t = Recording(model=tiny_qwen2_vl(), args=args, train_dataset=ds, data_collator=pad_collate,
                      token_lengths=ds.lengths(), sampler_options={"max_tokens_per_rank": budget})
        t.train(resume_from_checkpoint=resume)
        return list(seen), t

    full, t = run()
    assert t.tokenbal_sampler.epoch_steps == 34 and len(full) == 68
    for epoch in (full[:34], full[34:]):
        assert sorted(i for step in epoch for i in step) == list(range(60))
    resumed, _ = run(str(tmp_path / "checkpoint-40"))
    assert resumed == full[40:]


def test_padded_steps_divide_by_the_shifted_loss_tokens_on_every_transformers(tmp_path):
    # The global token mean's divisor is the step's labels[..., 1:] != -100 (what a causal LM's loss
    # sums over); before 5.19 the Trainer counted every label, one too many per row whose first label
    # is real. Padded rows here keep their first label, so the two counts differ.
    from collate.train.tiny import TinyVLDataset, pad_collate, tiny_qwen2_vl
    from tokenbal.integrations.hf import TokenBalancedTrainer

    ds = TinyVLDataset(8)
    got: list[tuple[int, int]] = []

    class Recording(TokenBalancedTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            inputs.pop("sample_idx")
            shifted = int((inputs["labels"][..., 1:] != -100).sum())
            got.append((int(num_items_in_batch), shifted))
            assert int((inputs["labels"][:, 0] != -100).sum()) > 0      # the counts would differ
            return super().training_step(model, inputs, num_items_in_batch)

    t = Recording(model=tiny_qwen2_vl(), args=_padded_args(str(tmp_path), max_steps=3), train_dataset=ds,
                  data_collator=pad_collate, token_lengths=ds.lengths())
    t.train()
    assert len(got) == 3 and all(n == shifted for n, shifted in got)


def test_packed_trainer_evaluates_raw_chat_rows(tmp_path):
    """packed=True with an eval_dataset of raw chat rows (a list, and a datasets.Dataset), under the
    Trainer's default remove_unused_columns=True: the eval loader hands the packed collator whole rows
    as the train loader does, and evaluation runs during and after training (before: KeyError "row
    has no 'messages' column (columns: [])": the Trainer had removed every column the model's forward
    does not name). The eval rows are not checked against the train plan's lengths."""
    datasets = pytest.importorskip("datasets")
    from transformers import TrainingArguments

    from collate.train.tiny import tiny_qwen2_vl
    from tests.helpers.tiny_processor import chat_rows, tiny_qwen2_vl_processor
    from tokenbal.integrations.hf import TokenBalancedTrainer

    proc = tiny_qwen2_vl_processor()
    rows, held_out = chat_rows(8, seed=1), chat_rows(5, seed=9)
    ids, _ = _rendered(rows, proc)
    for eval_dataset in (held_out, datasets.Dataset.from_list(held_out)):
        args = TrainingArguments(output_dir=str(tmp_path), num_train_epochs=1, report_to=[], use_cpu=True,
                                 save_strategy="no", disable_tqdm=True, eval_strategy="steps", eval_steps=2,
                                 per_device_eval_batch_size=2)
        t = TokenBalancedTrainer(model=tiny_qwen2_vl(), args=args, train_dataset=rows,
                                 eval_dataset=eval_dataset, processing_class=proc,
                                 token_lengths=np.array([len(t) for t in ids]), packed=True,
                                 max_tokens_per_rank=BUDGET)
        assert math.isfinite(t.evaluate()["eval_loss"])
        t.train()
        assert any("eval_loss" in entry for entry in t.state.log_history)
