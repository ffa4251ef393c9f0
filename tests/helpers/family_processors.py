"""Real transformers processors of every family ``dataset_lengths`` counts, at tiny settings, over
a tokenizer trained here (nothing downloaded), each with a chat template of its family's layout;
a user's subclass of each; random chat rows of every row shape; and the oracle: what the installed
transformers' processor gives for a row. Works on transformers 4.57 to 5.x: image processors are
taken by their PIL class (``XImageProcessorPil`` in 5.x, ``XImageProcessor`` in 4.x), and
processors whose ``__init__`` insists on a video processor (which needs torchvision, not
installable beside this torch build) are built without one."""

from __future__ import annotations

import io
import math
import random

import numpy as np

from tests.helpers.chat_processors import WORDS

ROWS_COLS = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
SPECIAL = ["<s>", "</s>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|image_pad|>", "<|video_pad|>", "<image>", "<video>", "<IMG_CONTEXT>", "<img>", "</img>",
           "<|image|>", "<|video|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>",
           "<|end_of_video|>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>", *ROWS_COLS]

# the family's image part as its checkpoints' templates render it
PLACEHOLDER = {
    "qwen2-vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen2.5-vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen3-vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "glm-4.1v": "<|begin_of_image|><|image|><|end_of_image|>",
    "internvl": "<IMG_CONTEXT>\n",
    "llava": "<image>\n",
    "llava-next": "<image>\n",
    "llava-onevision": "<image>\n",
    "idefics3": "<image>",
    "smolvlm": "<image>",
}
FAMILIES = sorted(PLACEHOLDER)


# the family's video part as its checkpoints' templates render it ({V}: the processor's video token)
VIDEO_PLACEHOLDER = {
    "qwen2-vl": "<|vision_start|>{V}<|vision_end|>",
    "qwen2.5-vl": "<|vision_start|>{V}<|vision_end|>",
    "qwen3-vl": "<|vision_start|>{V}<|vision_end|>",
    "glm-4.1v": "<|begin_of_video|>{V}<|end_of_video|>",
    "internvl": "{V}\n",
    "llava-onevision": "{V}\n",
    "smolvlm": "{V}",   # rows with a video part: SmolVLMProcessor renders its own video template
}
VIDEO_FAMILIES = sorted(VIDEO_PLACEHOLDER)
# families whose processor needs more than the tf-X.Y-video envs hold: SmolVLM's needs num2words,
# so its real-processor oracles run in the tf-X.Y-video-smolvlm overlays (tests/envs/)
OWN_ENV_VIDEO_FAMILIES = ("smolvlm",)
# the families whose real video processors run in the tf-X.Y-video envs themselves
VIDEO_ENV_FAMILIES = [f for f in VIDEO_FAMILIES if f not in OWN_ENV_VIDEO_FAMILIES]


