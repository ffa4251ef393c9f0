"""What every vision estimator shares: its identity (``name``, ``config``), ``replace`` (a checked
copy with some settings changed) and the type checks of its settings.

An estimator is a frozen dataclass whose first field is ``family`` (its key in
:mod:`tokenbal.estimate.families`) and that subclasses :class:`Estimator`; it adds only its own
settings and token rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, fields
from typing import Any, ClassVar, TypeVar

_E = TypeVar("_E", bound="Estimator")

__all__ = ["Estimator", "PatchGridEstimator"]


class Estimator:
    """Mixin for the estimator dataclasses (no fields of its own, so frozen subclasses stay frozen)."""

    family: str
    # Other libraries' spellings of a setting -> the field (``max_num`` for InternVL's ``max_tiles``).
    SETTING_ALIASES: ClassVar[Mapping[str, str]] = {}
    # Whether ``replace(family=...)`` may switch family (the Qwen estimators share one class).
    FAMILY_SETTABLE: ClassVar[bool] = False

    @property
    def name(self) -> str:
        return self.family

    @property
    def config(self) -> dict:
        """JSON-ready settings, written into the index manifest."""
        return {"estimator": self.family, **self.config_fields()}

    def config_fields(self) -> dict:
        return asdict(self)

    def replace(self: _E, **overrides: Any) -> _E:
        """A copy with some settings changed (validated like the constructor); ``TypeError`` names
        an unknown setting and lists the known ones."""
        known = {f.name for f in fields(self)}
        if not self.FAMILY_SETTABLE:
            known.discard("family")
        if self.SETTING_ALIASES:
            mapped = {}
            for k, v in overrides.items():
                key = self.SETTING_ALIASES.get(k, k)
                if key not in known:
                    raise TypeError(f"{self.family}: unknown setting {k!r}; known: "
                                    f"{sorted(known | set(self.SETTING_ALIASES))}")
                mapped[key] = v
        else:
            unknown = sorted(set(overrides) - known)
            if unknown:
                raise TypeError(f"{self.family}: unknown setting(s) {unknown}; known: {sorted(known)}")
            mapped = dict(overrides)
        return type(self)(**{**asdict(self), **self.normalize_settings(mapped)})

    def normalize_settings(self, overrides: dict) -> dict:
        """Hook: overrides in the field's own form (e.g. lists of pinpoints as tuples)."""
        return overrides

    def check_field_types(self, *, allow_zero: bool = False, bools: bool = False) -> None:
        """``ValueError`` for the first ``int`` field that is not a positive (``allow_zero``:
        non-negative) int, or, with ``bools``, the first ``bool`` field that is not a bool."""
        for f in fields(self):
            v = getattr(self, f.name)
            low = 0 if allow_zero else 1
            if f.type == "int" and (isinstance(v, bool) or not isinstance(v, int) or v < low):
                kind = "a non-negative" if allow_zero else "a positive"
                raise ValueError(f"{self.family}: {f.name} must be {kind} int, got {v!r}")
            if bools and f.type == "bool" and not isinstance(v, bool):
                raise ValueError(f"{self.family}: {f.name} must be a bool, got {v!r}")


class PatchGridEstimator(Estimator):
    """Towers that cut the resized image into ``patch_size`` patches and merge ``merge_size`` x
    ``merge_size`` of them into one token (Qwen2/2.5/3-VL, GLM-4.1V): a subclass says only how an
    image is resized (``resized_size``), with fields ``patch_size`` and ``merge_size``."""

    patch_size: int
    merge_size: int

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        raise NotImplementedError

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def image_grid(self, width: int, height: int) -> tuple[int, int, int]:
        """``image_grid_thw`` the processor emits: (1, H'/patch, W'/patch) in patches."""
        w, h = self.resized_size(width, height)
        return 1, h // self.patch_size, w // self.patch_size

    def image_tokens(self, width: int, height: int) -> int:
        """Image placeholder tokens for one image (wrappers not included)."""
        w, h = self.resized_size(width, height)
        return (h // self.factor) * (w // self.factor)
