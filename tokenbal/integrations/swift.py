"""ms-swift (4.6) on a token-balanced batch sampler, through its own extension point.

    swift sft ... --external_plugins "$(python -m tokenbal.integrations.swift)"

``python -m tokenbal.integrations.swift`` prints the path of ``swift_plugin/tokenbal_plugin.py``
(:func:`plugin_path`), a plugin file that calls :func:`register` with the defaults; for other
options write your own plugin file (any path)::

    from tokenbal.integrations.swift import register
    register(packed=True, max_tokens_per_rank=16384)   # or any TokenBalancingMixin sampler_options

:func:`register` points ms-swift's trainer mapping (``TrainerFactory.TRAINER_MAPPING["causal_lm"]``,
the trainer of ``swift sft``) at ms-swift's own ``Seq2SeqTrainer`` with
:class:`~tokenbal.integrations.hf.TokenBalancingMixin` in front: the train loader is a
:class:`~tokenbal.TokenBalancedBatchSampler`, prepared through accelerate without re-sharding, with
exact mid-epoch resume (its ``tokenbal_sampler.json`` per checkpoint; the Trainer skips the batches
already trained as index lists, so no skipped sample is encoded or loaded).

- **Lengths** (:func:`swift_lengths`): ms-swift's own encoding. With ``--lazy_tokenize false`` its
  ``lengths`` column (one list per row, ``[n]`` for an sft row; the row's length is its largest entry,
  as ms-swift's own ``group_by_length`` reads it); with lazy tokenization (the multimodal default)
  each row is encoded once by ms-swift's template before training. A row ms-swift cannot encode is an
  error naming it (its lazy loader would otherwise swap in a random other row, off the plan).
- **Order.** The dataset is indexed as ms-swift hands it to the trainer, after its load-time shuffle
  (``--dataset_shuffle``, ``--data_seed``); the plan's seed is ``--data_seed`` (else ``--seed``);
  ``--train_dataloader_shuffle false`` plans with ``shuffle=False`` (the same plan every epoch).
- **Cost.** ms-swift pads each micro-batch to its longest row: planned with ``cost="padded"``.
- **Packed** (``register(packed=True, max_tokens_per_rank=N)``), the alternative to ms-swift's
  ``--packing`` / ``--padding_free``: each rank's micro-batch is one packed row of whole items, at
  most ``N`` real tokens, no padding (:class:`collate.PackedCollator`: ``cu_seqlens`` and per-sample
  M-RoPE ids; the model patched by :func:`collate.models.enable_packed`). The items are ms-swift's
  own encoding (its template's ``input_ids``, ``labels``, ``pixel_values``, ``image_grid_thw``). The
  packed model embeds the tokens and runs the vision tower itself, so ms-swift's post-encode hook
  (which would replace ``input_ids`` by its own embeddings and drop the packing fields) is not
  registered for this trainer.
- **Loss.** ms-swift's own normalisation is kept: ``model_accepts_loss_kwargs`` with
  ``average_tokens_across_devices``, i.e. each micro-batch's loss sum over the step's loss tokens on
  all ranks (the global token mean), packed or padded.
- **Sequence parallelism** (``--sequence_parallel_size S``, padded batches): the ``S`` peers of one
  SP group get the same batches, planned over ms-swift's own data-parallel ranks
  (:func:`swift_dp_group`, the group its ``SequenceParallelSampler`` shards over), world / ``S`` of
  them; ms-swift then splits each padded row across the group as it does for its own sampler.
  ``packed=True`` with ``--sequence_parallel_size`` > 1 is refused.
- **Tensor parallelism** (DeepSpeed AutoTP, ``tensor_parallel.autotp_size`` in ``--deepspeed``):
  planned over world / ``autotp_size`` ranks, ``rank // autotp_size``, as ms-swift's own
  ``BatchSamplerShard`` splits them (``dataloader/shard.py``:19-43), through the Trainer mixin's
  :func:`tokenbal.hf_compat.trainer_data_parallel` (not run here: AutoTP needs DeepSpeed on GPUs).
- **Refused**, with a message: ``--packing`` and ``--padding_free`` (rows of their own; use
  ``packed=True`` with ``max_tokens_per_rank`` instead), streaming datasets,
  and any task but ``causal_lm`` (``--task_type seq_cls`` / ``embedding`` / ..., ``swift rlhf``),
  which would otherwise train on ms-swift's own sampler as if the plugin were not there.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

__all__ = ["plugin_path", "register", "swift_dp_group", "swift_lengths", "trainer_class"]

logger = logging.getLogger("tokenbal")

_OPTIONS: dict[str, Any] = {}


def swift_lengths(dataset: Any, *, encode: Any = None) -> np.ndarray:
    """One token count per item of ms-swift's train ``dataset``: its ``lengths`` column when it was
    encoded at load (``--lazy_tokenize false``), else each raw row of its ``LazyLLMDataset`` through
    the dataset's own ``encode_func`` (ms-swift's template). Raises ``ValueError`` naming a row it
    cannot encode or whose ``lengths`` entry is empty."""
    names = set(getattr(dataset, "column_names", None) or [])
    if "lengths" in names:
        values = dataset["lengths"]
    elif hasattr(dataset, "encode_func") and hasattr(dataset, "dataset"):
        encode = dataset.encode_func
        values = []
        for i in range(len(dataset.dataset)):
            try:
                values.append(encode(dataset.dataset[i], return_length=True)["lengths"])
            except Exception as e:
                raise ValueError(f"tokenbal: ms-swift's template cannot encode train row {i} "
                                 f"({type(e).__name__}: {e}); fix or drop the row (ms-swift's lazy loader "
                                 "would train a random other row in its place)") from e
    else:
        raise TypeError(f"tokenbal: no lengths for ms-swift's train dataset {type(dataset).__name__} "
                        "(neither a 'lengths' column nor a LazyLLMDataset)")
    out = np.empty(len(values), dtype=np.int64)
    for i, value in enumerate(values):
        flat = np.asarray(value, dtype=np.int64).reshape(-1)
        if flat.size == 0:
            raise ValueError(f"tokenbal: train row {i} has an empty 'lengths' entry")
        out[i] = flat.max()
    return out


def trainer_class(base: Any, options: dict[str, Any] | None = None) -> Any:
    """ms-swift's trainer ``base`` with the token-balancing mixin in front (``options``: its
    ``sampler_options``, and ``packed``)."""
    from tokenbal.integrations.hf import TokenBalancingMixin

    opts = dict(options or {})
    packed = bool(opts.pop("packed", False))

    class CollatorSlot(base):
        """ms-swift builds its trainer's collator itself (``_get_data_collator``) and passes it on:
        the packed collator the mixin made (``data_collator``) is handed over through that hook."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._tokenbal_collator = kwargs.pop("data_collator", None)
            super().__init__(*args, **kwargs)

        def _get_data_collator(self, *args: Any, **kwargs: Any) -> Any:
            if self._tokenbal_collator is not None:
                return self._tokenbal_collator
            return super()._get_data_collator(*args, **kwargs)

    class TokenBalancedSwiftTrainer(TokenBalancingMixin, CollatorSlot):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            train_args = kwargs.get("args")
            for flag in ("packing", "padding_free"):
                if getattr(train_args, flag, False):
                    raise ValueError(f"tokenbal: --{flag} is not supported with token-balanced batches (use "
                                     "tokenbal's register(packed=True, max_tokens_per_rank=N) instead)")
            sp = int(getattr(kwargs.get("template"), "sequence_parallel_size", None)
                     or getattr(train_args, "sequence_parallel_size", 1) or 1)
            dataset = kwargs.get("train_dataset")
            if dataset is None or not hasattr(dataset, "__len__"):
                raise ValueError("tokenbal: ms-swift's train dataset must have a length (no --streaming)")
            _check_placeholder_ids(kwargs.get("template"), kwargs.get("model"))
            lengths = swift_lengths(dataset)
            options = dict(opts)
            if sp > 1:
                if packed:
                    raise ValueError("tokenbal: packed=True with --sequence_parallel_size > 1 is not "
                                     "supported: ms-swift's sequence parallelism splits padded rows and "
                                     "patches the attention that the packed model replaces; use padded "
                                     "batches (the default plugin) with --sequence_parallel_size")
                # The peers of one SP group share a batch: plan over ms-swift's own data-parallel ranks.
                options.setdefault("dp_group", swift_dp_group(sp))
            if getattr(train_args, "train_dataloader_shuffle", True) is False:
                options.setdefault("shuffle", False)   # ms-swift's own loader would not shuffle either
            super().__init__(*args, token_lengths=lengths, sampler_options=options, packed=packed, **kwargs)
            if packed:
                # The packed model wrapper embeds the tokens and runs the vision tower itself; ms-swift's
                # post-encode hook would swap input_ids for its own embeddings and drop cu_seqlens.
                self.template.register_post_encode_hook = _no_post_encode_hook

    TokenBalancedSwiftTrainer.__qualname__ = f"TokenBalanced{base.__name__}"
    return TokenBalancedSwiftTrainer


