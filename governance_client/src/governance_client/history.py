"""History compaction against context rot: the seed article's four fixes, made correct.

An agent that loops is usually an agent whose history became unreadable: 40 messages, the last
20 saying the same thing, the original instruction drowned. These helpers keep the history
short and its signal visible. They work on chat messages as dicts (``{"role", "content", ...}``),
never mutate their input, and are meant to be called before every model call::

    history = pinned.inject(compact_with_budget(history, max_tokens=8000))

Tool results are the messages with role ``tool_result`` (the article's) or ``tool`` (OpenAI's).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .keys import normalize_text

__all__ = [
    "PINNED_KEY",
    "PinnedContext",
    "RepeatedErrorGuard",
    "compact_history",
    "compact_with_budget",
    "estimate_tokens",
    "is_pinned",
    "strip_markers",
]

Message = dict[str, Any]
TOOL_ROLES = frozenset({"tool_result", "tool"})
#: Marks the pinned-context message; strip it (``strip_markers``) if your provider rejects it.
PINNED_KEY = "pinned"
MAX_FULL_CHARS = 200
PREVIEW_CHARS = 150


def is_pinned(message: Mapping[str, Any]) -> bool:
    return message.get(PINNED_KEY) is True


def _is_tool_result(message: Mapping[str, Any]) -> bool:
    return message.get("role") in TOOL_ROLES and not is_pinned(message)


def compact_history(history: Sequence[Message], keep_full_last: int = 5) -> list[Message]:
    """Older tool results over 200 characters become a 150-character preview.

    The last ``keep_full_last`` messages stay whole: the model needs the recent detail, and it
    is the old, already-acted-upon output that drowns the signal. Returns a new list of new
    dicts.
    """
    split = max(len(history) - max(keep_full_last, 0), 0)
    compact: list[Message] = []
    for index, message in enumerate(history):
        message = dict(message)
        content = message.get("content")
        old = index < split and _is_tool_result(message)
        if old and isinstance(content, str) and len(content) > MAX_FULL_CHARS:
            omitted = len(content) - PREVIEW_CHARS
            message["content"] = (
                f"[result truncated: {content[:PREVIEW_CHARS]}… ({omitted} more characters)]"
            )
        compact.append(message)
    return compact


def estimate_tokens(message: Mapping[str, Any]) -> int:
    """About 4 characters per token, plus a few for the message's framing.

    Good enough for budgeting; pass a real tokenizer to ``compact_with_budget`` for precision.
    """
    content = message.get("content")
    text = content if isinstance(content, str) else json.dumps(content, default=str)
    if message.get("tool_calls"):
        text += json.dumps(message["tool_calls"], default=str)
    return math.ceil(len(text) / 4) + 4


def compact_with_budget(
    history: Sequence[Message],
    max_tokens: int = 8000,
    estimate_tokens: Callable[[Mapping[str, Any]], int] = estimate_tokens,
    keep_full_last: int = 5,
    placeholder: str | None = None,
) -> list[Message]:
    """Compact, then evict the oldest tool results until the history fits ``max_tokens``.

    Only tool results older than the last ``keep_full_last`` messages are evictable: the system
    prompt, the pinned context, the user's and assistant's messages and the last turns always
    stay. If the history is still over budget once every evictable message is gone, what
    remains is returned as is (over budget): dropping the instructions would be worse than a
    long prompt.

    With ``placeholder``, an evicted result is replaced by that short text instead of removed,
    for chat APIs that require every tool call to keep its result message (OpenAI's
    ``tool_call_id``).
    """
    compact = compact_history(history, keep_full_last)
    split = max(len(compact) - max(keep_full_last, 0), 0)
    evictable = [i for i in range(split) if _is_tool_result(compact[i])]
    sizes = [estimate_tokens(m) for m in compact]
    total = sum(sizes)
    evicted: set[int] = set()
    for index in evictable:  # oldest first
        if total <= max_tokens:
            break
        if placeholder is None:
            evicted.add(index)
            total -= sizes[index]
        else:
            compact[index] = {**compact[index], "content": placeholder}
            new_size = estimate_tokens(compact[index])
            total -= sizes[index] - new_size
    return [m for i, m in enumerate(compact) if i not in evicted]


def strip_markers(history: Iterable[Message]) -> list[Message]:
    """The history without the pinned marker key, for providers that reject unknown keys."""
    return [{k: v for k, v in m.items() if k != PINNED_KEY} for m in history]


class RepeatedErrorGuard:
    """Detects the same error coming back and produces the change-approach message.

    ``observe`` every tool outcome: the error text, or None for a success (which resets the
    counts, since the agent moved on). From the ``threshold``-th identical error (whitespace
    normalized) on, it returns the message to append to the history, naming the actual count;
    the wording is the service's repeated-error directive (SPEC 5.2).
    """

    def __init__(self, threshold: int = 3) -> None:
        if threshold < 1:
            raise ValueError("threshold must be >= 1")
        self.threshold = threshold
        self.counts: dict[str, int] = {}

    def observe(self, error: str | BaseException | None) -> Message | None:
        if error is None:
            self.reset()
            return None
        text = normalize_text(str(error)) or type(error).__name__
        count = self.counts[text] = self.counts.get(text, 0) + 1
        if count < self.threshold:
            return None
        return {
            "role": "user",
            "content": f"The error '{text}' occurred {count} times. "
            "Change approach radically or abandon this subtask.",
        }

    def reset(self) -> None:
        self.counts.clear()


class PinnedContext:
    """The active instructions of a session, re-injected every turn so compaction never loses
    them (the article's third edge case: goals that move during a multi-turn session)."""

    def __init__(
        self,
        instructions: Iterable[str] = (),
        *,
        role: str = "system",
        title: str = "Active instructions (pinned; they override anything earlier):",
    ) -> None:
        self._instructions: list[str] = []
        self.role = role
        self.title = title
        for instruction in instructions:
            self.add(instruction)

    @property
    def instructions(self) -> tuple[str, ...]:
        return tuple(self._instructions)

    def add(self, instruction: str) -> None:
        instruction = instruction.strip()
        if instruction and instruction not in self._instructions:
            self._instructions.append(instruction)

    def remove(self, instruction: str) -> None:
        instruction = instruction.strip()
        if instruction in self._instructions:
            self._instructions.remove(instruction)

    def clear(self) -> None:
        self._instructions.clear()

    def message(self) -> Message | None:
        if not self._instructions:
            return None
        lines = [self.title, *(f"- {i}" for i in self._instructions)]
        return {"role": self.role, "content": "\n".join(lines), PINNED_KEY: True}

    def inject(self, history: Sequence[Message]) -> list[Message]:
        """A new history with one pinned message right after the system prompt (or first, if
        there is none), replacing any earlier pinned message; without instructions, none."""
        rest = [dict(m) for m in history if not is_pinned(m)]
        message = self.message()
        if message is None:
            return rest
        at = 1 if rest and rest[0].get("role") == "system" else 0
        return [*rest[:at], message, *rest[at:]]
