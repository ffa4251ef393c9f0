"""Cost models: what the planner balances, per sample.

* ``"tokens"`` (default): total tokens. Equal token sums per rank are what most users ask for and
  what bounds activation memory.
* ``"flops"`` / :class:`FlopsModel`: training work of one sample, ``a·s + b·s²`` for the LLM
  (dense projections + MLP, then causal attention, per sequence since packed sequences do not
  attend to each other) plus an optional vision-encoder term on the sample's patches. The
  coefficients come from a transformers config (hidden size, layers, heads, MLP width). The
  attention term is why a 16k-token video costs more than eight 2k-token documents.
* a user array (one non-negative number per sample) or a callable ``f(lengths) -> array``.

The planner works on integers (it compares sums exactly and scales them internally), so every
model is turned into int64 *token-equivalents*: the cost divided by what one token of the
linear term costs, rounded. For ``"flops"`` a sample of s tokens then costs ``s + b/a·s²``
(+ vision), i.e. its token count plus an attention surcharge, and a budget in tokens stays
meaningful. Float user costs are scaled so the largest becomes ~1e6 (see :func:`to_int_costs`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["FlopsModel", "resolve_costs", "to_int_costs", "COST_NAMES"]

COST_NAMES = ("tokens", "flops")
_FLOAT_RESOLUTION = 1_000_000   # a float cost array is scaled so its maximum is this many units


@dataclass(frozen=True)
class FlopsModel:
    """Per-sample training FLOPs of a decoder LLM (+ optional ViT), as token-equivalents.

    Per LLM layer and token, forward: ``2·(2·h·(h + kv·d) + 3·h·i)`` for q/o + k/v projections
    (GQA-aware) and a gated MLP, and ``2·h·s`` for causal attention (QKᵀ and PV, half the square).
    Backward is twice forward, which cancels in the token-equivalent ratio. The ViT term, when
    ``vision_layers > 0``: patches ``p = vision_tokens · merge²`` cost ``2·(4·hv² + 2·hv·iv)`` each
    per layer plus ``4·hv·p·w`` for (non-causal) attention over a window of ``w`` patches
    (``w = p`` when ``vision_window`` is None: full attention over the whole sample — an upper
    bound for multi-image samples; Qwen2.5-VL's windowed layers are closer to ``w`` = 64·merge²).
    """

    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    vision_hidden_size: int = 0
    vision_layers: int = 0
    vision_intermediate_size: int = 0
    merge_size: int = 2
    vision_window: int | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "intermediate_size", "num_heads", "num_kv_heads",
                     "merge_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"FlopsModel.{name} must be a positive int, got {v!r}")

    @classmethod
    def from_config(cls, config: Any, *, vision: bool = True, vision_window: int | None = None
                    ) -> FlopsModel:
        """From a transformers config (object or dict); multimodal configs' ``text_config`` /
        ``vision_config`` are used when present (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA, InternVL)."""
        text = _sub(config, "text_config", "llm_config") or config
        h = _get(text, "hidden_size")
        heads = _get(text, "num_attention_heads")
        kw: dict[str, Any] = dict(
            hidden_size=h, num_layers=_get(text, "num_hidden_layers"),
            intermediate_size=_get(text, "intermediate_size", default=4 * h), num_heads=heads,
            num_kv_heads=_get(text, "num_key_value_heads", default=heads), vision_window=vision_window)
        vis = _sub(config, "vision_config") if vision else None
        if vis is not None:
            hv = _get(vis, "hidden_size", "embed_dim")
            mlp = _get(vis, "intermediate_size", default=0)
            if not mlp:
                mlp = int(round(_get(vis, "mlp_ratio", default=4) * _get(vis, "embed_dim", "hidden_size")))
            kw.update(vision_hidden_size=_get(vis, "embed_dim", "hidden_size", default=hv),
                      vision_layers=_get(vis, "depth", "num_hidden_layers"), vision_intermediate_size=mlp,
                      merge_size=_get(vis, "spatial_merge_size", default=2))
        return cls(**kw)

    @classmethod
    def qwen2_vl_7b(cls) -> FlopsModel:
        """Qwen2-VL-7B-Instruct's dimensions (config.json of the official checkpoint)."""
        return cls(hidden_size=3584, num_layers=28, intermediate_size=18944, num_heads=28, num_kv_heads=4,
                   vision_hidden_size=1280, vision_layers=32, vision_intermediate_size=5120, merge_size=2)

    def token_flops(self) -> float:
        """Forward FLOPs of one token's linear part (all LLM layers)."""
        h, i = self.hidden_size, self.intermediate_size
        kv_dim = self.num_kv_heads * (h // self.num_heads)
        return 2.0 * (2 * h * (h + kv_dim) + 3 * h * i) * self.num_layers

    def flops(self, lengths: np.ndarray, vision_tokens: np.ndarray | None = None,
              image_tokens: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """Forward FLOPs per sample (float64); training is ~3x this.

        ``image_tokens``: optional ``(offsets, tokens)``, each image's placeholder tokens with sample
        ``i`` owning ``tokens[offsets[i]:offsets[i + 1]]`` (``TokenIndex.image_tokens_table``). The
        vision tower attends within each image, so with it the ViT term is summed per image; without
        it a sample's patches count as one attention block (an upper bound for multi-image samples).
        """
        s = np.asarray(lengths, np.float64)
        out = s * self.token_flops() + 2.0 * self.hidden_size * s * s * self.num_layers
        if self.vision_layers > 0 and image_tokens is not None:
            offsets, tokens = (np.asarray(a) for a in image_tokens)
            per_image = self._vit_flops(tokens.astype(np.float64) * self.merge_size ** 2)
            owner = np.repeat(np.arange(len(s)), np.diff(offsets[: len(s) + 1]))
            out = out + np.bincount(owner, weights=per_image[: len(owner)], minlength=len(s))
        elif self.vision_layers > 0 and vision_tokens is not None:
            out = out + self._vit_flops(np.asarray(vision_tokens, np.float64) * self.merge_size ** 2)
        return out

    def _vit_flops(self, patches: np.ndarray) -> np.ndarray:
        hv, iv = self.vision_hidden_size, self.vision_intermediate_size
        w = patches if self.vision_window is None else np.minimum(patches, self.vision_window)
        return self.vision_layers * (2.0 * (4 * hv * hv + 2 * hv * iv) * patches + 4.0 * hv * patches * w)

    def token_equivalents(self, lengths: np.ndarray, vision_tokens: np.ndarray | None = None,
                          image_tokens: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """int64 cost per sample: FLOPs / one token's linear FLOPs, rounded up (>= tokens)."""
        flops = self.flops(lengths, vision_tokens, image_tokens)
        return np.ceil(flops / self.token_flops() - 1e-9).astype(np.int64)


CostSpec = str | FlopsModel | np.ndarray | Callable[[np.ndarray], Any] | None


def resolve_costs(lengths_or_index: Any, cost: CostSpec = None, *, config: Any = None) -> np.ndarray:
    """Per-sample int64 costs for the planner.

    ``lengths_or_index``: token counts, or an object with ``.lengths`` (and optionally
    ``.vision_tokens`` / ``.image_tokens_table``, e.g. :class:`tokenbal.TokenIndex`, which the flops
    model's ViT term uses).
    ``cost``: ``None``/``"tokens"``, ``"flops"`` (from ``config``, a transformers config; Qwen2-VL-7B
    when None), a :class:`FlopsModel`, an array, or a callable of the lengths.
    """
    from tokenbal.plan import check_lengths

    lens = check_lengths(lengths_or_index)
    if cost is None or (isinstance(cost, str) and cost == "tokens"):
        return lens
    if isinstance(cost, str):
        if cost != "flops":
            raise ValueError(f"unknown cost {cost!r}; use one of {COST_NAMES}, a FlopsModel, an array "
                             "or a callable")
        cost = FlopsModel.qwen2_vl_7b() if config is None else FlopsModel.from_config(config)
    if isinstance(cost, FlopsModel):
        vis = getattr(lengths_or_index, "vision_tokens", None)
        images = getattr(lengths_or_index, "image_tokens_table", None)
        return cost.token_equivalents(lens, None if vis is None else np.asarray(vis), images)
    values = cost(lens) if callable(cost) else cost
    arr = np.asarray(values)
    if arr.shape != lens.shape:
        raise ValueError(f"cost gives shape {arr.shape}, expected one value per sample {lens.shape}")
    return to_int_costs(arr)


def to_int_costs(values: np.ndarray) -> np.ndarray:
    """Integers as they are; floats scaled so the largest is ~1e6 and rounded (every positive cost
    stays >= 1, so no sample becomes free). Negative or non-finite values raise, naming the sample."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"costs must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iuf":
        raise TypeError(f"costs must be numbers, got dtype {arr.dtype}")
    bad = np.flatnonzero(~np.isfinite(arr.astype(np.float64)) | (arr < 0))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"costs must be finite and >= 0; sample {i} has cost {arr[i]!r}")
    if arr.dtype.kind in "iu" or arr.size == 0:
        return arr.astype(np.int64)
    top = float(arr.max())
    if top == 0:
        return np.zeros(arr.size, np.int64)
    scaled = np.round(arr * (_FLOAT_RESOLUTION / top)).astype(np.int64)
    return np.where(arr > 0, np.maximum(scaled, 1), 0)


def _sub(config: Any, *names: str) -> Any:
    for n in names:
        v = config.get(n) if isinstance(config, dict) else getattr(config, n, None)
        if v is not None:
            return v
    return None


_MISSING = object()


def _get(config: Any, *names: str, default: Any = _MISSING) -> Any:
    v = _sub(config, *names)
    if v is None:
        if default is _MISSING:
            raise ValueError(f"config has none of {names}; pass a FlopsModel explicitly")
        return default
    return v