def swift_dp_group(sequence_parallel_size: int) -> Any:
    """The process group of ms-swift's data-parallel ranks under ``--sequence_parallel_size`` (its
    ``SequenceParallel`` mesh ``("data", "sequence")`` or ``("data", "ring", "sequence")``, the SP peers
    of one ``"data"`` rank consecutive: ms-swift 4.6 ``sequence_parallel/sequence_parallel.py``:648-668),
    the group its own ``SequenceParallelSampler`` shards over (``sequence_parallel/utils.py``:108-116).
    ``swift sft`` prepares it before the trainer is built (``pipelines/train/sft.py``:55-57)."""
    from swift.sequence_parallel import sequence_parallel

    if sequence_parallel.device_mesh is None or sequence_parallel.world_size != sequence_parallel_size:
        raise RuntimeError(f"tokenbal: ms-swift's sequence parallelism is not prepared for "
                           f"--sequence_parallel_size {sequence_parallel_size} (its SequenceParallel has "
                           f"world size {sequence_parallel.world_size}); cannot tell which ranks share a "
                           "batch")
    return sequence_parallel.dp_group


def _check_placeholder_ids(template: Any, model: Any) -> None:
    """ms-swift's Qwen-VL templates name their image / video placeholder by a fixed id (Qwen2-VL's
    vocabulary: ``image_token_id = 151655``), not the tokenizer's. A checkpoint whose tokenizer puts
    it elsewhere is encoded with one unexpanded placeholder per image: lengths short by every image's
    tokens, and the vision features scattered to the wrong place. Refuse that, naming both ids."""
    config = getattr(model, "config", None)
    for kind in ("image", "video"):
        ours = getattr(template, f"{kind}_token_id", None)
        theirs = getattr(config, f"{kind}_token_id", None)
        if ours is not None and theirs is not None and int(ours) != int(theirs):
            raise ValueError(f"tokenbal: ms-swift's template {type(template).__name__} uses {kind}_token_id="
                             f"{ours} but the model's config has {kind}_token_id={theirs}: ms-swift would "
                             f"not expand the {kind} placeholders of this checkpoint")


