"""The parts :mod:`tokenbal.integrations.hf` wires into a ``transformers.Trainer``: packed batches,
per-sample processing of raw chat rows, logging the user sees, and loading a checkpoint's weights.

Kept out of ``hf.py`` so the Trainer hooks there stay short; nothing here imports transformers (or
``collate``) at module import time.
"""

from __future__ import annotations

import io
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["configure_logging", "process_row", "IndexedDataset", "PackedTrainCollator",
           "load_checkpoint_weights", "INDEX_KEY", "VERBOSITY_ENV"]

logger = logging.getLogger("tokenbal")

INDEX_KEY = "_tokenbal_index"      # the dataset index each item carries to the collator
VERBOSITY_ENV = "TOKENBAL_VERBOSITY"
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR, "critical": logging.CRITICAL}


# -- logging --------------------------------------------------------------------------------------


class _TrainerHandler(logging.StreamHandler):
    """The stderr handler :func:`configure_logging` adds (a class of its own, so it is added once)."""


def configure_logging() -> int:
    """Make tokenbal's messages visible the way transformers' are, and return the level set.

    The library itself only has a ``NullHandler`` (an application decides where logs go), so under
    the Trainer its warnings would reach nobody. Like ``transformers.logging``: a stderr handler on
    the ``tokenbal`` logger, warnings and above by default, unless the application configured logging
    itself (a handler on the root logger, or one of its own on ``tokenbal``). The level is
    ``TOKENBAL_VERBOSITY`` (debug / info / warning / error / critical) when set, else transformers'
    verbosity — which the Trainer sets from ``TrainingArguments.log_level`` (``log_level_replica``
    on the other ranks), so ``log_level="info"`` shows tokenbal's plan summary too.
    """
    tb = logging.getLogger("tokenbal")
    env = os.environ.get(VERBOSITY_ENV, "").strip().lower()
    if env and env not in _LEVELS:
        raise ValueError(f"{VERBOSITY_ENV}={env!r}; use one of {', '.join(_LEVELS)}")
    if env:
        level = _LEVELS[env]
    else:
        try:
            from transformers.utils import logging as hf_logging

            level = hf_logging.get_verbosity()
        except ImportError:
            level = logging.WARNING
    own = [h for h in tb.handlers if not isinstance(h, logging.NullHandler)]
    if not own and not logging.getLogger().handlers:
        handler = _TrainerHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))   # messages say "tokenbal: "
        tb.addHandler(handler)
    if env or any(isinstance(h, _TrainerHandler) for h in tb.handlers):
        tb.setLevel(level)
    return level


# -- per-sample processing ------------------------------------------------------------------------


def _as_image(value: Any) -> Any:
    """A PIL image from what a ``datasets.Image`` column holds (decoded, or ``{"bytes", "path"}``
    with ``decode=False``), raw bytes or a path, read as transformers' ``load_image`` reads files:
    EXIF / XMP orientation applied (``ImageOps.exif_transpose``), so the pixels match the size
    ``dataset_lengths`` counted from the header. A PIL image is passed as given (the processor
    takes it as is, and so does the count)."""
    from PIL import Image, ImageOps

    if isinstance(value, dict):
        if value.get("bytes") is not None:
            image = Image.open(io.BytesIO(value["bytes"]))
        elif value.get("path"):
            image = Image.open(value["path"])
        else:
            raise ValueError(f"image entry has neither bytes nor a path: {sorted(value)}")
    elif isinstance(value, (bytes, bytearray, memoryview)):
        image = Image.open(io.BytesIO(bytes(value)))
    elif isinstance(value, (str, os.PathLike)):
        if "://" in os.fspath(value):
            raise ValueError(f"{os.fspath(value)!r} is a URL; only local image paths are read")
        image = Image.open(value)
    else:
        return value
    image = ImageOps.exif_transpose(image)
    return image if image.mode == "RGB" else image.convert("RGB")


