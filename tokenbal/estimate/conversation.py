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


def chat_turns(value: Any, row: int, field: str) -> list:
    """A row's chat turns: a non-empty list of message dicts, else ``ValueError`` naming the row."""
    if not isinstance(value, (list, tuple)) or not value:
        what = f"a string ({value[:40]!r})" if isinstance(value, str) else type(value).__name__
        raise ValueError(f"row {row}: {field!r} is {what}, not a non-empty list of chat turns "
                         "({'role': ..., 'content': ...} dicts)")
    for k, message in enumerate(value):
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"row {row}: {field}[{k}] is {type(message).__name__} {str(message)[:60]!r}, "
                             "not a {'role': ..., 'content': ...} dict")
    return list(value)
