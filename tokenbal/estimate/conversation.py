"""Walking a chat conversation's content parts (the image and video parts the chat path counts)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any


def content_parts(conversation: Sequence[Any]) -> Iterator[dict]:
    """Every dict part of every message whose content is a list of parts, in order."""
    for message in conversation:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            yield from (part for part in content if isinstance(part, dict))
