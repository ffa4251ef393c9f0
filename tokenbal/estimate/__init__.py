"""Token-count estimators: vision placeholders per model family and text token counters.

``get_estimator(name, **overrides)`` / ``load_estimator(model_dir)`` give a vision estimator;
``get_text_counter(tokenizer_path_or_None)`` gives a text counter.
"""

from __future__ import annotations

from tokenbal.estimate.text import HeuristicTextCounter, TextTokenCounter, get_text_counter
from tokenbal.estimate.vision import get_estimator, load_estimator

__all__ = [
    "HeuristicTextCounter",
    "TextTokenCounter",
    "get_estimator",
    "get_text_counter",
    "load_estimator",
]