def _no_post_encode_hook(models: Any) -> None:
    """Stands in for the template's ``register_post_encode_hook`` under the packed path."""


def register(**sampler_options: Any) -> None:
    """Make ``swift sft`` (task ``causal_lm``) train on tokenbal's sampler; call it from an
    ``--external_plugins`` file. ``sampler_options``: as
    :class:`~tokenbal.integrations.hf.TokenBalancingMixin`'s."""
    from swift.trainers.trainer_factory import TrainerFactory

    from tokenbal.integrations.hf import unknown_sampler_options

    unknown = unknown_sampler_options(sampler_options, extra=("packed",))
    if unknown:
        # refused here, as the plugin loads, not at the first train step after the model has loaded
        raise ValueError(f"tokenbal: register() got unknown option(s) {', '.join(unknown)} (it takes "
                         "TokenBalancedBatchSampler's options, e.g. max_tokens_per_rank, seed, window, and "
                         "packed)")
    if not isinstance(sampler_options.get("packed", False), bool):
        raise ValueError(f"tokenbal: packed must be True or False, got {sampler_options['packed']!r}")
    _OPTIONS.clear()
    _OPTIONS.update(sampler_options)
    mapping = TrainerFactory.TRAINER_MAPPING
    mapping["causal_lm"] = f"{__name__}.TokenBalancedSeq2SeqTrainer"
    # ms-swift picks the trainer by --task_type (or swift rlhf's --rlhf_type): with the plugin loaded,
    # any other task would silently train on ms-swift's own sampler. Point those at a name that
    # refuses, naming the task (a trainer a user's own plugin registered there is left alone).
    for task, target in list(mapping.items()):
        if task != "causal_lm" and target.startswith("swift."):
            _UNSUPPORTED[task] = target
            mapping[task] = f"{__name__}.{_UNSUPPORTED_PREFIX}{task}"


_UNSUPPORTED: dict[str, str] = {}     # task -> ms-swift's own trainer, for the refusal's message
_UNSUPPORTED_PREFIX = "UnsupportedTask_"


def __getattr__(name: str) -> Any:
    if name.startswith(_UNSUPPORTED_PREFIX) and name[len(_UNSUPPORTED_PREFIX):] in _UNSUPPORTED:
        task = name[len(_UNSUPPORTED_PREFIX):]
        raise ValueError(f"tokenbal: the ms-swift plugin balances `swift sft` / `swift pt` (task_type "
                         f"causal_lm) only; {task!r} would train with ms-swift's own {_UNSUPPORTED[task]} "
                         "and its sampler, not token-balanced. Remove tokenbal's --external_plugins "
                         "file for this run")
    # Built on first access (by ms-swift's TrainerFactory), so importing this module imports no ms-swift.
    if name == "TokenBalancedSeq2SeqTrainer":
        from swift.trainers import Seq2SeqTrainer

        cls = trainer_class(Seq2SeqTrainer, _OPTIONS)
        cls.__module__ = __name__
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def plugin_path() -> str:
    """The path of the ready ``--external_plugins`` file (:func:`register` with the defaults)."""
    import os

    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "swift_plugin", "tokenbal_plugin.py")


if __name__ == "__main__":
    print(plugin_path())