def oracle_video_pool(family: str, videos: list[str], folder, n_videos: int, seed: int,
                      least: int) -> list[str]:
    """The videos a family's oracle rows draw from: ``videos``, and for SmolVLM also long clips
    (20-120 s, at least ``least`` of them), since its sampling skips a second at each end."""
    if family != "smolvlm":
        return videos
    return videos + write_videos(folder, max(least, n_videos // 6), seed=seed + 1, frames=(200, 600))


def template(family: str, bos: bool = False, video_token: str | None = None) -> str:
    """A chat template in the family's layout: string or part-list content, system and multi-turn,
    OpenAI ``image_url`` parts rendered as images (as the checkpoints' templates do); with
    ``video_token``, ``{"type": "video"}`` parts rendered as the family's video part."""
    ph = PLACEHOLDER[family].replace("\n", "\\n")
    video = ""
    if video_token is not None:
        vph = VIDEO_PLACEHOLDER[family].replace("{V}", video_token).replace("\n", "\\n")
        video = "{% elif c['type'] == 'video' %}{{ '" + vph + "' }}"
    return (
        ("{{ bos_token }}" if bos else "")
        + "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
        "{{ m['content'] }}{% else %}{% for c in m['content'] %}"
        "{% if c['type'] == 'image' or c['type'] == 'image_url' %}"
        "{{ '" + ph + "' }}" + video + "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}"
        "{% endif %}<|im_end|>\n{% endfor %}"
    )


_TOKENIZER = {}


def tokenizer():
    """A byte-level BPE tokenizer with every family's special tokens (as attributes too: InternVL's
    processor reads ``tokenizer.start_image_token`` ...); a post-processor prepends ``<s>``."""
    if "tok" in _TOKENIZER:
        return _TOKENIZER["tok"]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = random.Random(0)
    tok.train_from_iterator([" ".join(rng.choices(WORDS, k=12)) + "\n\n" for _ in range(300)], trainer)
    bos = [("<s>", tok.token_to_id("<s>"))]
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=bos)
    # no image_token attribute: Qwen / GLM processors would take it over their own
    extra = {"start_image_token": "<img>", "end_image_token": "</img>",
             "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                  pad_token="<|endoftext|>", unk_token=None, extra_special_tokens=extra)
    for name, value in extra.items():   # 4.x sets the strings only; InternVL reads the ids too
        if not hasattr(out, f"{name}_id"):
            setattr(out, f"{name}_id", out.convert_tokens_to_ids(value))
    _TOKENIZER["tok"] = out
    return out


def _pil(name: str):
    """The PIL-backed image processor class (5.x ``XPil``; 4.x and some 5.x releases: ``X``)."""
    import transformers

    def make(**kwargs):
        pil = getattr(transformers, name + "Pil", None)
        if pil is not None:
            try:
                return pil(**kwargs)
            except ImportError:   # e.g. 5.6's Idefics3ImageProcessorPil asks for torchvision
                pass
        return getattr(transformers, name)(**kwargs)
    return make


def _build(cls, **kwargs):
    """``cls(**kwargs)`` with the class check skipped for a missing video processor, and for the
    tokenizer (4.x insists on the checkpoint's tokenizer class; this one is trained here)."""
    proc = object.__new__(cls)
    check = getattr(cls, "check_argument_for_proper_class", None)
    if check is not None:
        proc.check_argument_for_proper_class = (
            lambda name, arg: None if arg is None or name == "tokenizer" else check(proc, name, arg))
    try:
        cls.__init__(proc, **kwargs)
    finally:
        proc.__dict__.pop("check_argument_for_proper_class", None)
    return proc


def image_processor(family: str):
    if family.startswith("qwen"):
        return _pil("Qwen2VLImageProcessor")(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 48,
                                             patch_size=16 if family == "qwen3-vl" else 14)
    if family == "glm-4.1v":
        return _pil("Glm4vImageProcessor")(size={"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 48})
    if family == "internvl":
        return _pil("GotOcr2ImageProcessor")(size={"height": 56, "width": 56}, crop_to_patches=True,
                                             max_patches=6, min_patches=1)
    if family == "llava":
        return _pil("CLIPImageProcessor")(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    if family == "llava-next":
        return _pil("LlavaNextImageProcessor")(
            size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56},
            image_grid_pinpoints=[[56, 112], [112, 56], [112, 112], [56, 168]])
    if family == "llava-onevision":
        return _pil("LlavaOnevisionImageProcessor")(
            size={"height": 56, "width": 56},
            image_grid_pinpoints=[[56 * i, 56 * j] for i in range(1, 4) for j in range(1, 4)])
    if family in ("idefics3", "smolvlm"):
        name = "Idefics3ImageProcessor" if family == "idefics3" else "SmolVLMImageProcessor"
        return _pil(name)(size={"longest_edge": 4 * 32}, max_image_size={"longest_edge": 32})
    raise KeyError(family)


def processor_class(family: str):
    import transformers

    return getattr(transformers, {
        "qwen2-vl": "Qwen2VLProcessor", "qwen2.5-vl": "Qwen2_5_VLProcessor", "qwen3-vl": "Qwen3VLProcessor",
        "glm-4.1v": "Glm4vProcessor", "internvl": "InternVLProcessor", "llava": "LlavaProcessor",
        "llava-next": "LlavaNextProcessor", "llava-onevision": "LlavaOnevisionProcessor",
        "idefics3": "Idefics3Processor", "smolvlm": "SmolVLMProcessor"}[family])


def processor(family: str, subclass: bool = False, bos_template: bool = False):
    """The family's real transformers processor at tiny settings (``subclass``: built from a user's
    subclass of it, which adds nothing)."""
    cls = processor_class(family)
    if subclass:
        cls = type(f"My{family.title().replace('-', '').replace('.', '')}Processor", (cls,), {})
    kw = dict(image_processor=image_processor(family), tokenizer=tokenizer(),
              chat_template=template(family, bos_template))
    if family in ("qwen2-vl", "qwen2.5-vl", "qwen3-vl", "glm-4.1v", "internvl", "llava-onevision", "smolvlm"):
        kw["video_processor"] = None
    if family == "internvl":
        kw["image_seq_length"] = 3
    if family in ("llava", "llava-next"):
        kw.update(patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1)
    if family == "llava-onevision":
        kw.update(num_image_tokens=16, vision_feature_select_strategy="full")
    if family in ("idefics3", "smolvlm"):
        kw["image_seq_len"] = 3
    proc = _build(cls, **kw)
    if family == "smolvlm" and getattr(proc, "video_processor", None) is None:
        # SmolVLM's apply_chat_template reads its video processor's num_frames / fps even for image
        # rows; the video processor needs torchvision, so only those two settings stand in for it.
        import types

        proc.video_processor = types.SimpleNamespace(num_frames=64, fps=1)
    return proc


# -- rows ------------------------------------------------------------------------------------------

def _text(rng: random.Random) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(1, 10)))


def exif_jpeg(w: int, h: int, orientation: int, seed: int = 0) -> bytes:
    from PIL import Image

    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (seed % 256, 90, 200)).save(buf, "JPEG", exif=exif.tobytes())
    return buf.getvalue()


def xmp_jpeg(w: int, h: int, orientation: int) -> bytes:
    """A JPEG whose orientation is only in its XMP packet (``tiff:Orientation``), as some editors
    write it; Pillow's ``exif_transpose`` (and transformers' ``load_image``) honour it."""
    from PIL import Image

    xmp = (b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-'
           b'syntax-ns#"><rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" tiff:Orientation="%d"/>'
           b"</rdf:RDF></x:xmpmeta>") % orientation
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (30, 200, 90)).save(buf, "JPEG", xmp=xmp)
    return buf.getvalue()


