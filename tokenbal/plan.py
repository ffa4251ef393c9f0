"""Plan one epoch: which samples every rank reads at every step.

:func:`plan_epoch` is a pure function of ``(lengths, num_replicas, settings, seed, epoch)``: every
rank calls it with the same arguments and gets the same :class:`EpochPlan` without talking to
the others. The sampler (:mod:`tokenbal.sampler`) only slices it.

How a plan is made
------------------
1. Permute the samples with ``np.random.default_rng([seed, epoch])`` (identity if not shuffling).
2. Cut the permutation into steps — ``global_batch_size`` samples each, or in
   ``max_tokens_per_rank`` mode as many steps as the tokens need — and group consecutive steps
   into *windows* of ``window`` steps.
3. Inside each window, decide which samples share a step and which rank gets each one with
   :func:`tokenbal.partition.fill_windows` (largest first; fill the gaps of steps that hold a big
   sample with the next big ones, otherwise least-loaded rank). Balancing a whole window is what
   makes heavy-tailed data balance: a step holding a 16k-token video gets enough other big
   samples to keep its other ranks busy, which per-step balancing cannot arrange.
4. Shuffle the order of the steps inside each window (the fill works largest-first, and
   without this the window would be a length curriculum) and which rank gets which bin.

Guarantees (tested in tests/test_plan.py)
-----------------------------------------
* Every rank has the same number of steps (``plan.num_steps``).
* ``drop_last=False``: every sample appears exactly once. ``global_batch_size`` mode: every step
  has exactly N samples except the last; if the last would have fewer than ``num_replicas``
  samples it is merged into the one before (which then has N + t < N + R samples).
* ``drop_last=True`` (``global_batch_size`` mode): the last ``n % N`` samples of this epoch's
  permutation are left out (``plan.dropped``) and every step has exactly N samples. In
  ``max_tokens_per_rank`` mode there is no partial step to drop and ``drop_last`` has no effect.
* ``global_batch_size`` mode: if ``n >= num_replicas`` samples are planned, every rank gets at
  least one sample in every step (each step has >= R samples, and the fill never gives a rank a
  second sample while another rank of the same step has none). With ``n < R`` (and
  ``drop_last=False``) there is one step, and ``R - n`` ranks get an empty list in it; the step
  count is still the same everywhere. ``drop_last=True`` with ``n < N`` plans zero steps.
* ``max_tokens_per_rank``: no rank-step ever exceeds the budget. A rank-step is empty only when
  the budget forces it: the window's samples are too few for its ``steps × R`` rank slots (e.g.
  samples close to the budget size, or fewer samples than ranks). ``plan.num_empty`` counts them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from tokenbal.partition import fill_windows

__all__ = ["EpochPlan", "plan_epoch", "default_window", "step_balance", "check_lengths", "check_settings",
           "PLAN_VERSION"]

# Bump when the same inputs would give a different plan (the sampler's resume fingerprint uses it).
PLAN_VERSION = 1
_TOKEN_FILL = 0.97   # token mode: fraction of the budget a window aims to use


@dataclass(frozen=True)
class EpochPlan:
    """Steps × ranks lists of dataset indices, stored flat.

    Slot ``s * num_replicas + r`` (step s, rank r) is ``indices[offsets[slot]:offsets[slot + 1]]``,
    in ascending dataset index order.
    """

    num_replicas: int
    indices: np.ndarray                 # int64, every planned sample once
    offsets: np.ndarray                 # int64, num_steps * num_replicas + 1
    dropped: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # drop_last tail

    @property
    def num_steps(self) -> int:
        return (len(self.offsets) - 1) // self.num_replicas

    @property
    def num_samples(self) -> int:
        return len(self.indices)

    def slot(self, step: int, rank: int) -> np.ndarray:
        i = step * self.num_replicas + rank
        return self.indices[self.offsets[i]:self.offsets[i + 1]]

    def rank_steps(self, rank: int, start: int = 0) -> list[list[int]]:
        """Rank ``rank``'s dataset indices for steps ``start, start + 1, ...``."""
        if not 0 <= rank < self.num_replicas:
            raise ValueError(f"rank must be in [0, {self.num_replicas}), got {rank}")
        return [self.slot(s, rank).tolist() for s in range(start, self.num_steps)]

    def counts(self) -> np.ndarray:
        """(num_steps, num_replicas) number of samples per rank-step."""
        return np.diff(self.offsets).reshape(self.num_steps, self.num_replicas)

    @property
    def num_empty(self) -> int:
        return int((self.counts() == 0).sum())

    def step_rank_tokens(self, lengths: np.ndarray) -> np.ndarray:
        """(num_steps, num_replicas) int64 tokens per rank-step for the given per-sample lengths."""
        lens = np.asarray(getattr(lengths, "lengths", lengths), np.int64)
        csum = np.concatenate([[0], np.cumsum(lens[self.indices])])
        return (csum[self.offsets[1:]] - csum[self.offsets[:-1]]).reshape(
            self.num_steps, self.num_replicas)


