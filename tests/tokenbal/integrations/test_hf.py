"""TokenBalancedTrainer on real gloo ranks: a real transformers Trainer (+ accelerate, DDP) training
a tiny random Qwen2-VL. Over an epoch every sample is trained exactly once across the ranks, every
rank runs the same number of steps, the next epoch has another order, the loss is normalised by the
step's token count over all ranks, and a crash + resume_from_checkpoint in the middle of epoch 1
trains exactly the samples that epoch had not reached yet."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.helpers.dist_utils import run_ranks  # noqa: E402

N, PER_DEVICE, WORLD = 24, 2, 2
STEPS_PER_EPOCH = N // (PER_DEVICE * WORLD)          # 6
SAVE_AT, CRASH_AT, TOTAL = 8, 10, 2 * STEPS_PER_EPOCH  # checkpoint mid-epoch 1, crash 2 steps later


class Crash(Exception):
    pass


def _train(rank: int, world: int, out_dir: str, resume: str | None) -> dict:
    from transformers import TrainerCallback, TrainingArguments

    from collate.train.tiny import TinyVLDataset, pad_collate, tiny_qwen2_vl
    from tokenbal.integrations.hf import TokenBalancedTrainer

    ds = TinyVLDataset(N)
    seen: list[tuple[int, list[int], int]] = []

    class Recording(TokenBalancedTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            idx = inputs.pop("sample_idx").tolist()
            seen.append((self.state.global_step + 1, idx, int(num_items_in_batch)))
            return super().training_step(model, inputs, num_items_in_batch)

    class CrashAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if resume is None and state.global_step == CRASH_AT:
                raise Crash()   # a kill: nothing after checkpoint-SAVE_AT is saved

    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=PER_DEVICE, num_train_epochs=2,
        save_strategy="steps", save_steps=SAVE_AT, logging_steps=1000, report_to=[], use_cpu=True,
        remove_unused_columns=False, learning_rate=1e-3, seed=0, dataloader_num_workers=0,
        disable_tqdm=True, ddp_backend="gloo", save_only_model=False)
    trainer = Recording(model=tiny_qwen2_vl(), args=args, train_dataset=ds, data_collator=pad_collate,
                        token_lengths=ds.lengths(), callbacks=[CrashAt()])
    try:
        trainer.train(resume_from_checkpoint=resume)
        crashed = False
    except Crash:
        crashed = True
    return {"seen": seen, "crashed": crashed, "len": len(trainer.get_train_dataloader()),
            "loss_tokens": _own_counts(trainer, ds, pad_collate)}


def _own_counts(trainer, ds, collate) -> list[int]:
    """Each sample's loss tokens as the Trainer counts them, on this rank alone (shifted labels on
    every transformers: the mixin counts them so where the Trainer before 5.19 did not)."""
    trainer.args.average_tokens_across_devices = False
    try:
        return [int(trainer._get_num_items_in_batch([collate([ds[i]])], "cpu")) for i in range(len(ds))]
    finally:
        trainer.args.average_tokens_across_devices = True


def _steps(records: list[dict], lo: int, hi: int) -> dict[int, list[list[int]]]:
    """step -> each rank's indices, for steps lo..hi."""
    return {s: [next(i for t, i, _ in r["seen"] if t == s) for r in records] for s in range(lo, hi + 1)}


