"""Real transformers Qwen-VL processors over a locally trained tokenizer (nothing downloaded), three
chat templates, and random chat datasets with 0-3 images per row: the oracles of
``dataset_lengths`` and of ``tokenbal index build --processor``. transformers is imported inside
the builders."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

SPECIAL = ["<s>", "</s>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|image_pad|>", "<|video_pad|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
           "<image>"]

WORDS = ("the quick brown fox jumps over a lazy dog describe this picture please what is in image colour "
         "cat sky tree token balance rank step pack sample 多模态 émigré 🙂 count 12345 and or").split()

# Qwen2-VL / Qwen2.5-VL's own chat template (the checkpoints' chat_template.json).
QWEN2_VL = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in "
    "messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful "
    "assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string "
    "%}{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}{% if "
    "content['type'] == 'image' or 'image' in content or 'image_url' in content %}{% set image_count.value = "
    "image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif "
    "%}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' or 'video' in content "
    "%}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value "
    "}}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}{{ "
    "content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if "
    "add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Written for these tests: a Llama-3 style layout that starts with the BOS token (so the processor
# adds no special tokens of its own), strips text, numbers the images.
LLAMA_STYLE = (
    "{{ bos_token }}{% set n = namespace(img=0) %}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
    "<|end_header_id|>\n\n{% if m['content'] is string %}{{ m['content'] | trim }}{% else %}{% for c in "
    "m['content'] %}{% if c['type'] == 'image' %}{% set n.img = n.img + 1 %}[img {{ n.img }}]"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'text' %}{{ c['text'] | trim }}"
    "{% endif %}{% endfor %}{% endif %}<|eot_id|>{% endfor %}"
)

# Written for these tests: no BOS (the tokenizer's post-processor adds it), the system turn folded
# into the first user turn, images as a bare placeholder, a generation-style suffix on user turns.
PLAIN_STYLE = (
    "{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}"
    "{% set rest = messages[1:] %}{% else %}{% set sys = '' %}{% set rest = messages %}{% endif %}"
    "{% for m in rest %}{% if m['role'] == 'user' %}USER: {% if loop.first and sys %}"
    "{{ sys if sys is string else sys[0]['text'] }}\n{% endif %}{% else %}ASSISTANT: {% endif %}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|image_pad|>{% else %}{{ c['text'] }} {% endif %}{% endfor %}{% endif %}"
    "{{ '</s>' if m['role'] == 'assistant' else '\n' }}{% endfor %}"
)

TEMPLATES = {"qwen2-vl": QWEN2_VL, "llama-style": LLAMA_STYLE, "plain-style": PLAIN_STYLE}


def tokenizer(bos_post_processor: bool = True):
    """A byte-level BPE tokenizer trained here, with Qwen-VL's special tokens; optionally a
    post-processor that prepends ``<s>`` (so ``add_special_tokens`` matters)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = random.Random(0)
    tok.train_from_iterator([" ".join(rng.choices(WORDS, k=12)) for _ in range(300)], trainer)
    if bos_post_processor:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                           special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<|endoftext|>", unk_token=None)


def image_processor(family: str = "qwen2-vl", min_pixels: int = 28 * 28 * 4, max_pixels: int = 28 * 28 * 96):
    from tests.helpers.family_processors import _pil

    patch = 16 if family == "qwen3-vl" else 14
    return _pil("Qwen2VLImageProcessor")(min_pixels=min_pixels, max_pixels=max_pixels, patch_size=patch)


def processor(template: str = QWEN2_VL, family: str = "qwen2-vl", tok=None, **image_kwargs):
    """The real ``Qwen2VLProcessor`` (``Qwen2_5_VLProcessor``, ``Qwen3VLProcessor``) over
    ``tokenizer()``. Built without a video processor: its class check needs torchvision, which cannot
    be installed beside this torch build, so only that one check of ``__init__`` is skipped (and
    4.x's tokenizer class check: this tokenizer is trained here)."""
    import transformers

    cls = {"qwen2-vl": transformers.Qwen2VLProcessor, "qwen2.5-vl": transformers.Qwen2_5_VLProcessor,
           "qwen3-vl": transformers.Qwen3VLProcessor}[family]
    from tests.helpers.family_processors import _build

    return _build(cls, image_processor=image_processor(family, **image_kwargs), tokenizer=tok or tokenizer(),
                  video_processor=None, chat_template=template)


