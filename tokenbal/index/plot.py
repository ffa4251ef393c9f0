"""``tokenbal index stats DIR --plot out.png``: a histogram of tokens per sample by modality, drawn
with Pillow (no plotting library needed).

Bins are powers of two (``[1, 2)``, ``[2, 4)``, … up to the largest count), because token counts
span four orders of magnitude (a 60-token caption next to a 16,000-token document scan); samples
with 0 tokens of a modality (text-only samples have 0 vision tokens) get their own first bin.
Vision bars are blue, text bars orange, side by side in each bin; the y axis is linear.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

VISION_RGB = (31, 119, 180)
TEXT_RGB = (255, 127, 14)


@dataclass
class TokenHistogram:
    labels: list[str]          # one per bin: "0", "1", "2-3", "4-7", ...
    vision: np.ndarray         # samples per bin
    text: np.ndarray


def token_histogram(vision_tokens: np.ndarray, text_tokens: np.ndarray) -> TokenHistogram:
    """Samples per power-of-two bin of vision and of text tokens (bin 0 holds the zeros)."""
    v, t = np.asarray(vision_tokens, np.int64), np.asarray(text_tokens, np.int64)
    top = int(max(v.max(initial=0), t.max(initial=0)))
    n_bins = 1 + max(1, top.bit_length())            # 0, then [2^k, 2^(k+1)) for k < bit_length

    def counts(a: np.ndarray) -> np.ndarray:
        # Bin of x: 0 for x == 0, else x's bit length (frexp's exponent is exact for integers < 2^53).
        bins = np.zeros(len(a), np.int64)
        nz = a > 0
        bins[nz] = np.frexp(a[nz].astype(np.float64))[1]
        return np.bincount(bins, minlength=n_bins)[:n_bins]

    labels = ["0"] + [str(1 << k) if k == 0 else f"{1 << k}-{(1 << (k + 1)) - 1}" for k in range(n_bins - 1)]
    return TokenHistogram(labels=labels, vision=counts(v), text=counts(t))


def plot_token_histogram(vision_tokens: np.ndarray, text_tokens: np.ndarray, out: str | os.PathLike,
                         title: str = "tokens per sample", width: int = 960,
                         height: int = 540) -> TokenHistogram:
    """Draw the histogram as a PNG at ``out``; returns the counts drawn."""
    from PIL import Image, ImageDraw

    hist = token_histogram(vision_tokens, text_tokens)
    im = Image.new("RGB", (width, height), "white")
    d = ImageDraw.Draw(im)
    left, right, top, bottom = 70, 20, 40, 90
    plot_w, plot_h = width - left - right, height - top - bottom
    peak = int(max(hist.vision.max(initial=0), hist.text.max(initial=0), 1))
    d.text((left, 10), f"{title} (n={len(np.asarray(vision_tokens)):,}): vision (blue) / text (orange)",
           fill="black")
    d.line([(left, top), (left, top + plot_h), (left + plot_w, top + plot_h)], fill="black")
    for frac in (0.0, 0.5, 1.0):
        y = top + plot_h - round(frac * plot_h)
        d.text((5, y - 6), f"{round(frac * peak):,}", fill="black")
        d.line([(left - 4, y), (left, y)], fill="black")
    n = len(hist.labels)
    slot = plot_w / n
    bar = max(1, int(slot * 0.4))
    for i, label in enumerate(hist.labels):
        x0 = left + int(i * slot) + max(1, int(slot * 0.1))
        for j, (count, rgb) in enumerate(((hist.vision[i], VISION_RGB), (hist.text[i], TEXT_RGB))):
            h = round(int(count) / peak * plot_h)
            if h:
                d.rectangle([x0 + j * bar, top + plot_h - h, x0 + (j + 1) * bar - 1, top + plot_h - 1],
                            fill=rgb)
        # Every bin labelled, on two alternating rows so that neighbouring labels do not overlap.
        d.text((x0, top + plot_h + 6 + 14 * (i % 2)), label, fill="black")
    d.text((left, height - 30), "tokens per sample (power-of-two bins)", fill="black")
    im.save(os.fspath(out), format="PNG")
    return hist
