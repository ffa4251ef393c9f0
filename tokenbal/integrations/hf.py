"""transformers ``Trainer`` integration: :class:`TokenBalancingMixin` and ``TokenBalancedTrainer``.

``Trainer`` asks ``_get_train_sampler`` for a per-sample sampler and batches it itself, so a batch
sampler returned there is iterated as if each index list were one index (a ``TypeError``), and
``accelerator.prepare`` then shards the loader a second time. The mixin instead builds the train
loader around a :class:`~tokenbal.TokenBalancedBatchSampler` and prepares it with accelerate's
re-sharding turned off (:func:`tokenbal.integrations.accelerate.neutralise`, the same pass-through
the Trainer applies to its own ``BatchRebalanceSampler``). What it keeps right:

- **Batch size.** ``global_batch_size`` = ``per_device_train_batch_size`` × data-parallel size ×
  ``gradient_accumulation_steps`` samples per optimizer step, split into balanced micro-batches
  (``grad_accum`` = the Trainer's); or a token budget, ``sampler_options={"max_tokens_per_rank": N}``.
  The DP size is that of ``sampler_options["dp_group"]`` / ``["device_mesh"]`` when given, else the
  data-parallel ranks the Trainer's own loader is sharded over
  (:func:`tokenbal.hf_compat.trainer_data_parallel`): the world size, or under tensor / context
  parallelism (``TrainingArguments.parallelism_config``, a ``tp_plan`` model, DeepSpeed AutoTP) the
  ``dp_replicate x dp_shard`` ranks of accelerate's device mesh, the peers of one TP / CP group
  getting the same batches. Refused: DeepSpeed ALST / Ulysses ``sp_size`` > 1, and ``packed=True``
  under TP / CP.
- **Epochs.** The Trainer's ``set_epoch`` reaches the sampler (also through the
  ``skip_first_batches`` loader of a resumed epoch), so every epoch has its own order.
- **Resume.** Each checkpoint gets ``tokenbal_sampler.json`` (the sampler state at that step). On
  ``resume_from_checkpoint`` it is loaded, which checks that the lengths and settings match the
  checkpoint (a different world size, batch size or dataset raises instead of training on a
  different plan) and selects the checkpoint's epoch; the Trainer then skips the batches already
  trained in that epoch (index lists only: skipped samples are not loaded), so training continues
  at the first step not yet trained. Elastic resume is not available through the Trainer (its skip
  count assumes the same plan); ``sampler_options={"elastic": True}`` raises.
- **Loss.** The Trainer's ``num_items_in_batch`` (labels ≠ -100, shifted, over the step's
  micro-batches) is summed over all ranks and the loss multiplied back by the world size when
  ``average_tokens_across_devices`` is on: that is the global token mean tokenbal's uneven batches
  need. The mixin turns the option on if it was off (with a warning), and warns when the model does
  not accept ``num_items_in_batch`` (each rank would then average its own tokens).

- **Packed** (``packed=True, max_tokens_per_rank=B``): the model is patched for packed rows
  (``collate.models.enable_packed``) and the collator is ``PackedCollator.from_config(model.config)``
  behind :class:`~tokenbal.integrations.trainer_support.PackedTrainCollator`, which renders raw chat
  rows with ``processing_class`` and checks every row against the planned lengths. Padded batches
  (the default) are planned with ``cost="padded"`` (:mod:`tokenbal.balance.partition.padded`),
  padding-free collators (``DataCollatorWithFlattening``, trl's ``padding_free``) by their tokens.
- **Weights on resume.** Checkpoint names that transformers' own loading would miss
  (huggingface/transformers#43701) are mapped through its key conversion, or the resume raises.
- **What the user sees.** Warnings reach stderr
  (:func:`~tokenbal.integrations.trainer_support.configure_logging`), and a finished ``train()``
  destroys the process group at exit (:func:`destroy_process_group_at_exit`). The trainer is in no
  reference cycle of tokenbal's (its callback and collator reach it through a weak reference), so a
  framework that drops it and destroys the group itself stops the group's gloo threads there.

Use ``TokenBalancedTrainer(model=..., args=..., train_dataset=..., token_lengths=index)``, or mix
into another ``Trainer`` subclass (trl's ``SFTTrainer``, LLaMA-Factory's trainers)::

    class MySFT(TokenBalancingMixin, SFTTrainer): pass

``token_lengths``: a :class:`~tokenbal.TokenIndex` (its ``.lengths``) or a 1-D array, one entry per
``train_dataset`` item, in dataset order. Without it (``_lengths_for``): the dataset's
``length_column_name`` column (``length``), else ``len(input_ids)``, else :func:`dataset_lengths`
under ``processing_class`` (a ``set_transform`` dataset: those of the transform's rows). The
Trainer's own length grouping (``group_by_length`` / ``train_sampling_strategy``) is replaced by
the plan, with a warning.
``sampler_options``: any further ``TokenBalancedBatchSampler`` keyword (``cost=``, ``stages=``,
``window=``, ``max_tokens_per_rank=``, ``dp_group=``, ``device_mesh=``, ``seed=`` (default
``data_seed`` or ``seed``), ``shuffle=`` (default off under ``train_sampling_strategy="sequential"``),
``settings=`` a :class:`~tokenbal.balance.settings.PlanSettings`, ...).
The planning ones become one ``PlanSettings`` over the data-parallel ranks, which the sampler holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import weakref
from collections.abc import Iterator
from functools import partial
from typing import Any

from tokenbal.balance.sampler import TokenBalancedBatchSampler
from tokenbal.balance.settings import PlanSettings, plan_settings
from tokenbal.integrations.hf_lengths import dataset_lengths as dataset_lengths

__all__ = ["SAMPLER_STATE_NAME", "TokenBalancedTrainer", "TokenBalancingMixin",  # noqa: F822 (lazy)
           "dataset_lengths"]

logger = logging.getLogger("tokenbal")

SAMPLER_STATE_NAME = "tokenbal_sampler.json"
# sampler_options that are PlanSettings fields (the rest go to the sampler as keywords).
_SETTINGS_FIELDS = tuple(f.name for f in dataclasses.fields(PlanSettings))


def unknown_sampler_options(options: dict[str, Any], extra: tuple[str, ...] = ()) -> list[str]:
    """The keys of ``options`` that are no ``TokenBalancedBatchSampler`` keyword (nor in ``extra``),
    sorted: for the framework entries to refuse a misspelt option before any rank starts, rather than
    at the first train step after the model has loaded."""
    import inspect

    known = set(inspect.signature(TokenBalancedBatchSampler.__init__).parameters)
    return sorted(set(options) - (known - {"self", "lengths_or_index"}) - set(extra))


def _unpack_settings(opts: dict[str, Any]) -> dict[str, Any]:
    """``sampler_options={"settings": PlanSettings(...)}`` as the settings' own keys (checked against
    any given next to it), so the Trainer's defaults (batch size, grad_accum, drop_last) and its
    checks see them as if they had been passed one by one."""
    settings = opts.pop("settings", None)
    if settings is None:
        return opts
    given = {name: opts.pop(name) for name in _SETTINGS_FIELDS if name in opts}
    fields = plan_settings(settings, **given).fingerprint()
    # Unset ones (None: the other batch mode, the default window) stay unset, as if never passed.
    return {**opts, **{name: v for name, v in fields.items() if v is not None}}


class TokenBalancingMixin:
    """Mix in before a ``transformers.Trainer`` subclass; see the module docstring."""

    # A subclass whose framework normalises the loss its own way (LLaMA-Factory's multimodal per
    # micro-batch mean) sets this to the line logged instead of the num_items_in_batch warning.
    tokenbal_loss_note: str | None = None

    def __init__(self, *args: Any, token_lengths: Any = None, sampler_options: dict[str, Any] | None = None,
                 packed: bool = False, max_tokens_per_rank: int | None = None, **kwargs: Any) -> None:
        from tokenbal.integrations.trainer_support import configure_logging

        bound = _bind_trainer_args(super(), args, kwargs)
        self.tokenbal_sampler_options = _unpack_settings(dict(sampler_options or {}))
        if max_tokens_per_rank is not None:
            if self.tokenbal_sampler_options.setdefault("max_tokens_per_rank", max_tokens_per_rank) != \
                    max_tokens_per_rank:
                raise ValueError(f"max_tokens_per_rank={max_tokens_per_rank} disagrees with sampler_options' "
                                 f"{self.tokenbal_sampler_options['max_tokens_per_rank']}")
        if self.tokenbal_sampler_options.get("elastic"):
            raise ValueError("elastic=True is not supported under the Trainer: its resume skips the batches "
                             "of the checkpoint's plan; resume with the same world size and batch settings")
        self.tokenbal_packed = bool(packed)
        self.tokenbal_token_lengths = token_lengths
        if self.tokenbal_packed:
            if args and "model" not in bound:   # positional arguments that could not be named
                raise ValueError("packed=True: pass the Trainer's arguments by keyword (model=..., args=...)")
            kwargs = _wire_packed(self, bound)
            args = ()
        self._tokenbal_sampler: TokenBalancedBatchSampler | None = None
        self._tokenbal_built_batch: int | None = None   # the per-device batch size it was planned for
        self._tokenbal_resume: str | None = None
        super().__init__(*args, **kwargs)
        configure_logging()   # after the Trainer set transformers' verbosity from args.log_level
        self.tokenbal_token_lengths = _lengths_for(self.train_dataset, self.processing_class, token_lengths,
                                                   type(self).__name__, self.args.length_column_name)
        from tokenbal.hf_compat import trainer_length_grouping

        grouping = trainer_length_grouping(self.args)
        if grouping is not None and self.train_dataset is not None:
            # The train loader is tokenbal's: the Trainer's length-grouped sampler is never built.
            logger.warning("tokenbal: %s is replaced by the token-balanced plan for the train loader "
                           "(padded batches are planned for count x longest sample, which groups similar "
                           "lengths itself); the eval loader keeps the Trainer's sampler", grouping)
        if not self.args.average_tokens_across_devices:
            logger.warning("tokenbal: setting average_tokens_across_devices=True: token-balanced ranks "
                           "hold different numbers of tokens, so each rank's own token mean would weight "
                           "them unevenly")
            self.args.average_tokens_across_devices = True
        if not (getattr(self, "model_accepts_loss_kwargs", True) or getattr(self, "compute_loss_func", None)):
            if self.tokenbal_loss_note:   # a framework's own loss normalisation, kept on purpose
                logger.info(self.tokenbal_loss_note)
            else:
                logger.warning("tokenbal: the model does not accept num_items_in_batch; its loss is each "
                               "rank's own token mean, not the global one (pass compute_loss_func= to fix)")
        self.add_callback(_make_callback(self))

    # -- the sampler ----------------------------------------------------------------------------

    @property
    def tokenbal_sampler(self) -> TokenBalancedBatchSampler:
        """The train batch sampler (built on first use from ``args`` and ``sampler_options``)."""
        if self._tokenbal_sampler is None:
            self._tokenbal_built_batch = self._tokenbal_per_device_batch()
            sampler = TokenBalancedBatchSampler(self.tokenbal_token_lengths, **self._sampler_kwargs())
            if sampler.settings.max_tokens_per_rank is not None and not sampler.elastic:
                # The Trainer takes every epoch's steps from the first epoch's length (and so does its
                # resume arithmetic), while token-budget plans differ by a step or two per epoch: every
                # epoch it will train is planned into the most steps any of them needs.
                sampler.fix_epoch_steps(self._tokenbal_epochs(sampler))
            self._tokenbal_sampler = sampler
        return self._tokenbal_sampler

    def _tokenbal_per_device_batch(self) -> int:
        """The per-device batch size the Trainer runs now: ``per_device_train_batch_size``, or after an
        out-of-memory step under ``auto_find_batch_size`` the smaller one it retries with (its
        ``_train_batch_size`` is the per-device size times the GPUs of ``nn.DataParallel``)."""
        current = getattr(self, "_train_batch_size", None)
        if current is None:
            return int(self.args.per_device_train_batch_size)
        return int(current) // max(1, self.args.n_gpu)

    def _tokenbal_follow_batch_size(self) -> None:
        """A new plan when the Trainer retries with a smaller batch (``auto_find_batch_size``): the
        aborted one's sampler ran ahead in its epoch, and its batches are still the ones that ran out
        of memory. A token budget cannot be halved by the Trainer: that retry raises."""
        if self._tokenbal_sampler is None or self._tokenbal_built_batch == self._tokenbal_per_device_batch():
            return
        batch, budget = self._tokenbal_per_device_batch(), self._tokenbal_sampler.max_tokens_per_rank
        if budget is not None:
            raise ValueError(f"tokenbal: auto_find_batch_size retried with per-device batch size {batch} "
                             "after an out-of-memory step, but the plan's micro-batches are set by "
                             f"max_tokens_per_rank={budget}, which the Trainer cannot shrink: lower "
                             "max_tokens_per_rank (and leave auto_find_batch_size off)")
        logger.warning("tokenbal: the Trainer retries with per-device batch size %d (auto_find_batch_size); "
                       "the token-balanced plan is rebuilt for it", batch)
        self._tokenbal_sampler = None

    def _tokenbal_epochs(self, sampler: TokenBalancedBatchSampler) -> int:
        """How many epochs ``train`` will start: ``num_train_epochs`` rounded up, or as many as
        ``max_steps`` reaches at the first epoch's steps (one more, as padding only lengthens them)."""
        args = self.args
        if args.max_steps is not None and args.max_steps > 0:
            return -(-int(args.max_steps) // max(1, sampler.natural_steps(0))) + 1
        return max(1, math.ceil(float(args.num_train_epochs)))

    def _sampler_kwargs(self) -> dict[str, Any]:
        from tokenbal.parallel import resolve_dp

        args, opts = self.args, dict(self.tokenbal_sampler_options)
        ga = int(args.gradient_accumulation_steps)
        if opts.setdefault("grad_accum", ga) != ga:
            raise ValueError(f"sampler_options grad_accum={opts['grad_accum']} disagrees with the Trainer's "
                             f"gradient_accumulation_steps={ga}")
        split = self._tokenbal_data_parallel()
        if opts.get("dp_group") is None and opts.get("device_mesh") is None:
            # The data-parallel ranks the Trainer's own loader is sharded over (accelerate's device
            # mesh: tensor / context parallel peers share one batch), not the world.
            opts.setdefault("num_replicas", split.size)
            opts.setdefault("rank", split.rank)
        dp, _ = resolve_dp(opts.get("num_replicas"), opts.get("rank"), opts.get("dp_group"),
                           opts.get("device_mesh"))
        if opts.get("max_tokens_per_rank") is None:
            opts.setdefault("global_batch_size", self._tokenbal_per_device_batch() * int(dp) * ga)
            if not (self.tokenbal_packed or _padding_free(self.data_collator)) and opts.get("cost") is None \
                    and opts.get("stages") is None:
                # A padding collator runs every micro-batch at count x longest sample: plan for that.
                opts["cost"] = "padded"
        opts.setdefault("seed", args.data_seed if args.data_seed is not None else args.seed)
        opts.setdefault("drop_last", bool(args.dataloader_drop_last))
        from tokenbal.hf_compat import trainer_shuffles_train_data

        if not trainer_shuffles_train_data(args):
            # train_sampling_strategy="sequential" asks for no random order: plan with shuffle=False
            opts.setdefault("shuffle", False)
        # One checked PlanSettings over the data-parallel ranks; the sampler takes it as it is.
        fields = {name: opts.pop(name) for name in _SETTINGS_FIELDS if name in opts}
        opts["settings"] = PlanSettings(**{**fields, "num_replicas": dp})
        return opts

    def _tokenbal_data_parallel(self) -> Any:
        """The Trainer's data-parallel split (:func:`tokenbal.hf_compat.trainer_data_parallel`), with
        what token-balanced batches cannot follow refused by name."""
        from tokenbal.hf_compat import trainer_data_parallel

        split = trainer_data_parallel(self)
        if split.sp_size > 1:
            # The Trainer wraps the prepared loader in DeepSpeed's UlyssesSPDataLoaderAdapter, which
            # gathers the SP group's batches and runs them one after another (sp_size micro-steps per
            # loader batch): the plan's steps, the resume position and the global token mean would
            # all be off. tokenbal's own SP splits one packed row instead (collate.sp).
            raise ValueError(f"tokenbal: TrainingArguments.parallelism_config sp_size={split.sp_size} "
                             "(DeepSpeed ALST / Ulysses sequence parallelism) is not supported with "
                             "token-balanced batches: the Trainer re-batches each sequence-parallel group's "
                             "loader through DeepSpeed's UlyssesSPDataLoaderAdapter; set sp_size=1 (or use "
                             "tokenbal's own sequence parallelism: PackedCollator(sp_size=...) with "
                             "enable_packed(model, sp_group=...))")
        if self.tokenbal_packed and split.tp_size * split.cp_size > 1:
            raise ValueError(f"tokenbal: packed=True is not supported under tensor / context parallelism "
                             f"(tp_size={split.tp_size}, cp_size={split.cp_size}, from {split.source}): the "
                             "packed forward (cu_seqlens, per-sample M-RoPE ids) has not been run on "
                             "tensor-parallel weights, and the Trainer's context parallelism splits the "
                             "packed row without its cu_seqlens; use padded batches (packed=False) there")
        return split

    def _tokenbal_steps_per_epoch(self) -> int:
        return len(self.tokenbal_sampler) // self.tokenbal_sampler.grad_accum

    # -- Trainer hooks ---------------------------------------------------------------------------

    def get_train_dataloader(self) -> Any:
        from torch.utils.data import DataLoader
        from transformers.trainer_utils import seed_worker

        from tokenbal.integrations.accelerate import neutralise

        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        dataset, collator = self.train_dataset, self.data_collator
        try:
            import datasets
        except ImportError:
            datasets = None
        if self.tokenbal_packed:
            from tokenbal.integrations.trainer_support import IndexedDataset

            # The packed collator takes what it needs (raw chat rows included) and checks every
            # sample's tokens against the plan's lengths, so it sees whole rows and their index.
            dataset = IndexedDataset(dataset)
        elif datasets is not None and isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description="Training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="Training")
        self._tokenbal_follow_batch_size()
        if len(dataset) != len(self.tokenbal_sampler.lengths):
            raise ValueError(f"token_lengths has {len(self.tokenbal_sampler.lengths)} entries but "
                             f"train_dataset has {len(dataset)} items")
        sampler = self.tokenbal_sampler
        if hasattr(collator, "set_lengths"):
            collator.set_lengths(sampler.lengths)   # an array, not a callable: workers may be spawned
        if not getattr(self, "_tokenbal_logged", False):
            self._tokenbal_logged = True
            _log_plan(sampler, self.tokenbal_packed)
        if self._tokenbal_resume is not None:
            self._load_sampler_state(self._tokenbal_resume)
            self._tokenbal_resume = None
        args = self.args
        params: dict[str, Any] = dict(
            batch_sampler=sampler, collate_fn=collator, num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory, persistent_workers=args.dataloader_persistent_workers,
            multiprocessing_context=_multiprocessing_context(args),
            prefetch_factor=args.dataloader_prefetch_factor,
            worker_init_fn=partial(seed_worker, num_workers=args.dataloader_num_workers,
                                   rank=args.process_index))
        if getattr(args, "dataloader_in_order", True) is not True:
            params["in_order"] = args.dataloader_in_order
        return neutralise(self.accelerator, DataLoader(dataset, **params))

    # packed=True: the packed collator renders whole raw rows (messages, images), so the Trainer's
    # removal of the columns the model's forward does not name would leave it nothing, in the eval
    # and test loaders too (the train loader keeps its rows through IndexedDataset).

    def _remove_unused_columns(self, dataset: Any, description: str | None = None) -> Any:
        if self.tokenbal_packed:
            return dataset
        return super()._remove_unused_columns(dataset, description)

    def _get_collator_with_removed_columns(self, data_collator: Any, description: str | None = None) -> Any:
        if self.tokenbal_packed:
            return data_collator
        return super()._get_collator_with_removed_columns(data_collator, description)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        if isinstance(resume_from_checkpoint, bool) and resume_from_checkpoint:
            from transformers.trainer_utils import get_last_checkpoint

            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        self._tokenbal_resume = resume_from_checkpoint or None
        # A new plan for every train(): a train() stopped mid-epoch (an exception, a KeyboardInterrupt)
        # left the sampler's cursor there, while the Trainer starts again at step 0 (or at the
        # checkpoint's step, whose state is loaded onto the new sampler); it also follows arguments
        # changed in between (num_train_epochs, max_steps: a token budget's epoch steps).
        self._tokenbal_sampler = None
        result = super().train(resume_from_checkpoint, *args, **kwargs)
        destroy_process_group_at_exit()
        return result

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        if self.tokenbal_packed and _is_trl(self):
            # trl's SFTTrainer computes its loss through a fused LM-head forward that calls the
            # backbone directly, past the packed model's entry point (cu_seqlens, M-RoPE ids): use
            # the Trainer's loss, i.e. the model's own forward. trl's token-accuracy / entropy
            # metrics are then not logged.
            from transformers import Trainer

            return Trainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def _get_num_items_in_batch(self, batch_samples: list, device: Any) -> Any:
        # The step's loss tokens over all ranks (the global token mean's divisor): before 5.19 the
        # Trainer counts every label != -100, not the shifted ones a causal LM's loss sums over
        # (padded rows were off by about one per row); count those there too.
        from tokenbal.hf_compat import trainer_counts_shifted_labels

        config = getattr(getattr(self, "model", None), "config", None)
        if not trainer_counts_shifted_labels(self) and not getattr(config, "is_encoder_decoder", False):
            batch_samples = [_labels_shifted_for_count(b) for b in batch_samples]
        return super()._get_num_items_in_batch(batch_samples, device)

    # -- checkpoints -----------------------------------------------------------------------------

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        # transformers 5.x: a Qwen-VL checkpoint's saved names differ from the model's, and the
        # Trainer's plain load_state_dict restores none of them (trainer_support.load_checkpoint_weights).
        if not (self.is_fsdp_enabled or self.is_deepspeed_enabled):
            from tokenbal.integrations.trainer_support import load_checkpoint_weights

            if load_checkpoint_weights(self.model if model is None else model, resume_from_checkpoint):
                return
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: Any) -> None:
        # Before transformers 5.19 the Trainer loads the optimizer state of a multi-process run with
        # map_location=args.device, which accelerate makes "cpu:0" on CPU ranks, and torch cannot
        # restore storages to an indexed CPU device: every CPU (gloo) resume raised. Newer Trainers
        # map to plain "cpu" there; do the same for the duration of the call.
        device = getattr(self.args, "device", None)
        if checkpoint is None or getattr(device, "type", None) != "cpu" or device.index is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        with _plain_cpu_map_location():
            return super()._load_optimizer_and_scheduler(checkpoint)

    def _sampler_state_at(self, global_step: int) -> dict[str, Any]:
        """The sampler state after ``global_step`` optimizer steps (not the sampler's own cursor,
        which runs ahead of training by the loader's look-ahead)."""
        per_epoch = self._tokenbal_steps_per_epoch()
        state = self.tokenbal_sampler.state_dict()
        state["epoch"], steps = divmod(int(global_step), per_epoch)
        state["cursor"] = steps * self.tokenbal_sampler.grad_accum
        state["global_step"] = int(global_step)
        return state

    def _save_sampler_state(self, checkpoint_dir: str, global_step: int) -> None:
        os.makedirs(checkpoint_dir, exist_ok=True)
        with open(os.path.join(checkpoint_dir, SAMPLER_STATE_NAME), "w") as f:
            json.dump(self._sampler_state_at(global_step), f, indent=1, sort_keys=True)

    def _load_sampler_state(self, checkpoint_dir: str) -> None:
        path = os.path.join(checkpoint_dir, SAMPLER_STATE_NAME)
        if not os.path.isfile(path):
            logger.warning("tokenbal: %s has no %s; resuming on the plan of the current settings unchecked",
                           checkpoint_dir, SAMPLER_STATE_NAME)
            return
        with open(path) as f:
            saved = json.load(f)
        with open(os.path.join(checkpoint_dir, "trainer_state.json")) as f:
            global_step = int(json.load(f)["global_step"])
        sampler = self.tokenbal_sampler
        saved_steps = (saved.get("fingerprint") or {}).get("epoch_steps")
        if saved_steps is not None and sampler.epoch_steps is not None and saved_steps != sampler.epoch_steps:
            if saved_steps < sampler.epoch_steps:
                raise ValueError(f"{path}: the checkpoint's run planned {saved_steps} steps per epoch, but "
                                 f"the epochs this run trains need {sampler.epoch_steps} (more epochs than "
                                 "the checkpoint's run?): resume with its num_train_epochs / max_steps")
            sampler.fix_epoch_steps(1, at_least=saved_steps)   # more epochs than before: its steps kept
        # Validates seed, lengths and settings against the checkpoint; the cursor stays 0 because the
        # Trainer itself skips the batches already trained in this epoch.
        try:
            sampler.load_state_dict({**saved, "cursor": 0})
        except ValueError as e:
            # Said in the Trainer's terms: its batch size is per device, and it resumes only on the
            # checkpoint's step settings (its own skip arithmetic assumes them; no elastic resume).
            text = getattr(e, "problem", str(e))   # SetupChangedError: without elastic=True's hint
            raise ValueError(f"{path}: {text}\n(global_batch_size = per_device_train_batch_size x "
                             "data-parallel ranks x gradient_accumulation_steps; the Trainer resumes only "
                             "with the checkpoint's batch size, gradient accumulation, world size and token "
                             "budget)") from None
        expect = self._sampler_state_at(global_step)
        if (saved["epoch"], saved["cursor"]) != (expect["epoch"], expect["cursor"]):
            raise ValueError(f"{path} is at epoch {saved['epoch']} batch {saved['cursor']}, but the trainer "
                             f"state's global_step={global_step} means epoch {expect['epoch']} batch "
                             f"{expect['cursor']}")
        logger.info("tokenbal: resuming epoch %d at batch %d of %d", saved["epoch"], saved["cursor"],
                    len(sampler))