def step_balance(step_rank_tokens: np.ndarray) -> np.ndarray:
    """Per-step max/mean of rank tokens (1.0 = perfect). Steps with no tokens count as 1.0."""
    t = np.asarray(step_rank_tokens, np.float64)
    mean = t.mean(1)
    return np.divide(t.max(1), mean, out=np.ones(len(t)), where=mean > 0)


def default_window(num_replicas: int, global_batch_size: int | None = None, *,
                   max_tokens_per_rank: int | None = None, mean_length: float = 1.0) -> int:
    """Steps per balancing window when the caller does not choose.

    ``global_batch_size`` mode: at least 16 steps, and enough for ~64 samples per rank in a
    window — with few samples per rank per step (N close to R) the fill needs more steps to pair
    big samples with small ones. Capped at 256 steps (planning time grows with window × ranks).

    ``max_tokens_per_rank`` mode: balance is easy (a step may hold any number of samples); the
    window only sets how finely the step count can follow the tokens (one step in ``window``),
    so use up to 16 steps but keep a window near 4096 samples, since the fill visits a
    window's samples one at a time.
    """
    R = int(num_replicas)
    if max_tokens_per_rank is not None:
        per_step = R * max_tokens_per_rank / max(mean_length, 1.0)
        return int(min(16, max(1, round(4096 / per_step))))
    if global_batch_size is None:
        raise ValueError("give global_batch_size or max_tokens_per_rank")
    return int(min(256, max(16, math.ceil(64 * R / global_batch_size))))


def plan_epoch(lengths: np.ndarray, num_replicas: int, *, global_batch_size: int | None = None,
               max_tokens_per_rank: int | None = None, seed: int = 0, epoch: int = 0,
               shuffle: bool = True, drop_last: bool = False, window: int | None = None) -> EpochPlan:
    """Plan one epoch for ``num_replicas`` ranks. See the module docstring for the guarantees.

    ``lengths``: per-sample non-negative integer costs (tokens), or an object with ``.lengths``.
    Exactly one of ``global_batch_size`` (samples per step, all ranks together, >= num_replicas)
    and ``max_tokens_per_rank`` (token budget per rank per step) must be given. ``window``: steps
    balanced together (default :func:`default_window`); 1 means per-step balancing only.
    """
    lens = check_lengths(lengths)
    R, N, B, window = check_settings(lens, num_replicas, global_batch_size, max_tokens_per_rank, window)
    rng = np.random.default_rng([_nonneg_int("seed", seed), _nonneg_int("epoch", epoch)])
    n = len(lens)
    perm = rng.permutation(n) if shuffle else np.arange(n, dtype=np.int64)

    if N is not None:
        caps, kept = _count_steps(n, N, R, drop_last)
        dropped = np.sort(perm[kept:])
        perm = perm[:kept]
        W = min(window or default_window(R, N), max(1, len(caps)))
        step_win = np.arange(len(caps)) // W
        G = int(step_win[-1]) + 1 if len(caps) else 0
        cap2d = np.zeros((G, W), np.int64)
        cap2d[step_win, np.arange(len(caps)) % W] = caps
        win_of_item = np.repeat(step_win, caps)
        steps_in_win, step_w, rank_w, _ = _fill(lens, perm, win_of_item, cap2d, R, None, False)
    else:
        assert B is not None
        caps = None
        dropped = np.zeros(0, np.int64)
        W = window or default_window(R, max_tokens_per_rank=B,
                                     mean_length=float(lens.mean()) if n else 1.0)
        # Windows hold ~97% of W full steps, so W steps usually suffice (else W + 1, retried).
        win_of_item = _token_windows(lens[perm], max(1, int(W * R * B * _TOKEN_FILL)))
        steps_in_win, step_w, rank_w = _token_fill(lens, perm, win_of_item, R, B)

    # Step order inside a window: random when shuffling (the fill puts big seeds in the first
    # steps), else by the smallest dataset index in the step so an unshuffled run reads forward.
    G, Wmax = len(steps_in_win), (int(steps_in_win.max()) if len(steps_in_win) else 0)
    exists = np.arange(Wmax)[None, :] < steps_in_win[:, None]
    if shuffle:
        key = rng.random((G, Wmax))
    else:
        key = np.full((G, Wmax), np.inf)
        np.minimum.at(key, (win_of_item, step_w), perm.astype(np.float64))
    key[~exists] = np.inf
    if caps is not None and len(caps) and caps[-1] != N:
        # The one step whose size differs from N (the tail) stays the last step of the epoch.
        key[-1, (len(caps) - 1) % Wmax] = np.finfo(np.float64).max
    order = np.argsort(key, axis=1, kind="stable")
    new_pos = np.empty_like(order)
    np.put_along_axis(new_pos, order, np.arange(Wmax)[None, :].repeat(G, 0), axis=1)
    win_start = np.concatenate([[0], np.cumsum(steps_in_win)])
    step = win_start[win_of_item] + new_pos[win_of_item, step_w]
    S = int(win_start[-1])
    rank = rank_w
    if shuffle:
        # Which rank gets which bin: the fill gives bin 0 the biggest seed of every step; a
        # random mapping keeps that from always landing on rank 0.
        rank_map = np.argsort(rng.random((S, R)), axis=1)
        rank = rank_map[step, rank_w]

    slot = step * R + rank
    order = _argsort_keys(slot, perm)
    offsets = np.zeros(S * R + 1, np.int64)
    np.cumsum(np.bincount(slot, minlength=S * R), out=offsets[1:])
    return EpochPlan(num_replicas=R, indices=perm[order].astype(np.int64), offsets=offsets,
                     dropped=dropped.astype(np.int64))


