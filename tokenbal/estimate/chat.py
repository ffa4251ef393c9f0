"""Exact token counts of chat conversations with images, as a transformers processor gives them,
without running the processor on pixels.

``processor.apply_chat_template(conversations, tokenize=True)`` renders the chat template (one
image placeholder per image part), and the processor's ``__call__`` replaces the ``i``-th
placeholder with that image's expansion (``<|image_pad|>`` × ``n_i`` for Qwen-VL and GLM-4.1V,
``<image>`` × ``n_i`` for LLaVA / LLaVA-NeXT / OneVision, ``<img>`` + ``<IMG_CONTEXT>`` × ``n_i`` +
``</img>`` for InternVL, the tile layout of Idefics3 / SmolVLM) and tokenizes the result. When the
placeholder is an added token and each expansion starts and ends with one (added tokens cut the
text before anything else), the count is

    tokens(rendered text) + Σ_i (tokens(expansion_i) - 1)

:class:`ChatTokenCounter` renders with the processor's own public ``apply_chat_template(...,
tokenize=False)`` (so its normalisation, template variables and special tokens are those of the
installed transformers, whatever its version), tokenizes the rendered texts in one batch with the
processor's own tokenizer and takes each expansion from the tokenbal estimator built from the
processor's settings (:func:`tokenbal.estimate.vision.estimator_from_processor`): no image is
decoded or resized. The shortcut is checked once per counter against the expanded text; when it
does not hold (or the placeholder is not an added token) the expanded text is tokenized (slower,
still exact). No private transformers helper is used: the processor's special-token rule is read
by calling it on a probe text, and whether it turns OpenAI ``image_url`` parts into image parts by
rendering a probe conversation.

The estimator's ``wrapper_tokens`` are counted as vision by :meth:`ChatTokenCounter.count_split`,
as the index counts them (``vision = Σ (n_i + wrappers)``, ``text = total - vision``).

Needs transformers (and jinja2); imported when a counter is built.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenbal.estimate.conversation import content_parts
from tokenbal.hf_compat import glm4v_upscales_small

# estimator family -> the placeholder its processor's template renders, for folders read without the
# processor class (``from_pretrained``); a loaded processor says it itself (``processor.image_token``).
_FAMILY_IMAGE_TOKEN = {**{family: "<|image_pad|>" for family in ("qwen2-vl", "qwen2.5-vl", "qwen3-vl")},
                       "llava-next": "<image>", "llava-onevision": "<image>", "llava": "<image>",
                       "internvl": "<IMG_CONTEXT>", "glm-4.1v": "<|image|>", "idefics3": "<image>",
                       "smolvlm": "<image>", "phi-4-multimodal": "<|image|>"}


class ChatCountError(ValueError):
    """A conversation cannot be counted (the message names the row)."""


@dataclass(frozen=True)
class Expansion:
    """What a family's processor puts in place of one image placeholder: ``prefix`` + ``token`` ×
    ``n`` + ``suffix`` (``tiles`` None), or Idefics3 / SmolVLM's tile layout (``tiles`` = (fake
    token, global-image token): per tile ``<fake><row_r_col_c>`` + ``token`` × ``n``, a newline
    after each tile row, then ``\n<fake><global>`` + ``token`` × ``n`` + ``<fake>``; an unsplit image
    is ``<fake><global>`` + ``token`` × ``n`` + ``<fake>``)."""

    token: str
    prefix: str = ""
    suffix: str = ""
    tiles: tuple[str, str] | None = None
    multi_image_tokens: int | None = None   # LLaVA-OneVision: each image of a multi-image row

    def text(self, n: int, grid: tuple[int, int] = (0, 0)) -> str:
        if self.tiles is None:
            return self.prefix + self.token * n + self.suffix
        fake, glob = self.tiles
        rows, cols = grid
        if rows == 0 and cols == 0:
            return f"{fake}{glob}{self.token * n}{fake}"
        out = ""
        for r in range(rows):
            for c in range(cols):
                out += f"{fake}<row_{r + 1}_col_{c + 1}>" + self.token * n
            out += "\n"
        return out + f"\n{fake}{glob}{self.token * n}{fake}"


def family_expansion(family: str, processor: Any = None) -> Expansion:
    """The :class:`Expansion` of ``family``'s processor (its own token attributes when given)."""
    def attr(name: str, default: str) -> str:
        value = getattr(processor, name, None) if processor is not None else None
        return value if isinstance(value, str) and value else default

    token = attr("image_token", _FAMILY_IMAGE_TOKEN.get(family, "<image>"))
    if family == "internvl":
        return Expansion(token, prefix=attr("start_image_token", "<img>"),
                         suffix=attr("end_image_token", "</img>"))
    if family in ("idefics3", "smolvlm"):
        glob = attr("global_image_tag", "") or attr("global_image_token", "<global-img>")
        return Expansion(token, tiles=(attr("fake_image_token", "<fake_token_around_image>"), glob))
    return Expansion(token)