def _padding_free(collator: Any) -> bool:
    """Whether ``collator`` concatenates a micro-batch into one row without padding (transformers'
    ``DataCollatorWithFlattening``, trl's ``padding_free`` collator, a ``PackedCollator``): its cost
    is then the micro-batch's tokens, not count x longest sample."""
    names = {c.__name__ for c in type(collator).__mro__}
    return bool(names & {"DataCollatorWithFlattening", "PackedCollator"}) or \
        getattr(collator, "padding_free", False) is True


def _labels_shifted_for_count(batch: Any) -> Any:
    """``batch`` with ``labels[..., 1:]`` as its labels, for counting loss tokens (unless it carries
    ``shift_labels``, which a Trainer of any version would count as they are)."""
    try:
        labels = batch["labels"]
    except (KeyError, TypeError):
        return batch
    if labels is None or "shift_labels" in batch or not hasattr(labels, "ndim"):
        return batch
    return {**{k: batch[k] for k in batch.keys()}, "labels": labels[..., 1:]}


def _lengths_for(train_dataset: Any, processing_class: Any, token_lengths: Any, who: str,
                 length_column: str = "length") -> Any:
    """The token lengths the sampler plans with: ``token_lengths`` when given; else the dataset's
    ``length_column`` (``TrainingArguments.length_column_name``, ``length`` by default: the column
    the Trainer's length grouping reads); else ``len(input_ids)`` of a tokenized dataset; else
    :func:`dataset_lengths` of its ``messages`` / ``images`` rows under ``processing_class``."""
    if train_dataset is None:
        return None   # no training; get_train_dataloader raises if it is ever asked for
    if not hasattr(train_dataset, "__len__") or not hasattr(train_dataset, "__getitem__"):
        raise TypeError(f"{who} plans whole epochs of a map-style train_dataset (len() and indexing); this "
                        f"one is a {type(train_dataset).__name__} (a stream): for streams use "
                        "tokenbal.data.balanced_batches in the data pipeline, or load the dataset map-style")
    if token_lengths is not None:
        return token_lengths
    from tokenbal.integrations.hf_lengths import lengths_column

    names = list(getattr(train_dataset, "column_names", None) or [])
    for column, what in ((length_column, f"the dataset's {length_column!r} column"),
                         ("input_ids", "len(input_ids) of the tokenized dataset")):
        found = lengths_column(train_dataset, column)
        if found is not None:
            logger.info("tokenbal: token lengths from %s", what)
            return found
    if hasattr(processing_class, "apply_chat_template") and "messages" in names:
        logger.info("tokenbal: computing token lengths with dataset_lengths (chat template + image tokens of "
                    "the processor)")
        return dataset_lengths(train_dataset, processing_class)
    raise TypeError(f"{who} needs token lengths: pass token_lengths= (a TokenIndex or one count per "
                    f"train_dataset item), give the dataset a {length_column!r} (length_column_name) or "
                    "'input_ids' column, or pass "
                    "processing_class=<processor> with a datasets.Dataset of 'messages' (and 'images') rows")


