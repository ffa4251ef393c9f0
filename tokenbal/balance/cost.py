"""Cost models: what the planner balances, per sample.

* ``"tokens"`` (default): total tokens. Equal token sums per rank are what most users ask for and
  what bounds activation memory.
* ``"flops"`` / :class:`FlopsModel`: training work of one sample, ``a·s + b·s²`` for the LLM
  (dense projections + MLP, then causal attention, per sequence since packed sequences do not
  attend to each other) plus an optional vision-encoder term on the sample's patches. The
  coefficients come from a transformers config (hidden size, layers, heads, MLP width). The
  attention term is why a 16k-token video costs more than eight 2k-token documents.
* :class:`StageCostModel`: measured seconds, linear in per-sample features (tokens, tokens²,
  patches, patches² per image, ...) with coefficients fitted to timed micro-batches of the real
  model on the real hardware (``collate.train.profile_stage_costs``); in microseconds.
* a user array (one non-negative number per sample) or a callable ``f(lengths) -> array``.
* ``"padded"``: for collators that pad each micro-batch to its longest sample; a micro-batch costs
  ``count × longest``, and the planner composes steps for that (:mod:`tokenbal.balance.partition.padded`,
  ``global_batch_size`` mode).

Stages (:func:`resolve_stage_costs`): under FSDP the vision tower and the language model each end
in collectives, so each waits for its own slowest rank and a step takes ``Σ_stage max_rank``.
``stages=True`` (sampler / planner) splits a FLOPs or measured cost into those two columns and the
planner balances both.

The planner works on integers (it compares sums exactly and scales them internally), so every
model is turned into int64 *token-equivalents*: the cost divided by what one token of the
linear term costs, rounded. For ``"flops"`` a sample of s tokens then costs ``s + b/a·s²``
(+ vision), i.e. its token count plus an attention surcharge, and a budget in tokens stays
meaningful. Float user costs are scaled so the largest becomes ~1e6 (see :func:`to_int_costs`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from tokenbal._checks import check_lengths
from tokenbal.hf_compat import vision_model_type

__all__ = ["FlopsModel", "StageCostModel", "stage_features", "resolve", "Resolved", "resolve_costs",
           "resolve_stage_costs", "to_int_costs",
           "COST_NAMES", "STAGE_NAMES", "STAGE_FEATURES"]

COST_NAMES = ("tokens", "flops", "padded")
_FLOAT_RESOLUTION = 1_000_000   # a float cost array is scaled so its maximum is this many units


@dataclass(frozen=True)
class FlopsModel:
    """Per-sample training FLOPs of a decoder LLM (+ optional ViT), as token-equivalents.

    Per LLM layer and token, forward: ``2·(2·h·(q·d + kv·d) + 3·h·i)`` for q/o + k/v projections
    (GQA-aware; ``d = head_dim``, ``h / q`` unless the config sets it apart, as Qwen3 and GLM-4.5 do)
    and a gated MLP ``i`` wide (a mixture of experts: the width a token is routed through, see
    :meth:`from_config`), and ``2·q·d·s`` for causal attention (QKᵀ and PV, half the square).
    Backward is twice forward, which cancels in the token-equivalent ratio. The ViT term, when
    ``vision_layers > 0``: patches ``p = vision_tokens · merge²`` cost ``2·(4·hv² + 2·hv·iv)`` each
    per layer (``2·(4·hv² + 3·hv·iv)`` with ``vision_gated_mlp``: Qwen2.5-VL's and GLM-4.1V's
    gate / up / down MLP) plus ``4·hv·p·w`` for (non-causal) attention over a window of ``w`` patches
    (``w = p`` when ``vision_window`` is None: full attention over the whole sample — an upper
    bound for multi-image samples). ``vision_full_layers`` of the vision layers attend over the
    whole image even with a window: Qwen2.5-VL's ``fullatt_block_indexes``; its other layers attend
    within windows of ``(window_size / patch_size)²`` = 64 patches (:meth:`from_config` reads both).
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
    head_dim: int | None = None   # None: hidden_size // num_heads
    vision_gated_mlp: bool = False
    vision_full_layers: int = 0


    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "intermediate_size", "num_heads", "num_kv_heads",
                     "merge_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"FlopsModel.{name} must be a positive int, got {v!r}")
        f = self.vision_full_layers
        if isinstance(f, bool) or not isinstance(f, int) or not 0 <= f <= max(self.vision_layers, 0):
            raise ValueError(f"FlopsModel.vision_full_layers must be an int in [0, vision_layers="
                             f"{self.vision_layers}], got {f!r}")
        d = self.head_dim
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"FlopsModel.head_dim must be a positive int or None, got {d!r}")

    @property
    def attention_dim(self) -> int:
        """Width of the attention heads together (q heads x head_dim): what q / o project to and
        what attention scores are computed over. Not hidden_size when the config sets head_dim."""
        d = self.hidden_size // self.num_heads if self.head_dim is None else self.head_dim
        return self.num_heads * d

    @classmethod
    def from_config(cls, config: Any, *, vision: bool = True, vision_window: int | None = None
                    ) -> FlopsModel:
        """From a transformers config (object or dict); multimodal configs' ``text_config`` /
        ``vision_config`` are used when present (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA, InternVL).
        A mixture-of-experts config's ``intermediate_size`` becomes the active width per token,
        averaged over the layers (routed experts x their width + shared experts; dense layers
        their own width).

        Placeholder tokens to patches: ``merge_size`` is Qwen's / GLM's ``spatial_merge_size``,
        InternVL's ``1 / downsample_ratio``, Idefics3's / SmolVLM's ``scale_factor``, and 1 for
        LLaVA (one token per patch). Tiling towers (LLaVA, InternVL, Idefics3 / SmolVLM,
        Phi-4-multimodal) attend within each tile, so their ``vision_window`` is the patches of a
        tile (``(image_size / patch_size)²``) unless ``vision_window`` is given; Qwen2.5-VL's is
        its ``window_size`` in patches, with ``fullatt_block_indexes`` as ``vision_full_layers``."""
        text = _sub(config, "text_config", "llm_config") or config
        h = _get(text, "hidden_size")
        heads = _get(text, "num_attention_heads")
        layers = _get(text, "num_hidden_layers")
        kw: dict[str, Any] = dict(
            hidden_size=h, num_layers=layers,
            intermediate_size=_active_mlp_width(text, layers, _get(text, "intermediate_size", default=4 * h)),
            num_heads=heads,
            num_kv_heads=_get(text, "num_key_value_heads", default=heads), vision_window=vision_window,
            head_dim=_explicit_head_dim(text, h, heads))
        vis = _sub(config, "vision_config") if vision else None
        if vis is not None:
            hv = _get(vis, "hidden_size", "embed_dim")
            mlp = _get(vis, "intermediate_size", default=0)
            if not mlp:
                mlp = int(round(_get(vis, "mlp_ratio", default=4) * _get(vis, "embed_dim", "hidden_size")))
            kind = vision_model_type(config, vis)
            if kind in _VISION_MLP_OUT_WIDE:
                # GLM-4.1V's vision blocks build their MLP out_hidden_size wide
                # (Glm4VisionMlp: intermediate_size = config.out_hidden_size); the vision config's
                # intermediate_size is the patch merger's, after the blocks
                mlp = _get(vis, "out_hidden_size")
            if kind in _TILED_VISION and vision_window is None:
                kw["vision_window"] = _tile_patches(vis)
            if kind in _WINDOWED_VISION and _sub(vis, "window_size"):
                # Qwen2.5-VL: window_size pixels per side, whole merge units of patches
                # (get_window_index: window_size // spatial_merge_size // patch_size merged tokens)
                merge, patch = int(_get(vis, "spatial_merge_size", default=2)), int(_get(vis, "patch_size"))
                if vision_window is None:
                    kw["vision_window"] = (int(_get(vis, "window_size")) // merge // patch * merge) ** 2
                kw["vision_full_layers"] = len(_sub(vis, "fullatt_block_indexes") or ())
            kw.update(vision_hidden_size=_get(vis, "embed_dim", "hidden_size", default=hv),
                      vision_layers=_get(vis, "depth", "num_hidden_layers"), vision_intermediate_size=mlp,
                      merge_size=_patches_per_token_side(config, vis, kind),
                      vision_gated_mlp=kind in _VISION_GATED_MLP)
        return cls(**kw)

    @classmethod
    def qwen2_vl_7b(cls) -> FlopsModel:
        """Qwen2-VL-7B-Instruct's dimensions (config.json of the official checkpoint)."""
        return cls(hidden_size=3584, num_layers=28, intermediate_size=18944, num_heads=28, num_kv_heads=4,
                   vision_hidden_size=1280, vision_layers=32, vision_intermediate_size=5120, merge_size=2)

    def token_flops(self) -> float:
        """Forward FLOPs of one token's linear part (all LLM layers)."""
        h, i, q_dim = self.hidden_size, self.intermediate_size, self.attention_dim
        kv_dim = self.num_kv_heads * (q_dim // self.num_heads)
        return 2.0 * (2 * h * (q_dim + kv_dim) + 3 * h * i) * self.num_layers

    def flops(self, lengths: np.ndarray, vision_tokens: np.ndarray | None = None,
              image_tokens: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """Forward FLOPs per sample (float64); training is ~3x this.

        ``image_tokens``: optional ``(offsets, tokens)``, each image's placeholder tokens with sample
        ``i`` owning ``tokens[offsets[i]:offsets[i + 1]]`` (``TokenIndex.image_tokens_table``). The
        vision tower attends within each image, so with it the ViT term is summed per image; without
        it a sample's patches count as one attention block (an upper bound for multi-image samples).
        """
        return self.stage_flops(lengths, vision_tokens, image_tokens).sum(1)

    def stage_flops(self, lengths: np.ndarray, vision_tokens: np.ndarray | None = None,
                    image_tokens: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """(n, 2) forward FLOPs per sample: column 0 the vision tower, column 1 the language model.

        Under FSDP every layer's all-gather waits for the slowest rank, and the vision tower runs
        to completion before the first decoder layer, so the two stages are balanced separately
        (``TokenBalancedBatchSampler(stages=True)``); :meth:`flops` is their sum.
        """
        s = np.asarray(lengths, np.float64)
        out = np.zeros((len(s), 2))
        out[:, 1] = s * self.token_flops() + 2.0 * self.attention_dim * s * s * self.num_layers
        if self.vision_layers > 0 and image_tokens is not None:
            offsets, tokens = (np.asarray(a) for a in image_tokens)
            per_image = self._vit_flops(tokens.astype(np.float64) * self.merge_size ** 2)
            owner = np.repeat(np.arange(len(s)), np.diff(offsets[: len(s) + 1]))
            out[:, 0] = np.bincount(owner, weights=per_image[: len(owner)], minlength=len(s))
        elif self.vision_layers > 0 and vision_tokens is not None:
            out[:, 0] = self._vit_flops(np.asarray(vision_tokens, np.float64) * self.merge_size ** 2)
        return out

    def _vit_flops(self, patches: np.ndarray) -> np.ndarray:
        hv, iv = self.vision_hidden_size, self.vision_intermediate_size
        mlp = (3 if self.vision_gated_mlp else 2) * hv * iv
        linear = self.vision_layers * 2.0 * (4 * hv * hv + mlp) * patches
        if self.vision_window is None:
            return linear + self.vision_layers * 4.0 * hv * patches * patches
        windowed = self.vision_layers - self.vision_full_layers
        return linear + 4.0 * hv * patches * (self.vision_full_layers * patches
                                              + windowed * np.minimum(patches, self.vision_window))

    def token_equivalents(self, lengths: np.ndarray, vision_tokens: np.ndarray | None = None,
                          image_tokens: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """int64 cost per sample: FLOPs / one token's linear FLOPs, rounded up (>= tokens)."""
        flops = self.flops(lengths, vision_tokens, image_tokens)
        return np.ceil(flops / self.token_flops() - 1e-9).astype(np.int64)

    def stage_token_equivalents(self, lengths: np.ndarray, vision_tokens: np.ndarray | None = None,
                                image_tokens: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """(n, 2) int64: :meth:`stage_flops` in token-equivalents (vision, language), rounded up."""
        flops = self.stage_flops(lengths, vision_tokens, image_tokens)
        return np.ceil(flops / self.token_flops() - 1e-9).astype(np.int64)


STAGE_NAMES = ("vision", "language")
# Per-sample features of each stage that a measured model is linear in: the language model's work is
# per sample, per token and per token² (causal attention); the vision tower's per image, per patch
# and per patch² (each image attends within itself).
STAGE_FEATURES = (("images", "patches", "patches²"), ("samples", "tokens", "tokens²"))


def stage_features(lengths_or_index: Any, merge_size: int = 2) -> np.ndarray:
    """(n, 2, 3) float64 per-sample features of :data:`STAGE_FEATURES` (vision, then language).

    Images come from ``.image_tokens_table`` when present (patches = placeholder tokens ·
    merge²), else a sample's ``.vision_tokens`` count as one image; bare lengths have no vision.
    """
    return _stage_features(check_lengths(lengths_or_index), lengths_or_index, merge_size)


def _stage_features(lens: np.ndarray, source: Any, merge_size: int) -> np.ndarray:
    """:func:`stage_features` of already checked lengths ``lens`` (``source``: where the vision
    attributes are read)."""
    s = lens.astype(np.float64)
    n = len(s)
    out = np.zeros((n, 2, 3))
    out[:, 1] = np.stack([np.ones(n), s, s * s], 1)
    table = getattr(source, "image_tokens_table", None)
    vis = getattr(source, "vision_tokens", None)
    if table is not None:
        offsets, tokens = (np.asarray(a) for a in table)
        p = tokens[: offsets[n]].astype(np.float64) * merge_size ** 2
        owner = np.repeat(np.arange(n), np.diff(offsets[: n + 1]))
        for j, f in enumerate((np.ones_like(p), p, p * p)):
            out[:, 0, j] = np.bincount(owner, weights=f, minlength=n)
    elif vis is not None:
        p = np.asarray(vis, np.float64) * merge_size ** 2
        out[:, 0] = np.stack([(p > 0).astype(np.float64), p, p * p], 1)
    return out


@dataclass(frozen=True)
class StageCostModel:
    """Measured seconds per sample and stage, linear in :data:`STAGE_FEATURES`.

    FLOPs are a poor clock when kernels differ in efficiency: on the 2-core CPU of
    docs/BENCHMARKS.md the demo model's language FLOPs took 1.6x the time of its vision FLOPs, and
    attention (s², per sample) dominated although FLOPs said the projections did. Fit one with
    :meth:`fit` from timed micro-batches (``collate.train.profile_stage_costs`` does the timing on
    the real model), then pass it as ``cost=`` and ``stages=True``. Costs are in microseconds.
    """

    vision: tuple[float, float, float]     # seconds per image, per patch, per patch²
    language: tuple[float, float, float]   # seconds per sample, per token, per token²
    merge_size: int = 2

    def __post_init__(self) -> None:
        for name in STAGE_NAMES:
            coef = getattr(self, name)
            if len(coef) != 3 or not all(np.isfinite(c) and c >= 0 for c in coef):
                raise ValueError(f"StageCostModel.{name} needs 3 finite coefficients >= 0, got {coef!r}")

    def stage_seconds(self, lengths_or_index: Any) -> np.ndarray:
        """(n, 2) predicted seconds per sample: vision, language."""
        return self._seconds(stage_features(lengths_or_index, self.merge_size))

    def stage_micros(self, lengths_or_index: Any) -> np.ndarray:
        """(n, 2) int64 microseconds, rounded up (work that exists never costs 0)."""
        return _micros(self.stage_seconds(lengths_or_index))

    def _seconds(self, f: np.ndarray) -> np.ndarray:
        return np.stack([f[:, 0] @ np.asarray(self.vision), f[:, 1] @ np.asarray(self.language)], 1)

    def _checked_micros(self, lens: np.ndarray, source: Any) -> np.ndarray:
        """:meth:`stage_micros` of already checked lengths (``resolve`` checks them once)."""
        return _micros(self._seconds(_stage_features(lens, source, self.merge_size)))

    @classmethod
    def fit(cls, batch_features: np.ndarray, batch_seconds: np.ndarray, merge_size: int = 2
            ) -> StageCostModel:
        """Least squares with non-negative coefficients, per stage, from B timed micro-batches.

        ``batch_features``: (B, 2, 3), each batch's summed :func:`stage_features`;
        ``batch_seconds``: (B, 2) its measured vision and language seconds. A per-batch constant
        (launch overheads, the loss) is fitted too and left out of the per-sample costs, since every
        rank pays it once per micro-batch whatever it holds.
        """
        X = np.asarray(batch_features, np.float64)
        y = np.asarray(batch_seconds, np.float64)
        if X.ndim != 3 or X.shape[1:] != (2, 3) or y.shape != X.shape[:2]:
            raise ValueError(f"need batch_features (B, 2, 3) and batch_seconds (B, 2), got {X.shape} and "
                             f"{y.shape}")
        if len(X) < 4 or not (np.isfinite(X).all() and np.isfinite(y).all()):
            raise ValueError("need at least 4 timed batches with finite features and times")
        coefs = [_nnls(np.column_stack([np.ones(len(X)), X[:, k]]), y[:, k])[1:] for k in range(2)]
        return cls(vision=tuple(float(c) for c in coefs[0]), language=tuple(float(c) for c in coefs[1]),
                   merge_size=merge_size)

    def to_dict(self) -> dict:
        return {"vision": list(self.vision), "language": list(self.language), "merge_size": self.merge_size,
                "features": {name: list(f) for name, f in zip(STAGE_NAMES, STAGE_FEATURES, strict=True)}}

    @classmethod
    def from_dict(cls, d: dict) -> StageCostModel:
        return cls(vision=tuple(d["vision"]), language=tuple(d["language"]),
                   merge_size=int(d.get("merge_size", 2)))


def _micros(seconds: np.ndarray) -> np.ndarray:
    return np.ceil(seconds * 1e6 - 1e-9).astype(np.int64)


def _nnls(A: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min ||A x - y|| with x >= 0, for a handful of columns: the best of all column subsets whose
    unconstrained solution is non-negative (the optimum is one of them)."""
    m = A.shape[1]
    # Scale columns: tokens² and tokens differ by ~1e4, which lstsq handles, but the residuals compare better.
    scale = np.maximum(np.abs(A).max(0), 1e-300)
    As = A / scale
    best, best_res = np.zeros(m), float(np.sum(y * y))
    for mask in range(1, 2 ** m):
        cols = [j for j in range(m) if mask >> j & 1]
        x, *_ = np.linalg.lstsq(As[:, cols], y, rcond=None)
        if (x < 0).any():
            continue
        res = float(np.sum((As[:, cols] @ x - y) ** 2))
        if res < best_res - 1e-15 * max(best_res, 1.0):
            best, best_res = np.zeros(m), res
            best[cols] = x
    return best / scale


CostSpec = str | FlopsModel | StageCostModel | np.ndarray | Callable[[np.ndarray], Any] | None


@dataclass(frozen=True, eq=False)
class Resolved:
    """A dataset's per-sample arrays, as the planner takes them (all int64, one row per sample).

    Made by :func:`resolve`, which checks the lengths and costs once; the planner, the sampler's
    replans and the simulator take it as it is and never check the values again (only that the
    shapes agree, here)."""

    lengths: np.ndarray               # tokens
    costs: np.ndarray                 # what is balanced (``lengths`` for tokens)
    stages: np.ndarray | None         # (n, K) per-stage costs, or None
    cost_name: str                    # "tokens", "flops", "padded" or the cost model's type name

    def __post_init__(self) -> None:
        n = len(self.lengths)
        if np.shape(self.costs) != (n,):
            raise ValueError(f"Resolved.costs must have one value per sample ({n}), got shape "
                             f"{np.shape(self.costs)}")
        if self.stages is not None and (np.ndim(self.stages) != 2 or len(self.stages) != n):
            raise ValueError(f"Resolved.stages must be (n, K) with n = {n}, got shape "
                             f"{np.shape(self.stages)}")

    def __len__(self) -> int:
        return len(self.lengths)

    def subset(self, indices: np.ndarray) -> Resolved:
        """The rows ``indices`` (dataset indices, in that order) as their own :class:`Resolved`:
        what a replan of part of an epoch (the sampler's elastic resume) plans on."""
        idx = np.asarray(indices, np.int64)
        return Resolved(lengths=self.lengths[idx], costs=self.costs[idx],
                        stages=None if self.stages is None else self.stages[idx], cost_name=self.cost_name)

    def fingerprint(self) -> dict[str, Any]:
        """The data's part of the sampler's resume fingerprint: sample count, a digest of the costs
        and stage costs (computed once), the cost's name and the number of stages."""
        return {"num_samples": int(len(self.lengths)), "lengths_sha256": self._digest,
                "cost": self.cost_name, "stages": 0 if self.stages is None else int(self.stages.shape[1])}

    @cached_property
    def _digest(self) -> str:
        h = hashlib.sha256(np.ascontiguousarray(self.costs, "<i8").tobytes())
        if self.stages is not None:
            h.update(b"stages" + np.ascontiguousarray(self.stages, "<i8").tobytes())
        return h.hexdigest()[:16]


def resolve(lengths_or_index: Any, cost: CostSpec = None, stages: Any = None, *, config: Any = None
            ) -> Resolved:
    """The one step from what a user passes (lengths, a :class:`tokenbal.TokenIndex`, a cost spec,
    ``stages``) to the arrays :func:`tokenbal.balance.plan.plan_epoch` works on; the sampler, the
    planner and the simulator all call it. ``stages`` False / None: no stage costs. The lengths are
    checked here once (:func:`tokenbal._checks.check_lengths`). A :class:`Resolved` is returned as
    it is (it already carries its cost and stages: passing ``cost`` / ``stages`` again is an error)."""
    if isinstance(lengths_or_index, Resolved):
        if cost is not None or (stages is not None and stages is not False):
            raise ValueError(f"already resolved (cost {lengths_or_index.cost_name!r}, "
                             f"{0 if lengths_or_index.stages is None else lengths_or_index.stages.shape[1]} "
                             "stages): pass cost= / stages= to resolve(), not again with its result")
        return lengths_or_index
    lens = check_lengths(lengths_or_index)
    tokens = cost is None or (isinstance(cost, str) and cost == "tokens")
    costs = lens if tokens else _costs(lens, lengths_or_index, cost, config)
    if costs is not lens and float(costs.sum(dtype=np.float64)) >= 2.0**63:
        # The planner sums costs in int64, as it does tokens (check_lengths refuses those).
        raise ValueError(f"costs sum to {float(costs.sum(dtype=np.float64)):.3g}, more than int64 holds")
    staged = None
    if stages is not None and stages is not False:
        staged = _stage_costs(lens, lengths_or_index, stages, cost, config)
        if float(staged.sum(dtype=np.float64)) >= 2.0**63:
            # The planner sums them per sample, per stage and per step in int64, as it does costs.
            raise ValueError(f"stage costs sum to {float(staged.sum(dtype=np.float64)):.3g}, more than int64 "
                             "holds (scale them down: only their ratios matter)")
    name = "tokens" if tokens else (cost if isinstance(cost, str) else type(cost).__name__)
    return Resolved(lengths=lens, costs=costs, stages=staged, cost_name=name)


def resolve_costs(lengths_or_index: Any, cost: CostSpec = None, *, config: Any = None) -> np.ndarray:
    """Per-sample int64 costs for the planner.

    ``lengths_or_index``: token counts, or an object with ``.lengths`` (and optionally
    ``.vision_tokens`` / ``.image_tokens_table``, e.g. :class:`tokenbal.TokenIndex`, which the flops
    model's ViT term uses).
    ``cost``: ``None``/``"tokens"``, ``"flops"`` (from ``config``, a transformers config; Qwen2-VL-7B
    when None), a :class:`FlopsModel`, an array, or a callable of the lengths.
    """
    return _costs(check_lengths(lengths_or_index), lengths_or_index, cost, config)


def _costs(lens: np.ndarray, source: Any, cost: CostSpec, config: Any) -> np.ndarray:
    """:func:`resolve_costs` of already checked lengths ``lens`` (``source``: what the user passed,
    for its vision attributes)."""
    if cost is None or (isinstance(cost, str) and cost == "tokens"):
        return lens
    if isinstance(cost, str) and cost == "padded":
        # Per sample the padded cost is its length; what differs is how a micro-batch adds them
        # up (count x longest), which the planner's padded composition handles
        # (tokenbal.balance.partition.padded).
        return lens
    if isinstance(cost, str):
        if cost != "flops":
            raise ValueError(f"unknown cost {cost!r}; use one of {COST_NAMES}, a FlopsModel, an array "
                             "or a callable")
        cost = FlopsModel.qwen2_vl_7b() if config is None else FlopsModel.from_config(config)
    if isinstance(cost, FlopsModel):
        vis = getattr(source, "vision_tokens", None)
        images = getattr(source, "image_tokens_table", None)
        return cost.token_equivalents(lens, None if vis is None else np.asarray(vis), images)
    if isinstance(cost, StageCostModel):
        return cost._checked_micros(lens, source).sum(1)
    values = cost(lens) if callable(cost) else cost
    arr = np.asarray(values)
    if arr.shape != lens.shape:
        raise ValueError(f"cost gives shape {arr.shape}, expected one value per sample {lens.shape}")
    return to_int_costs(arr)


def resolve_stage_costs(lengths_or_index: Any, stages: Any, cost: CostSpec = None, *,
                        config: Any = None) -> np.ndarray:
    """(n, K) int64 per-sample costs of K stages that run one after the other, each ending in a
    synchronisation of all ranks (under FSDP: the vision tower, then the language model).

    ``stages``: ``True`` derives them from ``cost`` (``"flops"`` or a :class:`FlopsModel` with a
    vision tower: columns vision, language, in the same token-equivalents as the scalar cost), or
    an (n, K) array of non-negative numbers (e.g. a measured time per stage; floats are scaled
    together so the largest entry is ~1e6).
    """
    return _stage_costs(check_lengths(lengths_or_index), lengths_or_index, stages, cost, config)


def _stage_costs(lens: np.ndarray, source: Any, stages: Any, cost: CostSpec, config: Any) -> np.ndarray:
    """:func:`resolve_stage_costs` of already checked lengths ``lens``."""
    if stages is True and isinstance(cost, StageCostModel):
        return cost._checked_micros(lens, source)
    if stages is True:
        model = cost
        if isinstance(cost, str) and cost == "flops":
            model = FlopsModel.qwen2_vl_7b() if config is None else FlopsModel.from_config(config)
        if not isinstance(model, FlopsModel) or model.vision_layers == 0:
            raise ValueError("stages=True needs cost='flops', a FlopsModel with a vision tower or a "
                             "StageCostModel (it splits each sample's cost into vision and language); "
                             "or pass an (n, K) array")
        vis = getattr(source, "vision_tokens", None)
        images = getattr(source, "image_tokens_table", None)
        if vis is None and images is None:
            raise ValueError("stages=True needs per-sample vision tokens: pass a TokenIndex (or an object "
                             "with .vision_tokens / .image_tokens_table), not bare lengths")
        return model.stage_token_equivalents(lens, None if vis is None else np.asarray(vis), images)
    arr = np.asarray(stages)
    if arr.ndim != 2 or arr.shape[0] != len(lens) or arr.shape[1] < 1:
        raise ValueError(f"stages must be True or an (n, K) array with one row per sample (n = {len(lens)}), "
                         f"got shape {arr.shape}")
    from tokenbal._checks import check_sample_values

    for k in range(arr.shape[1]):   # column by column, so an error names the sample, not a flat index
        check_sample_values(arr[:, k], "stage costs", whole=False, where=f" in stage {k}")
    return to_int_costs(arr.reshape(-1)).reshape(arr.shape)


def to_int_costs(values: np.ndarray) -> np.ndarray:
    """Integers as they are; floats scaled so the largest is ~1e6 and rounded (every positive cost
    stays >= 1, so no sample becomes free). Negative or non-finite values raise, naming the sample."""
    from tokenbal._checks import check_sample_values

    arr = check_sample_values(values, "costs", whole=False)
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

# vision towers whose blocks' MLP is gated (gate, up and down projections: 3·hv·iv per patch, not
# the fc1 / fc2 pair's 2·hv·iv of Qwen2-VL's, Qwen3-VL's, CLIP's and SigLIP's)
_VISION_GATED_MLP = frozenset({"qwen2_5_vl", "glm4v", "glm4v_moe"})
# ... and of those, the ones whose MLP is out_hidden_size wide rather than intermediate_size
_VISION_MLP_OUT_WIDE = frozenset({"glm4v", "glm4v_moe"})


# vision towers whose layers attend within windows, but for the fullatt_block_indexes ones
_WINDOWED_VISION = frozenset({"qwen2_5_vl"})
# vision towers that encode fixed-size tiles (crops) one by one: attention stays within a tile
_TILED_VISION = frozenset({"llava", "llava_next", "llava_onevision", "internvl", "internvl_chat", "idefics3",
                           "smolvlm", "phi4_multimodal"})


def _patches_per_token_side(config: Any, vis: Any, kind: str) -> int:
    """How many patches per side one placeholder token stands for (its square: patches per token)."""
    if kind in ("llava", "llava_next", "llava_onevision"):
        return 1   # the projector maps each patch feature to one token (no merging)
    if kind in ("idefics3", "smolvlm"):
        return int(_get(config, "scale_factor", default=2))   # pixel shuffle by scale_factor per side
    if kind in ("internvl", "internvl_chat"):
        # pixel shuffle: downsample_ratio 0.5 -> 2 x 2 patches per token
        return max(1, int(round(1 / float(_get(config, "downsample_ratio", default=0.5)))))
    return int(_get(vis, "spatial_merge_size", default=2))


def _tile_patches(vis: Any) -> int | None:
    """Patches of one tile of a tiling tower (image_size / patch_size per side; InternVL writes
    both as [height, width] lists), or None when the config does not say."""
    size, patch = _sub(vis, "image_size"), _sub(vis, "patch_size")
    if size is None or patch is None:
        return None
    sizes = list(size) if isinstance(size, (list, tuple)) else [size, size]
    patches = list(patch) if isinstance(patch, (list, tuple)) else [patch, patch]
    return max(1, (int(sizes[0]) // int(patches[0])) * (int(sizes[1]) // int(patches[1])))


def _active_mlp_width(text: Any, num_layers: int, dense_width: int) -> int:
    """The gated-MLP width one token goes through, averaged over the layers. Dense models: their
    intermediate_size. Mixture-of-experts models route a token through num_experts_per_tok experts
    of moe_intermediate_size (Mixtral: of intermediate_size) plus any shared expert, in the layers
    that are sparse (Qwen-MoE: every decoder_sparse_step-th layer not in mlp_only_layers;
    GLM-4.5V / DeepSeek: from first_k_dense_replace on); the other layers are dense. The router
    (hidden x experts per token) is left out, as the norms are."""
    k = _sub(text, "num_experts_per_tok")
    experts = _sub(text, "num_experts", "num_local_experts", "n_routed_experts")
    if not k or not experts:
        return dense_width
    expert = _sub(text, "moe_intermediate_size") or dense_width
    shared = _sub(text, "shared_expert_intermediate_size") or (_sub(text, "n_shared_experts") or 0) * expert
    step = _sub(text, "decoder_sparse_step") or 1
    dense_only = set(_sub(text, "mlp_only_layers") or ())
    first_sparse = _sub(text, "first_k_dense_replace") or 0
    sparse = sum(1 for i in range(num_layers)
                 if i not in dense_only and (i + 1) % step == 0 and i >= first_sparse)
    total = sparse * (k * expert + shared) + (num_layers - sparse) * dense_width
    return max(1, int(round(total / num_layers)))


def _explicit_head_dim(text: Any, hidden: int, heads: int) -> int | None:
    # Qwen3 / Qwen3-VL (e.g. 4B: hidden 2560, 32 heads of 128) and GLM-4.5 (hidden 4096, 96 heads
    # of 128) set head_dim apart from hidden / heads: their q / o projections and attention are
    # heads x head_dim wide, not hidden. Configs without the field (or with it equal) keep None.
    d = _sub(text, "head_dim")
    if d is None or isinstance(d, bool) or not isinstance(d, int) or d * heads == hidden:
        return None
    return d


def _get(config: Any, *names: str, default: Any = _MISSING) -> Any:
    v = _sub(config, *names)
    if v is None:
        if default is _MISSING:
            raise ValueError(f"config has none of {names}; pass a FlopsModel explicitly")
        return default
    return v