def image_bytes(w: int, h: int, fmt: str, seed: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), ((seed * 37) % 256, (seed * 91) % 256, 128)).save(buf, format=fmt)
    return buf.getvalue()


def random_image(rng: random.Random) -> bytes:
    w = rng.choice([12, 30, 57, 90, 150, 240, 333])
    h = rng.choice([12, 41, 64, 120, 200, 300])
    if rng.random() < 0.15:
        return exif_jpeg(w, h, rng.choice([3, 5, 6, 7, 8]), rng.randrange(99))
    return image_bytes(w, h, rng.choice(["PNG", "JPEG"]), rng.randrange(99))


SHAPES = ("column", "inline", "image_url", "string")


def random_rows(n: int, seed: int, shapes: tuple[str, ...] = SHAPES) -> list:
    """Rows ``{"messages", "images", "shape"}`` with 0-3 images, system turns, 1-3 exchanges, and
    the row shapes: ``column`` (``{"type": "image"}`` parts + images column of bytes), ``inline``
    (``{"type": "image", "image": bytes}`` parts), ``image_url`` (OpenAI parts with a path placeholder
    filled in by :func:`materialise`), ``string`` (string content, text only)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        shape = rng.choice(shapes)
        n_img = 0 if shape == "string" else rng.choice([0, 1, 1, 2, 3])
        msgs = []
        if rng.random() < 0.4:
            msgs.append({"role": "system", "content": _text(rng) if shape == "string"
                         else [{"type": "text", "text": _text(rng)}]})
        turns = rng.randint(1, 3)
        slots = [rng.randrange(turns) for _ in range(n_img)]
        images = [random_image(rng) for _ in range(n_img)]
        k = 0
        for t in range(turns):
            if shape == "string":
                msgs.append({"role": "user", "content": _text(rng)})
                msgs.append({"role": "assistant", "content": _text(rng)})
                continue
            parts = []
            for _ in range(slots.count(t)):
                if shape == "column":
                    parts.append({"type": "image"})
                elif shape == "inline":
                    parts.append({"type": "image", "image": k})
                else:
                    parts.append({"type": "image_url", "image_url": {"url": k}})
                k += 1
            parts.insert(rng.randint(0, len(parts)), {"type": "text", "text": _text(rng)})
            msgs.append({"role": "user", "content": parts})
            msgs.append({"role": "assistant", "content": [{"type": "text", "text": _text(rng)}]})
        rows.append({"messages": msgs, "images": images, "shape": shape})
    return rows


def write_images(images: list, folder, stem: str, suffix: str = ".img") -> list[str]:
    """Each image's bytes written to ``folder/STEM_J.SUFFIX``; their paths, in order."""
    paths = []
    for j, data in enumerate(images):
        p = folder / f"{stem}_{j}{suffix}"
        p.write_bytes(data)
        paths.append(str(p))
    return paths


