"""``ProcessorDataset``: an indexed sample, decoded and tokenized by a transformers processor, in the
form :class:`collate.PackedCollator` takes.

    shards = IndexedShardDataset(index, decode="pil")      # or IndexedParquetDataset(index)
    dataset = ProcessorDataset(shards, processor)         # processor: an HF processor or its folder
    dataset[i]   # {"input_ids", "labels", "pixel_values", "image_grid_thw", "__key__", "__index__"}

What it tokenizes is what the index counted (``tokenbal.index.text``): the text of the sample's text
members (tar ``.txt`` / ``.json``), of its Parquet row's messages / text column, or of its JSON(L)
annotation record, joined with newlines, with each ``<image>`` placeholder replaced by the
processor's image placeholder (``<|vision_start|><|image_pad|><|vision_end|>`` for Qwen-VL,
``<|begin_of_image|><|image|><|end_of_image|>`` for GLM-4.1V, the processor's ``image_token``
otherwise: LLaVA and InternVL processors add their own wrappers). A sample whose text has no
placeholder gets its images first, in member order; one with some but not one per image is an error
naming the sample. No chat template is applied and no special tokens are added, because the index
counts neither; a conversation is its turns' text joined with newlines, and ``labels`` are the
``input_ids`` with the vision placeholders and their wrappers set to -100 (every text token is
trained on). Subclass and override :meth:`ProcessorDataset.text_of` / :meth:`labels_of` for a chat
template or assistant-only labels (the index's lengths then undercount: build the index with the
same rule).

So ``len(dataset[i]["input_ids"]) == index.lengths[i]`` whenever the index was built with this
processor's tokenizer (``--tokenizer``) and image settings, and the tokenizer splits the text at each
placeholder anyway (at the start of the text, or next to whitespace or a newline, the usual layouts).
A sample where the two differ is logged (``tokenbal`` logger, the first one in full) and counted in
``length_mismatches``, or raises with ``strict=True``: the sampler balanced the index's numbers.
When the index counted text with the bytes-per-token heuristic (no ``--tokenizer``), its lengths are
estimates and are not compared.

Videos are not tokenized yet: a sample with a video raises ``ValueError`` naming it (the collator
takes ``pixel_values_videos`` / ``video_grid_thw`` from your own dataset meanwhile).

:func:`load_processor` is ``AutoProcessor.from_pretrained``, except that when the checkpoint's video
processor needs torchvision and torchvision is missing (the CPU torch ``make demo`` installs has
none), it returns the same processor class without its video processor (images and text only).
"""

from __future__ import annotations

import functools
import io
import json
import logging
import os
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from tokenbal.index.text import PLACEHOLDERS, json_text

__all__ = ["ProcessorDataset", "load_processor"]

log = logging.getLogger("tokenbal")

IGNORE_INDEX = -100
# What one image stands for in the text before the processor expands it, by processor class: the
# span the family's chat template writes. Processors not listed expand ``image_token`` with their
# own wrappers (LLaVA-NeXT / OneVision, InternVL).
_QWEN_SPAN = "<|vision_start|>{}<|vision_end|>"
_IMAGE_SPANS = {
    "Qwen2VLProcessor": _QWEN_SPAN,
    "Qwen2_5_VLProcessor": _QWEN_SPAN,
    "Qwen3VLProcessor": _QWEN_SPAN,
    "Qwen3VLMoeProcessor": _QWEN_SPAN,
    "Glm4vProcessor": "<|begin_of_image|>{}<|end_of_image|>",
}
_TEXT_EXTS = ("txt", "json")
_VIDEO_EXTS = ("mp4", "webm", "mkv", "mov", "avi")


def load_processor(path: str | os.PathLike, **kwargs: Any) -> Any:
    """``transformers.AutoProcessor.from_pretrained(path, **kwargs)``; without torchvision, a
    checkpoint whose video processor needs it loads as the same processor class with no video
    processor (a warning says so; images and text work, videos need torchvision)."""
    from transformers import AutoProcessor

    from tokenbal.hf_compat import processor_attributes

    try:
        return AutoProcessor.from_pretrained(path, **kwargs)
    except ImportError as e:
        if "torchvision" not in str(e).lower():
            raise
        cls = _processor_class(path)
        if cls is None or "video_processor" not in processor_attributes(cls):
            raise
    log.warning("%s: its video processor needs torchvision, which is not installed; loading %s for "
                "images and text only (pip install torchvision for videos)", path, cls.__name__)
    return _without_video(cls).from_pretrained(path, **kwargs)


