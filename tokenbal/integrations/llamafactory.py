"""LLaMA-Factory (0.9.5) on a token-balanced batch sampler.

    python -m tokenbal.integrations.llamafactory train CONFIG.yaml [key=value ...]

in place of ``llamafactory-cli train CONFIG.yaml``: the same YAML (and the same ``key=value``
overrides), with tokenbal's options under a top-level ``tokenbal:`` key (``tokenbal: {}`` for the
defaults; any :class:`~tokenbal.integrations.hf.TokenBalancingMixin` ``sampler_options`` key, e.g.
``max_tokens_per_rank``, ``seed``, ``window``, ``cost``; and ``packed: true``, see below). Several
ranks as LLaMA-Factory's own CLI starts them: ``FORCE_TORCHRUN=1 NPROC_PER_NODE=2 python -m
tokenbal.integrations.llamafactory train CONFIG.yaml`` (also ``NNODES`` / ``NODE_RANK`` /
``MASTER_ADDR`` / ``MASTER_PORT``, ``RDZV_ID`` / ``MIN_NNODES`` / ``MAX_NNODES`` / ``MAX_RESTARTS`` and
``OPTIM_TORCH``, as its launcher reads them), or under ``torchrun --nproc-per-node 2 -m
tokenbal.integrations.llamafactory train CONFIG.yaml``.

What it changes in LLaMA-Factory's ``sft`` stage, and nothing else: its trainer
(``CustomSeq2SeqTrainer``) gets :class:`~tokenbal.integrations.hf.TokenBalancingMixin` in front, so
the train loader is a :class:`~tokenbal.TokenBalancedBatchSampler` over LLaMA-Factory's own tokenized
dataset, planned for the padded cost of its padding collator, never re-sharded by accelerate, with
exact mid-epoch resume (``resume_from_checkpoint``).

- **Lengths** (:func:`llamafactory_lengths`): per row, the text tokens of LLaMA-Factory's own encoding
  (its template) plus, per image, tokenbal's header-only estimate (no image is decoded, no image
  processor runs) of what LLaMA-Factory makes of it: its own resize above ``image_max_pixels`` /
  below ``image_min_pixels`` (and the Qwen-VL plugin's 28-pixel and aspect-ratio clamps) before the
  processor's ``smart_resize``. Every row is then compared with LLaMA-Factory's tokenized
  ``input_ids``: a row that disagrees (an image the estimate sizes differently, a row cut at
  ``cutoff_len``) is an error naming it, never a silent plan.
- **Packed** (``tokenbal: {packed: true, max_tokens_per_rank: N}``), the alternative to
  LLaMA-Factory's ``packing`` / ``neat_packing``: each rank's micro-batch is one packed row of whole
  samples, at most ``N`` real tokens, no padding (:class:`collate.PackedCollator` with ``cu_seqlens``
  and per-sample M-RoPE ids; the model patched by :func:`collate.models.enable_packed`). The rows stay
  LLaMA-Factory's: its tokenized ``input_ids`` / ``labels`` (its template, its label mask), and each
  row's images and videos through its own mm_plugin (``get_mm_inputs``: its resize, then the processor)
  (:class:`LlamaFactorySamples`). Without ``max_tokens_per_rank`` a step holds
  ``per_device_train_batch_size`` x ranks x ``gradient_accumulation_steps`` samples, split by tokens.
  Image and video rows are packed alike (each video through the plugin's own frame sampling).
- **Loss.** With a multimodal processor LLaMA-Factory normalises the loss per micro-batch
  (``model_accepts_loss_kwargs = False``, after transformers#36044); that is kept as it is: padded,
  the token mean of each micro-batch; packed, the token mean of each rank's packed row (as with
  LLaMA-Factory's own ``neat_packing``), equal to the token-weighted mean of its samples' own losses.
- **Refused**, with a message: stages other than ``sft``, ``packing`` / ``neat_packing``
  (LLaMA-Factory packs at preprocessing, so its rows would no longer be the samples), ``streaming``,
  multimodal plugins other than ``Qwen2VLPlugin`` (named in the message), audio rows, and what trains
  past LLaMA-Factory's ``CustomSeq2SeqTrainer`` (``use_hyper_parallel``, ``USE_MCA=1``, ``USE_RAY=1``).

Videos (``Qwen2VLPlugin``): counted from the container header as LLaMA-Factory itself counts them
(:func:`lf_video_tokens`: its ``video_fps`` / ``video_maxlen`` / ``video_max_pixels`` /
``video_min_pixels``), and checked against its ``input_ids`` like images.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

__all__ = ["LlamaFactorySamples", "lf_image_size", "lf_video_frames", "lf_video_tokens",
           "llamafactory_lengths", "main", "trainer_class"]

logger = logging.getLogger("tokenbal")

_USAGE = "usage: python -m tokenbal.integrations.llamafactory train CONFIG.yaml [key=value ...]"
# LLaMA-Factory's mm_plugins whose image expansion llamafactory_lengths models (Qwen2VLPlugin's
# process_messages: <|vision_start|> + image_token x grid/merge^2 + <|vision_end|> per image).
_QWEN_PLUGINS = ("Qwen2VLPlugin",)


# -- lengths ----------------------------------------------------------------------------------------

def lf_image_size(width: int, height: int, max_pixels: int, min_pixels: int) -> tuple[int, int]:
    """The size LLaMA-Factory's Qwen-VL plugin hands the image processor (``BasePlugin._preprocess_image``
    then ``Qwen2VLPlugin._preprocess_image``, 0.9.5): scaled down to ``max_pixels`` / up to
    ``min_pixels`` (sides truncated to int), sides below 28 raised to 28, aspect ratios over 200 cut."""
    import math

    if width * height > max_pixels:
        f = math.sqrt(max_pixels / (width * height))
        width, height = int(width * f), int(height * f)
    if width * height < min_pixels:
        f = math.sqrt(min_pixels / (width * height))
        width, height = int(width * f), int(height * f)
    if min(width, height) < 28:
        width, height = max(width, 28), max(height, 28)
    if width / height > 200:
        width, height = height * 180, height
    if height / width > 200:
        width, height = width, width * 180
    return width, height


def lf_video_frames(frames: int, duration: float, video_fps: float, video_maxlen: int) -> int:
    """The frames LLaMA-Factory 0.9.5's Qwen-VL plugin counts for a video whose stream header says
    ``frames`` frames over ``duration`` seconds (``BasePlugin._get_video_sample_indices``:
    ``floor(duration x video_fps)``, at least 1, at most ``frames`` and ``video_maxlen``; a header
    without a frame count gets ``video_maxlen``), rounded up to even (its plugin repeats the last)."""
    import math

    if frames == 0:
        n = video_maxlen
    else:
        n = min(frames, video_maxlen, max(1, math.floor(duration * video_fps)))
    return n + n % 2


def lf_video_tokens(video: Any, processor: Any) -> int:
    """Video placeholder tokens LLaMA-Factory 0.9.5's ``Qwen2VLPlugin`` expands ``video`` (a path) to,
    from the container header alone, as its own ``_get_qwen_video_grid_metadata`` does: the header's
    frame count, stream duration and frame size; its ``video_fps`` / ``video_maxlen`` sampling
    (:func:`lf_video_frames`); its resize to ``video_max_pixels`` / ``video_min_pixels``
    (:func:`lf_image_size`); the video processor's ``smart_resize`` and patch sizes. Raises
    ``ValueError`` where LLaMA-Factory would decode the video to count it (no duration or frame rate
    in the header), which tokenbal does not model."""
    import math

    from tokenbal.estimate.qwen import smart_resize
    from tokenbal.index.video import _av

    av = _av()
    with av.open(os.fspath(video), "r") as container:   # headers only: no frame is decoded
        stream = next((s for s in container.streams if s.type == "video"), None)
        if stream is None or stream.duration is None or not stream.average_rate:
            raise ValueError(f"{video}: no video stream with a duration and frame rate in its header; "
                             "LLaMA-Factory decodes such a video to count it, which tokenbal does not model")
        frames, duration = int(stream.frames), float(stream.duration * stream.time_base)
        width, height = int(stream.width), int(stream.height)
    image_processor = processor.image_processor
    video_processor = getattr(processor, "video_processor", None) or image_processor
    size = video_processor.size
    min_px = size["shortest_edge"] if isinstance(size, dict) else size.shortest_edge
    max_px = size["longest_edge"] if isinstance(size, dict) else size.longest_edge
    n = lf_video_frames(frames, duration, float(getattr(processor, "video_fps", 2.0)),
                        int(getattr(processor, "video_maxlen", 128)))
    w, h = lf_image_size(width, height, int(getattr(processor, "video_max_pixels", 256 * 256)),
                         int(getattr(processor, "video_min_pixels", 16 * 16)))
    patch, merge = int(video_processor.patch_size), int(video_processor.merge_size)
    rh, rw = smart_resize(h, w, patch * merge, min_px, max_px)
    cells = math.ceil(n / int(video_processor.temporal_patch_size)) * (rh // patch) * (rw // patch)
    return cells // int(image_processor.merge_size) ** 2


def _image_path(image: Any) -> Any:
    if isinstance(image, dict):
        return image.get("bytes") or image.get("path")
    return image


def _header_size(image: Any) -> tuple[int, int]:
    from tokenbal.index.imagesize import image_size

    if isinstance(image, (bytes, bytearray)):
        return image_size(bytes(image))
    with open(image, "rb") as f:
        head = f.read(1 << 16)
        try:
            return image_size(head)
        except Exception:   # the header lies past the first 64 KiB: read the whole file
            f.seek(0)
            return image_size(f.read())


def _rows(dataset: Any, columns: Sequence[str]) -> Iterator[dict[str, Any]]:
    names = set(getattr(dataset, "column_names", None) or [])
    keep = [c for c in columns if c in names]
    if hasattr(dataset, "select_columns"):
        for batch in dataset.select_columns(keep).iter(batch_size=1024):
            for i in range(len(batch[keep[0]])):
                yield {c: batch[c][i] for c in keep}
    else:
        for row in dataset:
            yield {c: row.get(c) for c in keep}


def llamafactory_lengths(dataset: Any, processor: Any, template: Any) -> np.ndarray:
    """One token count per row of LLaMA-Factory's tokenized train ``dataset`` (``input_ids``,
    ``images``, ``videos``, ``audios`` columns): the row's text tokens plus tokenbal's estimate of its
    images under LLaMA-Factory's settings (``processor.image_max_pixels`` / ``image_min_pixels``, set
    by its ``patch_processor``), checked row by row against ``len(input_ids)``; raises ``ValueError``
    naming the rows that disagree."""
    from tokenbal.estimate import estimator_from_processor

    plugin = getattr(template, "mm_plugin", None)
    plugin_name = type(plugin).__name__
    image_token = getattr(plugin, "image_token", None)
    estimator = None
    if processor is not None and image_token is not None:
        if plugin_name not in _QWEN_PLUGINS:
            raise ValueError(f"tokenbal: LLaMA-Factory's {plugin_name} is not modelled (supported: "
                             f"{', '.join(_QWEN_PLUGINS)} and text-only templates)")
        if not getattr(plugin, "expand_mm_tokens", True):
            raise ValueError("tokenbal: the template does not expand image tokens (expand_mm_tokens=False)")
        estimator = estimator_from_processor(processor)
        image_token_id = processor.tokenizer.convert_tokens_to_ids(image_token)
        video_token = getattr(plugin, "video_token", None)
        video_token_id = (None if video_token is None
                          else processor.tokenizer.convert_tokens_to_ids(video_token))
        max_px = int(processor.image_max_pixels)
        min_px = int(processor.image_min_pixels)
    lengths, wrong = [], []
    for i, row in enumerate(_rows(dataset, ("input_ids", "images", "videos", "audios"))):
        ids = np.asarray(row["input_ids"])
        if row.get("audios"):
            raise ValueError(f"tokenbal: row {i} has audios; tokenbal's LLaMA-Factory lengths cover text, "
                             "image and video rows")
        images, videos = row.get("images") or [], row.get("videos") or []
        n = len(ids)
        if images or videos:
            if estimator is None:
                raise ValueError(f"tokenbal: row {i} has images or videos but LLaMA-Factory loaded no "
                                 "processor")
            text = n - int((ids == image_token_id).sum())
            vision = 0
            for image in images:
                w, h = lf_image_size(*_header_size(_image_path(image)), max_px, min_px)
                vision += int(estimator.image_tokens(w, h))
            if videos:
                if video_token_id is None:
                    raise ValueError(f"tokenbal: row {i} has videos but {plugin_name} has no video token")
                text -= int((ids == video_token_id).sum())
                for video in videos:
                    if not isinstance(video, (str, os.PathLike)):
                        raise ValueError(f"tokenbal: row {i}: a video given as frames, not a file, is not "
                                         "modelled (LLaMA-Factory counts it by decoding)")
                    try:
                        vision += lf_video_tokens(video, processor)
                    except ValueError as e:
                        raise ValueError(f"tokenbal: row {i}: {e}") from None
            n = text + vision
            if n != len(ids):
                wrong.append((i, n, len(ids)))
        lengths.append(n)
    if wrong:
        shown = "; ".join(f"row {i}: tokenbal {est}, LLaMA-Factory {got}" for i, est, got in wrong[:5])
        raise ValueError(f"tokenbal: {len(wrong)} of {len(lengths)} rows' lengths disagree with what "
                         f"LLaMA-Factory tokenized ({shown}{' ...' if len(wrong) > 5 else ''}); a row cut "
                         "at cutoff_len cannot be planned: raise cutoff_len or drop the row")
    return np.asarray(lengths, dtype=np.int64)


# -- the trainer ------------------------------------------------------------------------------------

class LlamaFactorySamples:
    """The packed path's collator over LLaMA-Factory's tokenized rows: each row becomes one sample of
    :class:`collate.PackedCollator` (its ``input_ids`` and ``labels`` as LLaMA-Factory made them, its
    images and videos through LLaMA-Factory's own mm_plugin ``get_mm_inputs``: the plugin's resize and
    frame sampling, then the processor), and ``packer`` packs them into one row. Floating tensors are cast to
    ``compute_dtype``, as LLaMA-Factory's own collator casts them."""

    def __init__(self, packer: Any, template: Any, processor: Any, compute_dtype: Any = None) -> None:
        self.packer, self.template, self.processor = packer, template, processor
        self.compute_dtype = compute_dtype

    def sample(self, row: dict[str, Any]) -> dict[str, Any]:
        import torch

        images, videos = list(row.get("images") or []), list(row.get("videos") or [])
        if row.get("audios"):
            raise ValueError("tokenbal: audio rows are not supported in LLaMA-Factory's packed rows")
        out: dict[str, Any] = {"input_ids": np.asarray(row["input_ids"], np.int64),
                               "labels": np.asarray(row["labels"], np.int64)}
        if images or videos:
            plugin = self.template.mm_plugin
            mm = plugin.get_mm_inputs(images, videos, [], [len(images)], [len(videos)], [0],
                                      [list(row["input_ids"])], self.processor)
            for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
                        "second_per_grid_ts"):
                if mm.get(key) is not None:
                    value = torch.as_tensor(mm[key])
                    if self.compute_dtype is not None and torch.is_floating_point(value) and key != \
                            "second_per_grid_ts":
                        value = value.to(self.compute_dtype)
                    out[key] = value
        return out

    def __call__(self, rows: list[dict[str, Any]]) -> Any:
        return self.packer([self.sample(row) for row in rows])


