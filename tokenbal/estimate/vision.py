"""Vision estimators (work in progress: Qwen family first)."""

from __future__ import annotations


def get_estimator(name: str, **overrides):
    raise NotImplementedError(f"vision estimator {name!r}: not implemented yet")


def load_estimator(model_dir):
    raise NotImplementedError("load_estimator: not implemented yet")
