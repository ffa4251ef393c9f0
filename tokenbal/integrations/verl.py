"""verl (0.9.1): a token-balanced SFT trainer and a vision-aware ``balance_batch`` for the RL trainer.

SFT. verl's ``SFTTrainer`` builds its loader in ``_build_dataloader`` (a ``DistributedSampler`` over
the data-parallel ranks, a fixed ``train_batch_size // dp_size`` per rank) and its ``fit()`` calls
``self.train_sampler.set_epoch(epoch=...)`` and checkpoints ``self.train_dataloader.state_dict()``
per DP rank (torchdata's ``StatefulDataLoader``). :func:`sft_trainer_class` returns a subclass
whose ``_build_dataloader`` puts a :class:`~tokenbal.TokenBalancedBatchSampler` there instead:

* planned over the **data-parallel** ranks (``engine.get_data_parallel_rank/size``: the Ulysses
  peers of one DP rank get the same samples), ``global_batch_size = data.train_batch_size``
  samples per step, every sample once per epoch, every rank the same number of steps;
* lengths from a tokenbal index built from the same Parquet files (``tokenbal index build
  train.parquet --processor MODEL_DIR --out IDX``: image tokens from image headers, text from the
  chat template; the processor is never run over the dataset);
* kept on ``self.train_sampler``, so ``fit()``'s ``set_epoch`` reaches it, and resumed through
  the ``StatefulDataLoader`` state verl saves per DP rank (mid-epoch, and at an epoch's end, where
  :class:`~tokenbal.integrations._resume.EpochFollowingSampler` starts the epoch ``fit()`` asks for).

Two places of verl assume what its ``DistributedSampler`` gives (the same number of samples on every
rank, the first sample of a batch carrying every key) and are made safe here:

* ``collate_variable_batch`` (``pad_mode=no_padding``) reads each key's type from the batch's first
  item, so a text-only item first in a batch with images raises ``KeyError: 'multi_modal_inputs'``;
  :class:`FirstItemComplete` puts an item holding every key first (verl's model input builder
  already skips the ``None`` entries of text-only items);
* ``SFTTrainer._get_batch_seqlens`` gathers per-sample lengths with ``all_gather_into_tensor``,
  which needs equal sample counts per rank (gloo aborts, NCCL reads garbage); the subclass gathers
  unequal counts (:func:`gather_lengths`).

The rest of verl's step is count-agnostic when ``data.use_dynamic_bsz=True`` (verl's default): its
micro-batches are cut by ``max_token_len_per_gpu`` and their count is agreed over the DP group
(``all_reduce(MAX)``), and the loss is normalised by the DP group's summed loss-mask tokens. With
``use_dynamic_bsz=False`` verl cuts fixed-size micro-batches and needs equal counts: refused with
an error rather than a hang.

Run it (every rank; verl's own Hydra config and overrides, plus ``tokenbal.*``)::

    torchrun --nproc-per-node 8 -m tokenbal.integrations.verl \\
        data.train_files=train.parquet model.path=Qwen/Qwen2-VL-2B-Instruct \\
        data.train_batch_size=64 trainer.total_epochs=2 \\
        +tokenbal.index=IDX [+tokenbal.seed=0] [+tokenbal.cost=flops +tokenbal.stages=true]

RL. ``RayPPOTrainer._balance_batch`` reorders a rollout batch so each DP rank gets similar
``attention_mask`` sums (Karmarkar-Karp, equal counts), with no term for the vision tower.
:func:`balance_batch` is a drop-in replacement that balances tokenbal's FLOPs cost of each sample,
vision tower (its ``image_grid_thw`` patches) plus language model (its tokens, attention included)::

    from tokenbal.integrations.verl import patch_rl_trainer
    patch_rl_trainer()      # RayPPOTrainer._balance_batch = tokenbal's balance_batch

Importing this module imports neither verl nor transformers.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["FirstItemComplete", "balance_batch", "balanced_partitions", "gather_lengths", "index_lengths",
           "main", "patch_rl_trainer", "sample_costs", "sft_trainer_class"]


# --- collate --------------------------------------------------------------------------------------

class FirstItemComplete:
    """Wraps a collate function that reads each key's type from ``batch[0]`` (verl's
    ``SFTTensorCollator`` with ``pad_mode=no_padding``): an item holding every key of the batch is
    moved first (order otherwise kept). Keys missing from every item that could go first are
    filled with ``None`` on a copy of the first item when the other items hold non-tensors there
    (verl's ``multi_modal_inputs`` dict); a tensor key missing from some items cannot be batched
    and raises, naming the key and the items."""

    def __init__(self, collate: Any) -> None:
        self.collate = collate

    def __call__(self, batch: list[dict]) -> Any:
        return self.collate(complete_first(batch))

    def __getattr__(self, name: str) -> Any:   # pad_mode and the rest of the wrapped collator
        return getattr(self.collate, name)


def complete_first(batch: list[dict]) -> list[dict]:
    """``batch`` reordered (or its first item completed) so that ``batch[0]`` has every key."""
    if not batch:
        return batch
    keys = set().union(*(item.keys() for item in batch))
    for i, item in enumerate(batch):
        if keys <= item.keys():
            return batch if i == 0 else [item, *batch[:i], *batch[i + 1:]]
    import torch

    first = dict(max(batch, key=len))
    for key in keys - first.keys():
        holders = [j for j, item in enumerate(batch) if key in item]
        if any(isinstance(batch[j][key], torch.Tensor) for j in holders):
            missing = [j for j, item in enumerate(batch) if key not in item]
            raise ValueError(f"cannot batch tensor key {key!r}: items {missing} of the batch lack it "
                             f"(items {holders} have it)")
        first[key] = None
    rest = list(batch)
    rest.remove(max(batch, key=len))
    return [first, *rest]


# --- gathers --------------------------------------------------------------------------------------

def gather_lengths(lengths: Any, group: Any = None, device: Any = None) -> list[int]:
    """Every rank's per-sample lengths of ``group``, concatenated in rank order, for any number of
    samples per rank (``all_gather_into_tensor`` needs the same count everywhere). Two collectives:
    the counts, then the lengths padded to the largest count. ``device``: where they travel; by
    default the group's own device (:func:`tokenbal.parallel.collective_device`)."""
    import torch
    import torch.distributed as dist

    from tokenbal.parallel import collective_device

    local = torch.as_tensor(lengths).reshape(-1)
    local = local.to(collective_device(group) if device is None else device)
    size = dist.get_world_size(group)
    count = torch.tensor([local.numel()], dtype=torch.int64, device=local.device)
    counts = torch.empty(size, dtype=torch.int64, device=local.device)
    dist.all_gather_into_tensor(counts, count, group=group)
    counts = counts.tolist()
    padded = torch.zeros(max(counts), dtype=local.dtype, device=local.device)
    padded[: local.numel()] = local
    out = torch.empty(size * max(counts), dtype=local.dtype, device=local.device)
    dist.all_gather_into_tensor(out, padded, group=group)
    rows = out.reshape(size, max(counts)).tolist()
    return [v for row, n in zip(rows, counts, strict=True) for v in row[:n]]


# --- lengths --------------------------------------------------------------------------------------

def index_lengths(index: Any, dataset_len: int, files: Sequence[str] = (), max_samples: int = -1,
                  shuffle: bool = False) -> Any:
    """The index (a ``TokenIndex`` or its folder) checked against the dataset verl built from
    ``files``: one row per dataset row, in the same order. verl reads every row of every file
    (``MultiTurnSFTDataset``), or the first ``max_samples`` without ``data.shuffle``."""
    from tokenbal.index.store import TokenIndex

    idx = TokenIndex.open(index) if isinstance(index, (str, os.PathLike)) else index
    if len(idx.errors):
        raise ValueError(f"the tokenbal index has {len(idx.errors)} row(s) it could not count (first: "
                         f"{idx.errors[0]}); verl's dataset keeps every row, so the lengths would not "
                         "line up")
    n = len(idx)
    if 0 < max_samples < n:
        if shuffle:
            raise ValueError("data.train_max_samples with data.shuffle picks random rows; index those rows "
                             "(or drop train_max_samples) so the lengths line up")
        n = max_samples
    if n != dataset_len:
        raise ValueError(f"the tokenbal index has {n} rows, verl's dataset {dataset_len}: build the index "
                         "from the same data.train_files, in the same order")
    names = [os.path.basename(str(f)) for f in files]
    if names:
        order = _file_order(idx.keys[i] for i in range(n))
        # The keys name a file by its base name only: files of one name in different folders, one after
        # the other (gsm8k/train.parquet, math/train.parquet), read as one run of keys.
        if order and order != _runs(f for f in names if f in order):
            raise ValueError(f"the index holds the files in the order {order}, data.train_files is {names}")
    return idx if n == len(idx) else np.asarray(idx.lengths[:n])


def _file_order(keys: Any) -> list[str]:
    # A Parquet row's key is "<file name>:<row group>:<row>" (tokenbal.index.parquet).
    return _runs(key.rsplit(":", 2)[0] for key in keys)


def _runs(names: Any) -> list[str]:
    # The names in order, each run of equal neighbours once.
    out: list[str] = []
    for name in names:
        if not out or out[-1] != name:
            out.append(name)
    return out


# --- the SFT trainer ------------------------------------------------------------------------------

# The keys of the config's `tokenbal` node sft_trainer_class reads; any other is refused.
TOKENBAL_OPTIONS = ("index", "seed", "cost", "stages", "window")


def sft_trainer_class() -> type:
    """verl's ``SFTTrainer`` with tokenbal's loader (verl is imported here, not at module import).
    Options come from the config's ``tokenbal`` node: ``index`` (required), ``seed`` (default 0),
    ``cost`` (``"tokens"`` or ``"flops"``), ``stages``, ``window``; any other key is refused."""
    from verl.trainer.sft_trainer import SFTTrainer

    class TokenBalancedSFTTrainer(SFTTrainer):
        def _build_dataloader(self) -> None:
            super()._build_dataloader()   # verl's val loader, collator and attributes as they are
            from torchdata.stateful_dataloader import StatefulDataLoader

            from tokenbal.integrations._resume import EpochFollowingSampler

            config = self.config
            if config.data.get("use_dynamic_bsz", True) is False:
                raise ValueError("tokenbal gives DP ranks different sample counts per step; verl's fixed "
                                 "micro-batches (data.use_dynamic_bsz=False) need equal counts. Use "
                                 "data.use_dynamic_bsz=True with data.max_token_len_per_gpu")
            options = dict(config.get("tokenbal") or {})
            unknown = sorted(set(options) - set(TOKENBAL_OPTIONS))
            if unknown:
                # A misspelt or unsupported key (+tokenbal.max_tokens_per_rank) would otherwise be dropped
                # without a word and the run planned on the defaults.
                named = ", ".join("+tokenbal." + k for k in unknown)
                known = ", ".join("+tokenbal." + k for k in TOKENBAL_OPTIONS)
                raise ValueError(f"tokenbal: unknown option(s) {named}; the verl SFT trainer takes {known} "
                                 "(a step is data.train_batch_size samples; verl's token budget per "
                                 "micro-batch is data.max_token_len_per_gpu)")
            if "index" not in options:
                raise ValueError("tokenbal: pass +tokenbal.index=DIR (a `tokenbal index build` of "
                                 "data.train_files)")
            data = config.data
            files = [data.train_files] if isinstance(data.train_files, str) else list(data.train_files)
            lengths = index_lengths(options["index"], len(self.train_dataset), files,
                                    data.get("train_max_samples", -1), data.get("shuffle", False))
            self.train_sampler = EpochFollowingSampler(
                lengths, num_replicas=self.engine.get_data_parallel_size(),
                rank=self.engine.get_data_parallel_rank(), global_batch_size=config.data.train_batch_size,
                seed=int(options.get("seed", 0)), cost=_cost(options, self.model_config),
                stages=options.get("stages"), window=options.get("window"),
                verify=False)   # ranks of one Ulysses group share a plan: the group-wide check would differ
            self.train_sampler.framework = "verl"
            self.collate_fn = FirstItemComplete(self.collate_fn)
            self.train_dataloader = StatefulDataLoader(
                dataset=self.train_dataset, batch_sampler=self.train_sampler, collate_fn=self.collate_fn,
                num_workers=config.data.num_workers, pin_memory=False)

        def _get_batch_seqlens(self, data: Any) -> list[int]:
            if data["input_ids"].is_nested:
                seqlens = data["input_ids"].offsets().diff()
            else:
                seqlens = data["attention_mask"].sum(dim=-1)
            group = self.engine.get_data_parallel_group()
            if self.engine.get_data_parallel_size() == 1 or group is None:
                return seqlens.tolist()
            return gather_lengths(seqlens, group, device=self.device_name)

    return TokenBalancedSFTTrainer


def _cost(options: dict, model_config: Any) -> Any:
    cost = options.get("cost")
    if cost in (None, "tokens"):
        return None
    if cost == "flops":
        from tokenbal.balance.cost import FlopsModel

        return FlopsModel.from_config(model_config.hf_config)
    raise ValueError(f"tokenbal.cost must be 'tokens' or 'flops', got {cost!r}")


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m tokenbal.integrations.verl OVERRIDES...``: verl's ``verl.trainer.sft_trainer``
    entry (its Hydra config ``sft_trainer_engine``) with :func:`sft_trainer_class`."""
    import sys

    import hydra
    import verl.trainer.sft_trainer as sft
    from verl.utils.device import auto_set_device
    from verl.utils.distributed import destroy_global_process_group, initialize_global_process_group

    config_dir = os.path.join(os.path.dirname(sft.__file__), "config")

    @hydra.main(config_path=config_dir, config_name="sft_trainer_engine", version_base=None)
    def run(config: Any) -> None:
        auto_set_device(config)
        initialize_global_process_group()
        trainer = sft_trainer_class()(config=config)
        trainer.fit()
        destroy_global_process_group()

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    run()


# --- RL: balance_batch ----------------------------------------------------------------------------

def sample_costs(batch: Any, model: Any = None) -> np.ndarray:
    """tokenbal's cost of each sample of a verl ``DataProto`` rollout batch: its tokens
    (``attention_mask`` sums) and, when ``model`` (a :class:`~tokenbal.balance.cost.FlopsModel` or a
    transformers config) has a vision tower, its images' patches (``multi_modal_inputs``'s
    ``image_grid_thw`` / ``video_grid_thw``); int64 token-equivalents. Without ``model``: tokens."""
    mask = batch.batch["attention_mask"]
    tokens = mask.reshape(mask.shape[0], -1).sum(-1).cpu().numpy().astype(np.int64)
    if model is None:
        return tokens
    from tokenbal.balance.cost import FlopsModel

    flops = model if isinstance(model, FlopsModel) else FlopsModel.from_config(model)
    mm = batch.non_tensor_batch.get("multi_modal_inputs") if hasattr(batch, "non_tensor_batch") else None
    if mm is None or flops.vision_layers == 0:
        return flops.token_equivalents(tokens)
    offsets, per_image = [0], []
    for inputs in mm:
        for key in ("image_grid_thw", "video_grid_thw"):
            grid = (inputs or {}).get(key)
            if grid is not None:
                # An image's placeholder tokens: its t·h·w patches merged merge² to one.
                per_image.extend((np.asarray(grid).reshape(-1, 3).prod(1) // flops.merge_size ** 2).tolist())
        offsets.append(len(per_image))
    table = (np.asarray(offsets), np.asarray(per_image, np.int64))
    return flops.token_equivalents(tokens, image_tokens=table)


def balanced_partitions(costs: np.ndarray, dp_size: int) -> list[list[int]]:
    """``costs`` split into ``dp_size`` lists of sample indices with equal counts (verl dispatches
    equal chunks) and the largest cost sum as small as tokenbal's partition makes it."""
    from tokenbal.balance.partition import partition

    costs = np.asarray(costs, np.int64)
    if len(costs) % dp_size:
        raise ValueError(f"a batch of {len(costs)} samples does not split evenly over {dp_size} DP ranks")
    bins = partition(costs, dp_size, equal_counts=True, refine=True)
    return [np.flatnonzero(bins == r).tolist() for r in range(dp_size)]


