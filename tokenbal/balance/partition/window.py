"""Batched level-fill over windows of steps: many independent packing problems at once, each a
window of consecutive training steps × ranks (:func:`fill_windows`, the planner's engine)."""

from __future__ import annotations

import numpy as np

__all__ = ["fill_windows"]

_BIG = np.iinfo(np.int64).max // 4


def fill_windows(costs: np.ndarray, caps: np.ndarray, num_ranks: int, *,
                 capacity: int | None = None, force_nonempty: bool = False, batch: int = 1,
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pack G independent windows at once; window g has ``caps.shape[1]`` steps × ``num_ranks`` bins.

    ``costs`` is (G, M) int64, each row sorted in descending order, every real item >= 1 and
    padding = 0 at the end of the row. ``caps`` is (G, W): the most items step w of window g may
    hold (0: the step does not exist). Returns ``(step, rank, failed)``: (G, M) step-in-window
    and rank of every item (-1 for padding or unplaced items) and a (G,) bool of windows where
    some item fitted nowhere (only possible with ``capacity``).

    Rule, per item, largest first:
      1. *Deficit fill*: if some open step has a bin whose gap to that step's fullest bin is at
         least the item, put it in the largest such gap. This is what lets a step holding one
         huge sample collect the big items it needs on its other ranks, while ordinary steps
         keep a mix of sizes — per-step LPT cannot do that, it only sees one step.
      2. Otherwise LPT: the least loaded bin over all open steps (within ``capacity``).
      3. ``force_nonempty``: once the items left are no more than the empty bins, each item
         goes to an empty bin, so no bin is left empty when the window has enough items.
    Ties go to the lowest step, then the lowest rank, so the result is deterministic. Because
    costs are >= 1, an empty bin is always the least loaded and has the largest gap in its step;
    hence a step whose cap is >= ``num_ranks`` never ends with an empty bin.

    ``batch > 1`` (only without ``capacity`` and ``force_nonempty``): place up to ``batch`` items
    of every window per round, the round's items (largest first) into the ``batch`` best bins by
    the same key taken once per round (deficit judged against the round's largest item), at most
    one item per bin and no more than a step's remaining cap per step. ``batch=1`` is the rule
    above exactly; larger batches trade a little balance for far fewer sequential rounds.
    """
    if batch > 1 and capacity is None and not force_nonempty:
        return _fill_windows_batched(costs, caps, int(num_ranks), int(batch))
    G, M = costs.shape
    W = caps.shape[1]
    R = int(num_ranks)
    # Flat views: step (g, w) is row g*W + w, bin (g, w, r) is g*W*R + w*R + r. 1-D takes and puts
    # cost a fraction of 2-D fancy indexing, and this loop runs once per item of a window.
    loads = np.zeros((G * W, R), np.int64)
    minload = np.zeros((G, W), np.int64)      # least loaded bin of each step (== largest gap)
    minbin = np.zeros(G * W, np.int64)
    smax = np.zeros((G, W), np.int64)         # fullest bin of each step
    scnt = np.zeros((G, W), np.int64)
    caps = caps.astype(np.int64)
    ml_flat, sm_flat, sc_flat = minload.reshape(-1), smax.reshape(-1), scnt.reshape(-1)
    rows = np.arange(G)
    base = rows * W
    step_out = np.full((G, M), -1, np.int64)
    rank_out = np.full((G, M), -1, np.int64)
    failed = np.zeros(G, bool)
    any_failed = False
    if force_nonempty:
        empty_bins = (caps > 0).sum(1) * R
        left = (costs > 0).sum(1)
    big = np.int64(_BIG)
    for j in range(M):
        x = costs[:, j]
        valid = x > 0
        if any_failed:
            valid &= ~failed
        if not valid.any():
            break
        open_ = scnt < caps
        gap = smax - minload
        xcol = x[:, None]
        lpt_key = np.where(open_ if capacity is None else open_ & (minload + xcol <= capacity), minload, big)
        key = np.where(open_ & (gap >= xcol), -gap, lpt_key)
        if force_nonempty:
            forced = left <= empty_bins
            if forced.any():
                key[forced] = np.where(open_[forced] & (minload[forced] == 0), 0, big)
        s = key.argmin(1)
        flat = base + s
        fits = key.reshape(-1)[flat] < big
        place = valid & fits
        newly = valid & ~fits
        if newly.any():
            failed |= newly
            any_failed = True
        r = minbin[flat]
        step_out[:, j] = np.where(place, s, -1)
        rank_out[:, j] = np.where(place, r, -1)
        lf = loads.reshape(-1)
        cell = flat * R + r
        new_load = lf[cell] + np.where(place, x, 0)
        lf[cell] = new_load
        sm_flat[flat] = np.maximum(sm_flat[flat], new_load)
        sc_flat[flat] += place
        if force_nonempty:
            empty_bins -= place & (new_load == x)
            left -= valid
        seg = loads[flat]                                     # (G, R): the chosen steps' bins
        mb = seg.argmin(1)
        minbin[flat] = mb
        ml_flat[flat] = seg[rows, mb]
    return step_out, rank_out, failed


def _fill_windows_batched(costs: np.ndarray, caps: np.ndarray, R: int, P: int
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`fill_windows` placing up to ``P`` items per window per round (see its docstring).

    Within a step both keys grow with the bin's load (deficit key = load - step max, LPT key =
    load), so ranking every bin of a window by one int64 key reproduces the one-at-a-time choice
    for the round's first item and approximates it for the rest.
    """
    G, M = costs.shape
    W = caps.shape[1]
    nb = W * R
    caps = caps.astype(np.int64)
    nitems = (costs > 0).sum(1)
    total = int(costs.sum(1).max(initial=0))
    # Key of an open step's bin in [1, 2 * t + 1] (t = total >> shift); a closed step's bins are
    # pushed past 3 * t + 4. Times nb plus the bin index makes every key unique, so ties go to the
    # lowest step, then the lowest rank, as in the exact loop. Large windows (scaled costs are
    # tokens × items per window) would overflow int64: the key then drops `shift` low bits of the
    # loads, a 2**shift / (items + 1) token resolution, while loads themselves stay exact.
    shift = 0
    while (4 * (total >> shift) + 5) * nb >= 2**62:
        shift += 1
    t = total >> shift
    closed_from = np.int64((3 * t + 4) * nb)
    loads = np.zeros((G, W, R), np.int64)
    lflat = loads.reshape(-1)
    # lkey = (load >> shift) * nb + bin index, kept up to date (only the round's bins change), so
    # a round builds its keys in three passes over the bins: this loop's cost is those passes
    # plus one argpartition per round.
    lkey = np.broadcast_to(np.arange(nb, dtype=np.int64).reshape(W, R), (G, W, R)).copy()
    kflat = lkey.reshape(-1)
    smax = np.zeros((G, W), np.int64)
    scnt = np.zeros((G, W), np.int64)
    step_out = np.full((G, M), -1, np.int64)
    rank_out = np.full((G, M), -1, np.int64)
    rows = np.arange(G)[:, None]
    k = min(P, nb)
    ar = np.arange(k)
    ptr = np.zeros(G, np.int64)
    failed = np.zeros(G, bool)
    while (ptr < nitems).any():
        col = ptr[:, None] + ar
        x = np.where(col < nitems[:, None], costs[rows, np.minimum(col, M - 1)], 0)
        # Deficit-eligible bins (gap to the step max >= the round's largest item, i.e. load <=
        # smax - x0) rank by load - smax, the others by load; closed steps last.
        elig = loads <= (smax - x[:, :1])[:, :, None]
        key2 = lkey + (np.where(scnt < caps, t + 1, 3 * t + 4) * nb)[:, :, None]
        np.subtract(key2, ((smax >> shift) * nb)[:, :, None], out=key2, where=elig)
        key2 = key2.reshape(G, nb)
        part = np.argpartition(key2, k - 1, axis=1)[:, :k] if k < nb else np.broadcast_to(ar, (G, nb))
        sel = np.take_along_axis(part, np.argsort(np.take_along_axis(key2, part, 1), axis=1), 1)
        st = sel // R
        # A step takes no more of the round's items than its remaining cap: occurrence number of
        # each step along the round (stable sort by step, position minus the group's start).
        oo = np.argsort(st, axis=1, kind="stable")
        sst = np.take_along_axis(st, oo, 1)
        start = np.ones(sst.shape, bool)
        start[:, 1:] = sst[:, 1:] != sst[:, :-1]
        first = np.maximum.accumulate(np.where(start, ar, 0), axis=1)
        occ = np.empty_like(sst)
        np.put_along_axis(occ, oo, ar - first, 1)
        ok = (occ < np.take_along_axis(caps - scnt, st, 1)) & (np.take_along_axis(key2, sel, 1) < closed_from)
        # Item i of the round goes to the i-th accepted bin.
        nplace = np.minimum(ok.sum(1), (x > 0).sum(1))
        dest = np.cumsum(ok, axis=1) - 1
        use = ok & (dest < nplace[:, None])
        gi = np.broadcast_to(rows, use.shape)[use]
        bi = sel[use]
        di = dest[use]
        ci = ptr[gi] + di
        xi = x[gi, di]
        si, ri = np.divmod(bi, R)
        cell = gi * nb + bi
        lflat[cell] += xi                     # bins are distinct within a round
        kflat[cell] = (lflat[cell] >> shift) * nb + bi
        step_out[gi, ci] = si
        rank_out[gi, ci] = ri
        np.maximum.at(smax, (gi, si), lflat[cell])
        np.add.at(scnt, (gi, si), 1)
        # A window whose open steps cannot take its next item (caps sum below its items) fails,
        # as in the exact loop; its remaining items stay unplaced (-1).
        stuck = (ptr < nitems) & (nplace == 0)
        failed |= stuck
        nitems[stuck] = ptr[stuck]
        ptr += nplace
    return step_out, rank_out, failed
