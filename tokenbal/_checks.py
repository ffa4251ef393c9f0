"""The one check of per-sample numbers (token counts, costs) that every public entry point uses.

numpy converts silently where a user needs an error: ``uint64`` values above ``2**63 - 1`` and
floats like ``1e30`` wrap or saturate in ``astype(np.int64)``, so a check made after the cast
reports a value the user never passed (``-1``, ``-9223372036854775808``). Everything here is
checked on the values as given, and an error names the first offending sample and its value.
"""

from __future__ import annotations

import numpy as np

_INT64_MAX = int(np.iinfo(np.int64).max)


def check_sample_values(values: object, what: str, *, whole: bool, where: str = "") -> np.ndarray:
    """``values`` as a checked 1-D array: numbers, finite, >= 0 and within int64.

    ``whole=True`` (token counts): floats must be whole numbers; returns int64. ``whole=False``
    (costs, scaled later): returns int64 for integer input, float64 for floats. Raises
    ``ValueError`` / ``TypeError`` naming sample ``i`` and its value as given (then ``where``,
    e.g. " in stage 1").
    """
    raw = np.asarray(values)
    if raw.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {raw.shape}")
    if raw.size == 0:
        return np.zeros(0, np.int64)
    if raw.dtype.kind == "O":
        raw = _from_objects(raw, what, where)
    if raw.dtype.kind not in "iuf":
        raise TypeError(f"{what} must be {'integers' if whole else 'numbers'}, got dtype {raw.dtype}")
    if raw.dtype.kind == "f":
        _first_bad(raw, ~np.isfinite(raw), what, "must be finite", where)
        _first_bad(raw, raw < 0, what, "must be >= 0", where)
        if whole:
            bad = np.flatnonzero(raw != np.round(raw))
            if bad.size:
                i = int(bad[0])
                raise TypeError(f"{what} must be whole numbers (token counts); sample {i} is "
                                f"{_show(raw[i])}{where}. Round or scale fractional costs to integers first.")
            # 2**63 is the first float64 above int64's range: casting it (or 1e30) would saturate.
            _first_bad(raw, raw >= 2.0**63, what, f"must fit in int64 (<= {_INT64_MAX})", where)
            return raw.astype(np.int64)
        return raw.astype(np.float64, copy=False)
    if raw.dtype.kind == "u":
        _first_bad(raw, raw > np.uint64(_INT64_MAX), what, f"must fit in int64 (<= {_INT64_MAX})", where)
    else:
        _first_bad(raw, raw < 0, what, "must be >= 0", where)
    return raw.astype(np.int64)


def _first_bad(raw: np.ndarray, mask: np.ndarray, what: str, rule: str, where: str) -> None:
    bad = np.flatnonzero(mask)
    if bad.size:
        i = int(bad[0])
        more = f" ({bad.size} samples in all)" if bad.size > 1 else ""
        raise ValueError(f"{what} {rule}; sample {i} is {_show(raw[i])}{where}{more}")


def _from_objects(raw: np.ndarray, what: str, where: str) -> np.ndarray:
    """A list of python numbers numpy could not type (e.g. an int above int64): check each one."""
    for i, v in enumerate(raw.tolist()):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise TypeError(f"{what} must be numbers; sample {i} is {v!r} ({type(v).__name__}){where}")
        if isinstance(v, (int, np.integer)) and not 0 <= int(v) <= _INT64_MAX:
            rule = "must be >= 0" if v < 0 else f"must fit in int64 (<= {_INT64_MAX})"
            raise ValueError(f"{what} {rule}; sample {i} is {int(v)}{where}")
    return raw.astype(np.float64) if any(isinstance(v, float) for v in raw.tolist()) else raw.astype(np.int64)


def _show(v: object) -> str:
    """A value as the user would write it (``1e+30``, ``18446744073709551615``, ``nan``)."""
    if isinstance(v, (np.integer, int)):
        return str(int(v))
    return repr(float(v))  # type: ignore[arg-type]


def check_costs(costs: object) -> np.ndarray:
    """1-D numeric costs for the partition solvers: int64 for integers, float64 otherwise; finite and
    >= 0, errors naming the first bad item."""
    c = np.asarray(costs)
    if c.ndim != 1:
        raise ValueError(f"costs must be 1-D, got shape {c.shape}")
    if c.size and not np.issubdtype(c.dtype, np.number):
        raise TypeError(f"costs must be numbers, got dtype {c.dtype}")
    c = c.astype(np.float64) if not np.issubdtype(c.dtype, np.integer) else c.astype(np.int64)
    bad = np.flatnonzero(~np.isfinite(c) | (c < 0)) if c.dtype.kind == "f" else np.flatnonzero(c < 0)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"costs must be finite and >= 0; item {i} has cost {c[i]!r}")
    return c

def check_lengths(lengths: object) -> np.ndarray:
    """Validate per-sample lengths (array or object with ``.lengths``) -> int64 array.

    Errors name the first bad sample and its value as given."""
    lens = check_sample_values(getattr(lengths, "lengths", lengths), "lengths", whole=True)
    # The planner sums token counts in int64; a total past it would wrap without a word.
    total = float(lens.sum(dtype=np.float64))
    if total >= 2.0**63:
        raise ValueError(f"lengths sum to {total:.3g} tokens, more than int64 holds; are they token counts?")
    return lens


def positive_int(name: str, v: object) -> int:
    """``v`` as an int >= 1 (bools refused), else ``ValueError`` naming the setting."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return int(v)


def nonneg_int(name: str, v: object) -> int:
    """``v`` as an int >= 0 (bools refused), else ``ValueError`` naming the setting."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
    return int(v)