def trainer_class(base: Any, options: dict[str, Any]) -> Any:
    """``base`` (LLaMA-Factory's ``CustomSeq2SeqTrainer``) with the token-balancing mixin in front and
    tokenbal's ``options`` (the YAML's ``tokenbal:`` mapping) as its ``sampler_options``; ``packed:
    true`` in them selects packed rows (:class:`LlamaFactorySamples`)."""
    from tokenbal.integrations.hf import TokenBalancingMixin

    opts = dict(options)
    packed = bool(opts.pop("packed", False))

    class TokenBalancedSeq2SeqTrainer(TokenBalancingMixin, base):
        # LLaMA-Factory normalises a multimodal loss per micro-batch on purpose; keep it, say so once.
        tokenbal_loss_note = ("tokenbal: LLaMA-Factory's own loss normalisation is kept (with a processor: "
                              "each micro-batch's token mean, model_accepts_loss_kwargs=False)")

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            collator = kwargs.get("data_collator")
            template = getattr(collator, "template", None)
            lengths = llamafactory_lengths(kwargs["train_dataset"], kwargs.get("processor"), template)
            options = dict(opts)
            if getattr(kwargs.get("finetuning_args"), "disable_shuffling", False):
                options.setdefault("shuffle", False)   # LLaMA-Factory's disable_shuffling: no shuffle
            if packed:
                from collate import PackedCollator

                model = kwargs.get("model")
                if model is None or not hasattr(model, "config"):
                    raise ValueError("tokenbal: packed: true needs LLaMA-Factory's model instance")
                kwargs["data_collator"] = LlamaFactorySamples(
                    PackedCollator.from_config(model.config), template, kwargs.get("processor"),
                    getattr(collator, "compute_dtype", None))
            super().__init__(*args, token_lengths=lengths, sampler_options=options, packed=packed, **kwargs)

    TokenBalancedSeq2SeqTrainer.__qualname__ = f"TokenBalanced{base.__name__}"
    return TokenBalancedSeq2SeqTrainer


