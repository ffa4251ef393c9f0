"""``plan simulate``'s notes (issue 31): whenever the methods' step counts differ, a note says why,
and its numbers are the simulation's own (samples each baseline drops, tokenbal's step count)."""

from __future__ import annotations

import re

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tokenbal.balance.simulate import simulate


@st.composite
def cases(draw):
    ranks = draw(st.integers(1, 8))
    batch = draw(st.integers(ranks, 5 * ranks + 3))
    n = draw(st.integers(ranks, 6 * batch))
    lengths = draw(st.lists(st.integers(1, 5000), min_size=n, max_size=n))
    return np.array(lengths, np.int64), ranks, batch


@settings(max_examples=40, deadline=None)
@given(cases())
# DistributedSampler's 9 steps of 2 against 6 steps of 3 elsewhere, nothing dropped: had no note
@example((np.ones(18, np.int64), 2, 3))
def test_step_count_notes_explain_the_table(case):
    lengths, R, N = case
    n = len(lengths)
    sim = simulate(lengths, R, N, baseline_steps=None)
    steps = {name: len(r) for name, r in sim.ratios.items()}
    ds, kk, tb = steps["DistributedSampler"], steps["per-step KK (equal counts, verl)"], steps["tokenbal"]
    differ = [x for x in sim.notes if x.startswith("step counts differ")]
    per_rank = N // R
    ds_dropped, kk_dropped = n - ds * per_rank * R, n - kk * N
    if ds == kk == tb and not ds_dropped and not kk_dropped:
        assert differ == []
        return
    (note,) = differ
    assert f"tokenbal plans every sample: {tb} step(s)" in note
    m = re.search(r"DistributedSampler drops the last (\d+) of (\d+) samples", note)
    assert (int(m.group(1)), int(m.group(2))) == (ds_dropped, n) if ds_dropped else m is None
    m = re.search(r"per-step LPT/KK drop the last (\d+) ", note)
    assert int(m.group(1)) == kk_dropped if kk_dropped else m is None
    assert any(x.startswith("n/a:") for x in sim.notes) == (ds == 0 or kk == 0)
    assert ("rank per step (a global batch of" in " ".join(sim.notes)) == (N % R != 0)
    # A method without a step prints n/a, never a perfect-looking 1.000.
    for line in sim.table().splitlines():
        if line[34:].split()[-1:] == ["0"]:
            assert line[34:].split()[:3] == ["n/a"] * 3
