"""Token-count estimators: vision placeholders per model family and text token counters.

``get_estimator(name, **overrides)`` / ``load_estimator(model_dir)`` give a vision estimator
(names: ``estimator_names()``: qwen2-vl, qwen2.5-vl, qwen3-vl, internvl, tiles, llava-next,
llava-onevision, idefics3, smolvlm, glm-4.1v, phi-4-multimodal);
``image_tokens_checked(est, widths, heights)`` counts a batch without letting one
bad image fail it; ``get_text_counter(tokenizer_path_or_None)`` gives a text counter;
``estimator_from_processor(processor)`` the estimator of a loaded transformers processor and
``ChatTokenCounter.from_processor(processor)`` / ``.from_pretrained(folder)`` exact chat-template
counts (template, text and image placeholders, as ``processor.apply_chat_template`` gives them).
"""

from __future__ import annotations

from tokenbal.estimate.chat import ChatTokenCounter
from tokenbal.estimate.text import HeuristicTextCounter, TextTokenCounter, get_text_counter
from tokenbal.estimate.vision import (
    estimator_from_processor,
    estimator_names,
    get_estimator,
    image_tokens_checked,
    load_estimator,
)

__all__ = [
    "ChatTokenCounter",
    "HeuristicTextCounter",
    "TextTokenCounter",
    "estimator_from_processor",
    "estimator_names",
    "get_estimator",
    "get_text_counter",
    "image_tokens_checked",
    "load_estimator",
]
