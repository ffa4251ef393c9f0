"""Random stage-cost mixtures: the data a planner is judged on when it was not tuned on it.

One mixture is a random blend of sample kinds (photos, documents, screenshots, text-only,
multi-image posts, videos) with its own size distributions: heavy (log-normal / Pareto) tails,
bimodal sizes (a second, larger mode per kind), its own share of text per kind and its own
text-only fraction. :func:`random_mixture` draws one from a seed, :func:`draw_samples` draws
samples from it (vision tokens per image or video frame group with Qwen2-VL's rules, text
tokens), and :func:`stage_costs` turns them into the (n, 2) vision / language costs the
planner's ``stages=`` takes:

* ``"square"``: vision = Σ over images (and video frame groups, which attend within themselves)
  of ``patches + patches²``, language = ``tokens + tokens²`` (tokens = vision + text);
* a :class:`tokenbal.balance.cost.FlopsModel`: its per-stage FLOPs (per image), in token-equivalents.

Everything is a pure function of its seed (``numpy.random.default_rng``), so a draw is the same
on every machine. Used by ``scripts/bench_balance.py --mixtures`` and the planner's property tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["KINDS", "MixtureSpec", "MixtureSamples", "random_mixture", "draw_samples", "stage_costs",
           "random_stage_costs"]

KINDS = ("photo", "document", "screenshot", "text", "multi_image", "video")
_MERGE = 2                       # Qwen2-VL: 2×2 patches per vision token
_PATCH = 14
_MIN_PIXELS, _MAX_PIXELS = 3136, 12845056
_TEMPLATE_TOKENS = 24


@dataclass(frozen=True)
class MixtureSpec:
    """One blend of kinds and its size distributions (all drawn by :func:`random_mixture`)."""

    weights: tuple[float, ...]          # per kind of KINDS, sums to 1
    image_scale: tuple[float, ...]      # per kind: median side length multiplier of its images
    tail: float                         # log-normal sigma of image and text sizes (heavy tail)
    big_mode: float                     # fraction of samples of a kind drawn from its second mode
    big_factor: float                   # the second mode's size multiplier (bimodal sizes)
    text_scale: tuple[float, ...]       # per kind: median text tokens (the vision share)
    pareto: float                       # shape of the Pareto tail on text lengths (smaller: heavier)
    max_images: int                     # multi-image posts hold 2 .. max_images images
    video_groups: tuple[int, int]       # range of temporal groups (2 frames each) per video
    video_side: float                   # video frame side multiplier
    max_pixels: int                     # the processor's max_pixels per image (frame)
    max_length: int                     # samples are truncated (text first) to this many tokens


@dataclass(frozen=True)
class MixtureSamples:
    """Per-sample token counts of a draw; images (and video frame groups) flat with offsets."""

    kind: np.ndarray                    # int8 index into KINDS
    text_tokens: np.ndarray             # int64
    vision_tokens: np.ndarray           # int64, all images / frames of the sample
    image_offsets: np.ndarray           # int64 (n + 1,): sample i owns image_tokens[o[i]:o[i+1]]
    image_tokens: np.ndarray            # int64 per image or video frame group (each attends alone)

    @property
    def lengths(self) -> np.ndarray:
        return self.text_tokens + self.vision_tokens

    @property
    def image_tokens_table(self) -> tuple[np.ndarray, np.ndarray]:
        return self.image_offsets, self.image_tokens

    def __len__(self) -> int:
        return len(self.kind)


def random_mixture(seed: int) -> MixtureSpec:
    """A random blend: kind weights from a Dirichlet (some kinds nearly absent), text-only between
    0 and 60 % of the samples, video between 0 and 10 %, per-kind image and text scales over a
    decade, tails from light to heavy, and a second size mode for 0-20 % of the samples."""
    rng = np.random.default_rng([7321, int(seed)])
    w = rng.dirichlet(np.full(len(KINDS), 0.7))
    text_only = rng.uniform(0.0, 0.6)
    video = rng.uniform(0.0, 0.10)
    rest = [i for i, k in enumerate(KINDS) if k not in ("text", "video")]
    w[rest] = w[rest] / w[rest].sum() * (1 - text_only - video)
    w[KINDS.index("text")] = text_only
    w[KINDS.index("video")] = video
    return MixtureSpec(
        weights=tuple(float(x) for x in w / w.sum()),
        image_scale=tuple(float(x) for x in np.exp(rng.uniform(np.log(0.3), np.log(2.5), len(KINDS)))),
        tail=float(rng.uniform(0.1, 0.8)),
        big_mode=float(rng.uniform(0.0, 0.2)),
        big_factor=float(rng.uniform(1.5, 4.0)),
        text_scale=tuple(float(x) for x in np.exp(rng.uniform(np.log(10), np.log(400), len(KINDS)))),
        pareto=float(rng.uniform(1.2, 3.0)),
        max_images=int(rng.integers(2, 9)),
        video_groups=(int(rng.integers(2, 8)), int(rng.integers(8, 48))),
        video_side=float(np.exp(rng.uniform(np.log(0.3), np.log(1.2)))),
        max_pixels=int(rng.choice([1280, 2560, 5120, 16384])) * 28 * 28,
        max_length=int(rng.choice([8192, 16384, 32768])),
    )


_BASE_SIDE = {"photo": (640, 480), "document": (1700, 2300), "screenshot": (1920, 1080),
              "multi_image": (640, 480), "video": (640, 360)}


def _image_tokens(width: np.ndarray, height: np.ndarray, max_pixels: int = _MAX_PIXELS) -> np.ndarray:
    """Qwen2-VL's placeholder tokens of a width × height image (smart_resize, 28-pixel grid)."""
    f = _PATCH * _MERGE
    h = np.maximum(f, np.round(height / f) * f)
    w = np.maximum(f, np.round(width / f) * f)
    px = h * w
    big = px > max_pixels
    beta = np.sqrt(height * width / max_pixels)
    h = np.where(big, np.maximum(f, np.floor(height / beta / f) * f), h)
    w = np.where(big, np.maximum(f, np.floor(width / beta / f) * f), w)
    small = h * w < _MIN_PIXELS
    beta = np.sqrt(_MIN_PIXELS / (height * width))
    h = np.where(small, np.ceil(height * beta / f) * f, h)
    w = np.where(small, np.ceil(width * beta / f) * f, w)
    return (h * w / f / f).astype(np.int64)