_IMAGE_URL_RULE: dict[int, tuple[Any, bool]] = {}


def _collects_image_url(processor: Any) -> bool:
    """Whether this processor turns OpenAI ``image_url`` parts into image parts (5.x does)."""
    from tokenbal.estimate.chat import _probe_image_url, _processor_renderer, _processor_template

    cached = _IMAGE_URL_RULE.get(id(processor))
    if cached is None or cached[0] is not processor:
        cached = (processor, _probe_image_url(_processor_renderer(processor, _processor_template(processor))))
        _IMAGE_URL_RULE[id(processor)] = cached
    return cached[1]


def process_row(row: dict[str, Any], processor: Any, *, messages: str = "messages", images: str = "images",
                ignore_token_ids: Sequence[int] = (), videos: str = "videos") -> dict[str, Any]:
    """One chat row -> the sample dict :class:`collate.PackedCollator` takes, as the processor renders
    it: what ``processor.apply_chat_template([row[messages]], images=[row[images]] or None,
    tokenize=True, return_dict=True)`` does, through public calls that exist on every transformers
    from 4.57 (the template rendered with ``tokenize=False``, the row's images — its ``images``
    column, else the images named in its message parts — read as :func:`_as_image` reads them; its
    videos likewise from its ``videos`` column or its video parts — then
    the processor called with the same special-token rule), ``labels`` a copy of ``input_ids`` with
    the image / video placeholders (and ``ignore_token_ids``) at -100."""
    import torch

    from tokenbal.estimate.chat import content_images, template_variables
    from tokenbal.estimate.conversation import chat_turns

    if messages not in row:
        raise KeyError(f"row has no {messages!r} column (columns: {sorted(row)}): the packed Trainer reads "
                       "chat rows from 'messages' (rename the column, e.g. "
                       "dataset.rename_column('conversations', 'messages')); process_row takes "
                       "messages=<column>")
    index = row.get(INDEX_KEY, "?")
    conv = chat_turns(row[messages], index, messages)
    values = row.get(images)
    if values is None or (isinstance(values, (list, tuple)) and not values):
        values = content_images(conv, image_url=_collects_image_url(processor))
    elif not isinstance(values, (list, tuple)):
        values = [values]   # one image, not in a list: as dataset_lengths counts it
    imgs = [_as_image(v) for v in values]
    video_kwargs = _row_videos(row, conv, processor, index, messages, videos)
    if video_kwargs and imgs and _VIDEO_ESTIMATOR[id(processor)][1] == "smolvlm":
        raise ValueError(f"row {index}: has {len(imgs)} image(s) and {len(video_kwargs['videos'][0])} "
                         f"video(s); {type(processor).__name__} returns only the videos' pixel_values for "
                         "such a row (transformers 5.19-5.25: its video processor's pixel_values replace its "
                         "image processor's), so the model would get no pixels for the images; keep SmolVLM "
                         "rows to images or to videos")
    extra = {"images": [imgs]} if "images" in template_variables(_template(processor)) else {}
    # copies of the messages: transformers 5.6 - 5.9 reassign message["content"] in place
    text = processor.apply_chat_template([[dict(m) for m in conv]], tokenize=False, **extra)
    text = text[0] if isinstance(text, (list, tuple)) else text
    bos = getattr(getattr(processor, "tokenizer", None), "bos_token", None)
    kwargs = {"add_special_tokens": False} if bos and text.startswith(bos) else {}
    stacked = _videos_stack(processor, text, video_kwargs)
    if stacked is None:
        out = processor(text=[text], images=[imgs] if imgs else None, return_tensors="pt", **kwargs,
                        **video_kwargs)
    elif stacked == "llava-onevision":
        out = _onevision_videos_apart(processor, text, imgs, video_kwargs, kwargs)
    else:
        out = internvl_by_parts(processor, text, imgs, video_kwargs, kwargs)
    ids = torch.as_tensor(out["input_ids"])[0].long()
    labels = ids.clone()
    masked = set(int(t) for t in ignore_token_ids)
    tok = getattr(processor, "tokenizer", None)
    for name in ("image_token", "video_token"):
        token = getattr(processor, name, None)
        if token is not None and tok is not None:
            masked.add(int(tok.convert_tokens_to_ids(token)))
    if getattr(tok, "pad_token_id", None) is not None:
        masked.add(int(tok.pad_token_id))
    if masked:
        labels[torch.isin(ids, torch.tensor(sorted(masked)))] = -100
    sample: dict[str, Any] = {"input_ids": ids, "labels": labels}
    for key in ("pixel_values", "image_grid_thw", "image_sizes", "pixel_values_videos", "video_grid_thw",
                "second_per_grid_ts"):
        if out.get(key) is not None:
            sample[key] = out[key]
    return sample