def check_settings(lengths: np.ndarray, num_replicas: object, global_batch_size: object,
                   max_tokens_per_rank: object, window: object = None
                   ) -> tuple[int, int | None, int | None, int | None]:
    """Validate planning settings against (checked) lengths without planning.

    Returns ``(num_replicas, global_batch_size, max_tokens_per_rank, window)`` as ints/None.
    Raises ``ValueError`` for N < R, a sample over the token budget (listing them), etc.
    """
    R = _positive_int("num_replicas", num_replicas)
    if (global_batch_size is None) == (max_tokens_per_rank is None):
        raise ValueError("give exactly one of global_batch_size and max_tokens_per_rank")
    W = None if window is None else _positive_int("window", window)
    if global_batch_size is not None:
        N = _positive_int("global_batch_size", global_batch_size)
        if N < R:
            raise ValueError(
                f"global_batch_size={N} is smaller than num_replicas={R}: every step would leave "
                f"{R - N} ranks without a sample. Use global_batch_size >= num_replicas (or "
                f"max_tokens_per_rank).")
        return R, N, None, W
    B = _positive_int("max_tokens_per_rank", max_tokens_per_rank)
    over = np.flatnonzero(lengths > B)
    if over.size:
        shown = ", ".join(f"{i} ({lengths[i]} tokens)" for i in over[:10].tolist())
        more = f" and {over.size - 10} more" if over.size > 10 else ""
        raise ValueError(f"{over.size} sample(s) exceed max_tokens_per_rank={B} on their own: "
                         f"{shown}{more}. Raise the budget or filter these samples out.")
    return R, None, B, W


def check_lengths(lengths: object) -> np.ndarray:
    """Validate per-sample lengths (array or object with ``.lengths``) -> int64 array."""
    raw = np.asarray(getattr(lengths, "lengths", lengths))
    if raw.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got shape {raw.shape}")
    if raw.size and raw.dtype.kind not in "iu":
        if raw.dtype.kind != "f":
            raise TypeError(f"lengths must be integers, got dtype {raw.dtype}")
        bad = np.flatnonzero(~np.isfinite(raw) | (raw != np.round(raw)))
        if bad.size:
            i = int(bad[0])
            raise TypeError(f"lengths must be whole numbers (token counts); sample {i} is {raw[i]!r}. "
                            "Round or scale fractional costs to integers first.")
    lens = raw.astype(np.int64)
    neg = np.flatnonzero(lens < 0)
    if neg.size:
        raise ValueError(f"lengths must be >= 0; sample {int(neg[0])} is {int(lens[neg[0]])}")
    return lens