def _processor_class(path: str | os.PathLike) -> Any:
    """The processor class a local checkpoint folder names (``processor_config.json``, else
    ``preprocessor_config.json`` / ``tokenizer_config.json``), or ``None``."""
    import transformers

    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        file = os.path.join(os.fspath(path), name)
        if os.path.isfile(file):
            with open(file) as f:
                cls_name = json.load(f).get("processor_class")
            if cls_name:
                return getattr(transformers, cls_name, None)
    return None


@functools.cache
def _without_video(cls: Any) -> Any:
    """``cls`` with ``video_processor`` dropped from its sub-processors (loaded and checked); one
    class per ``cls``, and its instances pickle (DataLoader workers under spawn)."""

    class NoVideo(cls):
        def __reduce__(self):
            return _rebuild_without_video, (cls, self.__dict__)

    if callable(getattr(cls, "get_attributes", None)):   # transformers 5.x
        NoVideo.get_attributes = classmethod(
            lambda klass: [a for a in cls.get_attributes() if a != "video_processor"])
    else:                                                # 4.57: a class-level list
        NoVideo.attributes = [a for a in cls.attributes if a != "video_processor"]

    NoVideo.__name__ = NoVideo.__qualname__ = cls.__name__
    return NoVideo


def _rebuild_without_video(cls: Any, state: dict) -> Any:
    obj = object.__new__(_without_video(cls))
    obj.__dict__.update(state)
    return obj


def _image_span(processor: Any) -> str:
    token = getattr(processor, "image_token", None)
    if not isinstance(token, str):
        raise ValueError(f"{type(processor).__name__} has no image_token: pass image_placeholder=")
    for klass in type(processor).__mro__:
        if klass.__name__ in _IMAGE_SPANS:
            return _IMAGE_SPANS[klass.__name__].format(token)
    return token