# -- the command line -------------------------------------------------------------------------------

def _read_config(argv: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(LLaMA-Factory's arguments, tokenbal's options) from ``CONFIG.yaml key=value ...``, read the way
    ``llamafactory-cli`` reads them (its ``read_args``)."""
    _refuse_other_trainers()
    from llamafactory.hparams import read_args

    saved = sys.argv
    try:
        sys.argv = [saved[0], *argv]
        args = read_args()
    finally:
        sys.argv = saved
    if not isinstance(args, dict):
        raise SystemExit(f"tokenbal: expected a .yaml / .yml / .json config, got {list(argv)}\n{_USAGE}")
    options = args.pop("tokenbal", None)
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise SystemExit(f"tokenbal: the config's `tokenbal:` key must be a mapping, got {options!r}")
    from tokenbal.integrations.hf import unknown_sampler_options

    unknown = unknown_sampler_options(options, extra=("packed",))
    if unknown:
        raise SystemExit(f"tokenbal: unknown key(s) under the config's `tokenbal:`: {', '.join(unknown)} (it "
                         "takes TokenBalancedBatchSampler's options, e.g. max_tokens_per_rank, seed, window, "
                         "cost, and packed)")
    if not isinstance(options.get("packed", False), bool):
        raise SystemExit(f"tokenbal: `packed:` must be true or false, got {options['packed']!r}")
    stage = args.get("stage", "sft")
    if stage != "sft":
        raise SystemExit(f"tokenbal: stage {stage!r} is not supported (only stage: sft)")
    for key in ("packing", "neat_packing", "streaming"):
        if args.get(key):
            raise SystemExit(f"tokenbal: `{key}: true` is not supported with token-balanced batches "
                             "(LLaMA-Factory packs / streams at preprocessing); remove it")
    # HyperParallel's own loop runs sft past the trainer tokenbal replaces: it would train unbalanced.
    if args.get("use_hyper_parallel"):
        raise SystemExit("tokenbal: `use_hyper_parallel: true` trains with HyperParallel's own loop, not the "
                         "trainer tokenbal balances; remove it")
    return args, options


def _refuse_other_trainers() -> None:
    """USE_MCA=1 (Megatron's trainer, mcore_adapter) and USE_RAY=1 (Ray workers, which import
    LLaMA-Factory afresh) run sft past the trainer tokenbal replaces in this process: training would go
    on without tokenbal's sampler. Read as LLaMA-Factory's ``is_env_enabled`` reads them, before
    LLaMA-Factory is imported (with USE_MCA its import already takes the Megatron path)."""
    for env in ("USE_MCA", "USE_RAY"):
        if os.environ.get(env, "0").lower() in ("true", "y", "1"):
            raise SystemExit(f"tokenbal: {env}=1 trains outside the trainer tokenbal balances "
                             "(LLaMA-Factory's sft workflow in this process); unset it and start ranks with "
                             "FORCE_TORCHRUN=1 or torchrun")


def _under_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def _launch_command(argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """The torchrun command and environment ``llamafactory-cli train`` (0.9.5, its ``launcher.py``) starts
    its ranks with, each rank running this module: ``NNODES`` / ``NODE_RANK`` / ``NPROC_PER_NODE`` /
    ``MASTER_ADDR`` / ``MASTER_PORT``; with ``RDZV_ID`` an elastic rendezvous (``MIN_NNODES`` /
    ``MAX_NNODES``, ``MAX_RESTARTS``); and, unless ``OPTIM_TORCH=0``, its allocator and NCCL settings
    (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, ``TORCH_NCCL_AVOID_RECORD_STREAMS=1``), so
    that a config which fits under ``llamafactory-cli`` fits here too."""
    from llamafactory.extras.misc import find_available_port, get_device_count, is_env_enabled

    env = dict(os.environ)
    nnodes = env.get("NNODES", "1")
    nproc = env.get("NPROC_PER_NODE", str(get_device_count()))
    addr = env.get("MASTER_ADDR", "127.0.0.1")
    port = env.get("MASTER_PORT", str(find_available_port()))
    if is_env_enabled("OPTIM_TORCH", "1"):
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        env["TORCH_NCCL_AVOID_RECORD_STREAMS"] = "1"
    run = [sys.executable, "-m", "torch.distributed.run"]
    target = ["-m", "tokenbal.integrations.llamafactory", "train", *argv]
    rdzv_id = env.get("RDZV_ID")
    if rdzv_id is not None:
        nodes = nnodes
        if env.get("MIN_NNODES") is not None and env.get("MAX_NNODES") is not None:
            nodes = f"{env['MIN_NNODES']}:{env['MAX_NNODES']}"
        cmd = [*run, "--nnodes", nodes, "--nproc-per-node", nproc, "--rdzv-id", rdzv_id, "--rdzv-backend",
               "c10d", "--rdzv-endpoint", f"{addr}:{port}", "--max-restarts", env.get("MAX_RESTARTS", "0"),
               *target]
    else:
        cmd = [*run, "--nnodes", nnodes, "--node_rank", env.get("NODE_RANK", "0"), "--nproc_per_node", nproc,
               "--master_addr", addr, "--master_port", port, *target]
    return cmd, env


def _launch(argv: Sequence[str]) -> int:
    """Start the ranks the way ``llamafactory-cli train`` does (:func:`_launch_command`)."""
    cmd, env = _launch_command(argv)
    return subprocess.run(cmd, env=env).returncode


def _train(argv: Sequence[str]) -> None:
    import llamafactory.train.sft.workflow as workflow
    from llamafactory.train.tuner import run_exp

    args, options = _read_config(argv)
    workflow.CustomSeq2SeqTrainer = trainer_class(workflow.CustomSeq2SeqTrainer, options)
    run_exp(args=args)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "train" or len(argv) < 2:
        print(_USAGE, file=sys.stderr)
        return 2
    rest = argv[1:]
    if not _under_torchrun():
        from llamafactory.extras.misc import get_device_count, is_env_enabled

        _read_config(rest)   # refuse a bad config before starting any rank
        if is_env_enabled("FORCE_TORCHRUN") or get_device_count() > 1:
            return _launch(rest)
    _train(rest)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