@pytest.mark.slow   # ~2 min on the loaded 2-core VM: two 2-rank launches, each importing transformers
def test_trainer_exactly_once_epochs_and_mid_epoch_resume(tmp_path):
    first = run_ranks(_train, WORLD, str(tmp_path), None, timeout=300)
    assert all(r["crashed"] for r in first)
    ckpt = tmp_path / f"checkpoint-{SAVE_AT}"
    state = json.loads((ckpt / "tokenbal_sampler.json").read_text())
    assert (state["epoch"], state["cursor"]) == (1, SAVE_AT - STEPS_PER_EPOCH)
    resumed = run_ranks(_train, WORLD, str(tmp_path), str(ckpt), timeout=300)
    assert not any(r["crashed"] for r in resumed)

    # equal steps per rank; the prepared loader is not sharded a second time
    assert [r["len"] for r in first] == [STEPS_PER_EPOCH] * WORLD
    for r in first:
        assert [t for t, _, _ in r["seen"]] == list(range(1, CRASH_AT + 1))
    for r in resumed:
        assert [t for t, _, _ in r["seen"]] == list(range(SAVE_AT + 1, TOTAL + 1))

    epoch0 = _steps(first, 1, STEPS_PER_EPOCH)
    flat0 = [i for ranks in epoch0.values() for b in ranks for i in b]
    assert sorted(flat0) == list(range(N))                        # exactly once across the ranks

    # epoch 1: the steps trained before the checkpoint + the resumed run = every sample once
    before = _steps(first, STEPS_PER_EPOCH + 1, SAVE_AT)
    after = _steps(resumed, SAVE_AT + 1, TOTAL)
    flat1 = [i for part in (before, after) for ranks in part.values() for b in ranks for i in b]
    assert sorted(flat1) == list(range(N))
    # the resumed run continues where the crashed one was (steps 9, 10 were trained, then lost)
    assert _steps(first, SAVE_AT + 1, CRASH_AT) == _steps(resumed, SAVE_AT + 1, CRASH_AT)
    # a different order in epoch 1
    epoch1 = {**before, **after}
    assert [epoch0[s] for s in sorted(epoch0)] != [epoch1[s] for s in sorted(epoch1)]

    # the loss is normalised by the step's loss tokens over all ranks (the global token mean)
    tokens = first[0]["loss_tokens"]
    for records in (first, resumed):
        for rank_rec in records:
            for step, _, num_items in rank_rec["seen"]:
                ranks = _steps(records, step, step)[step]
                assert num_items == sum(tokens[i] for b in ranks for i in b)


def test_trainer_rejects_mismatched_settings(tmp_path):
    import torch
    from transformers import TrainingArguments

    from collate.train.tiny import TinyVLDataset, pad_collate, tiny_qwen2_vl
    from tokenbal.integrations.hf import TokenBalancedTrainer

    ds = TinyVLDataset(8)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, report_to=[],
                             use_cpu=True, remove_unused_columns=False, gradient_accumulation_steps=2,
                             average_tokens_across_devices=False)
    with pytest.raises(TypeError, match="token_lengths"):
        TokenBalancedTrainer(model=tiny_qwen2_vl(), args=args, train_dataset=ds, data_collator=pad_collate)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(ds)

    said = (r"map-style train_dataset \(len\(\) and indexing\); this one is a Stream \(a stream\): for "
            r"streams use tokenbal.data.balanced_batches")
    stream_args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, report_to=[],
                                    use_cpu=True, remove_unused_columns=False, max_steps=2)
    for lengths in (None, ds.lengths()):     # a stream has no epoch to plan, with or without lengths
        with pytest.raises(TypeError, match=said):
            TokenBalancedTrainer(model=tiny_qwen2_vl(), args=stream_args, train_dataset=Stream(),
                                 data_collator=pad_collate, token_lengths=lengths)
    with pytest.raises(ValueError, match="elastic"):
        TokenBalancedTrainer(model=tiny_qwen2_vl(), args=args, train_dataset=ds, data_collator=pad_collate,
                             token_lengths=ds.lengths(), sampler_options={"elastic": True})
    t = TokenBalancedTrainer(model=tiny_qwen2_vl(), args=args, train_dataset=ds, data_collator=pad_collate,
                             token_lengths=ds.lengths()[:7])
    assert t.args.average_tokens_across_devices   # turned on: the global token mean needs it
    with pytest.raises(ValueError, match="7 entries but train_dataset has 8"):
        t.get_train_dataloader()
    t = TokenBalancedTrainer(model=tiny_qwen2_vl(), args=args, train_dataset=ds, data_collator=pad_collate,
                             token_lengths=ds.lengths())
    # global batch = per-device x DP size (1) x gradient accumulation; grad_accum follows the Trainer
    assert (t.tokenbal_sampler.global_batch_size, t.tokenbal_sampler.grad_accum) == (4, 2)
    assert len(t.get_train_dataloader()) == 4    # 2 steps x 2 micro-batches
    t = TokenBalancedTrainer(model=tiny_qwen2_vl(), args=args, train_dataset=ds, data_collator=pad_collate,
                             token_lengths=ds.lengths(), sampler_options={"grad_accum": 3})
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2"):
        t.get_train_dataloader()
    assert os.environ.get("WORLD_SIZE") is None