class ProcessorDataset(Dataset):
    """``source[i]`` (an :class:`~tokenbal.data.IndexedShardDataset` or
    :class:`~tokenbal.data.IndexedParquetDataset`) tokenized with ``processor`` (a transformers
    processor, or a checkpoint folder for :func:`load_processor`): see the module docstring for what
    is tokenized. ``image_placeholder``: the text one image stands for before the processor expands
    it (default: by processor class). ``strict``: raise instead of logging when a sample's token
    count differs from the index's. ``processor_kwargs`` go to every ``processor(...)`` call (e.g.
    ``images_kwargs``)."""

    def __init__(self, source: Any, processor: Any, *, image_placeholder: str | None = None,
                 strict: bool = False, processor_kwargs: dict | None = None) -> None:
        self.source = source
        self.index = getattr(source, "index", None)
        if not hasattr(self.index, "lengths"):
            raise TypeError("source must be an indexed dataset (IndexedShardDataset / IndexedParquetDataset) "
                            f"with an .index, got {type(source).__name__}")
        self.processor = load_processor(processor) if isinstance(processor, str | os.PathLike) else processor
        self.image_placeholder = image_placeholder or _image_span(self.processor)
        tok = self.processor.tokenizer
        # Every token of an image's span before expansion (placeholder and wrappers) carries no loss.
        span_ids = tok(self.image_placeholder, add_special_tokens=False)["input_ids"]
        self.vision_ids = np.unique(np.asarray(span_ids, dtype=np.int64))
        self.strict = bool(strict)
        self.processor_kwargs = dict(processor_kwargs or {})
        counter = (self.index.manifest.get("text_counter") or {})
        # Heuristic text counts (no --tokenizer) are estimates: comparing them would flag every sample.
        self.exact_lengths = counter.get("tokenizer") is not None
        self.length_mismatches = 0
        self._records: dict[str, Any] = {}      # JSON list file -> its records by key
        self._spans: dict[str, dict] = {}       # JSONL file -> (byte offset, length) of each record

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> dict:
        return self.tokenize(self.source[i])

    def __getitems__(self, indices: list[int]) -> list[dict]:
        # The source reads a batch in shard / row-group order (its own __getitems__).
        many = getattr(self.source, "__getitems__", None)
        samples = many(list(indices)) if many is not None else [self.source[i] for i in indices]
        return [self.tokenize(s) for s in samples]

    # ---- one sample ----------------------------------------------------------------------------
    def tokenize(self, sample: dict) -> dict:
        """The collator's fields of one sample as the source returned it."""
        i, key = int(sample["__index__"]), sample["__key__"]
        where = f"sample {i} (key {key!r}, {sample.get('__shard__')})"
        if "__error__" in sample:
            raise ValueError(f"{where}: {sample['__error__']}")
        if sample.get("__videos__") or any(k.rsplit(".", 1)[-1] in _VIDEO_EXTS for k in sample):
            raise ValueError(f"{where} has a video: ProcessorDataset tokenizes text and images only")
        images = self.images_of(sample)
        text = self.text_with_images(self.text_of(sample), len(images), where)
        kwargs = {"add_special_tokens": False, **self.processor_kwargs}
        out = self.processor(text=[text], images=images or None, return_tensors="pt", **kwargs)
        ids = np.asarray(out["input_ids"][0], dtype=np.int64)
        self._check_length(i, where, len(ids))
        item: dict[str, Any] = {"input_ids": ids, "labels": self.labels_of(ids), "__key__": key,
                                "__index__": i}
        for name in ("pixel_values", "image_grid_thw", "image_sizes", "num_patches"):
            if name in out:
                item[name] = out[name]
        return item

    def images_of(self, sample: dict) -> list:
        """The sample's decoded images, in member (or column) order; raw bytes are decoded here."""
        from tokenbal.index.imagesize import IMAGE_EXTS

        col = self._parquet_columns(sample)[0] if self._is_parquet(sample) else None
        if col is not None:
            value = sample.get(col)
            values = [] if value is None else value if isinstance(value, list) else [value]
        else:
            values = [v for k, v in sample.items()
                      if not k.startswith("__") and k.rsplit(".", 1)[-1] in IMAGE_EXTS]
        return [self._as_image(v) for v in values]

    def text_of(self, sample: dict) -> str:
        """The sample's text by the index's rules, placeholders kept (newline-joined pieces)."""
        if self._is_parquet(sample):
            _, messages, text = self._parquet_columns(sample)
            if messages is not None and sample.get(messages) is not None:
                turns = sample[messages]
                kind = "conversations" if turns and isinstance(turns[0], dict) and "value" in turns[0] \
                    and "content" not in turns[0] else "messages"
                return "\n".join(json_text({kind: turns}) or [])
            value = sample.get(text) if text is not None else None
            return value if isinstance(value, str) else ""
        shard = self.index.shard(int(sample["__index__"]))
        if shard.lower().endswith((".json", ".jsonl")):
            return "\n".join(json_text(self._record(shard, sample["__key__"])) or [])
        pieces: list[str] = []
        for k, v in sample.items():
            ext = k.rsplit(".", 1)[-1]
            if k.startswith("__") or ext not in _TEXT_EXTS:
                continue
            if isinstance(v, bytes | bytearray):
                v = v.decode("utf-8")
            if ext == "json" and isinstance(v, str):
                v = json.loads(v)
            got = [v] if ext == "txt" else json_text(v)
            pieces += got or []
        return "\n".join(pieces)

    def text_with_images(self, text: str, n_images: int, where: str) -> str:
        """``text`` with its ``<image>`` placeholders (or, with none, the images' spans first)."""
        for p in PLACEHOLDERS[1:]:
            if p in text:
                raise ValueError(f"{where}: text has a {p} placeholder; ProcessorDataset tokenizes text and "
                                 "images only")
        found = text.count("<image>")
        if found == 0:
            return self.image_placeholder * n_images + text
        if found != n_images:
            raise ValueError(f"{where}: text has {found} <image> placeholders for {n_images} images")
        return text.replace("<image>", self.image_placeholder)

    def labels_of(self, input_ids: np.ndarray) -> np.ndarray:
        """``input_ids`` with every vision token (placeholders, wrappers) set to -100."""
        labels = input_ids.copy()
        labels[np.isin(labels, self.vision_ids)] = IGNORE_INDEX
        return labels

    # ---- helpers -------------------------------------------------------------------------------
    def _check_length(self, i: int, where: str, got: int) -> None:
        if not self.exact_lengths:
            return
        want = int(self.index.lengths[i])
        if got == want:
            return
        self.length_mismatches += 1
        msg = (f"{where}: the processor gave {got} tokens, the index counted {want} (the sampler balanced "
               "the index's count); was the index built with this tokenizer and these image settings?")
        if self.strict:
            raise ValueError(msg)
        if self.length_mismatches == 1:
            log.warning("%s (further mismatches are counted in ProcessorDataset.length_mismatches)", msg)

    def _is_parquet(self, sample: dict) -> bool:
        return str(sample.get("__shard__", "")).lower().endswith((".parquet", ".pq"))

    def _parquet_columns(self, sample: dict) -> tuple[str | None, str | None, str | None]:
        from tokenbal.index.parquet import ParquetOptions, resolve_columns

        built = self.index.manifest.get("parquet") or {}
        opts = ParquetOptions(**{k: built.get(k) for k in ("image_column", "text_column", "messages_column")})
        return resolve_columns([k for k in sample if not k.startswith("__")], opts)

    def _as_image(self, value: Any) -> Any:
        """A PIL image from a decoded image or its bytes (Parquet ``{bytes, path}`` structs too),
        oriented as the index counted it."""
        if isinstance(value, dict):
            value = value.get("bytes")
        if not isinstance(value, bytes | bytearray):
            return value
        from PIL import Image, ImageOps

        im = Image.open(io.BytesIO(value))
        im.load()
        return ImageOps.exif_transpose(im) if self.index.manifest.get("exif") == "transpose" else im

    def _record(self, path: str, key: str) -> Any:
        """The JSON(L) annotation record of ``key`` (``<file>:<line>``, ``<file>[<i>]`` or the record's
        ``id``), found as the index build keyed it (:func:`tokenbal.index.annotations.annotation_records`).

        Every file read stays known, so samples of several files in one batch (a shuffled sampler's)
        do not re-read a file at each switch: of a JSONL file, where each record's line lies (a few
        numbers per record; the line is read when asked); a JSON list file, its parsed records."""
        from tokenbal.index.annotations import annotation_records, jsonl_record_spans
        from tokenbal.index.text import parse_json

        missing = f"{path}: no record keyed {key!r} (the file changed since the index was built?)"
        if path.lower().endswith(".jsonl"):
            spans = self._spans.get(path)
            if spans is None:
                self._check_unchanged(path)
                spans = self._spans[path] = jsonl_record_spans(path)
            if key not in spans:
                raise ValueError(missing)
            offset, size = spans[key]
            with open(path, "rb") as f:
                f.seek(offset)
                return parse_json(f.read(size))
        records = self._records.get(path)
        if records is None:
            self._check_unchanged(path)
            records = self._records[path] = annotation_records(path)
        if key not in records:
            raise ValueError(missing)
        return records[key]

    def _check_unchanged(self, path: str) -> None:
        """``ValueError`` when the annotation file at ``path`` is not the one the index was built from
        (size, or the fingerprint of its first and last MiB): a line added or removed moves every
        place key (``<file>:<line>``, ``<file>[<i>]``) onto another record, whose text would be
        tokenized in place of the one the index counted, with no error (as a tar shard's header
        check guards against for members)."""
        from tokenbal.index.scan import shard_fingerprint

        entry = next((e for e in self.index.manifest.get("shards", []) if e.get("path") == path), None)
        if entry is None or entry.get("fingerprint") is None:
            return
        size = os.path.getsize(path)
        if size != entry.get("size"):
            change = f"size {entry.get('size')} -> {size} bytes"
        elif shard_fingerprint(path, size) != entry["fingerprint"]:
            change = f"same size {size} bytes, other content"
        else:
            return
        raise ValueError(f"stale index: annotation file {path} changed since the index was built ({change}); "
                         "its records' keys may name other records now: run `tokenbal index verify`, then "
                         "rebuild the index")
