"""Validation of image/video sizes shared by every estimator.

Estimators are fed sizes read from annotations and image headers, so bad values are common
(0, negative, NaN, strings, a float like 640.5). Each one is rejected with a message that names the
value, which dimension it was, and (for batches) the element index, so the index builder can report
the sample instead of indexing a wrong token count.
"""

from __future__ import annotations

import math
import numbers

import numpy as np


def as_dim(value: object, what: str) -> int:
    """``value`` as a positive Python int; integral floats (``640.0``) are accepted."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ValueError(f"{what} must be a positive integer, got {value!r} ({type(value).__name__})")
    if isinstance(value, numbers.Integral):
        v = int(value)
    else:
        f = float(value)
        if not math.isfinite(f) or f != math.floor(f):
            raise ValueError(f"{what} must be a positive integer, got {value!r}")
        v = int(f)
    if v <= 0:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return v


# The largest image side taken (2^24 - 1 px): Pillow's formats stop far below it in practice (JPEG 65,535,
# WebP 16,383) and no decoder holds such an image in memory, while the token formulas' int64 products of
# two sides and their factors would overflow past it. A larger side is an error, not a made-up count.
MAX_SIDE = (1 << 24) - 1


def as_side(value: object, what: str) -> int:
    """An image side: :func:`as_dim`, at most :data:`MAX_SIDE`."""
    v = as_dim(value, what)
    if v > MAX_SIDE:
        raise ValueError(f"{what} {v} is larger than any image side ({MAX_SIDE} px at most)")
    return v


def as_dims(values: object, what: str) -> np.ndarray:
    """A 1-D int64 array of positive integers; the first bad element is named by index."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be a 1-D sequence, got shape {arr.shape}")
    if arr.dtype.kind in "iu":
        if arr.dtype.kind == "u" and arr.size and int(arr.max()) >= 2**63:
            raise ValueError(f"{what} has a value too large to be an image side: {int(arr.max())!r}")
        out = arr.astype(np.int64, copy=False)  # no copy for int64 input: we never write into it
        nonpos = out <= 0
        bad = np.flatnonzero(nonpos) if nonpos.any() else np.zeros(0, dtype=np.int64)
    elif arr.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            bad = np.flatnonzero(~np.isfinite(arr) | (arr != np.floor(arr)) | (arr <= 0))
        out = None
    else:
        # bool, object (None / str mixed in), strings: check element by element for a precise message
        for i, v in enumerate(arr.tolist()):
            as_dim(v, f"{what}[{i}]")
        out = np.asarray([int(v) for v in arr.tolist()], dtype=np.int64)
        bad = np.zeros(0, dtype=np.int64)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{what}[{i}] must be a positive integer, got {arr[i].item()!r}")
    if out is None:
        if arr.size and float(np.max(arr)) >= 2.0**53:
            raise ValueError(f"{what} has a value too large to be an image side: {float(np.max(arr))!r}")
        out = arr.astype(np.int64)
    return out


def pair_dims(widths: object, heights: object) -> tuple[np.ndarray, np.ndarray]:
    w = as_dims(widths, "widths")
    h = as_dims(heights, "heights")
    for arr, what in ((w, "widths"), (h, "heights")):
        big = np.flatnonzero(arr > MAX_SIDE)
        if big.size:
            i = int(big[0])
            raise ValueError(f"{what}[{i}] {int(arr[i])} is larger than any image side "
                             f"({MAX_SIDE} px at most)")
    if w.shape != h.shape:
        raise ValueError(f"widths and heights differ in length: {w.shape[0]} vs {h.shape[0]}")
    return w, h


# Elements per slice in :func:`chunked`: 16k int64 arrays (128 kB) keep a formula's temporaries in
# the CPU cache and in malloc's heap; a whole 1M-element batch would page-fault fresh 8 MB arrays
# for every intermediate, which costs about as much as the arithmetic.
CHUNK = 1 << 14


def chunked(fn, w: np.ndarray, h: np.ndarray, chunk: int = CHUNK) -> np.ndarray:
    """``fn(w, h, offset)`` (an int64 array per element) on slices of ``chunk`` elements, joined.

    ``offset`` is the slice's first element index, for error messages that name an element.
    """
    n = w.shape[0]
    if n <= chunk:
        return np.asarray(fn(w, h, 0), dtype=np.int64)
    out = np.empty(n, dtype=np.int64)
    for start in range(0, n, chunk):
        stop = start + chunk
        out[start:stop] = fn(w[start:stop], h[start:stop], start)
    return out


def fixed_frames_of(family: str, video_frames: int, num_frames: int) -> int:
    """``video_frames`` sampled uniformly from a video of ``num_frames``: a ``ValueError`` when the video
    is shorter, which the processor's sampler (transformers' ``BaseVideoProcessor.sample_frames``,
    ``InternVLVideoProcessor.sample_frames``; 4.57 to 5.25) refuses rather than repeat frames."""
    if video_frames > num_frames:
        raise ValueError(f"{family}: video_frames={video_frames} frames cannot be sampled from a video of "
                         f"{num_frames} frame(s): the processor's frame sampler refuses a num_frames above "
                         "the video's frame count")
    return video_frames
