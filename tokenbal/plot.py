"""Plots, drawn with matplotlib (the optional ``plot`` extra: ``pip install 'tokenbal[plot]'``).

:func:`pyplot` is the one place matplotlib is imported (lazily, with the file-only Agg backend, so
importing tokenbal never needs it); without it every plot raises :class:`PlotExtraMissing`, a one-line
error naming the extra. Here too: ``tokenbal plan simulate --plot out.png``, per-step max/mean rank
cost of each method. Its y axis is logarithmic in (ratio - 1), because tokenbal's 1.003 and
count-sharding's 3.0 must both be readable on one chart; the other plots are
``tokenbal.index.plot`` (tokens per sample), ``tokenbal.profile.report.write_timeline`` and
``scripts/train_fsdp2.py``'s timeline (seconds on the x axis).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from tokenbal._extras import MissingExtraError

# matplotlib's default cycle (tab10), so a chart's colours read the same as any matplotlib chart.
COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189)]
_FLOOR = 1e-4  # ratios closer to 1 than this are drawn on the floor line


class PlotExtraMissing(MissingExtraError, ValueError):
    """matplotlib is not installed: a missing extra like any other (the CLI's one line, exit 1, as the
    README's exit statuses say). Also a ``ValueError``, as it was before it was a missing extra."""


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (files only, no display needed)."""
    try:
        import matplotlib
    except ImportError:
        raise PlotExtraMissing("plots need matplotlib: pip install 'tokenbal[plot]'") from None
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def rgb(color: tuple[int, int, int]) -> tuple[float, float, float]:
    """An 8-bit RGB triple as matplotlib's 0..1 floats."""
    return (color[0] / 255, color[1] / 255, color[2] / 255)


def save(fig: Any, out: str | os.PathLike) -> None:
    """Write ``fig`` as a PNG at its own size (no tight cropping, so the pixel size is the figure's)."""
    fig.savefig(os.fspath(out), format="png")
    pyplot().close(fig)


def finish_timeline(ax: Any, row_labels: list[str], xlabel: str, title: str) -> None:
    """The shared frame of the per-rank timelines (one horizontal row per rank, bars along time):
    row labels top to bottom, the time axis, one legend entry per bar kind beside the plot."""
    ax.set_yticks(range(len(row_labels)), row_labels)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.grid(True, axis="x", color="0.9")
    ax.set_axisbelow(True)


def plot_step_ratios(ratios: Mapping[str, np.ndarray], out: str | os.PathLike, title: str = "",
                     width: int = 960, height: int = 420) -> Any:
    """Write a PNG with one line per method: per-step max/mean rank cost (1.000 = perfect); returns
    the (closed) matplotlib Figure."""
    if not ratios:
        raise ValueError("nothing to plot: no methods given")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(width / 100, height / 100), dpi=100, layout="constrained")
    for k, (name, r) in enumerate(ratios.items()):
        r = np.asarray(r, np.float64)
        if not len(r):
            continue
        ax.plot(np.arange(len(r)), np.maximum(r - 1.0, _FLOOR), color=rgb(COLORS[k % len(COLORS)]),
                linewidth=1.5, label=f"{name} (mean {r.mean():.3f})")
    ax.set_yscale("log")
    # Ticks labelled as the ratio itself (1.001, 1.1, 2), though the scale is of ratio - 1.
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda y, _: f"{1 + y:g}"))
    ax.set_ylim(bottom=_FLOOR * 0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("max / mean rank cost (log scale of ratio - 1)")
    ax.set_title(title or "per-step max / mean rank cost")
    ax.grid(True, which="major", color="0.9")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    save(fig, out)
    return fig