def test_sampler_options_become_one_plan_settings(tmp_path):
    """The Trainer's planning options (its defaults included) reach the sampler as one PlanSettings
    over the data-parallel ranks; a PlanSettings passed in sampler_options is used as it is, and is
    checked against the Trainer like the keywords it stands for."""
    from transformers import TrainingArguments

    from collate.train.tiny import TinyVLDataset, pad_collate, tiny_qwen2_vl
    from tokenbal.balance.settings import PlanSettings
    from tokenbal.integrations.hf import TokenBalancedTrainer

    ds = TinyVLDataset(12)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, report_to=[],
                             use_cpu=True, remove_unused_columns=False, gradient_accumulation_steps=2,
                             average_tokens_across_devices=True)
    make = lambda **opts: TokenBalancedTrainer(  # noqa: E731
        model=tiny_qwen2_vl(), args=args, train_dataset=ds, data_collator=pad_collate,
        token_lengths=ds.lengths(), sampler_options=opts)
    t = make(window=2)
    assert t.tokenbal_sampler.settings == PlanSettings(1, global_batch_size=4, window=2, grad_accum=2)
    mine = PlanSettings(1, global_batch_size=6, grad_accum=2, shuffle=False)
    t = make(settings=mine)
    assert t.tokenbal_sampler.settings == mine and t.tokenbal_sampler.cost_name == "padded"
    with pytest.raises(ValueError, match=r"disagrees with window=3 \(settings has None\)"):
        make(settings=mine, window=3)
    t = make(settings=PlanSettings(1, global_batch_size=6, grad_accum=3))
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2"):
        t.get_train_dataloader()


def test_sequential_sampling_strategy_plans_without_shuffling(tmp_path):
    """TrainingArguments(train_sampling_strategy="sequential") (transformers 5.6+) trains in no random
    order; the token-balanced loader then plans with shuffle=False, instead of shuffling regardless."""
    from transformers import TrainingArguments

    from collate.train.tiny import TinyVLDataset, pad_collate, tiny_qwen2_vl
    from tokenbal import TokenBalancedBatchSampler
    from tokenbal.integrations.hf import TokenBalancedTrainer

    if "train_sampling_strategy" not in TrainingArguments.__dataclass_fields__:
        pytest.skip("this transformers has no train_sampling_strategy")
    ds = TinyVLDataset(12)

    def epoch0(strategy):
        args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, report_to=[],
                                 use_cpu=True, remove_unused_columns=False, train_sampling_strategy=strategy)
        trainer = TokenBalancedTrainer(model=tiny_qwen2_vl(), args=args, train_dataset=ds,
                                       data_collator=pad_collate, token_lengths=ds.lengths())
        trainer.get_train_dataloader()
        return list(trainer.tokenbal_sampler)

    def plan(shuffle):
        return list(TokenBalancedBatchSampler(ds.lengths(), num_replicas=1, rank=0, global_batch_size=2,
                                              seed=42, shuffle=shuffle, cost="padded"))

    assert plan(False) != plan(True)
    assert epoch0("sequential") == plan(False)
    assert epoch0("random") == plan(True)


def test_mixin_serves_trl_sft_trainer(tmp_path):
    """The mixin in front of trl's SFTTrainer (one process): its loader is tokenbal's, each sample
    once per epoch."""
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    from collate.train.tiny import TinyVLDataset, pad_collate, tiny_qwen2_vl
    from tokenbal.integrations.hf import TokenBalancingMixin

    seen: list[list[int]] = []

    class TokenBalancedSFT(TokenBalancingMixin, SFTTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            seen.append(inputs.pop("sample_idx").tolist())
            return super().training_step(model, inputs, num_items_in_batch)

    raw = TinyVLDataset(8)   # text only here: SFTTrainer wants a datasets.Dataset
    ds = datasets.Dataset.from_list([{"input_ids": it["input_ids"].tolist(), "labels": it["labels"].tolist(),
                                      "sample_idx": it["sample_idx"]} for it in raw.items])
    vocab = {f"t{i}": i for i in range(126)} | {"[UNK]": 126, "[PAD]": 127}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")),
                                  unk_token="[UNK]", pad_token="[PAD]", eos_token="[PAD]")
    args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_train_epochs=1,
                     report_to=[], use_cpu=True, remove_unused_columns=False, save_strategy="no",
                     dataset_kwargs={"skip_prepare_dataset": True}, disable_tqdm=True)
    trainer = TokenBalancedSFT(model=tiny_qwen2_vl(), args=args, processing_class=tok, train_dataset=ds,
                               data_collator=pad_collate, token_lengths=raw.lengths())
    trainer.train()
    assert len(seen) == 4 and sorted(i for b in seen for i in b) == list(range(8))
    assert seen == list(trainer.tokenbal_sampler)   # the steps are the sampler's, in its order