def materialise(rows: list, folder) -> list:
    """Rows as a user gives them: inline / image_url parts point at image files written to
    ``folder`` (their images column emptied); column rows keep their bytes."""
    out = []
    for i, row in enumerate(rows):
        paths = write_images(row["images"], folder, f"r{i}")
        msgs = []
        for m in row["messages"]:
            if isinstance(m["content"], list):
                parts = []
                for part in m["content"]:
                    if "image" in part and part["type"] == "image":
                        part = {"type": "image", "image": paths[part["image"]]}
                    elif part["type"] == "image_url":
                        part = {"type": "image_url", "image_url": {"url": paths[part["image_url"]["url"]]}}
                    parts.append(part)
                m = {**m, "content": parts}
            msgs.append(m)
        images = row["images"] if row["shape"] == "column" else []
        out.append({"messages": msgs, "images": images, "shape": row["shape"]})
    return out


def load(value):
    """An image as transformers' ``load_image`` reads a path or bytes (EXIF transposed)."""
    from PIL import Image, ImageOps

    if hasattr(value, "mode") and hasattr(value, "size"):   # a PIL image: the processor takes it as given
        return value
    if isinstance(value, dict):   # datasets' Image(decode=False) value
        value = value["bytes"] if value.get("bytes") is not None else value["path"]
    img = Image.open(io.BytesIO(value)) if isinstance(value, bytes) else Image.open(value)
    img = ImageOps.exif_transpose(img)
    return img.convert("RGB")


def oracle(proc, row: dict) -> int:
    """What the installed transformers gives for ``row``: ``apply_chat_template(tokenize=True)``'s
    own steps with public calls (render, collect the images, call the processor with the
    special-token rule) — the same on every version, and runnable where ``images=`` or string
    content make ``apply_chat_template(tokenize=True)`` itself fail (transformers < 5.6 / 5.24)."""
    from tokenbal.estimate.chat import content_images

    # copies: transformers 5.6 - 5.9 reassign message["content"] in place
    text = proc.apply_chat_template([[dict(m) for m in row["messages"]]], tokenize=False)
    text = text[0] if isinstance(text, list) else text
    images = list(row["images"]) or content_images(row["messages"], image_url=_converts_image_url(proc))
    kw = {"add_special_tokens": False} if text.startswith(proc.tokenizer.bos_token) else {}
    out = proc(text=[text], images=[[load(v) for v in images]] if images else None, **kw)
    return int(np.asarray(out["input_ids"][0]).shape[-1])


def _converts_image_url(proc) -> bool:
    conv = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    probe = "{{ messages[0]['content'][0]['type'] }}"
    out = proc.apply_chat_template([conv], chat_template=probe, tokenize=False)
    return (out[0] if isinstance(out, list) else out).strip() == "image"