def save_folder(proc, folder: Path) -> Path:
    """What ``processor.save_pretrained`` writes for a processor of these parts (it cannot run
    without a video processor): tokenizer files, preprocessor_config.json with the processor class,
    chat_template.jinja."""
    folder.mkdir(parents=True, exist_ok=True)
    proc.tokenizer.save_pretrained(str(folder))
    proc.image_processor.save_pretrained(str(folder))
    cfg_path = folder / "preprocessor_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["processor_class"] = type(proc).__name__
    cfg_path.write_text(json.dumps(cfg))
    (folder / "chat_template.jinja").write_text(proc.chat_template)
    return folder


def image_bytes(w: int, h: int, fmt: str = "PNG", seed: int = 0) -> bytes:
    from PIL import Image

    img = Image.new("RGB", (w, h), ((seed * 37) % 256, (seed * 91) % 256, 128))
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def _text(rng: random.Random) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(1, 14)))


def chat_rows(n: int, seed: int = 0, string_content: bool = True) -> list[dict]:
    """``n`` rows ``{"messages": [...], "images": [PNG/JPEG bytes ...]}``: system turns (some),
    1-3 user/assistant exchanges, 0-3 images (placed in user turns), text-only rows, sizes from
    tiny to above max_pixels, odd aspect ratios. Content parts keep one struct shape
    (``{"type", "text"}``) as datasets stores them."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        n_img = rng.choice([0, 0, 1, 1, 2, 3])
        msgs = []
        if rng.random() < 0.4:
            msgs.append({"role": "system", "content": [{"type": "text", "text": _text(rng)}]})
        turns = rng.randint(1, 3)
        slots = [rng.randrange(turns) for _ in range(n_img)]
        for t in range(turns):
            parts = [{"type": "image", "text": None} for _ in range(slots.count(t))]
            parts.insert(rng.randint(0, len(parts)), {"type": "text", "text": _text(rng)})
            msgs.append({"role": "user", "content": parts})
            msgs.append({"role": "assistant", "content": [{"type": "text", "text": _text(rng)}]})
        sizes = [(rng.choice([28, 57, 90, 200, 333, 640]), rng.choice([28, 41, 120, 256, 480]))
                 for _ in range(n_img)]
        images = [image_bytes(w, h, rng.choice(["PNG", "JPEG"]), seed=rng.randrange(99)) for w, h in sizes]
        rows.append({"messages": msgs, "images": images})
    return rows


def hf_dataset(rows: list[dict], decode: bool = True):
    """A ``datasets.Dataset`` of ``rows`` with an ``images`` column of ``Sequence(Image())``."""
    import datasets

    data = {"messages": [r["messages"] for r in rows],
            "images": [[{"bytes": b, "path": None} for b in r["images"]] for r in rows]}
    ds = datasets.Dataset.from_dict(data)
    return ds.cast_column("images", datasets.List(datasets.Image(decode=decode)))


def oracle_length(proc, row: dict, messages: str = "messages", images: str = "images") -> int:
    """The processor's own count, the expression ``dataset_lengths`` promises to equal; where the
    installed transformers cannot take ``images=`` (before 5.24), the same steps through public calls
    (:func:`tests.helpers.family_processors.oracle`)."""
    try:
        return len(proc.apply_chat_template([row[messages]], images=[row[images]] or None, tokenize=True,
                                            return_dict=True)["input_ids"][0])
    except TypeError:   # 5.6 - 5.19: "multiple values for keyword argument 'images'"; 4.57 its own
        pass
    from tests.helpers.family_processors import oracle

    return oracle(proc, {"messages": row[messages], "images": row[images] or []})


# LLaVA-NeXT style (written for these tests): "<image>" placeholders before the turn's text.
LLAVA_NEXT = (
    "{% for m in messages %}{{ m['role'] | upper }}: {% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n{% endif %}{% endfor %}"
    "{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ eos_token if m['role'] == 'assistant' else '\n' }}{% endfor %}"
)


def llava_next_processor(template: str = LLAVA_NEXT, tok=None):
    """The real ``LlavaNextProcessor`` (336-px crops, CLS dropped) over ``tokenizer()``."""
    from tests.helpers.processors import llava_next_processor as build

    proc = build(tok or tokenizer())
    proc.chat_template = template
    return proc


def assert_counts_without_expansion_equal_expanded(counter, conv, sizes) -> None:
    """The chat counter's fast path (placeholders counted, not expanded) gives the token count of
    the fully expanded render, for one conversation with images of ``sizes``."""
    counter.expand = False
    fast = counter.count([conv], [sizes])
    counter.expand = True
    try:
        slow = counter.count([conv], [sizes])
    finally:
        counter.expand = False
    assert fast.tolist() == slow.tolist()