def _text_rows(n: int = 8) -> list[dict]:
    from collate.train.tiny import TinyVLDataset

    items = [it for it in TinyVLDataset(3 * n).items if "pixel_values" not in it][:n]
    return [{"input_ids": it["input_ids"].tolist(), "labels": it["labels"].tolist(),
             "sample_idx": it["sample_idx"]} for it in items]


def test_lengths_of_a_transformed_dataset_are_those_of_the_rows_the_trainer_loads(tmp_path):
    """A datasets.Dataset with set_transform: the Trainer loads the transform's rows, so the plan's
    lengths are theirs, not the stored column's (before: a truncating transform's rows of 5 tokens
    were planned as the stored 6..39 tokens), and a transform that makes input_ids from another column
    gives lengths too (before: "needs token lengths")."""
    datasets = pytest.importorskip("datasets")
    from transformers import DataCollatorWithFlattening, TrainingArguments

    from collate.train.tiny import tiny_qwen2_vl
    from tokenbal.integrations.hf import TokenBalancedTrainer

    rows = _text_rows()
    assert len({len(r["input_ids"]) for r in rows}) > 1 and min(len(r["input_ids"]) for r in rows) > 5
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, report_to=[],
                             use_cpu=True, remove_unused_columns=False, max_steps=2, save_strategy="no",
                             disable_tqdm=True)
    truncated = datasets.Dataset.from_list(rows)
    truncated.set_transform(lambda b: {"input_ids": [x[:5] for x in b["input_ids"]],
                                       "labels": [x[:5] for x in b["labels"]]})
    made = datasets.Dataset.from_list([{"text": " ".join(map(str, r["input_ids"]))} for r in rows])
    made.set_transform(lambda b: {"input_ids": [[int(t) for t in s.split()] for s in b["text"]],
                                  "labels": [[int(t) for t in s.split()] for s in b["text"]]})
    for ds, want in ((truncated, [5] * len(rows)), (made, [len(r["input_ids"]) for r in rows])):
        t = TokenBalancedTrainer(model=tiny_qwen2_vl(), args=args, train_dataset=ds,
                                 data_collator=DataCollatorWithFlattening())
        loaded = [len(ds[i]["input_ids"]) for i in range(len(ds))]
        assert t.tokenbal_sampler.lengths.tolist() == want == loaded
        t.train()


def test_length_grouping_is_said_to_be_replaced_and_its_length_column_is_read(tmp_path, caplog):
    """The Trainer's own length grouping (4.57 group_by_length=True; 5.x train_sampling_strategy=
    "group_by_length" / "batch_rebalance") cannot run beside the token-balanced loader: a warning says
    it is replaced (before: silently ignored). The lengths it would read (length_column_name) are the
    ones planned with (before: that column ignored, len(input_ids) planned instead)."""
    import logging

    datasets = pytest.importorskip("datasets")
    from transformers import DataCollatorWithFlattening, TrainingArguments

    from collate.train.tiny import tiny_qwen2_vl
    from tokenbal.integrations.hf import TokenBalancedTrainer

    rows = _text_rows()
    counts = [3 * len(r["input_ids"]) + 7 for r in rows]   # e.g. with the image tokens input_ids lack
    ds = datasets.Dataset.from_list([{**r, "n_tokens": n} for r, n in zip(rows, counts, strict=True)])
    fields = TrainingArguments.__dataclass_fields__
    strategies = [] if "group_by_length" in fields else fields["train_sampling_strategy"].metadata["choices"]
    groupings = ([{"group_by_length": True}] if "group_by_length" in fields else
                 [{"train_sampling_strategy": s} for s in strategies if s not in ("random", "sequential")])
    assert groupings
    for grouping in groupings:
        args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, report_to=[],
                                 use_cpu=True, remove_unused_columns=False, max_steps=1, save_strategy="no",
                                 disable_tqdm=True, length_column_name="n_tokens", **grouping)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tokenbal"):
            t = TokenBalancedTrainer(model=tiny_qwen2_vl(), args=args, train_dataset=ds,
                                     data_collator=DataCollatorWithFlattening())
        said = f"{next(iter(grouping))}={next(iter(grouping.values()))!r}"
        assert said in caplog.text and "replaced by the token-balanced plan" in caplog.text
        assert t.tokenbal_sampler.lengths.tolist() == counts
        t.train()