def save_folder(proc, family: str, folder):
    """What ``processor.save_pretrained`` writes for these parts (it cannot run without the video
    processor): tokenizer files, preprocessor_config.json naming the processor class,
    processor_config.json with the processor's own count settings, chat_template.jinja."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    proc.tokenizer.save_pretrained(str(folder))
    proc.image_processor.save_pretrained(str(folder))
    name = processor_class(family).__name__
    cfg_path = folder / "preprocessor_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["processor_class"] = name
    cfg_path.write_text(json.dumps(cfg))
    keys = ("image_seq_length", "image_seq_len", "num_image_tokens", "patch_size",
            "vision_feature_select_strategy", "num_additional_image_tokens")
    own = {k: getattr(proc, k) for k in keys if isinstance(getattr(proc, k, None), (int, str))}
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": name, **own}))
    (folder / "chat_template.jinja").write_text(proc.chat_template)
    return folder


# -- videos ----------------------------------------------------------------------------------------

VIDEO_CLASS = {"qwen2-vl": ("qwen2_vl", "Qwen2VLVideoProcessor"),
               "qwen2.5-vl": ("qwen2_vl", "Qwen2VLVideoProcessor"),
               "qwen3-vl": ("qwen3_vl", "Qwen3VLVideoProcessor"),
               "glm-4.1v": ("glm4v", "Glm4vVideoProcessor"),
               "llava-onevision": ("llava_onevision", "LlavaOnevisionVideoProcessor"),
               "internvl": ("internvl", "InternVLVideoProcessor"),
               "smolvlm": ("smolvlm", "SmolVLMVideoProcessor")}
# per family, the video settings tested: the class defaults at tiny frame sizes, and a sampling variant
VIDEO_SETTINGS = {
    "qwen2-vl": [{}, {"do_sample_frames": True, "fps": 2.0, "min_frames": 4, "max_frames": 12}],
    "qwen2.5-vl": [{}, {"do_sample_frames": True, "fps": 1.0}],
    "qwen3-vl": [{}, {"fps": 1.0, "min_frames": 2, "max_frames": 8}, {"do_sample_frames": False}],
    "glm-4.1v": [{}, {"fps": 1.0, "max_duration": 1,
                      "size": {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 40}},
                 {"do_sample_frames": False,
                  "size": {"shortest_edge": 28 * 28 * 2, "longest_edge": 28 * 28 * 64}},
                 {"fps": 3.0, "temporal_patch_size": 3, "merge_size": 1, "patch_size": 16}],
    "llava-onevision": [{}, {"do_sample_frames": True, "num_frames": 6}],
    "internvl": [{}, {"do_sample_frames": True, "num_frames": 5}],
    # the class default (every frame), the checkpoints' sampling (fps 1, at most 64: here 8, so
    # that clips over 10 s skip their first / last second) and a denser one
    "smolvlm": [{}, {"do_sample_frames": True, "fps": 1, "num_frames": 8},
                {"do_sample_frames": True, "fps": 4.0, "num_frames": 6}],
}
_STANDIN_KEYS = ("do_sample_frames", "fps", "num_frames", "min_frames", "max_frames", "size", "patch_size",
                 "merge_size", "temporal_patch_size", "max_duration", "do_pad", "max_image_size")


def _video_size(family: str) -> dict:
    if family.startswith("qwen"):
        p = 16 if family == "qwen3-vl" else 14
        return {"size": {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 64}, "patch_size": p}
    if family == "glm-4.1v":
        return {}   # the checkpoints' size; VIDEO_SETTINGS gives others
    if family == "smolvlm":   # as the image processor's: every frame one 32 px global image
        return {"size": {"longest_edge": 4 * 32}, "max_image_size": {"longest_edge": 32}}
    return {"size": {"height": 56, "width": 56}}


class StandInVideoProcessor:
    """A video processor's settings without the class (it needs torchvision, absent in CI): the real
    class's own defaults (read off the class, imported with shape-only torchvision stand-ins), with
    the test's overrides. Enough for what counting reads; it cannot process frames."""

    def __init__(self, family: str, **overrides):
        from tests.helpers.videos import import_without_torchvision

        module, name = VIDEO_CLASS[family]
        mod = import_without_torchvision(f"transformers.models.{module}.video_processing_{module}")
        cls = getattr(mod, name)
        self.__dict__.update({k: getattr(cls, k) for k in _STANDIN_KEYS if hasattr(cls, k)})
        for k in ("do_sample_frames", "fps", "num_frames", "min_frames", "max_frames"):
            self.__dict__.setdefault(k, None)   # the real instances have them all (None: unset)
        self.__dict__.update(overrides)
        if isinstance(self.__dict__.get("size"), dict):
            self.size = dict(self.size)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def video_processor(family: str, real: bool, **settings):
    """The family's video processor at tiny frame sizes (``real``: the transformers class, which
    needs torchvision; else :class:`StandInVideoProcessor`)."""
    kwargs = {**_video_size(family), **settings}
    if not real:
        return StandInVideoProcessor(family, **kwargs)
    import transformers

    return getattr(transformers, VIDEO_CLASS[family][1])(**kwargs)


