"""Exact token counts of chat conversations with images, as a transformers processor gives them,
without running the processor on pixels.

``processor.apply_chat_template(conversations, images=..., tokenize=True)`` renders the chat
template (one image placeholder per image part), replaces the ``i``-th placeholder with the image's
placeholder tokens (``<|image_pad|>`` × ``n_i`` for Qwen-VL) and tokenizes the result. The count is
therefore

    tokens(rendered text) - placeholders + Σ_i n_i

when the placeholder is an added token of the tokenizer (it then splits the text around it, so
repeating it changes nothing else). :class:`ChatTokenCounter` renders with transformers' own
template machinery (the processor's normalisation, ``render_jinja_template``, the tokenizer's
special tokens as template variables), tokenizes the rendered texts in one batch with the
processor's own tokenizer and takes each ``n_i`` from the tokenbal estimator built from the
processor's settings (:func:`tokenbal.estimate.vision.estimator_from_processor`): no image is
decoded or resized. When the placeholder is not an added token the placeholders are expanded and
the expanded text is tokenized (slower, still exact).

The estimator's ``wrapper_tokens`` (``<|vision_start|>`` / ``<|vision_end|>``) are part of the
rendered template text; :meth:`ChatTokenCounter.count_split` moves them to the vision count, as the
index counts them (``vision = Σ (n_i + wrappers)``, ``text = total - vision``).

Needs transformers (and jinja2); imported when a counter is built.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

# estimator family -> the placeholder its processor's template renders, for folders read without the
# processor class (``from_pretrained``); a loaded processor says it itself (``processor.image_token``).
_FAMILY_IMAGE_TOKEN = {**{family: "<|image_pad|>" for family in ("qwen2-vl", "qwen2.5-vl", "qwen3-vl")},
                       "llava-next": "<image>"}


class ChatCountError(ValueError):
    """A conversation cannot be counted (the message names the row)."""


class ChatTokenCounter:
    """Counts ``len(processor.apply_chat_template([conv], images=[imgs], tokenize=True,
    return_dict=True)["input_ids"][0])`` from the images' sizes (for a tokenizer, text-only:
    ``len(tokenizer.apply_chat_template(conv, tokenize=True))``).

    Build it with :meth:`from_processor` (a loaded transformers processor) or
    :meth:`from_pretrained` (a checkpoint / processor folder). ``count(conversations, sizes)``:
    ``sizes[r]`` is the list of ``(width, height)`` of row ``r``'s images, in the order the
    processor would receive them.
    """

    def __init__(self, tokenizer: Any, chat_template: str, estimator: Any, image_token: str | None, *,
                 normalize: Any = None, add_special_tokens: bool = True, source: str = "") -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.estimator = estimator
        self.image_token = image_token
        self.add_special_tokens = bool(add_special_tokens)
        self.source = source
        self._normalize = normalize   # a processor's own override, else transformers' rules (below)
        from transformers.utils.chat_template_utils import _get_template_variables

        self._template_vars = _get_template_variables(chat_template)
        self._backend = _fast_backend(tokenizer)
        self._backend_checked = False
        # The shortcut (count the placeholder once, add n_i - 1) holds when the placeholder is an
        # added token: the tokenizer cuts the text around added tokens before anything else.
        added = set(getattr(tokenizer, "get_added_vocab", dict)())
        self.expand = image_token is not None and image_token not in added
        self._fingerprint: str | None = None

    # -- construction ----------------------------------------------------------------------------

    @classmethod
    def from_processor(cls, processor: Any, estimator: Any = None) -> ChatTokenCounter:
        """The counter of a loaded transformers processor (its tokenizer, chat template, image
        token and image-processor settings). ``estimator`` overrides the one built from it."""
        from tokenbal.estimate.vision import estimator_from_processor

        tokenizer = getattr(processor, "tokenizer", None)
        is_tokenizer = hasattr(processor, "apply_chat_template") and hasattr(processor, "get_vocab")
        if tokenizer is None and is_tokenizer:
            # A tokenizer (text-only model): its apply_chat_template never adds special tokens
            return cls(processor, _processor_template(processor), estimator, None,
                       normalize=_tokenizer_normalize, add_special_tokens=False,
                       source=type(processor).__name__)
        if tokenizer is None:
            raise TypeError(f"{type(processor).__name__} is neither a transformers processor nor a tokenizer")
        template = _processor_template(processor)
        if estimator is None and getattr(processor, "image_processor", None) is not None:
            estimator = estimator_from_processor(processor)
        text_kwargs: dict = {}
        merge = getattr(processor, "_merge_kwargs", None)
        if callable(merge):   # the processor's own defaults for its tokenizer call
            text_kwargs = merge(tokenizer_init_kwargs=getattr(tokenizer, "init_kwargs", {}))["text_kwargs"]
        counter = cls(tokenizer, template, estimator, getattr(processor, "image_token", None),
                      normalize=_overridden_normalize(processor),
                      add_special_tokens=text_kwargs.get("add_special_tokens", True),
                      source=type(processor).__name__)
        if text_kwargs.get("truncation") or text_kwargs.get("max_length"):
            raise ValueError(f"{type(processor).__name__} truncates its text ({text_kwargs}); lengths of "
                             "truncated conversations are not modelled")
        return counter

    @classmethod
    def from_pretrained(cls, folder: str | Path, estimator: Any = None) -> ChatTokenCounter:
        """The counter of a checkpoint or processor folder: its tokenizer (``AutoTokenizer``), the
        processor's chat template (``chat_template.jinja``, ``chat_template.json``,
        ``processor_config.json``, else the tokenizer's) and the estimator of its processor configs
        (:func:`tokenbal.estimate.load_estimator`)."""
        from transformers import AutoTokenizer

        from tokenbal.estimate.vision import load_estimator

        d = Path(folder)
        if not d.is_dir():
            raise FileNotFoundError(f"processor folder {str(d)!r} does not exist")
        tokenizer = AutoTokenizer.from_pretrained(str(d))
        template = _folder_template(d) or getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):
            template = template.get("default")
        if not template:
            raise ValueError(f"{str(d)!r} has no chat template (chat_template.jinja / chat_template.json / "
                             "tokenizer_config.json)")
        est = estimator if estimator is not None else load_estimator(d)
        image_token = getattr(tokenizer, "image_token", None) or _FAMILY_IMAGE_TOKEN.get(est.name)
        if image_token is None:
            raise ValueError(f"{str(d)!r}: no image placeholder token known for estimator {est.name!r}")
        return cls(tokenizer, template, est, image_token, source=str(d))

    # -- identity --------------------------------------------------------------------------------

    @property
    def fingerprint(self) -> str:
        """A digest of everything a count depends on: vocabulary, template, special tokens, image
        token, estimator settings (for caches and index manifests)."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            backend = _fast_backend(self.tokenizer)
            vocab = backend.to_str() if backend is not None else json.dumps(
                sorted(self.tokenizer.get_vocab().items()))
            special = json.dumps(self.tokenizer.special_tokens_map, sort_keys=True)
            for part in (vocab, self.chat_template, special, str(self.image_token),
                         str(self.add_special_tokens),
                         json.dumps(getattr(self.estimator, "config", None), sort_keys=True, default=str)):
                h.update(part.encode("utf-8"))
                h.update(b"\0")
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    @property
    def name(self) -> str:
        return f"chat:sha256={self.fingerprint}"

    # -- counting --------------------------------------------------------------------------------

    def render(self, conversations: Sequence[Any], images: Sequence[Any] | None = None) -> list[str]:
        """The texts ``apply_chat_template(..., tokenize=False)`` renders, one per conversation
        (``images``: per row, what the processor would get as ``images=``; only templates that
        read an ``images`` variable see it)."""
        from transformers.utils.chat_template_utils import render_jinja_template

        if not len(conversations):
            return []
        convs = [list(c) for c in conversations]
        if self._normalize is not None:
            convs, _ = self._normalize(convs)
        elif all(_plain(c) for c in convs):   # Arrow / JSON rows: transformers' result without its walk
            convs, _ = normalize_plain(convs)
        else:
            convs, _ = normalize_conversations(convs)
        special = self.tokenizer.special_tokens_map
        if "images" not in self._template_vars:
            texts, _ = render_jinja_template(conversations=convs, chat_template=self.chat_template, **special)
            return list(texts)
        out = []
        for r, conv in enumerate(convs):
            extra = {"images": [images[r]] if images is not None else None}
            texts, _ = render_jinja_template(conversations=[conv], chat_template=self.chat_template,
                                             **{**special, **extra})
            out.append(texts[0])
        return out

    def count(self, conversations: Sequence[Any], sizes: Sequence[Sequence[tuple[int, int]]],
              first_row: int = 0, images: Sequence[Any] | None = None) -> np.ndarray:
        """Total tokens per conversation (int64). ``first_row`` numbers the rows in errors."""
        texts = self.render(conversations, images)
        return self._count_texts(texts, sizes, first_row)[0]

    def count_split(self, conversations: Sequence[Any], sizes: Sequence[Sequence[tuple[int, int]]],
                    first_row: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """``(text, vision)`` per conversation: ``vision`` = Σ (placeholder tokens + wrapper tokens)
        of its images, ``text`` = the rest (template, roles, text), so ``text + vision`` = total."""
        total, per_image, owner = self._count_texts(self.render(conversations), sizes, first_row)
        wrap = int(getattr(self.estimator, "wrapper_tokens", 0)) if self.estimator is not None else 0
        vision = np.bincount(owner, weights=per_image + wrap, minlength=len(total)).astype(np.int64)
        return total - vision, vision

    def _count_texts(self, texts: list[str], sizes: Sequence[Sequence[tuple[int, int]]], first_row: int):
        if len(sizes) != len(texts):
            raise ValueError(f"{len(texts)} conversations but {len(sizes)} image lists")
        n_images = np.fromiter((len(s) for s in sizes), dtype=np.int64, count=len(sizes))
        token = self.image_token
        for r, text in enumerate(texts):
            found = text.count(token) if token else 0
            if found != n_images[r]:
                raise ChatCountError(
                    f"row {first_row + r}: the chat template renders {found} image placeholder(s) "
                    f"({token!r}) but the row has {n_images[r]} image(s); the processor raises on this "
                    "(each image needs an image part in the messages, and each image part an image)")
        owner = np.repeat(np.arange(len(texts)), n_images)
        per_image = self._image_tokens(sizes, owner, first_row)
        if self.expand and len(per_image):
            texts = self._expanded(texts, per_image, owner)
            total = self._tokens(texts)
        else:
            total = self._tokens(texts) + np.bincount(owner, weights=per_image - 1,
                                                      minlength=len(texts)).astype(np.int64)
        return total, per_image, owner

    def _image_tokens(self, sizes, owner: np.ndarray, first_row: int) -> np.ndarray:
        if not len(owner):
            return np.zeros(0, np.int64)
        if self.estimator is None:
            raise ChatCountError(f"row {first_row + int(owner[0])} has images but the processor has no "
                                 "image processor")
        from tokenbal.estimate.vision import image_tokens_checked

        wh = np.array([s for row in sizes for s in row], dtype=np.int64).reshape(-1, 2)
        tokens, bad = image_tokens_checked(self.estimator, wh[:, 0], wh[:, 1])
        if bad:
            j = min(bad)
            k = int(j - np.searchsorted(owner, owner[j]))   # the image's place in its row
            raise ChatCountError(f"row {first_row + int(owner[j])}: image {k} "
                                 f"({wh[j, 0]}x{wh[j, 1]}): {bad[j]}")
        return tokens

    def _expanded(self, texts: list[str], per_image: np.ndarray, owner: np.ndarray) -> list[str]:
        out, j = [], 0
        for text in texts:
            pieces = text.split(self.image_token)
            built = [pieces[0]]
            for piece in pieces[1:]:
                built.append(self.image_token * int(per_image[j]))
                built.append(piece)
                j += 1
            out.append("".join(built))
        return out

    def _tokens(self, texts: list[str]) -> np.ndarray:
        """Token counts of the rendered texts, with the processor's special-token rule: none added
        when the text starts with the BOS token (the template wrote it), else the tokenizer's
        default (``add_special_tokens``)."""
        out = np.zeros(len(texts), np.int64)
        bos = getattr(self.tokenizer, "bos_token", None)
        flags = np.array([self.add_special_tokens and not (bos and t.startswith(bos)) for t in texts], bool)
        for flag in (True, False):
            rows = np.flatnonzero(flags == flag)
            if not len(rows):
                continue
            batch = [texts[i] for i in rows]
            if self._backend is not None and not self._backend_checked:
                self._check_backend(batch[:8], bool(flag))
            if self._backend is not None:
                encs = self._backend.encode_batch_fast(batch, add_special_tokens=bool(flag))
                out[rows] = [len(e.ids) for e in encs]
            else:
                ids = self.tokenizer(batch, add_special_tokens=bool(flag))["input_ids"]
                out[rows] = [len(x) for x in ids]
        return out

    def _check_backend(self, texts: list[str], flag: bool) -> None:
        """Counting through the ``tokenizers`` backend skips the transformers wrapper; the first
        texts are counted both ways, and a tokenizer whose wrapper changes the count (Python-side
        preprocessing) is used through the wrapper from then on."""
        self._backend_checked = True
        fast = [len(e.ids) for e in self._backend.encode_batch_fast(texts, add_special_tokens=flag)]
        slow = [len(x) for x in self.tokenizer(texts, add_special_tokens=flag)["input_ids"]]
        if fast != slow:
            self._backend = None

    def __repr__(self) -> str:
        est = getattr(self.estimator, "name", None)
        return f"ChatTokenCounter(source={self.source!r}, estimator={est!r})"


class ProcessorTextCounter:
    """The index's text counter for ``tokenbal index build --processor DIR``: samples with chat
    turns (:meth:`count_chat_text`) are counted through the processor's chat template, plain texts
    (captions, ``.txt``) with its tokenizer as ``processor(text=...)`` would (``count_batch``)."""

    def __init__(self, chat: ChatTokenCounter) -> None:
        self.chat = chat
        self.name = f"processor:{chat.name}"

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> ProcessorTextCounter:
        return cls(ChatTokenCounter.from_pretrained(folder))

    def count_batch(self, texts: Sequence[str]) -> np.ndarray:
        return self.chat._tokens(list(texts))

    def count_chat_text(self, conversations: Sequence[Any],
                        sizes: Sequence[Sequence[tuple[int, int]]]) -> np.ndarray:
        """Text tokens (everything but the images' placeholder and wrapper tokens) per conversation."""
        return self.chat.count_split(conversations, sizes)[0]

    def __repr__(self) -> str:
        return f"ProcessorTextCounter({self.chat!r})"


def normalize_conversations(conversations: list) -> tuple[list, bool]:
    """transformers 5.x ``ProcessorMixin._normalize_conversations`` for a batch (used when the
    counter has no processor object): message objects to dicts, ``None`` values of a message
    dropped, OpenAI ``image_url`` parts turned into ``{"type": "image", "url": ...}``."""
    from transformers.utils.chat_template_utils import _normalize_chat_messages

    convs = [_normalize_chat_messages(c) for c in conversations]
    for conv in convs:
        for message in conv:
            content = message.get("content")
            if not isinstance(content, list):
                continue
            message["content"] = [_openai_image(part) for part in content]
    return convs, True


def normalize_plain(conversations: list) -> tuple[list, bool]:
    """:func:`normalize_conversations` for conversations of plain dicts and lists only (what Arrow
    and JSON give): the ``None`` values of a message dropped, ``image_url`` parts converted."""
    out = []
    for conv in conversations:
        msgs = []
        for message in conv:
            m = {k: v for k, v in message.items() if v is not None}
            content = m.get("content")
            if isinstance(content, list):
                m["content"] = [_openai_image(part) for part in content]
            msgs.append(m)
        out.append(msgs)
    return out, True


def _plain(value: Any) -> bool:
    """Only dicts, lists and JSON scalars (nothing transformers' normalisation would convert)."""
    if type(value) is dict:
        return all(_plain(v) for v in value.values())
    if type(value) is list:
        return all(_plain(v) for v in value)
    return value is None or type(value) in (str, int, float, bool)


def _tokenizer_normalize(conversations: list) -> tuple[list, bool]:
    # what a tokenizer's apply_chat_template does: objects to dicts, None values of a message dropped
    from transformers.utils.chat_template_utils import _normalize_chat_messages

    return [_normalize_chat_messages(c) for c in conversations], True


def _openai_image(part: Any) -> Any:
    if isinstance(part, dict) and part.get("type") == "image_url" and "image_url" in part:
        info = part["image_url"]
        return {"type": "image", "url": info.get("url", "") if isinstance(info, dict) else info}
    return part


def content_images(conversation: Sequence[Any]) -> list[Any]:
    """The images named inside a conversation's content parts, in order, as the processor collects
    them when no ``images=`` is passed (``image`` / ``url`` / ``path`` / ``base64`` of image parts)."""
    out = []
    for message in conversation:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, dict) and part.get("type") == "image":
                out.extend(part[k] for k in ("image", "url", "path", "base64") if k in part)
    return out


