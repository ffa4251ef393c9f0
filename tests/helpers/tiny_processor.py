"""A Qwen2-VL processor whose token ids match ``collate.train.tiny.tiny_qwen2_vl`` (nothing downloaded):
a word-level tokenizer (``w0`` .. ``w99``, the roles, Qwen's chat and vision special tokens at the
tiny model's ids), a Qwen chat template, and Qwen2-VL's image processor at 56 x 56 .. 112 x 112
pixels (4 .. 16 placeholder tokens per image). For the packed Trainer / trl tests, which render raw
chat rows with it."""

from __future__ import annotations

from collate.train.tiny import IMG, VEND, VID, VSTART

ROLES = ["system", "user", "assistant"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }} {% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ c['text'] }} {% endif %}{% endfor %}{% endif %}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


def tiny_qwen2_vl_processor():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2VLImageProcessorPil, Qwen2VLProcessor

    vocab = {f"w{i}": i for i in range(100)}
    vocab |= {r: 100 + i for i, r in enumerate(ROLES)}
    special = {"<|im_start|>": 110, "<|im_end|>": 111, "<|image_pad|>": IMG, "<|video_pad|>": VID,
               "<|vision_start|>": VSTART, "<|vision_end|>": VEND, "[UNK]": 126, "[PAD]": 127}
    tok = Tokenizer(models.WordLevel(vocab | special, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                        additional_special_tokens=[t for t in special if t.startswith("<|")])
    tokenizer.chat_template = CHAT_TEMPLATE
    images = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14,
                                      merge_size=2, temporal_patch_size=2)
    # No video processor: ProcessorMixin's class check of that slot needs torchvision (not installable
    # beside this torch build), so the check is skipped for the None argument only.
    proc = object.__new__(Qwen2VLProcessor)
    check = Qwen2VLProcessor.check_argument_for_proper_class
    proc.check_argument_for_proper_class = lambda name, arg: None if arg is None else check(proc, name, arg)
    Qwen2VLProcessor.__init__(proc, image_processor=images, tokenizer=tokenizer, video_processor=None,
                              chat_template=CHAT_TEMPLATE)
    del proc.check_argument_for_proper_class
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