_VIDEO_ESTIMATOR: dict[int, tuple[Any, str, Any]] = {}


def _videos_stack(processor: Any, text: str, video_kwargs: dict[str, Any]) -> str | None:
    """The family, where its processor's ``return_tensors="pt"`` call cannot take this row's videos:
    LLaVA-OneVision's and InternVL's video processors stack a call's videos into one
    ``(videos, frames, C, H, W)`` tensor, which fails when they keep different numbers of frames;
    InternVL's also fails when a video comes before the row's first image. None where it can."""
    if not video_kwargs:
        return None
    family = _VIDEO_ESTIMATOR[id(processor)][1]
    frames = [len(f) for f in video_kwargs["videos"][0]]
    if family == "llava-onevision" and len(set(frames)) > 1:
        return family
    if family == "internvl":
        from tokenbal.estimate.chat_video import internvl_row_rejected

        if internvl_row_rejected(text, processor.image_token, processor.video_token, frames):
            return family
    return None


def _onevision_videos_apart(processor: Any, text: str, imgs: list, video_kwargs: dict[str, Any],
                            kwargs: dict[str, Any]) -> dict[str, Any]:
    """LLaVA-OneVision, a row whose videos keep different numbers of frames: the processor's own call
    without ``return_tensors`` (its videos come back one tensor each, its text as it writes it),
    turned into the sample's fields; ``pixel_values_videos`` a list of ``(frames, C, S, S)``, one
    per video, which :class:`collate.anyres.AnyresLayout` takes and tokenbal's packed forward encodes
    video by video (transformers' own forward takes one ``(videos, frames, ...)`` tensor, so needs
    equal frames: the packed Trainer always runs the packed forward)."""
    import torch

    out = processor(text=[text], images=[imgs] if imgs else None, **kwargs, **video_kwargs)
    sample = {"input_ids": torch.as_tensor(np.asarray(out["input_ids"][0]))[None],
              "pixel_values_videos": [torch.as_tensor(np.asarray(v)) for v in out["pixel_values_videos"]]}
    if imgs:
        sample["pixel_values"] = torch.cat([torch.as_tensor(np.asarray(p)) for p in out["pixel_values"]])
        sample["image_sizes"] = torch.as_tensor(np.asarray(out["image_sizes"]))
    return sample


