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

    Calibration of the default ``bytes_per_token=4.0`` (one-off measurement, not re-run by tests):
    4 bytes/token is the usual rule of thumb for English with large byte-level BPE vocabularies
    (GPT-2 / Qwen2 / Llama-3 class). Those tokenizers cannot be downloaded here, so we trained
    byte-level BPE tokenizers with the ``tokenizers`` library on 9.8 MB of English technical prose
    available offline (Vim's ``doc/*.txt``) and encoded held-out English legal prose (the GPL-3,
    Apache-2.0, GFDL-1.3 and Artistic licence texts, 76 kB): 3.46 bytes/token at an 8k vocabulary,
    4.04 at 32k, 4.21 at 64k. Bigger vocabularies trained on more data compress English further, so
    4.0 errs towards over-counting for English. It is not exact for code, CJK or numbers-heavy text;
    pass the real tokenizer (``TextTokenCounter``) whenever exact lengths matter.
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

    def __init__(self, tokenizer, name: str, add_special_tokens: bool = False) -> None:
        self._tok = tokenizer
        self.name = name
        self.add_special_tokens = bool(add_special_tokens)

    @classmethod
    def from_pretrained(cls, path: str | Path, add_special_tokens: bool = False) -> TextTokenCounter:
        """Load ``path`` (a folder containing ``tokenizer.json``, or the ``tokenizer.json`` file)."""
        from tokenizers import Tokenizer  # optional dependency: only needed for exact counting

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
        return cls(tok, f"tokenizer.json:sha256={digest}", add_special_tokens=add_special_tokens)

    def count(self, text: str) -> int:
        enc = self._tok.encode(_as_text(text, None), add_special_tokens=self.add_special_tokens)
        return len(enc.ids)

    def count_batch(self, texts: Sequence[str]) -> np.ndarray:
        texts = [_as_text(t, i) for i, t in enumerate(texts)]
        if not texts:
            return np.zeros(0, dtype=np.int64)
        encs = self._tok.encode_batch(texts, add_special_tokens=self.add_special_tokens)
        return np.fromiter((len(e.ids) for e in encs), dtype=np.int64, count=len(encs))

    def __repr__(self) -> str:
        return f"TextTokenCounter(name={self.name!r})"


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
