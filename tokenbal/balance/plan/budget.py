"""Token-budget mode (``max_tokens_per_rank``): the epoch packed into budget-sized rank-steps by
first-fit decreasing over chunks of the permutation, the partial bins packed again, the bins dealt to
steps (``_budget_fill``); oversize samples alone in extra steps (``_insert_alone_steps``)."""

from __future__ import annotations

from bisect import bisect_left, insort

import numpy as np

# Token mode: bins a chunk's first-fit leaves below this fill are packed again, _REPACK_FAN chunks'
# worth together, then _REPACK_FAN of those groups, ... (see _budget_fill).
_REPACK_BELOW = 0.99
_REPACK_FAN = 8
# Token mode: items up to budget / _SMALL_ITEM are packed after the others, in random order.
_SMALL_ITEM = 32


def _token_windows(lens_perm: np.ndarray, window_tokens: int) -> np.ndarray:
    """Window id per item (in permutation order): a new window every ``window_tokens`` tokens."""
    if lens_perm.size == 0:
        return np.zeros(0, np.int64)
    start_tok = np.cumsum(lens_perm) - lens_perm
    win = start_tok // window_tokens
    # A short last window would plan a thin last step: fold it into the one before.
    last = int(win[-1])
    if last > 0 and int(lens_perm[win == last].sum()) * 2 < window_tokens:
        win[win == last] = last - 1
    return win.astype(np.int64)