def draw_samples(spec: MixtureSpec, n: int, seed: int) -> MixtureSamples:
    """``n`` samples of ``spec`` (vectorised; a pure function of ``(spec, n, seed)``)."""
    rng = np.random.default_rng([9203, int(seed)])
    kind = rng.choice(len(KINDS), size=n, p=np.asarray(spec.weights)).astype(np.int8)
    # Sizes: log-normal around the kind's scale, times the second mode's factor for some samples.
    mode = np.where(rng.random(n) < spec.big_mode, spec.big_factor, 1.0)
    size = np.exp(rng.normal(0.0, spec.tail, n)) * mode
    text = np.asarray(spec.text_scale)[kind] * (rng.pareto(spec.pareto, n) + 0.5) * mode
    text_tokens = np.round(text).astype(np.int64) + _TEMPLATE_TOKENS
    n_img = np.zeros(n, np.int64)
    is_img = np.isin(kind, [KINDS.index(k) for k in ("photo", "document", "screenshot")])
    n_img[is_img] = 1
    mi = kind == KINDS.index("multi_image")
    n_img[mi] = rng.integers(2, spec.max_images + 1, int(mi.sum()))
    vid = kind == KINDS.index("video")
    n_img[vid] = rng.integers(spec.video_groups[0], spec.video_groups[1] + 1, int(vid.sum()))
    owner = np.repeat(np.arange(n), n_img)
    k = kind[owner]
    base_w = np.zeros(len(KINDS))
    base_h = np.zeros(len(KINDS))
    for name, (bw, bh) in _BASE_SIDE.items():
        base_w[KINDS.index(name)], base_h[KINDS.index(name)] = bw, bh
    scale = np.asarray(spec.image_scale)[k] * np.sqrt(size[owner])
    scale = np.where(k == KINDS.index("video"), spec.video_side * np.sqrt(mode[owner]), scale)
    # Every image of a post gets its own size; a video's frame groups share the video's size.
    jitter = np.exp(rng.normal(0.0, 0.15, (2, len(owner))))
    first = np.r_[0, np.cumsum(n_img)[:-1]]
    vid_item = k == KINDS.index("video")
    jitter[:, vid_item] = jitter[:, first[owner[vid_item]]]
    portrait = rng.random(len(owner)) < 0.3
    ww = base_w[k] * scale * jitter[0]
    hh = base_h[k] * scale * jitter[1]
    ww, hh = np.where(portrait & ~vid_item, hh, ww), np.where(portrait & ~vid_item, ww, hh)
    img_tok = (_image_tokens(np.maximum(ww, 8.0), np.maximum(hh, 8.0), spec.max_pixels)
               + np.where(vid_item, 0, 2))
    # A post or video longer than max_length loses its last images / frame groups (never the first).
    before = np.cumsum(img_tok) - img_tok
    before -= before[first[owner]]
    keep = (before + img_tok <= spec.max_length) | (before == 0)
    owner, img_tok = owner[keep], img_tok[keep]
    n_img = np.bincount(owner, minlength=n)
    vision_tokens = np.bincount(owner, weights=img_tok, minlength=n).astype(np.int64)
    # Truncation to max_length cuts text only (a sample's images are never cut).
    text_tokens = np.clip(spec.max_length - vision_tokens, _TEMPLATE_TOKENS, text_tokens)
    offsets = np.concatenate([[0], np.cumsum(n_img)]).astype(np.int64)
    return MixtureSamples(kind=kind, text_tokens=text_tokens, vision_tokens=vision_tokens,
                          image_offsets=offsets, image_tokens=img_tok.astype(np.int64))


def stage_costs(samples: MixtureSamples, model: object = "square") -> np.ndarray:
    """(n, 2) float64 vision / language cost per sample (see the module docstring for the models).

    ``"square"``: per image (video frame group) ``p + p²`` with ``p`` = tokens × merge² patches;
    language ``t + t²``. A ``FlopsModel``: its :meth:`stage_token_equivalents` (per image)."""
    n = len(samples)
    if isinstance(model, str):
        if model != "square":
            raise ValueError(f"unknown stage cost model {model!r}; use 'square' or a FlopsModel")
        p = samples.image_tokens.astype(np.float64) * _MERGE ** 2
        owner = np.repeat(np.arange(n), np.diff(samples.image_offsets))
        vision = np.bincount(owner, weights=p + p * p, minlength=n)
        t = samples.lengths.astype(np.float64)
        return np.stack([vision, t + t * t], 1)
    return np.asarray(model.stage_token_equivalents(samples.lengths, samples.vision_tokens,
                                                    samples.image_tokens_table), np.float64)


def random_stage_costs(n: int, seed: int, model: object = "square") -> np.ndarray:
    """(n, 2) stage costs of ``n`` samples of mixture ``seed`` (:func:`random_mixture`)."""
    return stage_costs(draw_samples(random_mixture(seed), n, seed), model)