def internvl_by_parts(processor: Any, text: str, imgs: list, video_kwargs: dict[str, Any],
                      kwargs: dict[str, Any]) -> dict[str, Any]:
    """InternVL, a row its processor's ``__call__`` raises on (videos of different frame counts, or a
    video before the first image): what that call does, from the processor's own parts. The images
    through its image processor and the videos *one by one* through its video processor (with its
    call defaults), each placeholder replaced by its own ``replace_image_token`` /
    ``replace_video_token`` in one pass, the text through its tokenizer; ``pixel_values`` every
    image's tiles and every video's frames in text order. InternVL's model takes a video's frames as
    tiles (one ``Frame{i}:`` block of ``image_seq_length`` tokens each), so the frame counts need not
    agree. Equal to the processor's own output where that one runs (tested)."""
    import re

    import torch

    from tokenbal.hf_compat import processor_modality_kwargs, replace_placeholders

    merged = processor_modality_kwargs(processor)
    images_out, image_texts, tiles = None, [], []
    if imgs:
        image_kw = {**merged["images_kwargs"], "return_tensors": "pt"}
        images_out = processor.image_processor(images=imgs, **image_kw)
        patches = [int(n) for n in np.asarray(images_out["num_patches"]).reshape(-1)]
        image_texts = [processor.replace_image_token(images_out, j) for j in range(len(imgs))]
        tiles = list(torch.split(torch.as_tensor(images_out["pixel_values"]), patches))
    video_kw = {**merged["videos_kwargs"], "return_tensors": "pt", "do_sample_frames": False}
    frames, video_texts = [], []
    for video, metadata in zip(video_kwargs["videos"][0], video_kwargs["video_metadata"][0], strict=True):
        one = processor.video_processor(videos=[video], video_metadata=[metadata], **video_kw)
        video_texts.append(processor.replace_video_token(one, 0))
        frames.append(torch.as_tensor(one["pixel_values_videos"])[0])
    order = re.finditer(f"{re.escape(processor.image_token)}|{re.escape(processor.video_token)}", text)
    images, videos = iter(tiles), iter(frames)
    pixels = [next(images if m.group(0) == processor.image_token else videos) for m in order]
    expanded = replace_placeholders(processor, text, image_texts, video_texts)
    ids = processor.tokenizer([expanded], **kwargs)["input_ids"]
    return {"input_ids": torch.as_tensor(ids), "pixel_values": torch.cat(pixels)}


def _row_videos(row: dict[str, Any], conv: list, processor: Any, index: Any, messages: str,
                videos: str = "videos") -> dict[str, Any]:
    """The processor's video arguments for a row's videos (its ``videos`` column, else its
    ``{"type": "video"}`` parts' files): only the frames the processor keeps are decoded (PyAV), the
    ones ``dataset_lengths`` counted (``tokenbal.estimate.chat_video.sample_video``, checked equal to
    the video processors' own sampling), handed over with their metadata and ``do_sample_frames``
    off, so the processor resizes, patchifies and writes the prompt text from exactly those frames."""
    from tokenbal.estimate.chat_video import content_videos

    values = row.get(videos) or content_videos(conv)
    if not values:
        return {}
    from transformers.video_utils import VideoMetadata

    from tokenbal.estimate.chat_video import check_video_support, sample_video
    from tokenbal.estimate.vision import estimator_from_processor, processor_family
    from tokenbal.index.video import decode_frames, probe_row_video

    cached = _VIDEO_ESTIMATOR.get(id(processor))
    if cached is None or cached[0] is not processor:
        cached = (processor, processor_family(processor), estimator_from_processor(processor))
        _VIDEO_ESTIMATOR[id(processor)] = cached
    _, family, est = cached
    check_video_support(processor, family, est)
    frames, metadata = [], []
    for j, value in enumerate(values if isinstance(values, (list, tuple)) else [values]):
        info = probe_row_video(value, index, f"{videos}[{j}]")
        indices, _ = sample_video(processor, family, est, info)
        src = value.get("bytes") or value.get("path") if isinstance(value, dict) else value
        frames.append(decode_frames(bytes(src) if isinstance(src, (bytearray, memoryview)) else src, indices))
        metadata.append(VideoMetadata(total_num_frames=int(info.frames), fps=float(info.fps),
                                      duration=float(info.frames / info.fps), width=int(info.width),
                                      height=int(info.height), frames_indices=list(indices)))
    return {"videos": [frames], "video_metadata": [metadata], "do_sample_frames": False}


