"""The demo's corpus, tokenizer, tiny models and loaders: what ``tokenbal demo``,
``scripts/train_fsdp2.py``, the probes under ``scripts/`` and the tests build on.

- data: :func:`prepare_data` writes a small heavy-tailed multimodal webdataset
  (:mod:`tokenbal.synthetic`) and trains a byte-level BPE tokenizer on its text;
  :class:`IndexedSamples` reads it back through the token index as model inputs.
- models: :func:`tiny_qwen2_vl_config`, :func:`demo_config`, :func:`load_model_config`,
  :func:`match_tokenizer` and :func:`build_model` for the families of :data:`MODEL_CLASSES`.
- loaders: :func:`make_loader`, tokenbal's balanced batches or ``DistributedSampler``'s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from tokenbal.synthetic import make_samples, write_shards

# Images are capped at 1280 tokens (transformers' Qwen2VLImageProcessor class default, a common
# fine-tuning setting) so that the CPU demo stays fast; the index is built with the same cap,
# which is what makes its predicted lengths exact.
DEMO_MAX_PIXELS = 1280 * 28 * 28
DEMO_MIN_PIXELS = 4 * 28 * 28
SPECIAL_TOKENS = ["<|endoftext|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


@dataclass(frozen=True)
class DemoPaths:
    root: str
    shards: tuple[str, ...]
    tokenizer: str
    index: str


# ---------------------------------------------------------------------------------------------
# data


def train_tokenizer(texts: list[str], out_dir: str, vocab_size: int = 800) -> str:
    """Train a small byte-level BPE tokenizer on ``texts`` and save ``tokenizer.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "tokenizer.json")
    tok.save(path)
    return path


def prepare_data(root: str, num_samples: int, seed: int) -> DemoPaths:
    samples = make_samples(num_samples, seed=seed)
    shards = write_shards(samples, os.path.join(root, "shards"), samples_per_shard=64)
    tokenizer = train_tokenizer([s.text for s in samples], os.path.join(root, "tokenizer"))
    return DemoPaths(root=root, shards=tuple(shards), tokenizer=tokenizer, index=os.path.join(root, "index"))


