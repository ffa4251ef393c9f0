"""``tokenbal plan simulate --plot out.png``: per-step max/mean rank cost of each method, drawn with
Pillow (no plotting library needed). The y axis is logarithmic in (ratio - 1), because tokenbal's
1.003 and count-sharding's 3.0 must both be readable on one chart."""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np

COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189)]
_FLOOR = 1e-4  # ratios closer to 1 than this are drawn on the floor line


def _y(ratio: np.ndarray, top: float) -> np.ndarray:
    """Fraction of the plot height (0 = bottom) for each ratio, log-scaled in ratio - 1."""
    lo, hi = np.log10(_FLOOR), np.log10(max(top - 1.0, _FLOOR * 10))
    return (np.log10(np.maximum(np.asarray(ratio, np.float64) - 1.0, _FLOOR)) - lo) / (hi - lo)


def plot_step_ratios(ratios: Mapping[str, np.ndarray], out: str | os.PathLike, title: str = "",
                     width: int = 960, height: int = 420) -> None:
    """Write a PNG with one line per method: per-step max/mean rank cost (1.000 = perfect)."""
    from PIL import Image, ImageDraw

    if not ratios:
        raise ValueError("nothing to plot: no methods given")
    left, right, top_pad, bottom = 70, 280, 30, 40
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    pw, ph = width - left - right, height - top_pad - bottom
    top = max(float(np.max(r)) for r in ratios.values() if len(r))
    steps = max(len(r) for r in ratios.values())
    draw.rectangle([left, top_pad, left + pw, top_pad + ph], outline=(120, 120, 120))
    for tick in (1.0001, 1.001, 1.01, 1.1, 2.0, 5.0, 10.0):
        if tick - 1.0 > max(top - 1.0, _FLOOR * 10):
            break
        y = top_pad + ph * (1 - float(_y(np.array([tick]), top)[0]))
        draw.line([left, y, left + pw, y], fill=(225, 225, 225))
        draw.text((5, y - 6), f"{tick:g}", fill="black")
    for k, (name, r) in enumerate(ratios.items()):
        r = np.asarray(r, np.float64)
        if not len(r):
            continue
        xs = left + pw * np.arange(len(r)) / max(steps - 1, 1)
        ys = top_pad + ph * (1 - _y(r, top))
        color = COLORS[k % len(COLORS)]
        draw.line(list(zip(xs.tolist(), ys.tolist(), strict=True)), fill=color, width=1)
        legend_y = top_pad + 18 * k
        draw.rectangle([left + pw + 12, legend_y + 4, left + pw + 22, legend_y + 14], fill=color)
        draw.text((left + pw + 28, legend_y + 2), f"{name} (mean {r.mean():.3f})", fill="black")
    draw.text((left, 8), title or "per-step max / mean rank cost", fill="black")
    draw.text((left + pw // 2 - 20, top_pad + ph + 12), f"step (0..{steps - 1})", fill="black")
    img.save(out)