def _template(processor: Any) -> str:
    from tokenbal.estimate.chat import _processor_template

    return _processor_template(processor)


class IndexedDataset:
    """``dataset`` whose items also carry their index (:data:`INDEX_KEY`), so the collator can name
    the sample whose token count disagrees with the lengths the plan used."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, Any]:
        item = self.dataset[i]
        if not isinstance(item, dict):
            item = dict(item)
        return {**item, INDEX_KEY: int(i)}


class PackedTrainCollator:
    """The Trainer's collator for ``packed=True``: rows -> samples (:func:`process_row` when a row has
    no ``input_ids`` yet) -> :class:`collate.PackedCollator`. Each row's real token count is checked
    against the lengths the plan was made from: a packed row over ``max_tokens_per_rank`` raises,
    naming the samples whose lengths were short; smaller differences are counted and warned about once
    (the plan is then balanced on wrong numbers)."""

    def __init__(self, packer: Callable[[list[dict[str, Any]]], Any],
                 lengths: np.ndarray | Callable[[], np.ndarray], max_tokens_per_rank: int | None,
                 processor: Any = None, *, messages: str = "messages", images: str = "images") -> None:
        self.packer = packer
        self._lengths = lengths
        self.max_tokens_per_rank = max_tokens_per_rank
        self.processor = processor
        self.messages, self.images = messages, images
        self.mismatched = 0
        self._warned = False

    @property
    def lengths(self) -> np.ndarray:
        """The per-sample token counts the plan was made from (an array, or read through a callable)."""
        if callable(self._lengths):
            self._lengths = self._lengths()
        return np.asarray(self._lengths, np.int64)

    def set_lengths(self, lengths: np.ndarray) -> None:
        self._lengths = np.asarray(lengths, np.int64)

    def _sample(self, row: dict[str, Any]) -> dict[str, Any]:
        if "input_ids" in row:
            return row
        if self.processor is None or not hasattr(self.processor, "apply_chat_template"):
            raise ValueError(f"sample {row.get(INDEX_KEY)} has no input_ids and the trainer has no processor "
                             "to render its messages: pass processing_class=<the model's processor>")
        return process_row(row, self.processor, messages=self.messages, images=self.images)

    def __call__(self, rows: list[dict[str, Any]]) -> Any:
        idx = [row.get(INDEX_KEY) for row in rows]
        samples = []
        for row in rows:
            s = self._sample(row)
            samples.append({k: v for k, v in s.items() if k != INDEX_KEY})
        real = [int(len(s["input_ids"])) for s in samples]
        if all(i is not None for i in idx):
            planned = self.lengths[np.asarray(idx, np.int64)] if idx else np.zeros(0, np.int64)
            wrong = [(i, int(p), r) for i, p, r in zip(idx, planned.tolist(), real, strict=True) if p != r]
            B = self.max_tokens_per_rank
            if B is not None and sum(real) > B:
                shown = ", ".join(f"sample {i}: planned {p}, real {r}" for i, p, r in wrong[:8])
                raise ValueError(f"a packed row holds {sum(real)} real tokens, over max_tokens_per_rank={B}: "
                                 f"the token lengths the plan used are short ({shown or 'none differ'}). "
                                 "Compute them with the processor that renders the rows (chat template "
                                 "included)")
            if wrong:
                self.mismatched += len(wrong)
                if not self._warned:
                    self._warned = True
                    i, p, r = wrong[0]
                    logger.warning("tokenbal: token lengths differ from the collated samples (sample %d: "
                                   "planned %d, real %d); the plan is balanced on the planned numbers",
                                   i, p, r)
        batch = self.packer(samples)
        # A plain dict: trainers edit their inputs (trl's compute_loss sets use_cache), and the
        # Trainer moves a mapping's tensors to the device itself; host fields pass through unchanged.
        return dict(batch.items()) if hasattr(batch, "items") else batch


# -- checkpoint weights ---------------------------------------------------------------------------


def _saved_keys(checkpoint_dir: str) -> list[str] | None:
    """Tensor names of a checkpoint's safetensors weights (one file or an index), None if neither."""
    single = os.path.join(checkpoint_dir, "model.safetensors")
    index = os.path.join(checkpoint_dir, "model.safetensors.index.json")
    if os.path.isfile(single):
        from safetensors import safe_open

        with safe_open(single, "pt") as f:
            return list(f.keys())
    if os.path.isfile(index):
        with open(index) as f:
            return list(json.load(f)["weight_map"])
    return None


