"""``tokenbal demo``: the whole path on CPU, end to end, in a few minutes.

1. Write a small heavy-tailed multimodal webdataset (real JPEG/PNG files) and a tokenizer.
2. ``tokenbal index build`` over it (image headers only, exact Qwen2-VL token counts).
3. Per-step rank balance at 8 ranks: ``DistributedSampler`` vs ``TokenBalancedBatchSampler``.
4. Train a tiny random Qwen2-VL with FSDP2 on local gloo ranks with each sampler, through the
   packed collator and the packed model patch, each sampler's epoch repeated and alternated with
   the other's. Headline what a loaded machine does not move: epoch / ideal and each rank's wait
   (median per step over repeats); the speed-up only when the repeats agree beyond their noise.
5. Check that the packed model's loss on one batch equals transformers' unpacked loss.
"""

from __future__ import annotations

import os
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass

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
        from transformers import Qwen2VLImageProcessorPil

        from tokenbal.wds import IndexedShardDataset

        self.reader = IndexedShardDataset(index_dir, decode=None)
        self.index = self.reader.index
        self.size = len(self.index) if limit is None else min(limit, len(self.index))
        self.tokenizer = Tokenizer.from_file(tokenizer_path)
        self.processor = Qwen2VLImageProcessorPil(min_pixels=DEMO_MIN_PIXELS, max_pixels=DEMO_MAX_PIXELS,
                                                  patch_size=patch_size)
        if config is not None and config.model_type == "glm4v":
            # GLM-4.1V: its own image processor (3-D smart_resize) at the demo's pixel caps; the
            # demo's vision_start / vision_end stand for <|begin_of_image|> / <|end_of_image|>.
            from transformers import Glm4vImageProcessorPil

            self.processor = Glm4vImageProcessorPil(
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

        raw = self.reader.read_raw(i)
        text = raw["txt"].decode("utf-8") if "txt" in raw else ""
        images = [Image.open(io.BytesIO(data)).convert("RGB") for ext, data in raw.items()
                  if not ext.startswith("__") and ext.rsplit(".", 1)[-1] in ("jpg", "jpeg", "png", "webp")]
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

        self.layout = PackedCollator.from_config(config).anyres
        side = self.layout.crop_size if hasattr(self.layout, "crop_size") else self.layout.tile_size
        if config.model_type == "internvl":
            from transformers import GotOcr2ImageProcessorPil

            self.processor = GotOcr2ImageProcessorPil(size={"height": side, "width": side},
                                                      crop_to_patches=True)
        else:
            import transformers

            name = "LlavaNextImageProcessorPil" if config.model_type == "llava_next" else \
                "LlavaOnevisionImageProcessorPil"
            self.processor = getattr(transformers, name)(
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

    return Qwen2VLConfig(
        text_config=dict(vocab_size=vocab_size, bos_token_id=None, eos_token_id=None,
                         hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
                         rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[4, 6, 6])),
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

    import transformers

    with open(path) as f:
        raw = json.load(f)
    model_type = raw.get("model_type")
    if model_type not in MODEL_CLASSES:
        raise ValueError(f"{path}: model_type {model_type!r} is not one this demo trains; supported: "
                         f"{sorted(MODEL_CLASSES)}")
    return getattr(transformers, MODEL_CLASSES[model_type][0]).from_dict(raw)


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
    import transformers

    if config.model_type not in MODEL_CLASSES:
        raise ValueError(f"model_type {config.model_type!r} is not one this demo trains; supported: "
                         f"{sorted(MODEL_CLASSES)}")
    torch.manual_seed(seed)
    config._attn_implementation = "sdpa"
    return getattr(transformers, MODEL_CLASSES[config.model_type][1])(config).float()


def special_token_ids(tokenizer_path: str) -> tuple[int, dict[str, int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    return tok.get_vocab_size(), {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


# ---------------------------------------------------------------------------------------------
# balance table


def count_sharded_steps(lengths: np.ndarray, num_replicas: int, global_batch_size: int,
                        seed: int) -> np.ndarray:
    """(steps, ranks) token sums of torch's DistributedSampler + a per-rank BatchSampler."""
    from torch.utils.data import DistributedSampler

    per_rank = global_batch_size // num_replicas
    rows = []
    for r in range(num_replicas):
        order = np.fromiter(DistributedSampler(range(len(lengths)), num_replicas, r, shuffle=True, seed=seed),
                            dtype=np.int64)
        steps = len(order) // per_rank
        rows.append(lengths[order[: steps * per_rank]].reshape(steps, per_rank).sum(1))
    return np.stack(rows, axis=1)


def tokenbal_steps(lengths: np.ndarray, num_replicas: int, global_batch_size: int, seed: int) -> np.ndarray:
    from tokenbal.sampler import TokenBalancedBatchSampler

    per_rank = []
    for r in range(num_replicas):
        s = TokenBalancedBatchSampler(lengths, num_replicas=num_replicas, rank=r,
                                      global_batch_size=global_batch_size, seed=seed)
        per_rank.append([int(lengths[step].sum()) for step in s])
    return np.array(per_rank).T


def imbalance_row(step_tokens: np.ndarray) -> tuple[float, float, float]:
    ratio = step_tokens.max(1) / np.maximum(step_tokens.mean(1), 1e-9)
    return float(ratio.mean()), float(np.percentile(ratio, 95)), float(ratio.max())


# ---------------------------------------------------------------------------------------------
# FSDP2 training on local ranks


def make_loader(dataset, sampler_kind: str, rank: int, world_size: int, global_batch_size: int, seed: int,
                collator, num_workers: int = 0, cost=None, stages: bool = False):
    """A DataLoader over ``dataset`` with tokenbal's balanced batches or DistributedSampler's.

    ``sampler_kind``: "tokenbal", "distributed", or "identical": every rank gets tokenbal's
    rank-0 micro-batch of each step. That is a timing control, not training (the ranks' data is
    duplicated): perfectly balanced work with the mixture and step sizes of tokenbal's epoch, so
    its epoch / ideal is what a perfect plan would reach on this machine.
    ``cost``: what tokenbal balances (see ``tokenbal.cost``): None for tokens, or a FlopsModel;
    ``stages``: also balance its vision and language parts separately (needs a FlopsModel).
    """
    from types import SimpleNamespace

    from torch.utils.data import DataLoader, DistributedSampler

    from tokenbal.sampler import TokenBalancedBatchSampler

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


def _patch_size(config) -> int:
    patch = config.vision_config.patch_size  # InternVL's is (h, w)
    return int(patch[0] if isinstance(patch, (list, tuple)) else patch)


def _train_rank(rank: int, world_size: int, paths: DemoPaths, kinds: tuple[str, ...], train_samples: int,
                global_batch_size: int, seed: int, model_config: str | None = None) -> list[list]:
    """One rank: an epoch over the first ``train_samples`` samples with FSDP2 for each sampler kind
    in ``kinds``, in that order, on one model; per epoch its per-step records."""
    import torch.distributed as dist

    from collate import PackedCollator
    from collate.models import enable_packed
    from collate.train import (
        FSDPSettings,
        StepRecord,
        keep_freed_memory,
        make_optimizer,
        shard_qwen2_vl,
        solo_compute_time,
        train_step,
    )

    keep_freed_memory()
    # FSDP2 warns that the root returns a view (the logits); nothing here modifies it in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    config = demo_config(paths.tokenizer, model_config)
    dataset = IndexedSamples(paths.index, paths.tokenizer, limit=train_samples,
                             patch_size=_patch_size(config), config=config)
    solo = enable_packed(build_model(config, seed))
    model = shard_qwen2_vl(enable_packed(build_model(config, seed)), **asdict(FSDPSettings.for_device("cpu")))
    optim = make_optimizer(model, 1e-3)

    epochs = []
    for n, kind in enumerate(kinds):
        loader = make_loader(dataset, kind, rank, world_size, global_batch_size, seed,
                             PackedCollator.from_config(config))
        records = []
        for step, batch in enumerate(loader):
            if n == 0 and step == 0:  # warm-up (allocator, lazy init) on the first batch, not timed
                solo_compute_time(solo, batch)
                train_step(model, optim, batch)
            compute = solo_compute_time(solo, batch)
            dist.barrier()
            t0 = time.perf_counter()
            loss = train_step(model, optim, batch)
            records.append(StepRecord(step=step, rank=rank, samples=len(batch.seq_lens),
                                      tokens=int(batch.input_ids.shape[1]), compute_s=compute,
                                      step_s=time.perf_counter() - t0, loss=float(loss)))
        epochs.append(records)
    return epochs


def alternating_order(kinds: tuple[str, str], repeats: int) -> tuple[str, ...]:
    """A B B A A B ...: each kind as often first as second in a pair, so a machine that slows down
    (or speeds up) steadily over the run charges both kinds alike."""
    a, b = kinds
    return tuple(x for i in range(repeats) for x in ((a, b) if i % 2 == 0 else (b, a)))


def speedup_verdict(baseline_s: list[float], tokenbal_s: list[float], baseline_ideal_s: list[float],
                    tokenbal_ideal_s: list[float]) -> tuple[float | None, str]:
    """The speed-up of tokenbal's epoch over the baseline's from alternating repeats, or None when
    the machine was too noisy to tell.

    Each repeat pairs one epoch of each sampler; the speed-up is the ratio of the median epochs.
    Two things measure the noise: how much the same sampler's epoch varied between repeats, and
    how far apart the two epochs' *ideal* times (the same samples' total compute, which a steady
    machine measures equal) were within a pair. The speed-up is reported only when every pair
    agrees on which is faster and the difference exceeds both."""
    import statistics

    pairs = [b / t for b, t in zip(baseline_s, tokenbal_s, strict=True)]
    ratio = statistics.median(baseline_s) / statistics.median(tokenbal_s)
    spread = max((max(x) - min(x)) / statistics.median(x) for x in (baseline_s, tokenbal_s))
    drift = max(abs(b / t - 1) for b, t in zip(baseline_ideal_s, tokenbal_ideal_s, strict=True))
    balance = (statistics.median(b / i for b, i in zip(baseline_s, baseline_ideal_s, strict=True))
               / statistics.median(t / i for t, i in zip(tokenbal_s, tokenbal_ideal_s, strict=True)))
    shown = ", ".join(f"{p:.2f}x" for p in pairs)
    noise = (f"the same sampler's epoch varied by {spread:.0%} between repeats, the same work's compute "
             f"by {drift:.0%} within a pair")
    if len(pairs) < 2:
        return None, (f"one repeat ({shown}) cannot tell a real difference from machine noise; "
                      "run more repeats")
    agree = all(p > 1 for p in pairs) or all(p < 1 for p in pairs)
    if agree and abs(ratio - 1) > max(spread, drift):
        return ratio, (f"tokenbal's epoch is {ratio:.2f}x as fast as DistributedSampler's (per repeat "
                       f"{shown}; {noise})")
    return None, (f"too noisy to tell which epoch is faster on this machine: per repeat {shown}; {noise}. "
                  f"The epoch / ideal column, which does not depend on the machine's speed, predicts "
                  f"{balance:.2f}x")


# ---------------------------------------------------------------------------------------------
# loss check


def packed_loss_check(paths: DemoPaths, seed: int, num_samples: int = 6,
                      model_config: str | None = None) -> tuple[float, float]:
    """Loss of one packed batch vs the token-weighted mean of transformers' per-sample losses."""
    from collate import PackedCollator
    from collate.models import enable_packed

    config = demo_config(paths.tokenizer, model_config)
    dataset = IndexedSamples(paths.index, paths.tokenizer, patch_size=_patch_size(config), config=config)
    reference = build_model(config, seed).eval()
    packed = enable_packed(build_model(config, seed)).eval()
    samples = [dataset[i] for i in range(num_samples)]
    with torch.no_grad():
        total, weight = 0.0, 0
        for s in samples:
            kwargs = dict(input_ids=s["input_ids"][None], labels=s["labels"][None])
            if "pixel_values" in s and "image_grid_thw" not in s:  # LLaVA / InternVL crops or tiles
                kwargs.update({k: s[k] for k in ("pixel_values", "image_sizes") if k in s})
                if config.model_type == "llava_onevision":
                    kwargs["batch_num_images"] = torch.tensor([s["image_sizes"].shape[0]])
            elif "pixel_values" in s:
                mm = torch.zeros_like(s["input_ids"], dtype=torch.int32)
                mm[s["input_ids"] == config.image_token_id] = 1
                kwargs.update(pixel_values=s["pixel_values"], image_grid_thw=s["image_grid_thw"],
                              mm_token_type_ids=mm[None])
            n = int((s["labels"][1:] != -100).sum())
            total += float(reference(**kwargs).loss) * n
            weight += n
        packed_loss = float(packed(**PackedCollator.from_config(config)(samples)).loss)
    return packed_loss, total / weight


# ---------------------------------------------------------------------------------------------


def _print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print("  " + "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    for r in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))


def run_demo(workdir: str | None = None, train_samples: int = 32, ranks: int = 2, seed: int = 0,
             num_samples: int = 256, global_batch_size: int = 8, repeats: int = 2,
             model: str | None = None) -> int:
    """``model``: a config.json of any :data:`MODEL_CLASSES` family, randomly initialised (default: the
    tiny Qwen2-VL); the index is built with that family's token rule. Each sampler trains ``repeats``
    epochs, alternating, and the speed-up is judged from those repeats."""
    from collate.train import median_records, summarise
    from tokenbal.index import TokenIndex, build_index
    from tokenbal.launch import run_ranks

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tokenbal-demo-") as tmp:
        root = workdir or tmp
        print(f"[1/5] writing {num_samples} synthetic samples as webdataset shards under {root}")
        paths = prepare_data(root, num_samples, seed)

        config = None if model is None else demo_config(paths.tokenizer, model)
        estimator = "qwen2-vl" if config is None else MODEL_CLASSES[config.model_type][2]
        print(f"[2/5] tokenbal index build ({len(paths.shards)} shards, {estimator})")
        report = build_index(list(paths.shards), paths.index, model=estimator, tokenizer=paths.tokenizer,
                             estimator_overrides=estimator_overrides(config), progress=False)
        print("  " + report.summary())
        lengths = np.asarray(TokenIndex.open(paths.index).lengths, dtype=np.int64)
        print(f"  tokens per sample: min {lengths.min()}, median {int(np.median(lengths))}, "
              f"max {lengths.max()} "
              f"({lengths.max() / max(lengths.min(), 1):.0f}x spread)")

        print("[3/5] per-step max/mean rank tokens at 8 ranks (1.00 = perfect balance)")
        rows = []
        for n in (16, 64):
            for name, fn in (("DistributedSampler", count_sharded_steps),
                             ("TokenBalancedBatchSampler", tokenbal_steps)):
                mean, p95, worst = imbalance_row(fn(lengths, 8, n, seed))
                rows.append([name, str(n), f"{mean:.3f}", f"{p95:.3f}", f"{worst:.3f}"])
        _print_table(["sampler", "global batch", "mean", "p95", "max"], rows)

        name = "tiny Qwen2-VL" if config is None else type(config).__name__.removesuffix("Config")
        print(f"[4/5] FSDP2 training of a random {name} on {ranks} CPU ranks (gloo): an epoch over "
              f"the same {train_samples} samples with each sampler, {global_batch_size} per step, {repeats} "
              "times each, alternating")
        order = alternating_order(("distributed", "tokenbal"), repeats)
        per_rank = run_ranks(_train_rank, ranks, paths, order, train_samples, global_batch_size, seed,
                             model, timeout=600)
        epochs: dict[str, list[list]] = {"distributed": [], "tokenbal": []}
        for n, kind in enumerate(order):
            epochs[kind].append([r for rank_epochs in per_rank for r in rank_epochs[n]])
        # Per step and rank the median over repeats: one noisy repeat moves no column.
        summaries = {kind: summarise(median_records(reps)) for kind, reps in epochs.items()}
        rows = []
        for kind, s in summaries.items():
            waits = " / ".join(f"{w:.0%}" for w in s["wait_fraction"])
            rows.append([kind, f"{s['step_over_ideal']:.2f}", waits, f"{s['token_max_over_mean']:.2f}",
                         str(s["steps"]), " / ".join(f"{c:.2f}" for c in s["compute_s"]),
                         f"{s['epoch_s']:.2f} s"])
        _print_table(["sampler", "epoch / ideal", "wait per rank", "tokens max/mean", "steps",
                      "compute per rank (s)", "epoch time (median)"], rows)
        print("  (compute = this rank's forward+backward timed alone on an unsharded replica; ideal = each "
              "step's total compute spread evenly; wait = share of the epoch spent waiting for other ranks)")
        each = {kind: [summarise(r) for r in reps] for kind, reps in epochs.items()}
        d, t = each["distributed"], each["tokenbal"]
        _, verdict = speedup_verdict([s["epoch_s"] for s in d], [s["epoch_s"] for s in t],
                                     [s["ideal_s"] for s in d], [s["ideal_s"] for s in t])
        print(f"  same samples, same model: {verdict}")

        print("[5/5] packed loss check")
        packed, unpacked = packed_loss_check(paths, seed, model_config=model)
        rel = abs(packed - unpacked) / abs(unpacked)
        ok = rel < 1e-4
        print(f"  packed loss {packed:.6f} vs transformers unpacked token-weighted mean {unpacked:.6f} "
              f"(relative difference {rel:.1e}) -> {'OK' if ok else 'MISMATCH'}")
    print(f"demo finished in {time.perf_counter() - start:.0f} s")
    return 0 if ok else 1