def video_family_processor(family: str, real: bool, settings: dict | None = None, subclass: bool = False):
    """:func:`processor` with a video processor and a template that renders video parts."""
    proc = processor(family, subclass=subclass)
    proc.video_processor = video_processor(family, real, **(settings or {}))
    proc.chat_template = template(family, video_token=proc.video_token)
    return proc


VIDEO_SHAPES = ("column", "column_bytes", "column_dict", "parts", "inline_video", "inline_path", "inline_url")


def write_videos(folder, n: int, seed: int, frames: tuple[int, int] = (4, 80)) -> list[str]:
    """``n`` small videos of varied container (mp4 / webm / avi), size, rate and duration
    (``frames``: the range of their frame counts)."""
    from tests.helpers.videos import write_video

    rng = random.Random(seed)
    out = []
    for i in range(n):
        ext = rng.choice(["mp4", "mp4", "webm", "avi"])
        w, h = rng.choice([(64, 48), (48, 80), (96, 40), (33, 57), (128, 72), (40, 40)])
        if ext != "avi":
            w, h = w + w % 2, h + h % 2   # yuv420p
        fps = rng.choice([5, 10, 12.5, 24, 25, 30])
        count = rng.randint(*frames)
        kw = {"gaps_ms": [33, 50, 100]} if ext == "mp4" and rng.random() < 0.2 else {}
        out.append(write_video(str(folder / f"v{seed}_{i}.{ext}"), count, w, h, fps, **kw))
    return out


def random_video_rows(n: int, seed: int, videos: list[str], images: bool = True) -> list:
    """Rows ``{"messages", "images", "videos", "shape"}`` with 1-2 videos (a quarter with none) and,
    with ``images``, 0-2 images, in the video row shapes: ``column`` (``{"type": "video"}`` parts
    + a videos column of paths), ``column_bytes`` / ``column_dict`` (the column holds the file's
    bytes / a ``{bytes, path}`` dict, as ``datasets.Video(decode=False)`` gives it), ``parts``
    (the column given, parts named too), ``inline_*`` (the parts name the file under ``video`` /
    ``path`` / ``url``, no column)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        shape = rng.choice(VIDEO_SHAPES)
        n_vid = rng.choice([0, 1, 1, 1, 2])
        vids = [rng.choice(videos) for _ in range(n_vid)]
        imgs = [random_image(rng) for _ in range(rng.choice([0, 0, 1, 2]) if images else 0)]
        parts = [{"type": "image"} for _ in imgs]
        for v in vids:
            if shape.startswith("inline"):
                parts.append({"type": "video", shape.split("_")[1]: v})
            elif shape == "parts":
                parts.append({"type": "video", "video": v})
            else:
                parts.append({"type": "video"})
        rng.shuffle(parts)
        parts.insert(rng.randint(0, len(parts)), {"type": "text", "text": _text(rng)})
        msgs = []
        if rng.random() < 0.3:
            msgs.append({"role": "system", "content": [{"type": "text", "text": _text(rng)}]})
        msgs += [{"role": "user", "content": parts},
                 {"role": "assistant", "content": [{"type": "text", "text": _text(rng)}]}]
        if shape.startswith("inline"):
            column = []
        elif shape == "column_bytes":
            column = [open(v, "rb").read() for v in vids]
        elif shape == "column_dict":
            column = [{"bytes": open(v, "rb").read(), "path": None} for v in vids]
        else:
            column = list(vids)
        # images go in the column in the order of their parts; videos likewise
        rows.append({"messages": msgs, "images": imgs, "videos": column, "files": vids, "shape": shape})
    return rows


def decode_video(path: str):
    """Every frame of ``path`` (PyAV) and the ``VideoMetadata`` a decoder of the whole file reports
    (frames decoded, the stream's average rate): what the processor receives when it loads the file."""
    import av
    from transformers.video_utils import VideoMetadata

    with av.open(path) as c:
        fps = float(c.streams.video[0].average_rate)
        frames = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])
    return frames, VideoMetadata(total_num_frames=len(frames), fps=fps, duration=len(frames) / fps,
                                 width=frames.shape[2], height=frames.shape[1],
                                 frames_indices=list(range(len(frames))))


