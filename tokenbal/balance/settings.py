"""``PlanSettings``: how an epoch is cut into steps, checked once when it is made.

The planner's inputs are the per-sample arrays (:class:`tokenbal.balance.cost.Resolved`, made once
by :func:`tokenbal.balance.cost.resolve`), these settings, and ``(seed, epoch)``. Everything that
plans — :func:`tokenbal.balance.plan.plan_epoch`, ``TokenBalancedBatchSampler`` (which replans per
epoch), the HF Trainer's ``sampler_options`` and ``tokenbal plan simulate`` — builds one
``PlanSettings`` and hands it on, so a bad value fails where it was given, once, with the same
message whichever entry point took it::

    settings = PlanSettings(num_replicas=8, global_batch_size=256, grad_accum=2)
    settings = PlanSettings.from_layout(layout, max_tokens_per_rank=16384)   # dp size of a ParallelLayout
    plan = plan_epoch(resolve(index), settings=settings, seed=0, epoch=3)

What needs the data (a sample over the token budget with ``oversize="error"``) is
:meth:`PlanSettings.check_against`. :meth:`PlanSettings.fingerprint` is the settings' part of the
sampler's resume fingerprint (plain JSON values), :meth:`PlanSettings.from_fingerprint` its inverse.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenbal._checks import positive_int

__all__ = ["PlanSettings", "OVERSIZE", "plan_settings"]

# What the token-budget mode does with a sample over the budget on its own.
OVERSIZE = ("error", "skip", "alone")

# Batch sizes and token budgets at or above this are refused when set: beyond any data set, and the
# planner's int64 sums and numpy array sizes of them overflow (an OverflowError at the first len()).
_HUGE = 2**62


@dataclass(frozen=True)
class PlanSettings:
    """The settings of an epoch plan besides the data, the seed and the epoch.

    ``num_replicas``: data-parallel ranks. Exactly one of ``global_batch_size`` (samples per
    optimizer step over all ranks, >= ``num_replicas × grad_accum``) and ``max_tokens_per_rank``
    (cost budget per rank per step, per micro-batch when ``grad_accum > 1``). ``window``: steps
    balanced together (None: :func:`tokenbal.balance.plan.default_window`). ``grad_accum``:
    micro-batches per rank per step. ``oversize``: token-budget mode's samples over the budget,
    one of :data:`OVERSIZE`. Values are checked and normalised (numpy ints to ``int``) on creation;
    the dataclass is frozen, so a checked object stays checked.
    """

    num_replicas: int
    global_batch_size: int | None = None
    max_tokens_per_rank: int | None = None
    window: int | None = None
    grad_accum: int = 1
    shuffle: bool = True
    drop_last: bool = False
    oversize: str = "error"

    def __post_init__(self) -> None:
        # The order (and wording) of plan_epoch's checks before settings were an object: a test or
        # a user fixing one error at a time sees the same first error as before.
        k = positive_int("grad_accum", self.grad_accum)
        if not isinstance(self.oversize, str) or self.oversize not in OVERSIZE:
            raise ValueError(f"oversize must be 'error', 'skip' or 'alone', got {self.oversize!r}")
        R = positive_int("num_replicas", self.num_replicas)
        if (self.global_batch_size is None) == (self.max_tokens_per_rank is None):
            raise ValueError("give exactly one of global_batch_size and max_tokens_per_rank")
        W = None if self.window is None else positive_int("window", self.window)
        N = B = None
        if self.global_batch_size is not None:
            N = _below_huge("global_batch_size", positive_int("global_batch_size", self.global_batch_size))
            if N < R * k:
                what = f"num_replicas={R}" if k == 1 else f"num_replicas × grad_accum = {R * k}"
                raise ValueError(
                    f"global_batch_size={N} is smaller than {what}: every step would leave "
                    f"{R * k - N} {'ranks' if k == 1 else 'micro-batches'} without a "
                    f"sample. Use global_batch_size >= {R * k} (or max_tokens_per_rank).")
        else:
            B = _below_huge("max_tokens_per_rank",
                            positive_int("max_tokens_per_rank", self.max_tokens_per_rank))
        normal = {"num_replicas": R, "global_batch_size": N, "max_tokens_per_rank": B, "window": W,
                  "grad_accum": k, "shuffle": _flag("shuffle", self.shuffle),
                  "drop_last": _flag("drop_last", self.drop_last)}
        for name, value in normal.items():
            object.__setattr__(self, name, value)   # frozen: the one place values are normalised

    @classmethod
    def from_layout(cls, layout: Any, **settings: Any) -> PlanSettings:
        """Settings planned over the data-parallel ranks of a :class:`tokenbal.parallel.ParallelLayout`
        (its ``dp_size``: the peers of one sequence-parallel group share a batch)."""
        if "num_replicas" in settings:
            raise ValueError("from_layout takes num_replicas from the layout (its dp_size); do not pass it")
        return cls(num_replicas=layout.dp_size, **settings)

    def check_against(self, costs: np.ndarray) -> None:
        """The checks that need the data: with a token budget and ``oversize="error"``, no sample's
        cost may exceed the budget on its own (``ValueError`` listing the first ten)."""
        B = self.max_tokens_per_rank
        if B is None or self.oversize != "error":
            return
        costs = np.asarray(costs)
        over = np.flatnonzero(costs > B)
        if over.size:
            shown = ", ".join(f"{i} ({costs[i]} tokens)" for i in over[:10].tolist())
            more = f" and {over.size - 10} more" if over.size > 10 else ""
            raise ValueError(f"{over.size} sample(s) exceed max_tokens_per_rank={B} on their own: "
                             f"{shown}{more}. Raise the budget, filter them out, or pass "
                             "oversize='skip' / 'alone'.")

    def fingerprint(self) -> dict[str, Any]:
        """The settings as plain JSON values: the settings' part of the sampler's resume fingerprint
        (keys and values as checkpoints have stored them since before this class existed)."""
        return {"num_replicas": self.num_replicas, "global_batch_size": self.global_batch_size,
                "max_tokens_per_rank": self.max_tokens_per_rank, "shuffle": self.shuffle,
                "drop_last": self.drop_last, "window": self.window, "grad_accum": self.grad_accum,
                "oversize": self.oversize}

    @classmethod
    def from_fingerprint(cls, fingerprint: dict[str, Any]) -> PlanSettings:
        """The settings a (sampler) fingerprint was made with; its other keys (the data's digest,
        the plan version, ...) are ignored. ``ValueError`` naming the missing keys."""
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in fingerprint]
        if missing:
            raise ValueError(f"fingerprint has no {', '.join(missing)}")
        return cls(**{n: fingerprint[n] for n in names})


def plan_settings(settings: PlanSettings | None = None, **keywords: Any) -> PlanSettings:
    """The one ``PlanSettings`` of a call that takes either ``settings=`` or the settings as keywords
    (``plan_epoch``, the sampler). Without ``settings``: ``PlanSettings(**keywords)``. With it, a
    keyword that is not at its default must agree with it (``ValueError`` naming it); one left at
    its default is the settings' value."""
    if settings is None:
        return PlanSettings(**keywords)
    if not isinstance(settings, PlanSettings):
        raise TypeError(f"settings must be a PlanSettings, got {type(settings).__name__}")
    defaults = {f.name: (None if f.default is dataclasses.MISSING else f.default)
                for f in dataclasses.fields(PlanSettings)}
    unknown = sorted(set(keywords) - set(defaults))
    if unknown:
        raise TypeError(f"not a PlanSettings field: {', '.join(unknown)}")
    clash = [f"{name}={value!r} (settings has {getattr(settings, name)!r})"
             for name, value in keywords.items()
             if not _same(value, defaults[name]) and not _same(value, getattr(settings, name))]
    if clash:
        raise ValueError("settings= disagrees with " + ", ".join(clash) + "; pass one or the other")
    return settings


def _same(a: Any, b: Any) -> bool:
    # `True == 1` but a flag is not a count: compare types as well as values (numpy ints as ints).
    if isinstance(a, np.integer):
        a = int(a)
    if isinstance(b, np.integer):
        b = int(b)
    return type(a) is type(b) and a == b


def _below_huge(name: str, v: int) -> int:
    if v >= _HUGE:
        raise ValueError(f"{name} must be below 2**62 ({_HUGE}), got {v}: larger than any data set, and "
                         "the planner's int64 arithmetic would overflow")
    return v


def _flag(name: str, v: object) -> bool:
    """A bool setting: ``True`` / ``False`` (numpy's too) or the ints 0 / 1, never a string whose
    truth would be an accident (``"false"`` is truthy)."""
    if isinstance(v, (bool, np.bool_)) or (isinstance(v, (int, np.integer)) and v in (0, 1)):
        return bool(v)
    raise ValueError(f"{name} must be True or False, got {v!r}")