class IndexedSamples(torch.utils.data.Dataset):
    """Map-style dataset over an index: verified reads by byte offset, decode, tokenize.

    Produces what a Qwen2-VL training set produces per sample (``patch_size`` 16: Qwen3-VL's):
    ``input_ids`` with ``<|vision_start|><|image_pad|>*n<|vision_end|>`` per image followed by the text,
    ``labels`` (vision tokens masked), ``pixel_values`` and ``image_grid_thw`` from transformers'
    own image processor. Raises if a sample's token count differs from the index's.
    """

    def __init__(self, index_dir: str, tokenizer_path: str, limit: int | None = None, patch_size: int = 14,
                 config=None):
        from tokenizers import Tokenizer

        from tokenbal.data.indexed import IndexedShardDataset
        from tokenbal.hf_compat import image_processor_class

        self.reader = IndexedShardDataset(index_dir, decode=None)
        self.index = self.reader.index
        self.size = len(self.index) if limit is None else min(limit, len(self.index))
        self.tokenizer = Tokenizer.from_file(tokenizer_path)
        self.processor = image_processor_class("Qwen2VLImageProcessorPil")(
            min_pixels=DEMO_MIN_PIXELS, max_pixels=DEMO_MAX_PIXELS, patch_size=patch_size)
        if config is not None and config.model_type == "glm4v":
            # GLM-4.1V: its own image processor (3-D smart_resize) at the demo's pixel caps; the
            # demo's vision_start / vision_end stand for <|begin_of_image|> / <|end_of_image|>.
            self.processor = image_processor_class("Glm4vImageProcessorPil")(
                size={"shortest_edge": DEMO_MIN_PIXELS, "longest_edge": DEMO_MAX_PIXELS},
                patch_size=patch_size)
        ids = {t: self.tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
        self.vision_start, self.vision_end = ids["<|vision_start|>"], ids["<|vision_end|>"]
        self.image_pad = ids["<|image_pad|>"]
        # LLaVA-NeXT / OneVision / InternVL: their own image processor and placeholder rule instead.
        self.images = None if config is None or config.model_type not in _CROP_MODEL_TYPES else \
            CropImages(config)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        import io

        from PIL import Image

        from tokenbal.index.imagesize import IMAGE_EXTS  # the extensions the index counted as images

        raw = self.reader.read_raw(i)
        text = raw["txt"].decode("utf-8") if "txt" in raw else ""
        images = [Image.open(io.BytesIO(data)).convert("RGB") for ext, data in raw.items()
                  if not ext.startswith("__") and ext.rsplit(".", 1)[-1] in IMAGE_EXTS]
        ids: list[int] = []
        labels: list[int] = []
        sample: dict = {}
        if images and self.images is not None:
            fields, n = self.images(images)
            ids += [self.image_pad] * n
            labels += [-100] * n
            sample.update(fields)
        elif images:
            out = self.processor(images=images, return_tensors="pt")
            grid = out["image_grid_thw"]
            for n in (grid.prod(-1) // self.processor.merge_size**2).tolist():
                block = [self.vision_start] + [self.image_pad] * n + [self.vision_end]
                ids += block
                labels += [-100] * len(block)
            sample.update(pixel_values=out["pixel_values"], image_grid_thw=grid)
        text_ids = self.tokenizer.encode(text).ids
        ids += text_ids
        labels += text_ids
        if len(ids) != self.index.lengths[i]:
            # The index promised a length; the sampler balanced on it. A mismatch means a stale
            # index or an estimator that does not match the processor: never train on silently.
            raise ValueError(f"sample {i} (key {self.index.keys[i]!r}) has {len(ids)} tokens but the index "
                             f"says {int(self.index.lengths[i])}")
        sample.update(input_ids=torch.tensor(ids, dtype=torch.long),
                      labels=torch.tensor(labels, dtype=torch.long), index=i)
        return sample


_CROP_MODEL_TYPES = ("llava_next", "llava_onevision", "internvl")


class CropImages:
    """A LLaVA-NeXT / LLaVA-OneVision / InternVL sample's images through transformers' own image
    processor at the config's crop size (and pinpoints); returns the sample's vision fields and its
    ``<image>`` placeholder count (:mod:`collate.anyres`, the index's rule)."""

    def __init__(self, config) -> None:
        from collate import PackedCollator
        from tokenbal.hf_compat import image_processor_class

        self.layout = PackedCollator.from_config(config).anyres
        side = self.layout.crop_size if hasattr(self.layout, "crop_size") else self.layout.tile_size
        if config.model_type == "internvl":
            self.processor = image_processor_class("GotOcr2ImageProcessorPil")(
                size={"height": side, "width": side}, crop_to_patches=True)
        else:
            name = "LlavaNextImageProcessorPil" if config.model_type == "llava_next" else \
                "LlavaOnevisionImageProcessorPil"
            self.processor = image_processor_class(name)(
                size={"height": side, "width": side} if config.model_type == "llava_onevision"
                else {"shortest_edge": side}, crop_size={"height": side, "width": side},
                image_grid_pinpoints=[list(p) for p in self.layout.pinpoints])

    def __call__(self, images: list) -> tuple[dict, int]:
        out = self.processor(images=images, return_tensors="pt")
        if "image_sizes" not in out:  # InternVL: tiles, each tokens_per_tile placeholders
            tiles = out["pixel_values"].shape[0]
            return {"pixel_values": out["pixel_values"]}, self.layout.tokens_per_tile * tiles
        sizes = out["image_sizes"].tolist()
        n = sum(self.layout.image_tokens(h, w, len(sizes)) for h, w in sizes)
        return {"pixel_values": out["pixel_values"], "image_sizes": out["image_sizes"]}, n


def estimator_overrides(config) -> dict:
    """The index estimator's settings for ``config`` on the demo data (Qwen: the demo's pixel caps)."""
    if config is None or config.model_type not in _CROP_MODEL_TYPES:
        return dict(min_pixels=DEMO_MIN_PIXELS, max_pixels=DEMO_MAX_PIXELS)
    from collate import PackedCollator

    layout = PackedCollator.from_config(config).anyres
    if config.model_type == "internvl":
        # The demo writes no <img> / </img> text around the placeholders.
        return dict(tile_size=layout.tile_size, tokens_per_tile=layout.tokens_per_tile, wrapper_tokens=0)
    return dict(crop_size=layout.crop_size, patch_size=layout.patch_size, pinpoints=layout.pinpoints)


# ---------------------------------------------------------------------------------------------
# model


def tiny_qwen2_vl_config(vocab_size: int, special_ids: dict[str, int]):
    from transformers import Qwen2VLConfig

    from tokenbal.hf_compat import rope_config

    return Qwen2VLConfig(
        text_config=dict(vocab_size=vocab_size, bos_token_id=None, eos_token_id=None,
                         hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
                         **rope_config(Qwen2VLConfig, 1e6, mrope_section=[4, 6, 6])),
        vision_config=dict(depth=2, embed_dim=64, hidden_size=128, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=special_ids["<|image_pad|>"], video_token_id=special_ids["<|video_pad|>"],
        vision_start_token_id=special_ids["<|vision_start|>"],
        vision_end_token_id=special_ids["<|vision_end|>"],
    )


# model_type -> (config class, model class, tokenbal estimator) of the families the demo data trains:
# images as <|vision_start|><|image_pad|>*n<|vision_end|>, patches from transformers' Qwen2-VL image
# processor at the config's patch size (14 px for Qwen2/2.5-VL, 16 px for Qwen3-VL), 2x2 merge.
MODEL_CLASSES = {
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", "qwen2-vl"),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", "qwen2.5-vl"),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", "qwen3-vl"),
    # <|vision_start|><|image_pad|>*n<|vision_end|> through Glm4vImageProcessorPil.
    "glm4v": ("Glm4vConfig", "Glm4vForConditionalGeneration", "glm-4.1v"),
    # <|image_pad|> * n with each family's own image processor (CropImages).
    "llava_next": ("LlavaNextConfig", "LlavaNextForConditionalGeneration", "llava-next"),
    "llava_onevision": ("LlavaOnevisionConfig", "LlavaOnevisionForConditionalGeneration", "llava-onevision"),
    "internvl": ("InternVLConfig", "InternVLForConditionalGeneration", "internvl"),
}


def load_model_config(path: str):
    """A Qwen2-VL, Qwen2.5-VL or Qwen3-VL transformers config from a ``config.json`` (a checkpoint's
    own file works: its ``model_type`` picks the class)."""
    import json

    from tokenbal.hf_compat import require_class

    with open(path) as f:
        raw = json.load(f)
    model_type = raw.get("model_type")
    if model_type not in MODEL_CLASSES:
        raise ValueError(f"{path}: model_type {model_type!r} is not one this demo trains; supported: "
                         f"{sorted(MODEL_CLASSES)}")
    return require_class(MODEL_CLASSES[model_type][0]).from_dict(raw)


def match_tokenizer(config, vocab_size: int, special_ids: dict[str, int]) -> list[str]:
    """Point ``config``'s vision token ids at this tokenizer's and make its vocabulary at least the
    tokenizer's (a no-op for a checkpoint's config with its own tokenizer; needed to train a real
    model's shape on the demo's small tokenizer). Returns what changed, for the log."""
    changed = []
    for attr, token in (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                        ("vision_start_token_id", "<|vision_start|>"),
                        ("vision_end_token_id", "<|vision_end|>"),
                        # GLM-4.1V's image wrappers play the demo's vision start / end
                        ("image_start_token_id", "<|vision_start|>"),
                        ("image_end_token_id", "<|vision_end|>")):
        if attr != "image_token_id" and not hasattr(config, attr):
            continue  # a family without that token (LLaVA-NeXT has no video, no vision_start)
        if getattr(config, attr, None) != special_ids[token]:
            changed.append(f"{attr} {getattr(config, attr, None)} -> {special_ids[token]}")
            setattr(config, attr, special_ids[token])
    text = getattr(config, "text_config", config)
    if text.vocab_size < vocab_size:
        changed.append(f"vocab_size {text.vocab_size} -> {vocab_size}")
        text.vocab_size = vocab_size
    return changed


def build_model(config, seed: int):
    """Randomly initialised fp32 model of ``config``'s family (:data:`MODEL_CLASSES`), SDPA attention."""
    from tokenbal.hf_compat import require_class

    if config.model_type not in MODEL_CLASSES:
        raise ValueError(f"model_type {config.model_type!r} is not one this demo trains; supported: "
                         f"{sorted(MODEL_CLASSES)}")
    torch.manual_seed(seed)
    config._attn_implementation = "sdpa"
    return require_class(MODEL_CLASSES[config.model_type][1])(config).float()


def special_token_ids(tokenizer_path: str) -> tuple[int, dict[str, int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    return tok.get_vocab_size(), {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


# ---------------------------------------------------------------------------------------------
# loaders


def make_loader(dataset, sampler_kind: str, rank: int, world_size: int, global_batch_size: int, seed: int,
                collator, num_workers: int = 0, cost=None, stages: bool = False):
    """A DataLoader over ``dataset`` with tokenbal's balanced batches or DistributedSampler's.

    ``sampler_kind``: "tokenbal", "distributed", or "identical": every rank gets tokenbal's
    rank-0 micro-batch of each step. That is a timing control, not training (the ranks' data is
    duplicated): perfectly balanced work with the mixture and step sizes of tokenbal's epoch, so
    its epoch / ideal is what a perfect plan would reach on this machine.
    ``cost``: what tokenbal balances (see ``tokenbal.balance.cost``): None for tokens, or a FlopsModel;
    ``stages``: also balance its vision and language parts separately (needs a FlopsModel).
    """
    from types import SimpleNamespace

    from torch.utils.data import DataLoader, DistributedSampler

    from tokenbal.balance.sampler import TokenBalancedBatchSampler

    if sampler_kind in ("tokenbal", "identical"):
        n = len(dataset)
        samples = SimpleNamespace(lengths=np.asarray(dataset.index.lengths[:n]),
                                  vision_tokens=np.asarray(dataset.index.vision_tokens[:n]))
        if cost is not None:
            offsets, tokens = dataset.index.image_tokens_table
            samples.image_tokens_table = (offsets[: n + 1], tokens[: offsets[n]])
        batch_sampler = TokenBalancedBatchSampler(samples, num_replicas=world_size,
                                                  rank=rank if sampler_kind == "tokenbal" else 0,
                                                  global_batch_size=global_batch_size, seed=seed, cost=cost,
                                                  stages=stages or None,
                                                  # "identical": every rank claims rank 0, so only
                                                  # process 0 would join the cross-rank check.
                                                  verify=None if sampler_kind == "tokenbal" else False)
        return DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=collator, num_workers=num_workers)
    if sampler_kind == "distributed":
        sampler = DistributedSampler(dataset, world_size, rank, shuffle=True, seed=seed)
        return DataLoader(dataset, batch_size=global_batch_size // world_size, sampler=sampler,
                          collate_fn=collator, num_workers=num_workers)
    raise ValueError(f"sampler must be 'tokenbal', 'distributed' or 'identical', got {sampler_kind!r}")


def demo_config(tokenizer: str, model_config: str | None = None):
    """The demo's tiny Qwen2-VL, or ``model_config`` (a config.json of any :data:`MODEL_CLASSES`
    family) pointed at the demo tokenizer."""
    vocab, special = special_token_ids(tokenizer)
    if model_config is None:
        return tiny_qwen2_vl_config(vocab, special)
    config = load_model_config(model_config)
    match_tokenizer(config, vocab, special)
    return config


def patch_size(config) -> int:
    """The vision patch size of ``config`` as one int (InternVL's config gives (h, w))."""
    patch = config.vision_config.patch_size  # InternVL's is (h, w)
    return int(patch[0] if isinstance(patch, (list, tuple)) else patch)
