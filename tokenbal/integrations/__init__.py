"""Adapters for the frameworks users train with: :mod:`tokenbal.integrations.hf` (transformers'
``Trainer``, trl's ``SFTTrainer`` and other subclasses), :mod:`tokenbal.integrations.accelerate`
(raw accelerate loops), :mod:`tokenbal.integrations.llamafactory` (``python -m
tokenbal.integrations.llamafactory train CONFIG.yaml``) and :mod:`tokenbal.integrations.swift`
(ms-swift's ``--external_plugins``). Importing this package imports none of those frameworks."""

from __future__ import annotations

from typing import Any

__all__ = ["TokenBalancedTrainer", "TokenBalancingMixin", "dataset_lengths", "prepare_loader"]


def __getattr__(name: str) -> Any:
    # Lazy: transformers / accelerate are imported only when an adapter is asked for.
    if name in ("TokenBalancedTrainer", "TokenBalancingMixin", "dataset_lengths"):
        from tokenbal.integrations import hf

        return getattr(hf, name)
    if name == "prepare_loader":
        from tokenbal.integrations.accelerate import prepare_loader

        return prepare_loader
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