class ChatTokenCounter:
    """Counts what ``processor.apply_chat_template([conv], tokenize=True)`` gives for a row whose
    images (in the order the processor receives them) have the given sizes (for a tokenizer,
    text-only: ``len(tokenizer.apply_chat_template(conv, tokenize=True))``).

    Build it with :meth:`from_processor` (a loaded transformers processor) or
    :meth:`from_pretrained` (a checkpoint / processor folder). ``count(conversations, sizes)``:
    ``sizes[r]`` is the list of ``(width, height)`` of row ``r``'s images, in the order the
    processor would receive them.
    """

    def __init__(self, tokenizer: Any, chat_template: str, estimator: Any, image_token: str | None, *,
                 render: Callable[..., list[str]] | None = None, add_special_tokens: bool = True,
                 source: str = "", family: str | None = None, expansion: Expansion | None = None,
                 converts_image_url: bool = True) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.estimator = estimator
        self.image_token = image_token
        self.add_special_tokens = bool(add_special_tokens)
        self.source = source
        self.family = family
        self.converts_image_url = converts_image_url
        self.expansion = expansion if expansion is not None else (
            Expansion(image_token) if image_token is not None else None)
        self._render_fn = render if render is not None else _tokenizer_renderer(tokenizer, chat_template)
        self._uses_images = "images" in template_variables(chat_template)
        # SmolVLM's apply_chat_template picks its template for a whole batch of conversations (its
        # video template if any has a video part): its rows are rendered one by one, as it sees them
        self._render_each = family == "smolvlm"
        self._backend = _fast_backend(tokenizer)
        self._backend_checked = False
        added = set(getattr(tokenizer, "get_added_vocab", dict)())
        # The shortcut needs the placeholder to be an added token; it is checked once on real rows.
        self.expand = image_token is not None and image_token not in added
        self._shortcut_checked = False
        self._grid_tokens: dict[tuple[int, int, int], int] = {}
        self._affix_tokens: int | None = None
        self._fingerprint: str | None = None
        self.min_image_side = 0   # images with a smaller side make the processor raise (see _version_*)
        self.video_token: str | None = None   # the processor's video placeholder (videos given: counted)
        self.audio_token: str | None = None   # the processor's audio placeholder (audio rows: refused)
        self.processor: Any = None            # the loaded processor (its replace_video_token writes videos)
        self._video_texts: dict[tuple, tuple[str, int]] = {}

    # -- construction ----------------------------------------------------------------------------

    @classmethod
    def from_processor(cls, processor: Any, estimator: Any = None) -> ChatTokenCounter:
        """The counter of a loaded transformers processor (its tokenizer, chat template, image
        tokens and image-processor settings). ``estimator`` overrides the one built from it."""
        from tokenbal.estimate.vision import estimator_from_processor, processor_family

        tokenizer = getattr(processor, "tokenizer", None)
        is_tokenizer = hasattr(processor, "apply_chat_template") and hasattr(processor, "get_vocab")
        if tokenizer is None and is_tokenizer:
            # A tokenizer (text-only model): its apply_chat_template never adds special tokens
            template = _processor_template(processor)
            render = _tokenizer_renderer(processor, template)
            return cls(processor, template, estimator, None, render=render, add_special_tokens=False,
                       source=type(processor).__name__, converts_image_url=_probe_image_url(render))
        if tokenizer is None:
            raise TypeError(f"{type(processor).__name__} is neither a transformers processor nor a tokenizer")
        template = _processor_template(processor)
        family = None
        if getattr(processor, "image_processor", None) is not None:
            family = processor_family(processor)
            if estimator is None:
                estimator = estimator_from_processor(processor)
        expansion = family_expansion(family, processor) if family is not None else None
        image_token = expansion.token if expansion is not None else getattr(processor, "image_token", None)
        render = _processor_renderer(processor, template)
        counter = cls(tokenizer, template, estimator, image_token, render=render,
                      add_special_tokens=_probe_add_special_tokens(processor, tokenizer),
                      source=type(processor).__name__, family=family, expansion=expansion,
                      converts_image_url=_probe_image_url(render))
        if family == "glm-4.1v" and not glm4v_upscales_small():   # 4.57 refuses such images
            counter.min_image_side = int(estimator.patch_size) * int(estimator.merge_size)
        video = getattr(processor, "video_token", None)
        counter.video_token = video if isinstance(video, str) and video and video != image_token else None
        audio = getattr(processor, "audio_token", None)   # Phi-4-multimodal: images counted, audio not
        counter.audio_token = audio if isinstance(audio, str) and audio and audio != image_token else None
        counter.processor = processor
        return counter

    @classmethod
    def from_pretrained(cls, folder: str | Path, estimator: Any = None) -> ChatTokenCounter:
        """The counter of a checkpoint or processor folder: its tokenizer (``AutoTokenizer``), the
        processor's chat template (``chat_template.jinja``, ``chat_template.json``,
        ``processor_config.json``, else the tokenizer's) and the estimator of its processor configs
        (:func:`tokenbal.estimate.load_estimator`). Conversations are normalised as transformers 5.x
        processors normalise them (``None`` values dropped, ``image_url`` parts made image parts)."""
        from transformers import AutoTokenizer

        from tokenbal.estimate.vision import load_estimator

        d = Path(folder)
        if not d.is_dir():
            raise FileNotFoundError(f"processor folder {str(d)!r} does not exist")
        est = estimator if estimator is not None else load_estimator(d)
        loaded = _auto_processor(d)
        if loaded is not None:
            return cls.from_processor(loaded, estimator=est)
        tokenizer = AutoTokenizer.from_pretrained(str(d))
        template = _folder_template(d) or getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):
            template = template.get("default")
        if not template:
            raise ValueError(f"{str(d)!r} has no chat template (chat_template.jinja / chat_template.json / "
                             "tokenizer_config.json)")
        image_token = getattr(tokenizer, "image_token", None) or _FAMILY_IMAGE_TOKEN.get(est.name)
        if image_token is None:
            raise ValueError(f"{str(d)!r}: no image placeholder token known for estimator {est.name!r}")
        render = _tokenizer_renderer(tokenizer, template, normalize=True)
        expansion = family_expansion(est.name)
        expansion = Expansion(image_token, expansion.prefix, expansion.suffix, expansion.tiles)
        counter = cls(tokenizer, template, est, image_token, render=render, source=str(d), family=est.name,
                      expansion=expansion)
        if est.name == "phi-4-multimodal":   # its processor takes audio too: such rows are refused
            counter.audio_token = getattr(tokenizer, "audio_token", None) or "<|audio|>"
        return counter

    # -- identity --------------------------------------------------------------------------------

    @property
    def fingerprint(self) -> str:
        """A digest of everything a count depends on: vocabulary, template, special tokens, image
        token and expansion, estimator settings (for caches and index manifests)."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            backend = _fast_backend(self.tokenizer)
            vocab = backend.to_str() if backend is not None else json.dumps(
                sorted(self.tokenizer.get_vocab().items()))
            special = json.dumps(self.tokenizer.special_tokens_map, sort_keys=True, default=str)
            for part in (vocab, self.chat_template, special, str(self.image_token), str(self.expansion),
                         str(self.family), str(self.add_special_tokens), str(self.converts_image_url),
                         str(self.min_image_side), str(self.video_token),
                         _video_settings_digest(self.processor),
                         type(self.estimator).__name__,
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
        if not len(conversations):
            return []
        convs = [list(c) for c in conversations]
        if not self._uses_images and not self._render_each:
            return list(self._render_fn(convs))
        out = []
        for r, conv in enumerate(convs):
            out.extend(self._render_fn([conv], images=[images[r]] if images is not None else None))
        return out

    def row_images(self, conversation: Sequence[Any]) -> list[Any]:
        """The images a processor collects from a conversation's parts when no ``images=`` is given
        (``image`` / ``url`` / ``path`` / ``base64`` of image parts; OpenAI ``image_url`` parts too
        when the installed processor converts them)."""
        return content_images(conversation, image_url=self.converts_image_url)

    def row_videos(self, conversation: Sequence[Any]) -> list[Any]:
        """The videos a processor collects from a conversation's ``{"type": "video"}`` parts."""
        from tokenbal.estimate.chat_video import content_videos

        return content_videos(conversation)

    def count(self, conversations: Sequence[Any], sizes: Sequence[Sequence[tuple[int, int]]],
              first_row: int = 0, images: Sequence[Any] | None = None,
              videos: Sequence[Sequence[Any]] | None = None) -> np.ndarray:
        """Total tokens per conversation (int64). ``first_row`` numbers the rows in errors.
        ``videos[r]``: the :class:`~tokenbal.index.video.VideoInfo` of row ``r``'s videos, in the
        order the processor receives them (None: rows without videos)."""
        texts = self.render(conversations, images)
        self._refuse_audio(conversations, texts, first_row)
        return self._count_texts(texts, sizes, first_row, videos)[0]

    def count_split(self, conversations: Sequence[Any], sizes: Sequence[Sequence[tuple[int, int]]],
                    first_row: int = 0, videos: Sequence[Sequence[Any]] | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
        """``(text, vision)`` per conversation: ``vision`` = Σ (the estimator's image tokens +
        wrapper tokens) of its images, as the index counts them, + Σ :meth:`video_tokens` of its
        videos (``videos`` as :meth:`count` takes them), ``text`` = the rest, so ``text + vision``
        = total (the count of :meth:`count`)."""
        texts = self.render(conversations)
        self._refuse_audio(conversations, texts, first_row)
        total, _, owner = self._count_texts(texts, sizes, first_row, videos)
        video = np.zeros(len(total), np.int64)
        for r, infos in enumerate(videos or ()):
            call = self.call_frames(infos, first_row + r)
            video[r] = sum(self.video_tokens(info, first_row + r, str(k), call)[0]
                           for k, info in enumerate(infos or ()))
        if not len(owner):
            return total - video, video
        from tokenbal.estimate.vision import image_tokens_checked

        # the index's own per-image vision count (tokenbal/index/build.py ``_count_tokens``):
        # estimator tokens + wrappers (per size for Idefics3 / SmolVLM), OneVision's shared-row rule
        est = self.estimator
        wh = np.array([s for row in sizes for s in row], dtype=np.int64).reshape(-1, 2)
        per_image = image_tokens_checked(est, wh[:, 0], wh[:, 1])[0]
        if getattr(est, "family", None) == "llava-onevision":
            counts = np.bincount(owner, minlength=len(total))
            per_image = np.where(counts[owner] > 1, est.image_tokens(1, 1, images_in_sample=2), per_image)
        wrap_batch = getattr(est, "image_wrapper_tokens_batch", None)
        wrap = (np.asarray(wrap_batch(wh[:, 0], wh[:, 1]), np.int64) if wrap_batch is not None
                else int(getattr(est, "wrapper_tokens", 0)))
        vision = np.bincount(owner, weights=per_image + wrap, minlength=len(total)).astype(np.int64) + video
        return total - vision, vision

    def _refuse_audio(self, conversations: Sequence[Any], texts: list[str], first_row: int) -> None:
        """Rows with audio (an audio part, or the processor's audio placeholder in the rendered
        text) under a processor that takes audio: refused naming the row; audio is not counted."""
        if self.audio_token is None:
            return
        for r, (conv, text) in enumerate(zip(conversations, texts, strict=True)):
            parts = [p for p in content_parts(conv) if p.get("type") in ("audio", "input_audio")]
            if parts or self.audio_token in text:
                what = (f"{len(parts)} audio part(s)" if parts
                        else f"the audio placeholder {self.audio_token!r}")
                raise ChatCountError(f"row {first_row + r}: has {what}; tokenbal counts {self.source}'s "
                                     "images but not its audio (remove the audio or count those rows "
                                     "yourself)")

    def _count_texts(self, texts: list[str], sizes: Sequence[Sequence[tuple[int, int]]], first_row: int,
                     videos: Sequence[Sequence[Any]] | None = None):
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
        n_videos = self._check_videos(texts, videos, first_row)
        owner = np.repeat(np.arange(len(texts)), n_images)
        n_tokens, grids = self._image_tokens(sizes, owner, n_images, first_row)
        if n_videos.any():
            return self._count_with_videos(texts, videos, n_tokens, grids, owner, first_row)
        if not len(n_tokens):
            return self._tokens(texts), n_tokens, owner
        if not self._shortcut_checked and not self.expand:
            self._check_shortcut(texts, n_tokens, grids, owner)
        if self.expand:
            total = self._tokens(self._expanded(texts, n_tokens, grids, owner))
        else:
            per = self._expansion_tokens(n_tokens, grids)
            total = self._tokens(texts) + np.bincount(owner, weights=per - 1,
                                                      minlength=len(texts)).astype(np.int64)
        return total, n_tokens, owner

    def _check_videos(self, texts: list[str], videos: Sequence[Sequence[Any]] | None,
                      first_row: int) -> np.ndarray:
        """Videos per row, checked against the video placeholders the template rendered."""
        n_videos = np.zeros(len(texts), np.int64)
        if videos is not None:
            if len(videos) != len(texts):
                raise ValueError(f"{len(texts)} conversations but {len(videos)} video lists")
            n_videos = np.fromiter((len(v or ()) for v in videos), np.int64, count=len(texts))
        token = self.video_token
        for r, text in enumerate(texts):
            found = text.count(token) if token else 0
            if found == n_videos[r]:
                continue
            if videos is None:
                raise ChatCountError(
                    f"row {first_row + r}: the chat template renders {found} video placeholder(s) "
                    f"({token!r}); this count has no videos given (index such samples with `tokenbal "
                    "index build`, or count them with dataset_lengths)")
            if token is None:
                raise ChatCountError(f"row {first_row + r} has {n_videos[r]} video(s) but {self.source} has "
                                     "no video placeholder token, so it takes no videos")
            raise ChatCountError(
                f"row {first_row + r}: the chat template renders {found} video placeholder(s) ({token!r}) "
                f"but the row has {n_videos[r]} video(s); the processor raises on this (each video needs a "
                "video part in the messages, and each video part a video)")
        return n_videos

    def call_frames(self, infos: Sequence[Any] | None, row: int = 0) -> int | None:
        """The most frames the processor keeps of one of a row's videos (``infos``: their headers),
        for a family whose video text reads the padded frames of the whole call (SmolVLM, see
        :func:`tokenbal.hf_compat.video_token_inputs`); None for the others."""
        if self.family != "smolvlm" or not infos:
            return None
        return max(self.video_text(info, row, str(k))[1] for k, info in enumerate(infos))

    def video_text(self, info: Any, row: int = 0, where: str = "",
                   call_frames: int | None = None) -> tuple[str, int]:
        """What the processor writes in place of the placeholder of a video with header ``info``, and
        the number of frames it keeps of it (``call_frames``: :meth:`call_frames` of its row)."""
        from tokenbal.estimate.chat_video import VideoCountError, check_video_support, video_replacement

        key = (int(info.frames), float(info.fps), int(info.width), int(info.height), call_frames)
        text = self._video_texts.get(key)
        if text is None:
            if self.processor is None:
                raise ChatCountError(
                    f"row {row}: video {where}: {self.source} was read from its files, not loaded as a "
                    "processor (AutoProcessor could not load it here: without torchvision transformers "
                    "builds no video processor), so its videos cannot be counted; count them where the "
                    "processor loads with its video processor")
            try:
                check_video_support(self.processor, self.family, self.estimator)
                text = video_replacement(self.processor, self.family, self.estimator, info, call_frames)
            except VideoCountError as e:
                raise ChatCountError(f"row {row}: video {where}: {e}") from None
            except ValueError as e:
                raise ChatCountError(f"row {row}: video {where} ({info.frames} frames, {info.width}x"
                                     f"{info.height} at {info.fps:g} fps): {e}") from None
            self._video_texts[key] = text
        return text

    def video_tokens(self, info: Any, row: int = 0, where: str = "",
                     call_frames: int | None = None) -> tuple[int, int]:
        """(tokens of what the processor writes in place of the placeholder of a video with header
        ``info`` (:meth:`video_text`, tokenized on its own), frames it keeps of it): the video's
        share of :meth:`count_split`'s vision (``call_frames``: :meth:`call_frames` of its row)."""
        text, frames = self.video_text(info, row, where, call_frames)
        key = ("tokens", text)
        n = self._video_texts.get(key)
        if n is None:
            collapsed, extra = self._collapse_placeholders(text)
            n = self._video_texts[key] = self._raw_tokens(collapsed) + extra
        return int(n), frames

    def _collapse_placeholders(self, text: str) -> tuple[str, int]:
        """``text`` with each run of an added placeholder token (image / video) cut to one copy, and
        the number of copies cut: each copy is one token, so a run's count is its length, without
        tokenizing thousands of copies."""
        import re

        added = set(getattr(self.tokenizer, "get_added_vocab", dict)())
        extra = 0
        for token in (self.video_token, self.image_token):
            if token and token in added:
                copies = text.count(token)
                if copies:
                    text = re.sub(f"(?:{re.escape(token)})+", lambda m, t=token: t, text)
                    extra += copies - text.count(token)
        return text, extra

    def _count_with_videos(self, texts, videos, n_tokens, grids, owner, first_row):
        """Rows with videos: the text with every image and video placeholder replaced as the processor
        replaces them (one pass, in order), tokenized; a run of an added placeholder token counts
        as its length without being tokenized (each copy is one token)."""
        from tokenbal.hf_compat import replace_placeholders

        exp = self.expansion or Expansion(self.image_token or "")
        starts = np.concatenate([[0], np.cumsum(np.bincount(owner, minlength=len(texts)))]).astype(int)
        out, extra = [], np.zeros(len(texts), np.int64)
        for r, text in enumerate(texts):
            image_texts = [exp.text(int(n_tokens[j]), tuple(grids[j]) if grids is not None else (0, 0))
                           for j in range(starts[r], starts[r + 1])]
            call = self.call_frames(videos[r], first_row + r)
            video_texts = [self.video_text(info, first_row + r, str(k), call)[0]
                           for k, info in enumerate(videos[r] or ())]
            text = replace_placeholders(self.processor, text, image_texts, video_texts)
            text, extra[r] = self._collapse_placeholders(text)
            out.append(text)
        total = self._tokens(out) + extra
        return total, n_tokens, owner

    def _image_tokens(self, sizes, owner: np.ndarray, n_images: np.ndarray, first_row: int):
        """Per image: the placeholder-token count ``n`` and its tile grid (rows, cols; Idefics3)."""
        if not len(owner):
            return np.zeros(0, np.int64), None
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
        if self.min_image_side:
            small = np.flatnonzero(wh.min(axis=1) < self.min_image_side)
            if len(small):
                j = int(small[0])
                k = int(j - np.searchsorted(owner, owner[j]))
                raise ChatCountError(
                    f"row {first_row + int(owner[j])}: image {k} ({wh[j, 0]}x{wh[j, 1]}): this transformers' "
                    f"{self.source} rejects images with a side below {self.min_image_side} px")
        exp = self.expansion
        grids = None
        if exp is not None and exp.tiles is not None:
            # Idefics3 / SmolVLM: n is per view (image_seq_len); the grid gives the layout
            rows, cols = self.estimator._grid_batch(wh[:, 0], wh[:, 1])
            grids = np.stack([np.asarray(rows, np.int64), np.asarray(cols, np.int64)], axis=1)
            tokens = np.full(len(wh), int(self.estimator.image_seq_len), np.int64)
        if self.family == "llava-onevision":
            # transformers gives each image of a multi-image row the base view + newline only
            side = int(self.estimator.grid_side)
            multi = n_images[owner] > 1
            tokens = np.where(multi, side * side + 1, tokens)
        return tokens.astype(np.int64), grids

    def _expansion_tokens(self, n_tokens: np.ndarray, grids: np.ndarray | None) -> np.ndarray:
        """Tokens of each image's expansion (the shortcut: added tokens at both ends)."""
        exp = self.expansion
        if exp is None or (exp.tiles is None and not exp.prefix and not exp.suffix):
            return n_tokens
        if exp.tiles is None:
            if self._affix_tokens is None:
                self._affix_tokens = self._raw_tokens(exp.prefix) + self._raw_tokens(exp.suffix)
            return n_tokens + self._affix_tokens
        out = np.empty(len(n_tokens), np.int64)
        for j, (n, (r, c)) in enumerate(zip(n_tokens.tolist(), grids.tolist(), strict=True)):
            key = (n, r, c)
            if key not in self._grid_tokens:
                self._grid_tokens[key] = self._raw_tokens(exp.text(n, (r, c)))
            out[j] = self._grid_tokens[key]
        return out

    def _raw_tokens(self, text: str) -> int:
        if not text:
            return 0
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _check_shortcut(self, texts: list[str], n_tokens: np.ndarray, grids, owner: np.ndarray) -> None:
        """Count the first rows with images both ways; a tokenizer where the expansion does not
        tokenize on its own (no added token at its ends) is counted on expanded texts from then on."""
        self._shortcut_checked = True
        rows = sorted(set(owner[:16].tolist()))
        sel = np.isin(owner, rows)
        sub_owner = np.searchsorted(rows, owner[sel])
        sub_texts = [texts[r] for r in rows]
        sub_grids = grids[sel] if grids is not None else None
        slow = self._tokens(self._expanded(sub_texts, n_tokens[sel], sub_grids, sub_owner))
        per = self._expansion_tokens(n_tokens[sel], sub_grids)
        fast = self._tokens(sub_texts) + np.bincount(sub_owner, weights=per - 1,
                                                     minlength=len(rows)).astype(np.int64)
        if not np.array_equal(slow, fast):
            self.expand = True

    def _expanded(self, texts: list[str], n_tokens: np.ndarray, grids, owner: np.ndarray) -> list[str]:
        exp = self.expansion or Expansion(self.image_token)
        out, j = [], 0
        for text in texts:
            pieces = text.split(self.image_token)
            built = [pieces[0]]
            for piece in pieces[1:]:
                grid = tuple(grids[j]) if grids is not None else (0, 0)
                built.append(exp.text(int(n_tokens[j]), grid))
                built.append(piece)
                j += 1
            out.append("".join(built))
        return out

    def _tokens(self, texts: list[str]) -> np.ndarray:
        """Token counts of the rendered texts, with the processor's special-token rule: none added
        when the text starts with the BOS token (the template wrote it), else the processor's
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
        return f"ChatTokenCounter(source={self.source!r}, family={self.family!r}, estimator={est!r})"


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

    def count_chat_text(self, conversations: Sequence[Any], sizes: Sequence[Sequence[tuple[int, int]]],
                        videos: Sequence[Sequence[Any]] | None = None) -> np.ndarray:
        """Text tokens (everything but the images' placeholder and wrapper tokens and what replaces
        each video placeholder) per conversation; ``videos[r]``: the headers
        (:class:`~tokenbal.index.video.VideoInfo`) of row ``r``'s videos, in order."""
        return self.chat.count_split(conversations, sizes, videos=videos)[0]

    def video_tokens(self, info: Any, where: str = "", row_videos: Sequence[Any] | None = None
                     ) -> tuple[int, int]:
        """(tokens, frames kept) of one video as :meth:`count_chat_text` takes it out of the text
        (:meth:`ChatTokenCounter.video_tokens`; ``row_videos``: the headers of every video of its
        sample, which SmolVLM's video text depends on); ``ChatCountError`` when it cannot be
        counted."""
        return self.chat.video_tokens(info, 0, where, self.chat.call_frames(row_videos))

    def __repr__(self) -> str:
        return f"ProcessorTextCounter({self.chat!r})"


def normalize_plain(conversations: list) -> tuple[list, bool]:
    """What transformers 5.x processors do to conversations before rendering, for conversations
    of plain dicts and lists (what Arrow and JSON give): the ``None`` values of a message and of
    its content parts dropped, OpenAI ``image_url`` parts turned into ``{"type": "image", "url":
    ...}``. Used where no processor object renders (``from_pretrained``)."""
    out = []
    for conv in conversations:
        msgs = []
        for message in conv:
            m = {k: v for k, v in dict(message).items() if v is not None}
            content = m.get("content")
            if isinstance(content, list):
                m["content"] = [_openai_image(part) for part in content]
            msgs.append(m)
        out.append(msgs)
    return out, True


def _openai_image(part: Any) -> Any:
    if isinstance(part, dict) and part.get("type") == "image_url" and "image_url" in part:
        info = part["image_url"]
        return {"type": "image", "url": info.get("url", "") if isinstance(info, dict) else info}
    return part


def content_images(conversation: Sequence[Any], image_url: bool = True) -> list[Any]:
    """The images named inside a conversation's content parts, in order, as the processor collects
    them when no ``images=`` is passed (the non-``None`` ``image`` / ``url`` / ``path`` / ``base64``
    of image parts; with ``image_url``, OpenAI ``image_url`` parts, which transformers 5.x
    processors turn into image parts)."""
    out = []
    for part in content_parts(conversation):
        if image_url and part.get("type") == "image_url" and part.get("image_url") is not None:
            part = _openai_image(part)
        if part.get("type") == "image":
            out.extend(part[k] for k in ("image", "url", "path", "base64") if part.get(k) is not None)
    return out


def template_variables(template: str) -> set[str]:
    """The variables a Jinja chat template reads (jinja2's own analysis)."""
    import jinja2
    from jinja2 import meta

    try:
        return set(meta.find_undeclared_variables(jinja2.Environment().parse(template)))
    except jinja2.TemplateSyntaxError:
        return set()


class _Renderer:
    """``obj.apply_chat_template(convs, tokenize=False)`` (a processor's or a tokenizer's, both
    public) with one template; a class so that it pickles to ``Dataset.map`` workers."""

    def __init__(self, obj: Any, template: str, normalize: bool = False) -> None:
        self.obj, self.template, self.normalize = obj, template, normalize

    def __call__(self, convs: list, chat_template: str | None = None, **kw: Any) -> list[str]:
        if self.normalize:
            convs = normalize_plain(convs)[0]
        else:   # transformers 5.6 - 5.9 reassign message["content"] in place: render copies
            convs = [[dict(m) if isinstance(m, dict) else m for m in c] for c in convs]
        if chat_template is None and self.template != getattr(self.obj, "chat_template", None):
            chat_template = self.template
        # the object's own template left to its own method: SmolVLM's renders rows with a video part
        # with its video template instead (as its apply_chat_template(tokenize=True) does)
        out = self.obj.apply_chat_template(convs, chat_template=chat_template, tokenize=False, **kw)
        return [out] if isinstance(out, str) else list(out)


def _processor_renderer(processor: Any, template: str) -> _Renderer:
    return _Renderer(processor, template)


def _tokenizer_renderer(tokenizer: Any, template: str, normalize: bool = False) -> _Renderer:
    return _Renderer(tokenizer, template, normalize)


_PROBE_TEXT = "tokenbal probe 12"


def _probe_add_special_tokens(processor: Any, tokenizer: Any) -> bool:
    """Whether the processor's own call adds the tokenizer's special tokens to a text that does not
    start with BOS: the processor is called on a probe text and compared with its tokenizer."""
    with_special = list(tokenizer([_PROBE_TEXT], add_special_tokens=True)["input_ids"][0])
    without = list(tokenizer([_PROBE_TEXT], add_special_tokens=False)["input_ids"][0])
    if with_special == without:
        return True
    got = list(processor(text=[_PROBE_TEXT])["input_ids"][0])
    if got == with_special:
        return True
    if got == without:
        return False
    raise ValueError(f"{type(processor).__name__} tokenizes text unlike its tokenizer ({len(got)} tokens "
                     f"for a probe its tokenizer makes {len(with_special)} / {len(without)}): its lengths "
                     "are not modelled (truncation or extra tokens in the processor's text kwargs?)")


# -- VERSION-DEPENDENT behaviour, detected on the installed transformers (candidates for
# -- tokenbal/hf_compat.py, the one module for version differences) ------------------------------

def _probe_image_url(render: Callable[..., list[str]]) -> bool:
    """Whether the renderer turns OpenAI ``image_url`` parts into image parts (transformers 5.x
    processors do; 4.x ones do not), read off a probe conversation rendered by a probe template."""
    conv = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    try:
        return render([conv], chat_template="{{ messages[0]['content'][0]['type'] }}")[0].strip() == "image"
    except Exception:  # noqa: BLE001 - a renderer that cannot take the probe: the 5.x rule
        return True


# families whose text layout (Idefics3 / SmolVLM tiles) is counted only through a loaded processor:
# where this transformers cannot load it, no processor of the installed version exists to be exact to
_NEEDS_LOADED_PROCESSOR = ("idefics3", "smolvlm")


def _auto_processor(d: Path) -> Any:
    """The folder's processor as ``AutoProcessor`` loads it, when it loads here with a chat template
    and a family tokenbal knows (then its own tokens and settings are used); else None (e.g. its
    video processor needs torchvision), and the folder's files are read directly. Idefics3 /
    SmolVLM folders whose processor does not load here are refused, naming the transformers
    version, the loading error and the known requirements missing here."""
    try:
        from transformers import AutoProcessor

        from tokenbal.estimate.vision import processor_family

        proc = AutoProcessor.from_pretrained(str(d))
        if getattr(proc, "image_processor", None) is None or not getattr(proc, "chat_template", None):
            return None
        processor_family(proc)
        return proc
    except Exception as e:  # noqa: BLE001 - any failure to load: read the files instead (but see below)
        _refuse_unloadable(d, e)
        return None


def _refuse_unloadable(d: Path, error: Exception) -> None:
    import importlib.util

    from tokenbal.estimate.vision import _family_from_processor_files, _processor_dicts
    from tokenbal.hf_compat import transformers_version

    family = _family_from_processor_files(d, _processor_dicts(d)[0])
    if family in _NEEDS_LOADED_PROCESSOR:
        reason = " ".join(str(error).split())[:160]
        missing = [m for m in ("torchvision", "num2words") if importlib.util.find_spec(m) is None]
        raise ValueError(f"{str(d)!r}: its {family} processor does not load with transformers "
                         f"{transformers_version()} here ({type(error).__name__}: {reason}); missing here: "
                         f"{', '.join(missing) or 'nothing tokenbal knows of'}. {family} lengths are counted "
                         "through the loaded processor: install what it needs (on transformers 4.57-5.9 its "
                         "image / video processor needs torchvision, its processor num2words) or use a "
                         "transformers where it loads") from error


def _video_settings_digest(processor: Any) -> str:
    """The processor's video processor settings (sampling, sizes), for the fingerprint: a changed
    ``fps`` or ``num_frames`` changes video rows' counts."""
    vp = getattr(processor, "video_processor", None)
    to_dict = getattr(vp, "to_dict", None)
    if not callable(to_dict):
        return "none"
    return json.dumps(to_dict(), sort_keys=True, default=str)


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
