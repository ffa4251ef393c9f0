"""The plots (matplotlib, the ``plot`` extra): labelled axes with units, ticks, a legend naming every
series; and without matplotlib a one-line error naming the extra (exit 1), not a traceback."""

from __future__ import annotations

import sys

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from PIL import Image  # noqa: E402

from tokenbal.plot import COLORS, PlotExtraMissing, plot_step_ratios  # noqa: E402


def _colors(png) -> set:
    with Image.open(png) as im:
        return {c for _, c in im.convert("RGB").getcolors(1 << 22)}


def test_step_ratio_chart_has_axes_ticks_and_a_legend(tmp_path):
    ratios = {"DistributedSampler": np.array([2.5, 3.0, 1.8]), "tokenbal": np.array([1.002, 1.001, 1.0])}
    fig = plot_step_ratios(ratios, tmp_path / "r.png", title="8 ranks")
    ax = fig.axes[0]
    assert ax.get_xlabel() == "step" and "max / mean rank cost" in ax.get_ylabel()
    assert ax.get_yscale() == "log" and ax.get_title() == "8 ranks"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["DistributedSampler (mean 2.433)",
                                                                 "tokenbal (mean 1.001)"]
    with Image.open(tmp_path / "r.png") as im:
        assert im.format == "PNG" and im.size == (960, 420)
    assert set(COLORS[:2]) <= _colors(tmp_path / "r.png")


def test_profile_timeline_is_in_seconds(tmp_path):
    from tokenbal.profile import write_timeline
    from tokenbal.profile.analysis import RankStep, RunProfile

    steps = [RankStep(rank=r, step=s, step_s=1.0, compute_s=0.6 + 0.2 * r, comm_s=0.3, exposed_comm_s=0.2,
                      idle_s=0.0) for r in range(2) for s in range(3)]
    prof = RunProfile(source="traces/run", ranks=[0, 1], steps=steps, collectives=[], device=False,
                      has_python_stacks=False)
    fig = write_timeline([prof], str(tmp_path / "t.png"))
    ax = fig.axes[0]
    assert ax.get_xlabel().endswith("(s)") and ax.get_xlim()[1] >= 3.0
    assert [t.get_text() for t in ax.get_yticklabels()] == ["traces/run rank 0", "traces/run rank 1"]
    assert {t.get_text() for t in ax.get_legend().get_texts()} >= {"compute", "exposed communication / wait"}
    assert _colors(tmp_path / "t.png")


def test_without_matplotlib_the_cli_names_the_extra(monkeypatch, tmp_path, capsys):
    from tests.helpers.corpus import make_corpus
    from tokenbal.cli import main
    from tokenbal.index import build_index

    corpus = make_corpus(tmp_path / "c", n_shards=1, samples_per_shard=3, bad=False)
    out = build_index(corpus.shards, tmp_path / "idx", progress=False).out
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # import matplotlib -> ImportError
    with pytest.raises(PlotExtraMissing, match=r"pip install 'tokenbal\[plot\]'"):
        plot_step_ratios({"a": np.ones(2)}, tmp_path / "x.png")
    # A missing extra is exit 1, as pyarrow's or PyAV's is (it was 2, a usage error)
    assert main(["index", "stats", str(out), "--plot", str(tmp_path / "h.png")]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "tokenbal index stats: error: plots need matplotlib: pip install 'tokenbal[plot]'"