def test_auto_find_batch_size_retries_on_a_plan_of_the_smaller_batch(tmp_path):
    """auto_find_batch_size: after an out-of-memory step the Trainer retries with half the per-device
    batch; the plan is rebuilt for it, and the retry trains every sample once (before: the retry
    reused the aborted epoch's sampler and "trained" zero steps, loss 0, silently). A token budget
    cannot be halved by the Trainer: its retry raises saying so."""
    from transformers import TrainingArguments

    from collate.train.tiny import TinyVLDataset, pad_collate, tiny_qwen2_vl
    from tokenbal.integrations.hf import TokenBalancedTrainer

    ds = TinyVLDataset(16)
    seen: list = []

    class OutOfMemoryAbove2(TokenBalancedTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            idx = inputs.pop("sample_idx").tolist()
            if len(idx) > 2:   # what accelerate's find_executable_batch_size takes for an OOM
                raise RuntimeError("CUDA out of memory. (simulated)")
            seen.append(idx)
            return super().training_step(model, inputs, num_items_in_batch)

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, report_to=[],
                             auto_find_batch_size=True, use_cpu=True, remove_unused_columns=False,
                             disable_tqdm=True, save_strategy="no", num_train_epochs=1)
    t = OutOfMemoryAbove2(model=tiny_qwen2_vl(), args=args, train_dataset=ds, data_collator=pad_collate,
                          token_lengths=ds.lengths())
    t.train()
    assert t.state.global_step == len(seen) == 8 and sorted(i for b in seen for i in b) == list(range(16))
    assert t.tokenbal_sampler.global_batch_size == 2
    seen.clear()
    t = OutOfMemoryAbove2(model=tiny_qwen2_vl(), args=args, train_dataset=ds, data_collator=pad_collate,
                          token_lengths=ds.lengths(), max_tokens_per_rank=200)
    with pytest.raises(ValueError, match="auto_find_batch_size.*max_tokens_per_rank"):
        t.train()


def test_train_again_after_an_interrupted_train_starts_a_whole_epoch(tmp_path):
    """train() without resume_from_checkpoint starts at step 0 of epoch 0; after a train() stopped
    by an exception mid-epoch (a KeyboardInterrupt in a notebook), the next train() on the same
    trainer trains the whole epoch again (before: it continued the sampler's cursor, 2 steps of 6,
    4 of 12 samples trained, the rest never, with only a warning about DataLoader workers)."""
    from transformers import TrainingArguments

    from collate.train.tiny import TinyVLDataset, pad_collate, tiny_qwen2_vl
    from tokenbal.integrations.hf import TokenBalancedTrainer

    ds = TinyVLDataset(12)
    seen: list[list[int]] = []

    class Interrupt(Exception):
        pass

    class StopsOnce(TokenBalancedTrainer):
        stop_at: int | None = 2

        def training_step(self, model, inputs, num_items_in_batch=None):
            if self.state.global_step == self.stop_at:
                self.stop_at = None
                raise Interrupt()
            seen.append(inputs.pop("sample_idx").tolist())
            return super().training_step(model, inputs, num_items_in_batch)

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, report_to=[],
                             use_cpu=True, remove_unused_columns=False, disable_tqdm=True, save_strategy="no",
                             num_train_epochs=1)
    t = StopsOnce(model=tiny_qwen2_vl(), args=args, train_dataset=ds, data_collator=pad_collate,
                  token_lengths=ds.lengths())
    with pytest.raises(Interrupt):
        t.train()
    assert len(seen) == 2
    seen.clear()
    t.train()
    assert t.state.global_step == len(seen) == 6 and sorted(i for b in seen for i in b) == list(range(12))