def _budget_fill(lens: np.ndarray, perm: np.ndarray, R: int, B: int, W: int,
                 rng: np.random.Generator | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token-budget mode: pack the epoch into as few rank-steps of ``B`` tokens as first-fit
    decreasing finds, then deal the bins out to steps. Returns (steps, step, rank) per item of
    ``perm`` for one window holding the whole epoch (the caller shuffles its steps and ranks).

    1. *Chunks*: ``perm`` (random) is cut into chunks of ``W`` steps' worth of tokens and each
       chunk is packed on its own (:func:`_pack_chunk`: first-fit decreasing, equal sizes in
       ``perm`` order, then the small samples best-fit in ``perm`` order). Which samples may share
       a bin is thus redrawn every epoch; one sorted epoch would pack the same samples together
       every time.
    2. *Repack*: the bins left under 99 % full (a chunk's last ones) are emptied and packed again,
       ``_REPACK_FAN`` chunks together, then ``_REPACK_FAN`` of those groups, ... up to one group,
       so chunking costs next to no bins.
    3. *Steps*: S = ceil(bins / R). The R·S − bins spare rank-steps go into one *light step* with
       the R lightest-but-spare bins: their samples are re-spread over all R ranks (LPT under the
       budget), so that step is short instead of leaving ranks empty; if its samples are fewer than
       R, the smallest samples of multi-sample bins elsewhere fill its empty ranks. The other bins
       go to the other steps in random order (``rng``; in bin order without it).
    """
    n = len(perm)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    x = lens[perm]
    # (A window over the whole epoch is one chunk: capped there, W·R·B may pass int64.)
    chunk = _token_windows(x, max(1, min(W * R * B, int(x.sum()) + 1)))
    pos = np.arange(n)
    bins, nb, group = _pack_groups(x, chunk, pos, B)
    load = _bin_sums(bins, x, nb)
    while True:
        partial = load < _REPACK_BELOW * B
        if partial.sum() < 2:
            break
        # Each level pools the partial bins of _REPACK_FAN groups of the level below.
        top = group[partial] // _REPACK_FAN
        again = partial[bins]
        keep = np.cumsum(~partial) - 1
        nk = int((~partial).sum())
        sel = np.flatnonzero(again)
        b, m, g = _pack_groups(x[sel], group[bins[sel]] // _REPACK_FAN, pos[sel], B)
        bins = keep[bins]
        bins[sel] = b + nk
        group = np.concatenate([group[~partial] // _REPACK_FAN, g])
        nb = nk + m
        load = _bin_sums(bins, x, nb)
        if top.min() == top.max():
            break
    S = max(1, -(-nb // R))
    light_n = nb - (S - 1) * R                      # bins of the light step, 1..R
    by_load = np.lexsort((np.arange(nb), load))
    light = np.zeros(nb, bool)
    light[by_load[:light_n]] = True
    full = np.flatnonzero(~light)
    if rng is not None:
        full = full[rng.permutation(len(full))]
    slot_of_bin = np.empty(nb, np.int64)
    slot_of_bin[full] = np.arange(len(full))
    slot = slot_of_bin[bins]
    in_light = light[bins]
    li = np.flatnonzero(in_light)
    light_slot = _spread(x[li], R, B, bins[li])
    slot[li] = (S - 1) * R + light_slot
    slot = _fill_light_step(slot, x, S, R)
    return np.array([S], np.int64), slot // R, slot % R


def _pack_groups(x: np.ndarray, group: np.ndarray, pos: np.ndarray, B: int
                 ) -> tuple[np.ndarray, int, np.ndarray]:
    """First-fit decreasing inside every group of items (``group`` non-decreasing); returns (bin
    per item, number of bins, group per bin)."""
    order = np.argsort(group, kind="stable")
    g = group[order]
    bins = np.empty(len(x), np.int64)
    bin_group = []
    nb = 0
    bounds = np.flatnonzero(np.diff(g)) + 1
    for lo, hi in zip(np.r_[0, bounds].tolist(), np.r_[bounds, len(g)].tolist(), strict=True):
        idx = order[lo:hi]
        b, m = _pack_chunk(x[idx], pos[idx], B)
        bins[idx] = b + nb
        bin_group.append(np.full(m, g[lo], np.int64))
        nb += m
    return bins, nb, np.concatenate(bin_group) if bin_group else np.zeros(0, np.int64)


def _pack_chunk(x: np.ndarray, pos: np.ndarray, B: int) -> tuple[np.ndarray, int]:
    """Bins for one chunk: first-fit decreasing for the items above ``B / _SMALL_ITEM``, then the
    small ones best-fit (into the fullest bin they fit) in ``pos`` order, i.e. at random.

    FFD alone ends every chunk with bins of its smallest items in size order, and those bins float
    up the repack levels together, so the same tiny samples would share a step every epoch. Small
    items fill the gaps about as tightly in any order; taken at random they land next to random
    neighbours."""
    from tokenbal.balance.partition import first_fit_decreasing

    small = x <= B // _SMALL_ITEM
    bins = np.empty(len(x), np.int64)
    big = np.flatnonzero(~small)
    b, nb = first_fit_decreasing(x[big], B, tiebreak=pos[big])
    bins[big] = b
    tiny = np.flatnonzero(small)
    if not tiny.size:
        return bins, nb
    tiny = tiny[np.argsort(pos[tiny], kind="stable")]
    M = len(x) + 1
    # key = room * M + bin: the first key >= size * M is the fullest bin with room (lowest id on ties).
    # Python ints: with costs near 2^62 (raw FLOPs) room * M passes int64.
    room = (B - _bin_sums(b, x[big], nb)).tolist()
    keys = sorted(r * M + q for q, r in enumerate(room))
    out = []
    for v in x[tiny].tolist():
        j = bisect_left(keys, v * M)
        if j < len(keys):
            k = keys.pop(j)
            r, q = divmod(k, M)
        else:
            r, q = B, nb
            nb += 1
        out.append(q)
        insort(keys, (r - v) * M + q)
    bins[tiny] = out
    return bins, nb


def _bin_sums(bins: np.ndarray, x: np.ndarray, nb: int) -> np.ndarray:
    """Exact int64 sum of ``x`` per bin (``np.bincount``'s float64 weights lose units above 2^53, and the
    budget is a hard limit)."""
    out = np.zeros(nb, np.int64)
    np.add.at(out, bins, x)
    return out


def _spread(x: np.ndarray, R: int, B: int, bins: np.ndarray) -> np.ndarray:
    """Rank (0..R-1) for each of the light step's samples: LPT over R ranks within the budget, or
    the bins they came in (renumbered) when LPT cannot keep the budget."""
    from tokenbal.balance.partition import partition

    try:
        ranks = partition(x, R, "lpt", capacity=B)
    except ValueError:
        ranks = None
    # The solvers sum in float64; above 2^53 that may hide a unit over the budget: checked exactly.
    if ranks is None or int(_bin_sums(ranks, x, R).max(initial=0)) > B:
        return np.unique(bins, return_inverse=True)[1].astype(np.int64)
    return ranks


def _fill_light_step(slot: np.ndarray, x: np.ndarray, S: int, R: int) -> np.ndarray:
    """Give each empty rank of the last (light) step the smallest sample of a bin that has more
    than one, never emptying a bin: only samples too few for S·R rank-steps leave a rank empty."""
    counts = np.bincount(slot, minlength=S * R)
    empty = np.flatnonzero(counts[(S - 1) * R:] == 0) + (S - 1) * R
    if not empty.size:
        return slot
    cand = np.flatnonzero(counts[slot] > 1)
    cand = cand[np.lexsort((cand, x[cand]))].tolist()
    spare = {}
    slot = slot.copy()
    it = iter(empty.tolist())
    target = next(it, None)
    for i in cand:
        if target is None:
            break
        s = int(slot[i])
        left = spare.setdefault(s, int(counts[s]) - 1)
        if left == 0:
            continue
        spare[s] = left - 1
        slot[i] = target
        target = next(it, None)
    return slot


def _insert_alone_steps(slot: np.ndarray, perm: np.ndarray, S: int, R: int, big: np.ndarray,
                        rng: np.random.Generator, shuffle: bool) -> tuple[np.ndarray, np.ndarray, int]:
    """Extra steps holding the oversize samples, one per (virtual) rank, mixed into the epoch."""
    E = -(-len(big) // R)
    pos = np.sort(rng.choice(S + E, E, replace=False)) if shuffle else np.arange(S, S + E)
    is_extra = np.zeros(S + E, bool)
    is_extra[pos] = True
    new_of_old = np.flatnonzero(~is_extra)          # old step s -> new step
    old_step, r = np.divmod(slot, R)
    j = np.arange(len(big))
    slot = np.concatenate([new_of_old[old_step] * R + r, pos[j // R] * R + j % R])
    return slot, np.concatenate([perm, big]), S + E
