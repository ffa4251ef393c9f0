"""A tiny random Qwen2-VL and a synthetic image+text dataset that runs anywhere (CPU, no
downloads): what ``examples/train_hf_trainer.py`` trains and the Trainer / accelerate tests check.
Deterministic from a seed, so every rank builds the same model and data. Also a real
``Qwen2VLProcessor`` whose token ids match the tiny model (:func:`tiny_qwen2_vl_processor`) and raw
chat rows for it (:func:`chat_rows`): the packed Trainer / trl path renders those per sample."""

from __future__ import annotations

import numpy as np
import torch

VOCAB = 128
IMG, VID, VSTART, VEND = 120, 121, 122, 123
PATCH_DIM = 3 * 2 * 14 * 14  # channels * temporal patch * patch * patch of Qwen2-VL's tower input


def tiny_qwen2_vl(seed: int = 0):
    """A one-layer Qwen2-VL (text and tower) with random weights from ``seed``."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from tokenbal.hf_compat import rope_config

    config = Qwen2VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         bos_token_id=None, eos_token_id=None,
                         **rope_config(Qwen2VLConfig, 10000.0, mrope_section=[2, 3, 3])),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, patch_size=14,
                           spatial_merge_size=2),
        image_token_id=IMG, video_token_id=VID, vision_start_token_id=VSTART, vision_end_token_id=VEND,
        attn_implementation="sdpa")
    torch.manual_seed(seed)
    return Qwen2VLForConditionalGeneration(config)


class TinyVLDataset(torch.utils.data.Dataset):
    """``n`` samples of ``4 .. max_text - 1`` text tokens; every third one also has one image.

    The image is ``side x side`` patches: 4 when ``image_sides`` is None, else drawn from
    ``range(*image_sides)`` times 2 (so the 2x2 merge divides it). Each item carries
    ``sample_idx``, its position in the dataset.
    """

    def __init__(self, n: int, seed: int = 0, max_text: int = 40,
                 image_sides: tuple[int, int] | None = None) -> None:
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for i in range(n):
            n_text = int(torch.randint(4, max_text, (1,), generator=g))
            ids = torch.randint(0, 100, (n_text,), generator=g).tolist()
            item: dict = {"sample_idx": i}
            if i % 3 == 0:
                side = 4 if image_sides is None else int(torch.randint(*image_sides, (1,), generator=g)) * 2
                ids = ids[:2] + [VSTART] + [IMG] * (side * side // 4) + [VEND] + ids[2:]
                item["pixel_values"] = torch.randn(side * side, PATCH_DIM, generator=g)
                item["image_grid_thw"] = torch.tensor([[1, side, side]])
            item["input_ids"] = torch.tensor(ids)
            labels = item["input_ids"].clone()
            labels[labels == IMG] = -100
            item["labels"] = labels
            self.items.append(item)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]

    def lengths(self) -> np.ndarray:
        """Tokens per sample, in dataset order: what the token-balanced sampler balances."""
        return np.array([len(it["input_ids"]) for it in self.items], dtype=np.int64)

    def loss_tokens(self, i: int) -> int:
        """Tokens the Trainer counts for sample ``i`` (shifted labels that are not -100)."""
        return int((self.items[i]["labels"][1:] != -100).sum())


def pad_collate(features: list[dict]) -> dict:
    """Right-padded batch for HF's own (unpacked) Qwen2-VL forward, plus ``sample_idx``."""
    n = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), n, dtype=torch.long)
    labels = torch.full((len(features), n), -100, dtype=torch.long)
    mask = torch.zeros(len(features), n, dtype=torch.long)
    for r, f in enumerate(features):
        k = len(f["input_ids"])
        ids[r, :k], labels[r, :k] = torch.as_tensor(f["input_ids"]), torch.as_tensor(f["labels"])
        mask[r, :k] = 1
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask,
             "mm_token_type_ids": (ids == IMG).int(),
             "sample_idx": torch.tensor([f["sample_idx"] for f in features])}
    images = [f for f in features if "pixel_values" in f]
    if images:
        batch["pixel_values"] = torch.cat([f["pixel_values"] for f in images])
        batch["image_grid_thw"] = torch.cat([f["image_grid_thw"] for f in images])
    return batch


# -- a processor for the tiny model, and raw chat rows ------------------------------------------

ROLES = ["system", "user", "assistant"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }} {% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ c['text'] }} {% endif %}{% endfor %}{% endif %}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


def tiny_qwen2_vl_processor():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2VLProcessor

    from tokenbal.hf_compat import image_processor_class, processor_attributes, set_processor_attributes

    vocab = {f"w{i}": i for i in range(100)}
    vocab |= {r: 100 + i for i, r in enumerate(ROLES)}
    special = {"<|im_start|>": 110, "<|im_end|>": 111, "<|image_pad|>": IMG, "<|video_pad|>": VID,
               "<|vision_start|>": VSTART, "<|vision_end|>": VEND, "[UNK]": 126, "[PAD]": 127}
    tok = Tokenizer(models.WordLevel(vocab | special, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                        additional_special_tokens=[t for t in special if t.startswith("<|")])
    tokenizer.chat_template = CHAT_TEMPLATE
    images = image_processor_class("Qwen2VLImageProcessorPil")(
        min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14, merge_size=2, temporal_patch_size=2)
    # No video processor: ProcessorMixin's class check of that slot needs torchvision (not installable
    # beside this torch build), so the check is skipped for the None argument only.
    proc = object.__new__(Qwen2VLProcessor)
    check = Qwen2VLProcessor.check_argument_for_proper_class
    # (4.57 also insists on a Qwen2Tokenizer class; the tiny tokenizer is a PreTrainedTokenizerFast.)
    proc.check_argument_for_proper_class = (
        lambda name, arg: None if arg is None or name == "tokenizer" else check(proc, name, arg))
    Qwen2VLProcessor.__init__(proc, image_processor=images, tokenizer=tokenizer, video_processor=None,
                              chat_template=CHAT_TEMPLATE)
    del proc.check_argument_for_proper_class
    # ...and saving (the Trainer writes the processor into every checkpoint) skips that empty slot.
    names = [a for a in processor_attributes(type(proc)) if getattr(proc, a, None) is not None]
    set_processor_attributes(proc, names)
    return proc


def chat_rows(n: int, seed: int = 0, *, max_images: int = 2) -> list[dict]:
    """``n`` chat rows (``messages``, ``images``: 0 .. ``max_images`` PIL images of 56 .. 112 px a
    side), some with a system turn, some multi-turn."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        k = int(rng.integers(0, max_images + 1))
        sides = [(int(rng.integers(56, 113)), int(rng.integers(56, 113))) for _ in range(k)]
        imgs = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in sides]
        words = lambda: " ".join(f"w{int(w)}" for w in rng.integers(0, 100, int(rng.integers(2, 30))))  # noqa: E731
        user = [{"type": "image"} for _ in imgs] + [{"type": "text", "text": words()}]
        msgs = ([{"role": "system", "content": [{"type": "text", "text": words()}]}] if i % 4 == 1 else [])
        msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": [{"type": "text",
                                                                                     "text": words()}]}]
        if i % 5 == 2:
            msgs += [{"role": "user", "content": [{"type": "text", "text": words()}]},
                     {"role": "assistant", "content": [{"type": "text", "text": words()}]}]
        rows.append({"messages": msgs, "images": imgs})
    return rows
