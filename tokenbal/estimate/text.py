"""Text token counters: an exact one (a real ``tokenizer.json``) and a cheap heuristic.

Both expose the same small interface so the index builder does not care which one it has:
``.name`` (written into the index manifest), ``.count(text) -> int`` and
``.count_batch(texts) -> np.ndarray[int64]``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

# Calibration of the default (see HeuristicTextCounter's docstring for the method and numbers).
DEFAULT_BYTES_PER_TOKEN = 4.0


class HeuristicTextCounter:
    """Estimate tokens as ``ceil(utf8_bytes / bytes_per_token)`` (0 for the empty string).

    Counting UTF-8 bytes rather than characters keeps the estimate sane for CJK text (3 bytes per
    character, and byte-level BPE vocabularies of Qwen/Llama give roughly one token per 1-2 CJK
    characters) without any per-script tables.

    Calibration of the default ``bytes_per_token=4.0``: 4 bytes/token is the usual rule of thumb for
    English with large byte-level BPE vocabularies (GPT-2 / Qwen2 / Llama-3 class). Those tokenizers
    cannot be downloaded here, so ``scripts/bench_estimate.py`` trains byte-level BPE tokenizers with
    the ``tokenizers`` library on local text (Vim's docs + half of the Python stdlib, 11.8 MB) and
    measures held-out samples (docs/bench/estimate.md): English legal prose has 4.26 bytes/token at a
    32k vocabulary (heuristic total +6.9 %, per-sample p5..p95 -22 %..+31 %) and 4.47 at 64k (+12 %);
    Python code 3.97-4.06 (total -0.6 %..+1.6 %, per-sample -33 %..+20 %). It is not calibrated for
    CJK or numbers-heavy text; pass the real tokenizer (``TextTokenCounter``) whenever exact lengths
    matter.
    """

    def __init__(self, bytes_per_token: float = DEFAULT_BYTES_PER_TOKEN) -> None:
        if not (
            isinstance(bytes_per_token, (int, float))
            and math.isfinite(bytes_per_token)
            and bytes_per_token > 0
        ):
            raise ValueError(f"bytes_per_token must be a finite number > 0, got {bytes_per_token!r}")
        self.bytes_per_token = float(bytes_per_token)
        self.name = f"heuristic:bytes_per_token={self.bytes_per_token:g}"

    def count(self, text: str) -> int:
        n = len(_as_text(text, None).encode("utf-8"))
        return math.ceil(n / self.bytes_per_token)

    def count_batch(self, texts: Sequence[str]) -> np.ndarray:
        nbytes = np.fromiter(
            (len(_as_text(t, i).encode("utf-8")) for i, t in enumerate(texts)),
            dtype=np.int64,
            count=len(texts),
        )
        return np.ceil(nbytes / self.bytes_per_token).astype(np.int64)

    def __repr__(self) -> str:
        return f"HeuristicTextCounter(bytes_per_token={self.bytes_per_token:g})"


class TextTokenCounter:
    """Exact token counts from a Hugging Face ``tokenizer.json`` via the ``tokenizers`` library.

    Counts are ``len(tokenizer.encode(text, add_special_tokens=...).ids)``; by default no special
    tokens are added (chat templates add their own, which the caller counts as text). ``.name`` is
    ``"tokenizer.json:sha256=<first 16 hex>"`` so an index records exactly which vocabulary it used.
    """

    def __init__(
        self,
        tokenizer,
        name: str,
        add_special_tokens: bool = False,
        chat_template: str | dict[str, str] | None = None,
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self._tok = tokenizer
        self.name = name
        self.add_special_tokens = bool(add_special_tokens)
        # str, or {name: template} as in tokenizer_config.json's list form ("default" is used)
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})  # bos_token etc., visible to the template
        self._hf = None  # transformers tokenizer over the same vocabulary, built on first chat use

    @classmethod
    def from_pretrained(cls, path: str | Path, add_special_tokens: bool = False) -> TextTokenCounter:
        """Load ``path`` (a folder containing ``tokenizer.json``, or the ``tokenizer.json`` file)."""
        from tokenbal._extras import require

        # optional dependency: only needed for exact counting
        Tokenizer = require("tokenizers", "exact text counts (--tokenizer)").Tokenizer  # noqa: N806

        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            where = f"folder {str(p)!r} has no tokenizer.json" if p.is_dir() else f"{str(p)!r} does not exist"
            raise FileNotFoundError(f"cannot load tokenizer: {where}")
        data = file.read_bytes()
        try:
            tok = Tokenizer.from_str(data.decode("utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise ValueError(f"cannot load tokenizer from {str(file)!r}: {e}") from e
        digest = hashlib.sha256(data).hexdigest()[:16]
        template, special = _read_chat_config(file.parent)
        return cls(
            tok,
            f"tokenizer.json:sha256={digest}",
            add_special_tokens=add_special_tokens,
            chat_template=template,
            special_tokens=special,
        )

    def count(self, text: str) -> int:
        enc = self._tok.encode(_as_text(text, None), add_special_tokens=self.add_special_tokens)
        return len(enc.ids)

    def count_batch(self, texts: Sequence[str]) -> np.ndarray:
        texts = [_as_text(t, i) for i, t in enumerate(texts)]
        if not texts:
            return np.zeros(0, dtype=np.int64)
        encs = self._tok.encode_batch(texts, add_special_tokens=self.add_special_tokens)
        return np.fromiter((len(e.ids) for e in encs), dtype=np.int64, count=len(encs))

    # ---- chat templates ---------------------------------------------------------------------
    def _hf_tokenizer(self):
        if self._hf is None:
            from tokenizers import Tokenizer
            from transformers import PreTrainedTokenizerFast  # only needed for chat templates

            # a copy: transformers may register special tokens on the object it wraps, which must
            # not change what count() returns
            self._hf = PreTrainedTokenizerFast(
                tokenizer_object=Tokenizer.from_str(self._tok.to_str()),
                chat_template=self.chat_template,
                **self.special_tokens,
            )
        return self._hf

    def count_chat(
        self,
        messages: Sequence[dict],
        *,
        template: str | None = None,
        add_generation_prompt: bool = False,
        **template_kwargs,
    ) -> int:
        """Tokens of a whole conversation rendered with its chat template.

        Exactly ``len(tokenizer.apply_chat_template(messages, tokenize=True))`` of transformers
        with this vocabulary, the checkpoint's ``chat_template`` (``tokenizer_config.json`` or
        ``chat_template.jinja`` beside ``tokenizer.json``; ``template`` overrides it) and its
        special tokens (``bos_token`` etc.) available to the template. ``template_kwargs`` go to the
        template (e.g. ``enable_thinking=False``). Needs ``transformers`` (and ``jinja2``).
        """
        if template is None and self.chat_template is None:
            raise ValueError(
                f"{self.name}: no chat template (none in tokenizer_config.json / chat_template.jinja); "
                "pass template=..."
            )
        _check_messages(messages)
        ids = self._hf_tokenizer().apply_chat_template(
            list(messages),
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
            **template_kwargs,
        )
        return len(ids)

    def chat_overhead(self, messages: Sequence[dict], **kwargs) -> int:
        """Tokens the chat template adds: :meth:`count_chat` minus the sum of each message's
        ``content`` counted on its own (:meth:`count`). For ChatML templates this is the per-turn
        ``<|im_start|>role\n`` ... ``<|im_end|>\n`` plus any default system prompt. Only string
        contents are supported (multimodal content lists need the processor's template)."""
        _check_messages(messages)
        return self.count_chat(messages, **kwargs) - sum(self.count(m["content"]) for m in messages)

    def __repr__(self) -> str:
        return f"TextTokenCounter(name={self.name!r})"


def _check_messages(messages: Sequence[dict]) -> None:
    if isinstance(messages, (str, bytes)) or not len(messages):
        raise ValueError(f"messages must be a non-empty list of role/content dicts, got {messages!r:.80}")
    for i, m in enumerate(messages):
        ok = isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        if not ok:
            raise ValueError(f"messages[{i}] must be a dict with str 'role' and str 'content', got {m!r:.80}")


def _read_chat_config(folder: Path) -> tuple[str | dict[str, str] | None, dict[str, str]]:
    """(chat template, special tokens) from a checkpoint folder, the way transformers reads them:
    ``chat_template.jinja`` wins over ``tokenizer_config.json``'s ``chat_template`` (a string, or a
    list of ``{"name", "template"}``); special tokens are the ``*_token`` entries (strings, or
    ``{"content": ...}`` AddedToken dicts)."""
    import json

    cfg: dict = {}
    path = folder / "tokenizer_config.json"
    if path.is_file():
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise ValueError(f"cannot read {str(path)!r}: {e}") from e
    template = cfg.get("chat_template")
    if isinstance(template, list):
        template = {t["name"]: t["template"] for t in template}
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    special = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"):
        v = cfg.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            special[key] = v
    return template, special


TextCounter = HeuristicTextCounter | TextTokenCounter


def get_text_counter(tokenizer: str | Path | None = None, **kwargs) -> TextCounter:
    """``None`` -> :class:`HeuristicTextCounter` (kwargs: ``bytes_per_token``); otherwise a path to a
    ``tokenizer.json`` or its folder -> :class:`TextTokenCounter` (kwargs: ``add_special_tokens``)."""
    if tokenizer is None:
        return HeuristicTextCounter(**kwargs)
    return TextTokenCounter.from_pretrained(tokenizer, **kwargs)


def _as_text(text: object, index: int | None) -> str:
    # A None/bytes caption would otherwise be silently counted as its repr; name the element instead.
    if isinstance(text, str):
        return text
    where = "" if index is None else f" at index {index}"
    raise TypeError(f"text{where} must be str, got {type(text).__name__}")