def _load_saved(checkpoint_dir: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    single = os.path.join(checkpoint_dir, "model.safetensors")
    if os.path.isfile(single):
        return load_file(single, device="cpu")
    with open(os.path.join(checkpoint_dir, "model.safetensors.index.json")) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    out: dict[str, Any] = {}
    for name in files:
        out.update(load_file(os.path.join(checkpoint_dir, name), device="cpu"))
    return out


def load_checkpoint_weights(model: Any, checkpoint_dir: str) -> bool:
    """Load ``checkpoint_dir``'s weights into ``model`` when the Trainer's own loading would miss them.

    transformers 5.x saves checkpoints with the model's weight conversions reverted (Qwen2-VL's
    ``model.visual.*`` / ``model.language_model.*`` are written as ``visual.*`` / ``model.*``), but
    ``Trainer._load_from_checkpoint`` loads them with a plain ``load_state_dict(strict=False)``: every
    weight is reported missing and the model keeps its initial values (huggingface/transformers#43701).
    Returns False when the saved names already match (the Trainer's loading is fine: let it run);
    otherwise maps the saved names onto the model's through the same conversion that saved them,
    loads every weight, and returns True. Raises ``RuntimeError`` naming the weights when that is not
    possible, rather than training on from initial weights.
    """
    saved = _saved_keys(checkpoint_dir)
    if saved is None:
        return False
    own = model.state_dict()
    tied = _tied_keys(model)
    names = set(saved)
    missing = [k for k in own if k not in names and k not in tied]   # tied weights are saved once
    if not missing:
        return False
    from tokenbal.hf_compat import revert_weight_conversion

    # The saved name of each of the model's tensors: revert the conversion on the model's own state
    # dict and follow each tensor object (a pure renaming keeps them; merges or splits do not).
    reverted = revert_weight_conversion(model, dict(own))
    by_id = {id(t): k for k, t in own.items()}
    rename = {}
    for saved_name, t in reverted.items():
        k = by_id.get(id(t))
        if k is not None:
            rename[saved_name] = k
    state = _load_saved(checkpoint_dir)
    converted = {rename.get(k, k): v for k, v in state.items()}
    result = model.load_state_dict(converted, strict=False)
    still = [k for k in result.missing_keys if k not in tied]
    if still or result.unexpected_keys:
        raise RuntimeError(
            f"cannot restore the weights of {checkpoint_dir}: the checkpoint's tensor names do not match "
            f"the model's ({len(still)} missing, e.g. {still[:3]}; {len(result.unexpected_keys)} unexpected, "
            f"e.g. "
            f"{list(result.unexpected_keys)[:3]}), also after transformers' own key conversion "
            "(huggingface/transformers#43701). Resuming would train from the initial weights.")
    logger.warning("tokenbal: restored %d weights of %s through transformers' key conversion (its Trainer "
                   "would have missed %d of them: huggingface/transformers#43701)", len(converted),
                   checkpoint_dir, len(missing))
    return True


def _tied_keys(model: Any) -> set[str]:
    """The model's parameters that share storage with another (tied embeddings are saved once)."""
    seen: dict[int, str] = {}
    tied = set()
    for name, p in model.state_dict(keep_vars=True).items():
        key = id(p)
        if key in seen:
            tied.add(name)
        else:
            seen[key] = name
    return tied