def _multiprocessing_context(args: Any) -> Any:
    """The workers' start method, as the installed Trainer would choose it: the
    ``dataloader_multiprocessing_context`` argument (transformers 5.19 and newer), else what the older
    Trainers hard-code (``"fork"`` on MPS with more than one worker, the platform default otherwise)."""
    if hasattr(args, "dataloader_multiprocessing_context"):
        return args.dataloader_multiprocessing_context
    import torch

    mps = getattr(torch.backends, "mps", None)
    return "fork" if mps is not None and mps.is_available() and args.dataloader_num_workers > 1 else None


@contextlib.contextmanager
def _plain_cpu_map_location() -> Iterator[None]:
    """``torch.load`` with an indexed CPU ``map_location`` (``cpu:0``) mapped to ``"cpu"``, inside."""
    import torch

    load = torch.load

    def plain_cpu_load(*args: Any, **kwargs: Any) -> Any:
        where = kwargs.get("map_location")
        if isinstance(where, (str, torch.device)) and torch.device(where).type == "cpu":
            kwargs["map_location"] = "cpu"
        return load(*args, **kwargs)

    torch.load = plain_cpu_load
    try:
        yield
    finally:
        torch.load = load


_EXIT_HOOK: list[Any] = []


def destroy_process_group_at_exit() -> None:
    """Destroy the default process group when the interpreter exits, if it is still there.

    A gloo rank can abort at exit with ``terminate called without an active exception`` (torchrun
    then returns 1 after a finished training) when the process group's C++ worker threads are still
    running while the interpreter is torn down (pytorch/pytorch#190489; the upstream atexit fix,
    pytorch/pytorch#179291, was abandoned). The threads stop when the group's last holder goes, and
    DDP's reducer in a wrapped model holds it: so a GC pass first frees a model that only reference
    cycles still hold (ms-swift 4.6.0's: with a destroy alone the threads ran at exit on every rank),
    then the group is destroyed. The Trainer never destroys the group, so a finished ``train()``
    registers this once. Registered only after training returned: destroying it while another rank is
    still inside a collective (after an exception here) can hang (pytorch/torchtitan#1342). Calling
    ``destroy_process_group()`` yourself is fine too.
    """
    import atexit
    import gc

    import torch.distributed as dist

    if _EXIT_HOOK or not (dist.is_available() and dist.is_initialized()):
        return

    def destroy() -> None:
        if dist.is_initialized():
            # The group's gloo threads stop when its last holder goes, and DDP's reducer holds it: free
            # what only the cyclic GC would free (a model in a framework's reference cycles) first, so
            # that they stop here, not while the interpreter is being torn down.
            gc.collect()
            dist.destroy_process_group()

    atexit.register(destroy)
    _EXIT_HOOK.append(destroy)