def is_smolvlm(proc) -> bool:
    return any(c.__name__ == "SmolVLMProcessor" for c in type(proc).__mro__)


def video_oracle(proc, row: dict) -> int:
    """What the installed transformers' processor gives for a video row (needs its video processor,
    i.e. torchvision): the template rendered, the images and the videos (each file decoded whole,
    as the processor's loader does) handed to the processor, with the special-token rule."""
    text = proc.apply_chat_template([[dict(m) for m in row["messages"]]], tokenize=False)
    text = text[0] if isinstance(text, list) else text
    images = list(row["images"])
    decoded = [decode_video(v) for v in row["files"]]
    kw = {"add_special_tokens": False} if text.startswith(proc.tokenizer.bos_token) else {}
    if decoded:
        kw.update(videos=[[d[0] for d in decoded]], video_metadata=[[d[1] for d in decoded]])
        if is_smolvlm(proc):   # 5.19 / 5.24's SmolVLM raises without tensors (its pixel_values a list)
            kw["return_tensors"] = "pt"
    out = proc(text=[text], images=[[load(v) for v in images]] if images else None, **kw)
    return int(np.asarray(out["input_ids"][0]).shape[-1])


# -- Phi-4-multimodal (images; its image processor needs torchvision, absent in CI) ------------------

PHI4_MODULE = "transformers.models.phi4_multimodal.image_processing_phi4_multimodal"


class StandInPhi4ImageProcessor:
    """Phi-4-multimodal's image processor settings without the class (it needs torchvision): the
    real class's own defaults (read off the class, imported with shape-only torchvision stand-ins)
    with the test's overrides. Enough for what counting reads; it cannot process images."""

    def __init__(self, **overrides):
        from tests.helpers.videos import import_without_torchvision

        cls = import_without_torchvision(PHI4_MODULE).Phi4MultimodalImageProcessor
        self.__dict__.update({"size": dict(cls.size), "patch_size": cls.patch_size,
                              "dynamic_hd": cls.dynamic_hd, **overrides})

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def phi4_tokenizer():
    """:func:`tokenizer` with Phi-4's ``<|audio|>`` token added and the tokens its processor reads
    (``image_token`` / ``audio_token`` and their ids) as the tokenizer's own extra special tokens,
    so that ``save_pretrained`` writes them and a saved folder loads (``AutoProcessor``)."""
    if "phi4" in _TOKENIZER:
        return _TOKENIZER["phi4"]
    import copy

    from transformers import PreTrainedTokenizerFast

    base = tokenizer()
    backend = copy.deepcopy(base.backend_tokenizer)
    backend.add_special_tokens(["<|audio|>"])
    extra = {"start_image_token": "<img>", "end_image_token": "</img>",
             "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>",
             "image_token": "<|image|>", "audio_token": "<|audio|>"}
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                  pad_token="<|endoftext|>", unk_token=None, extra_special_tokens=extra)
    for name, value in extra.items():   # 4.x sets the strings only
        if getattr(tok, name, None) != value:
            setattr(tok, name, value)
        if not hasattr(tok, f"{name}_id"):
            setattr(tok, f"{name}_id", tok.convert_tokens_to_ids(value))
    _TOKENIZER["phi4"] = tok
    return tok