def test_padding_free_collators_are_planned_for_their_tokens_not_a_padded_cost(tmp_path):
    """A collator that concatenates a micro-batch without padding (transformers'
    DataCollatorWithFlattening, trl's padding_free collator) runs it at its total tokens: the plan
    uses the token cost, not count x longest (before: cost='padded' for every collator; on 8 ranks
    max/mean tokens per step median 1.006, p90 1.021, instead of 1.002 / 1.004:
    scripts/bench_flattening_cost.py)."""
    from transformers import DataCollatorWithFlattening, TrainingArguments

    from collate.train.tiny import TinyVLDataset, pad_collate, tiny_qwen2_vl
    from tokenbal.integrations.hf import TokenBalancedTrainer

    ds = TinyVLDataset(8)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, report_to=[],
                             use_cpu=True, remove_unused_columns=False)
    collators = {"padded": pad_collate, "flattening": DataCollatorWithFlattening()}
    try:
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

        collators["trl padding_free"] = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    except ImportError:
        pass
    for name, collator in collators.items():
        t = TokenBalancedTrainer(model=tiny_qwen2_vl(), args=args, train_dataset=ds, data_collator=collator,
                                 token_lengths=ds.lengths())
        assert t.tokenbal_sampler.cost_name == ("padded" if name == "padded" else "tokens"), name


# -- the trainer is freed by its last reference -------------------------------------------------------
# A framework that destroys the process group after training (LLaMA-Factory's run_exp, once its sft
# workflow returned) stops the group's gloo threads only if nothing holds the group then, and DDP's
# reducer in the trainer's wrapped model does while the trainer lives. A trainer in a reference cycle
# lives until a cyclic GC pass, often not before interpreter exit: the threads then still ran while
# Python finalised, the state in which a gloo rank can abort at exit (pytorch#190489). Measured on
# LLaMA-Factory 0.9.5's CLI, 2 gloo ranks: running at exit on 6 of 6 ranks with tokenbal's trainer
# before, 0 of 8 after, 0 of 4 with its own trainer (the framework tests assert it,
# tests/helpers/framework_record.py). In one process, no group: the cycle itself.

@pytest.mark.parametrize("packed", [False, True])
def test_a_trained_trainer_is_freed_by_its_last_reference(tmp_path, packed):
    import gc
    import weakref

    from transformers import TrainingArguments

    from collate.train.tiny import (
        TinyVLDataset,
        chat_rows,
        pad_collate,
        tiny_qwen2_vl,
        tiny_qwen2_vl_processor,
    )
    from tokenbal.integrations.hf import TokenBalancedTrainer
    from tokenbal.integrations.trainer_support import process_row

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2,
                             save_strategy="no", report_to=[], use_cpu=True, remove_unused_columns=False,
                             disable_tqdm=True)
    gc.collect()
    gc.disable()
    try:
        if packed:
            proc, rows = tiny_qwen2_vl_processor(), chat_rows(8, seed=1)
            lengths = [len(process_row(r, proc)["input_ids"]) for r in rows]
            trainer = TokenBalancedTrainer(model=tiny_qwen2_vl(), args=args, train_dataset=rows,
                                           processing_class=proc, token_lengths=lengths, packed=True,
                                           max_tokens_per_rank=2 * max(lengths))
        else:
            ds = TinyVLDataset(8)
            trainer = TokenBalancedTrainer(model=tiny_qwen2_vl(), args=args, train_dataset=ds,
                                           data_collator=pad_collate, token_lengths=ds.lengths())
        trainer.train()
        gone = weakref.ref(trainer)
        del trainer
        # before: the sampler-state callback (and the packed collator's lengths) held the trainer.
        # (Whether the model goes with it is not tokenbal's alone: on transformers 4.57, after other
        # tests in the same process, something outside tokenbal still held it; alone it went too.)
        assert gone() is None
    finally:
        gc.enable()