def _is_trl(trainer: Any) -> bool:
    return any(c.__module__.split(".")[0] == "trl" for c in type(trainer).__mro__)


def _bind_trainer_args(parent: Any, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The Trainer arguments by name (``model``, ``train_dataset``, ...), however they were passed."""
    import inspect

    try:
        sig = inspect.signature(parent.__init__)
        named = sig.bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return dict(kwargs)
    out: dict[str, Any] = {}
    for name, value in named.items():
        kind = sig.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            return dict(kwargs)   # cannot name them: only what was passed by keyword (see __init__)
        else:
            out[name] = value
    return out


def _wire_packed(trainer: Any, bound: dict[str, Any]) -> dict[str, Any]:
    """``packed=True``: the model patched for packed rows (``enable_packed``), the collator a
    :class:`collate.PackedCollator` for its config behind per-sample processing and the length check.
    Returns the Trainer's keyword arguments with the collator in place."""
    from collate import PackedCollator
    from collate.models import enable_packed
    from tokenbal.integrations.trainer_support import PackedTrainCollator

    model = bound.get("model")
    if model is None or not hasattr(model, "config"):
        raise ValueError("packed=True needs the model instance (model=...), to patch it and read its config")
    enable_packed(model)
    kwargs = {**bound}
    collator = kwargs.get("data_collator")
    if collator is None:
        collator = PackedCollator.from_config(model.config)
    budget = trainer.tokenbal_sampler_options.get("max_tokens_per_rank")
    # The lengths are known once the Trainer holds its dataset: read them from the sampler when used
    # (through a weak reference: the Trainer holds this collator, see _make_callback).
    trainer_ref = weakref.ref(trainer)
    kwargs["data_collator"] = PackedTrainCollator(collator, lambda: trainer_ref().tokenbal_sampler.lengths,
                                                  budget, kwargs.get("processing_class"))
    return kwargs


def _log_plan(sampler: TokenBalancedBatchSampler, packed: bool) -> None:
    """One info line on what the plan does (visible with log_level="info" or TOKENBAL_VERBOSITY=info)."""
    if not logger.isEnabledFor(logging.INFO):
        return
    plan = sampler.plan()
    mode = (f"max_tokens_per_rank={sampler.max_tokens_per_rank}" if sampler.max_tokens_per_rank is not None
            else f"global_batch_size={sampler.global_batch_size}")
    logger.info("tokenbal: %d samples, %d steps per epoch on %d ranks (%s, grad_accum %d, cost %s, %s)",
                len(sampler.lengths), plan.num_steps, sampler.num_replicas, mode, sampler.grad_accum,
                sampler.cost_name, "packed rows" if packed else "padded batches")


def _make_callback(trainer: TokenBalancingMixin) -> Any:
    from transformers import TrainerCallback

    # A weak reference: the Trainer holds this callback, and a strong one back would put the Trainer
    # (its wrapped model, DDP's reducer and the process group the reducer holds) in a reference cycle
    # that only the cyclic GC frees, often not before interpreter exit: the group's gloo threads then
    # outlive a framework's own destroy_process_group() into interpreter teardown (pytorch#190489).
    trainer_ref = weakref.ref(trainer)

    class TokenBalancedCallback(TrainerCallback):
        """Writes the sampler state into every checkpoint the Trainer saves."""

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            trainer = trainer_ref()
            if trainer is not None and args.should_save and trainer._tokenbal_sampler is not None:
                from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

                ckpt = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
                trainer._save_sampler_state(ckpt, state.global_step)

    return TokenBalancedCallback()


_TRAINER_CLASS: Any = None


def __getattr__(name: str) -> Any:
    # Built on first access so that importing this module does not import transformers.
    global _TRAINER_CLASS
    if name == "TokenBalancedTrainer":
        if _TRAINER_CLASS is None:
            from transformers import Trainer

            class TokenBalancedTrainer(TokenBalancingMixin, Trainer):
                """``transformers.Trainer`` on a token-balanced batch sampler (see
                :mod:`tokenbal.integrations.hf`)."""

            TokenBalancedTrainer.__module__ = __name__
            _TRAINER_CLASS = TokenBalancedTrainer
        return _TRAINER_CLASS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