def phi4_template() -> str:
    """The chat template layout of :func:`template` with Phi-4's ``<|image|>`` image part and
    ``<|audio|>`` audio part."""
    return (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
        "{{ m['content'] }}{% else %}{% for c in m['content'] %}"
        "{% if c['type'] == 'image' or c['type'] == 'image_url' %}{{ '<|image|>' }}"
        "{% elif c['type'] == 'audio' %}{{ '<|audio|>' }}"
        "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}"
        "{% endif %}<|im_end|>\n{% endfor %}"
    )


def phi4_processor(real: bool, subclass: bool = False, **settings):
    """A real ``Phi4MultimodalProcessor`` (``subclass``: a user's subclass of it) over
    :func:`phi4_tokenizer` with its real audio feature extractor (``Phi4MultimodalFeatureExtractor``,
    class defaults: what ``save_pretrained`` needs); its image processor the real class
    (``real``: needs torchvision; then the processor saves and loads as a folder) or
    :class:`StandInPhi4ImageProcessor`."""
    import transformers

    cls = transformers.Phi4MultimodalProcessor
    if subclass:
        cls = type("MyPhi4MultimodalProcessor", (cls,), {})
    image = (transformers.Phi4MultimodalImageProcessor(**settings) if real
             else StandInPhi4ImageProcessor(**settings))
    proc = object.__new__(cls)
    proc.check_argument_for_proper_class = lambda name, arg: None   # stand-in / our tokenizer
    try:
        cls.__init__(proc, image_processor=image,
                     audio_processor=transformers.Phi4MultimodalFeatureExtractor(),
                     tokenizer=phi4_tokenizer(), chat_template=phi4_template())
    finally:
        proc.__dict__.pop("check_argument_for_proper_class", None)
    return proc


PHI4_EXTREME = [(5000, 20), (20, 5000), (3000, 12), (900, 9), (9, 900), (4000, 40)]


def phi4_image_size(rng: random.Random) -> tuple[int, int]:
    """Sizes for Phi-4's crop grid: small to ~2000 px, aspect ratios up to the ones its processor
    rejects (a resized side below 10 px) and beyond."""
    if rng.random() < 0.1:
        return rng.choice(PHI4_EXTREME)
    w = int(round(math.exp(rng.uniform(math.log(8), math.log(2000)))))
    h = int(round(math.exp(rng.uniform(math.log(8), math.log(2000)))))
    if rng.random() < 0.15:   # near a multiple of the 448-px crop
        w = 448 * rng.randint(1, 4) + rng.choice([-1, 0, 1])
    return w, h


def phi4_rows(n: int, seed: int) -> list:
    """:func:`random_rows` (0-3 images, every row shape) with images of :func:`phi4_image_size`."""
    rng = random.Random(seed + 1)
    rows = random_rows(n, seed)
    for row in rows:
        row["images"] = [image_bytes(*phi4_image_size(rng), rng.choice(["PNG", "JPEG"]), rng.randrange(99))
                         for _ in row["images"]]
    return rows


def tally_lengths(proc, rows: list, wants: list) -> tuple[int, int, list[int], list[dict]]:
    """``dataset_lengths`` row by row against the processor's lengths ``wants`` (an int, or a string
    where the processor rejects the row): (rows that agree, rows both reject — tokenbal's error
    naming the row —, the indices of the agreeing rows, every disagreement)."""
    from tokenbal.integrations.hf_lengths import dataset_lengths

    agree = rejected = 0
    accepted, wrong = [], []
    for i, (row, want) in enumerate(zip(rows, wants, strict=True)):
        try:
            got = int(dataset_lengths([row], proc)[0])
        except ValueError as e:
            got = f"raises {type(e).__name__}" if str(e).startswith("row 0") else f"unnamed: {e}"
        if isinstance(want, str) and isinstance(got, str) and not got.startswith("unnamed"):
            rejected += 1
        elif want == got:
            agree += 1
            accepted.append(i)
        else:
            wrong.append({"row": i, "processor": want, "dataset_lengths": got, "shape": row["shape"]})
    return agree, rejected, accepted, wrong