def balance_batch(self: Any, batch: Any, metrics: dict, logging_prefix: str = "global_seqlen",
                  keep_minibatch: bool = False) -> None:
    """Drop-in for ``RayPPOTrainer._balance_batch`` (verl 0.9.1's signature): reorders ``batch`` so
    that verl's equal-chunk dispatch gives each DP rank a similar vision-tower + LLM cost, and adds
    verl's ``global_seqlen`` metrics plus ``{prefix}/tokenbal_cost_max_over_mean``. The model's
    config is read once from ``actor_rollout_ref.model.path``. ``keep_minibatch=True`` balances
    each PPO mini-batch separately, like verl. PrefixGrouper batches go to verl's own method."""
    if getattr(self, "use_prefix_grouper", False) and "uid" in batch.non_tensor_batch:
        if _VERL_BALANCE_BATCH is None:
            raise RuntimeError("PrefixGrouper batches need verl's own _balance_batch: install this one with "
                               "tokenbal.integrations.verl.patch_rl_trainer()")
        return _VERL_BALANCE_BATCH(self, batch, metrics, logging_prefix, keep_minibatch)
    import torch
    from verl.utils.seqlen_balancing import log_seqlen_unbalance

    model = getattr(self, "_tokenbal_flops", None)
    if model is None:
        from tokenbal.balance.cost import FlopsModel

        model = FlopsModel.from_config(_hf_config(self.config.actor_rollout_ref.model.path))
        self._tokenbal_flops = model
    costs = sample_costs(batch, model)
    dp_size = self._get_dp_size(self.actor_rollout_wg, "actor")
    if keep_minibatch:
        size = self.config.actor_rollout_ref.actor.get("ppo_mini_batch_size")
        if len(costs) % size:
            raise ValueError(f"keep_minibatch: a batch of {len(costs)} samples is not whole mini-batches "
                             f"of ppo_mini_batch_size={size}")
        parts: list[list[int]] = [[] for _ in range(dp_size)]
        for start in range(0, len(costs), size):
            for r, part in enumerate(balanced_partitions(costs[start:start + size], dp_size)):
                parts[r].extend(i + start for i in part)
    else:
        parts = balanced_partitions(costs, dp_size)
    for r, part in enumerate(parts):
        # Like verl: light micro-batches at both ends of each rank's list (pipeline bubbles).
        part.sort(key=lambda i: (costs[i], i))
        parts[r] = part[::2] + part[1::2][::-1]
    batch.reorder(torch.tensor([i for part in parts for i in part]))
    seqlens = batch.batch["attention_mask"].reshape(len(costs), -1).sum(-1)
    # the reorder moved the rows: partition r is now the r-th equal chunk
    chunk = len(costs) // dp_size
    chunks = [list(range(r * chunk, (r + 1) * chunk)) for r in range(dp_size)]
    metrics.update(log_seqlen_unbalance(seqlen_list=seqlens.tolist(), partitions=chunks,
                                        prefix=logging_prefix))
    loads = [float(costs[p].sum()) for p in parts]
    metrics[f"{logging_prefix}/tokenbal_cost_max_over_mean"] = max(loads) / max(np.mean(loads), 1e-9)


_VERL_BALANCE_BATCH: Any = None


def patch_rl_trainer(trainer_cls: Any = None) -> None:
    """Make :func:`balance_batch` the ``_balance_batch`` of verl's ``RayPPOTrainer`` (or of
    ``trainer_cls``), keeping verl's own for PrefixGrouper batches. Call before the trainer runs."""
    global _VERL_BALANCE_BATCH
    if trainer_cls is None:
        from verl.trainer.ppo.ray_trainer import RayPPOTrainer as trainer_cls
    if trainer_cls._balance_batch is not balance_batch:
        _VERL_BALANCE_BATCH = trainer_cls._balance_batch
        trainer_cls._balance_batch = balance_batch


def _hf_config(path: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, trust_remote_code=True)


if __name__ == "__main__":
    main()