def _count_steps(n: int, N: int, R: int, drop_last: bool) -> tuple[np.ndarray, int]:
    """Items per step and how many samples are kept, for global_batch_size mode."""
    if drop_last:
        S = n // N
        return np.full(S, N, np.int64), S * N
    if n == 0:
        return np.zeros(0, np.int64), 0
    S = -(-n // N)
    caps = np.full(S, N, np.int64)
    caps[-1] = n - (S - 1) * N
    if S > 1 and caps[-1] < R:
        # A last step with fewer samples than ranks would leave ranks empty: merge it.
        caps = caps[:-1].copy()
        caps[-1] += n - S * N + N
    return caps, n


def _sorted_windows(lens: np.ndarray, perm: np.ndarray, win_of_item: np.ndarray, G: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Lay the windows' items out as rows sorted by (length desc, dataset index)."""
    order = _argsort_keys(win_of_item, int(lens.max(initial=0)) - lens[perm], perm)
    counts = np.bincount(win_of_item, minlength=G)
    start = np.concatenate([[0], np.cumsum(counts)])
    w_sorted = win_of_item[order]
    pos = np.arange(len(order)) - start[w_sorted]
    M = int(counts.max()) if G else 0
    return order, w_sorted, pos, M


def _argsort_keys(*keys: np.ndarray) -> np.ndarray:
    """Lexicographic argsort, first key most significant, all keys int >= 0.

    Packs the keys into one int64 when they fit (one argsort is ~5x faster than np.lexsort on a
    million items); falls back to lexsort otherwise.
    """
    if not len(keys[0]):
        return np.zeros(0, np.int64)
    packed = np.zeros(len(keys[0]), np.int64)
    span = 1
    for k in reversed(keys):
        top = int(k.max()) + 1
        if span * top >= 2**62:
            return np.lexsort(keys[::-1])
        packed += k.astype(np.int64) * span
        span *= top
    return np.argsort(packed, kind="stable")


def _scaled(lens_sorted: np.ndarray, M: int) -> tuple[np.ndarray, int]:
    # Cost' = tokens * C + 1 with C > items per window: loads then compare by (tokens, item count),
    # every item costs >= 1 (so an empty rank is always the least loaded), and a token budget B
    # maps exactly to load' <= B * C + C - 1.
    C = M + 1
    if lens_sorted.size and int(lens_sorted.max()) * max(M, 1) >= (np.iinfo(np.int64).max >> 2) // C:
        raise ValueError("lengths too large to plan exactly in int64 (tokens × window size overflow)")
    return lens_sorted * C + 1, C


def _fill(lens: np.ndarray, perm: np.ndarray, win_of_item: np.ndarray, cap2d: np.ndarray, R: int,
          capacity: int | None, force_nonempty: bool
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Run the window fill; returns (steps per window, step-in-window, rank, failed windows).

    Steps left without any sample (possible only in token mode) are squeezed out, so the steps
    of window g are always numbered 0 .. steps[g] - 1.
    """
    G = cap2d.shape[0]
    order, w_sorted, pos, M = _sorted_windows(lens, perm, win_of_item, G)
    x, C = _scaled(lens[perm[order]], M)
    costs = np.zeros((G, M), np.int64)
    costs[w_sorted, pos] = x
    # A bin never holds more than its whole window, so clamping the budget there changes nothing
    # and keeps the scaled budget inside int64.
    cap_scaled = None if capacity is None else min(capacity, int(x.sum()) // C + 1) * C + C - 1
    s2d, r2d, failed = fill_windows(costs, cap2d, R, capacity=cap_scaled, force_nonempty=force_nonempty)
    step_w = np.full(len(perm), -1, np.int64)
    rank_w = np.full(len(perm), -1, np.int64)
    step_w[order] = s2d[w_sorted, pos]
    rank_w[order] = r2d[w_sorted, pos]
    placed = step_w >= 0
    used = np.zeros(cap2d.shape, bool)
    used[win_of_item[placed], step_w[placed]] = True
    renum = np.cumsum(used, axis=1) - 1
    step_w[placed] = renum[win_of_item[placed], step_w[placed]]
    return used.sum(1), step_w, rank_w, failed


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


def _token_fill(lens: np.ndarray, perm: np.ndarray, win_of_item: np.ndarray, R: int, B: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token-budget mode: as few steps per window as the budget allows, at least one item per bin."""
    G = int(win_of_item.max()) + 1 if len(win_of_item) else 0
    tokens = np.bincount(win_of_item, weights=lens[perm], minlength=G)
    nsteps = np.maximum(1, -(-tokens.astype(np.int64) // (R * B)))
    steps_in_win = np.zeros(G, np.int64)
    step_w = np.full(len(perm), -1, np.int64)
    rank_w = np.full(len(perm), -1, np.int64)
    todo = np.arange(G)
    tries = 0
    while todo.size:
        # Windows whose samples did not fit are planned again with more steps: one more at first
        # (keeps steps full), then geometrically more, so even awkward sizes (every sample just
        # over half the budget) need only a few rounds.
        sel = np.flatnonzero(np.isin(win_of_item, todo))
        local = np.searchsorted(todo, win_of_item[sel])
        W = int(nsteps[todo].max())
        cap2d = np.where(np.arange(W)[None, :] < nsteps[todo][:, None], len(sel) + 1, 0)
        steps, s, r, failed = _fill(lens, perm[sel], local, cap2d, R, B, True)
        ok = ~failed[local]
        step_w[sel[ok]] = s[ok]
        rank_w[sel[ok]] = r[ok]
        steps_in_win[todo[~failed]] = steps[~failed]
        grow = nsteps[todo[failed]]
        nsteps[todo[failed]] += np.maximum(1, (grow * (2**tries - 1)) // 8)
        todo = todo[failed]
        tries += 1
    return steps_in_win, step_w, rank_w


def _positive_int(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return int(v)


def _nonneg_int(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
    return int(v)
