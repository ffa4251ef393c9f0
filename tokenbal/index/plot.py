"""``tokenbal index stats DIR --plot out.png``: a histogram of tokens per sample by modality, drawn
with matplotlib (the ``plot`` extra).

Bins are powers of two (``[1, 2)``, ``[2, 4)``, … up to the largest count), because token counts
span four orders of magnitude (a 60-token caption next to a 16,000-token document scan); samples
with 0 tokens of a modality (text-only samples have 0 vision tokens) get their own first bin.
Vision bars are blue, text bars orange, side by side in each bin (a legend says which); the y axis
is samples, linear.
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
    """Draw the histogram as a PNG at ``out`` (matplotlib, the ``plot`` extra); returns the counts."""
    from tokenbal.plot import pyplot, rgb, save

    hist = token_histogram(vision_tokens, text_tokens)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(width / 100, height / 100), dpi=100, layout="constrained")
    x = np.arange(len(hist.labels))
    ax.bar(x - 0.2, hist.vision, width=0.4, color=rgb(VISION_RGB), label="vision tokens")
    ax.bar(x + 0.2, hist.text, width=0.4, color=rgb(TEXT_RGB), label="text tokens")
    ax.set_xticks(x, hist.labels, rotation=45, ha="right")
    ax.set_xlabel("tokens per sample (power-of-two bins)")
    ax.set_ylabel("samples")
    ax.set_title(f"{title} (n={len(np.asarray(vision_tokens)):,})")
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.grid(True, axis="y", color="0.9")
    ax.set_axisbelow(True)
    ax.legend(loc="best")
    save(fig, out)
    return hist