def _overridden_normalize(processor: Any) -> Any:
    """The processor's ``_normalize_conversations`` when its class changes transformers' own."""
    try:
        from transformers.processing_utils import ProcessorMixin
    except ImportError:
        return None
    own = getattr(type(processor), "_normalize_conversations", None)
    if own is None or own is getattr(ProcessorMixin, "_normalize_conversations", None):
        return None
    return processor._normalize_conversations


def _processor_template(processor: Any) -> str:
    template = getattr(processor, "chat_template", None)
    if isinstance(template, dict):
        if "default" not in template:
            raise ValueError(f"{type(processor).__name__} has several chat templates, none named 'default'")
        template = template["default"]
    if not template:
        raise ValueError(f"{type(processor).__name__} has no chat template")
    return template


def _folder_template(d: Path) -> str | dict | None:
    jinja = d / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    for name in ("chat_template.json", "processor_config.json"):
        path = d / name
        if path.is_file():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except ValueError as e:
                raise ValueError(f"cannot read {str(path)!r}: {e}") from e
            if isinstance(data, dict) and data.get("chat_template"):
                return data["chat_template"]
    return None


def _fast_backend(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` behind a fast transformers tokenizer, or ``None``."""
    backend = getattr(tokenizer, "_tokenizer", None)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    return backend if isinstance(backend, Tokenizer) and hasattr(backend, "encode_batch_fast") else None
