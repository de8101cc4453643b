"""History compaction against context rot: the seed article's four fixes, made correct.

An agent that loops is usually an agent whose history became unreadable: 40 messages, the last
20 saying the same thing, the original instruction drowned. These helpers keep the history
short and its signal visible. They never mutate their input, and are meant to be called before
every model call::

    history = pinned.inject(compact_with_budget(history, max_tokens=8000))

They take the histories frameworks pass around, and give back the same kind of items:

* chat dicts (``{"role", "content", "tool_calls", "tool_call_id"}``, OpenAI's chat format and
  the seed article's ``tool_result`` role), with ``content`` a string or a list of parts;
* LangChain message objects (``SystemMessage``, ``HumanMessage``, ``AIMessage`` with
  ``tool_calls``, ``ToolMessage``), copied with ``model_copy``;
* Anthropic messages (``tool_use`` blocks in the assistant's content, ``tool_result`` blocks in
  the user's);
* OpenAI Agents SDK / Responses input items (``function_call`` and ``function_call_output``).

Eviction never leaves a tool call without its result: a tool call and its results are evicted
together, or (with ``placeholder``) the results are replaced and the call kept.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .keys import normalize_text

__all__ = [
    "PINNED_ID",
    "PINNED_KEY",
    "Compacted",
    "PinnedContext",
    "RepeatedErrorGuard",
    "compact_history",
    "compact_with_budget",
    "estimate_tokens",
    "is_pinned",
    "strip_markers",
]

Message = Any  # a dict, or a LangChain message object
TOOL_ROLES = frozenset({"tool_result", "tool"})
#: Marks the pinned-context dict message; strip it (``strip_markers``) if your provider rejects it.
PINNED_KEY = "pinned"
#: The id of the pinned-context LangChain message (ids are never sent to the model).
PINNED_ID = "governance-pinned-context"
MAX_FULL_CHARS = 200
PREVIEW_CHARS = 150
_LC_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool"}


# -- What a message is, whatever its shape -----------------------------------------------------

def _is_object(message: Any) -> bool:
    return not isinstance(message, Mapping) and hasattr(message, "content")


def _get(message: Any, name: str, default: Any = None) -> Any:
    if isinstance(message, Mapping):
        return message.get(name, default)
    return getattr(message, name, default)


def _role(message: Any) -> str | None:
    if _is_object(message):
        return _LC_ROLES.get(getattr(message, "type", ""), getattr(message, "type", None))
    role = message.get("role")
    return role if role is not None else message.get("type")


def is_pinned(message: Any) -> bool:
    if _is_object(message):
        kwargs = getattr(message, "additional_kwargs", None) or {}
        return getattr(message, "id", None) == PINNED_ID or kwargs.get(PINNED_KEY) is True
    return message.get(PINNED_KEY) is True


def _blocks(message: Any) -> list[Any]:
    content = _get(message, "content")
    return content if isinstance(content, list) else []


def _call_ids(message: Any) -> list[str]:
    """The tool calls this message makes (an assistant turn, or a function_call item)."""
    if _get(message, "type") == "function_call":
        return [str(_get(message, "call_id") or _get(message, "id"))]
    ids = [str(_get(c, "id")) for c in (_get(message, "tool_calls") or []) if _get(c, "id")]
    ids += [str(b["id"]) for b in _blocks(message)
            if isinstance(b, Mapping) and b.get("type") == "tool_use" and b.get("id")]
    return ids


def _result_ids(message: Any) -> list[str]:
    """The tool calls whose results this message carries."""
    if _get(message, "type") == "function_call_output":
        return [str(_get(message, "call_id"))]
    if _role(message) in TOOL_ROLES:
        call = _get(message, "tool_call_id")
        return [str(call)] if call else []
    return [str(b["tool_use_id"]) for b in _blocks(message)
            if isinstance(b, Mapping) and b.get("type") == "tool_result" and b.get("tool_use_id")]


def _is_tool_result(message: Any) -> bool:
    if is_pinned(message):
        return False
    return (_role(message) in TOOL_ROLES or _get(message, "type") == "function_call_output"
            or bool(_result_ids(message)))


def _text(content: Any) -> str:
    """The readable text of a content value: a string, or a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, Mapping):
                if isinstance(part.get("text"), str):
                    parts.append(part["text"])
                elif "content" in part:
                    parts.append(_text(part["content"]))
        return "\n".join(parts)
    return "" if content is None else json.dumps(content, default=str)


def _replace(message: Any, **changes: Any) -> Any:
    if _is_object(message):
        copy = getattr(message, "model_copy", None)
        if callable(copy):
            return copy(update=changes)
        return message
    return {**message, **changes}


def _copy(message: Any) -> Any:
    return message if _is_object(message) else dict(message)


# -- Compaction ---------------------------------------------------------------------------------

def _preview(text: str) -> str:
    omitted = len(text) - PREVIEW_CHARS
    return f"[result truncated: {text[:PREVIEW_CHARS]}… ({omitted} more characters)]"


def _compact_content(content: Any) -> Any:
    """A long result's content as a preview, in the content's own shape."""
    if isinstance(content, str):
        return _preview(content) if len(content) > MAX_FULL_CHARS else content
    if isinstance(content, list):
        text = _text(content)
        if len(text) <= MAX_FULL_CHARS:
            return content
        return [{"type": "text", "text": _preview(text)}]
    return content


def _compact(message: Any) -> Any:
    if _get(message, "type") == "function_call_output":
        output = _get(message, "output")
        compact = _compact_content(output)
        return message if compact is output else _replace(message, output=compact)
    blocks = _blocks(message)
    if blocks and any(isinstance(b, Mapping) and b.get("type") == "tool_result" for b in blocks):
        new = [
            {**b, "content": _compact_content(b.get("content"))}
            if isinstance(b, Mapping) and b.get("type") == "tool_result" else b
            for b in blocks
        ]
        return _replace(message, content=new)
    content = _get(message, "content")
    compact = _compact_content(content)
    return message if compact is content else _replace(message, content=compact)


def compact_history(history: Sequence[Message], keep_full_last: int = 5) -> list[Message]:
    """Older tool results over 200 characters become a 150-character preview.

    The last ``keep_full_last`` messages stay whole: the model needs the recent detail, and it
    is the old, already-acted-upon output that drowns the signal. Returns a new list; dicts are
    new dicts, message objects are copies where they change.
    """
    for index, message in enumerate(history):
        if not isinstance(message, Mapping) and not _is_object(message):
            # Said plainly, not an AttributeError from deep inside (a LangChain ("user",
            # "hi") tuple, a bare string, None).
            raise TypeError(f"history[{index}] is a {type(message).__name__}: each message "
                            "must be a dict or a message object with .content")
    split = max(len(history) - max(keep_full_last, 0), 0)
    return [
        _compact(message) if index < split and _is_tool_result(message) else _copy(message)
        for index, message in enumerate(history)
    ]


def estimate_tokens(message: Message) -> int:
    """About 4 characters per token, plus a few for the message's framing.

    Good enough for budgeting; pass a real tokenizer to ``compact_with_budget`` for precision.
    """
    if _get(message, "type") == "function_call_output":
        text = _text(_get(message, "output"))
    elif _get(message, "type") == "function_call":
        text = str(_get(message, "name") or "") + str(_get(message, "arguments") or "")
    else:
        content = _get(message, "content")
        text = content if isinstance(content, str) else json.dumps(content, default=str)
    calls = _get(message, "tool_calls")
    if calls:
        text += json.dumps(calls, default=str)
    return math.ceil(len(text) / 4) + 4


def _exchanges(history: Sequence[Message]) -> list[list[int]]:
    """Units of eviction, oldest first: a tool-calling message with every message that holds
    one of its results, or a result whose call is not in the history, alone.

    A result belongs to the nearest call before it with its id: some servers give every
    turn's call the same id (``call_0``), and pairing each result with the last call of that
    id left the earlier results without theirs (found by an attacker: a result evicted after
    its call, which the model's API refuses). A result whose call comes only after it takes
    that call. Units are joined in one pass (a union-find), so a history of thousands of
    exchanges costs about as many steps, not their square (8,000 took 2.6 s before)."""
    parent: dict[int, int] = {}

    def root(index: int) -> int:
        while parent[index] != index:
            parent[index] = parent[parent[index]]
            index = parent[index]
        return index

    def join(a: int, b: int) -> None:
        first, second = root(a), root(b)
        if first != second:
            parent[max(first, second)] = min(first, second)

    latest: dict[str, int] = {}  # a call id: the last message so far that made that call
    early: dict[str, list[int]] = {}  # a call id: results seen before any call with it
    for index, message in enumerate(history):
        calls, is_result = _call_ids(message), _is_tool_result(message)
        if not calls and not is_result:
            continue
        parent[index] = index
        if is_result:
            for call in _result_ids(message):
                if call in latest:
                    join(latest[call], index)
                else:
                    early.setdefault(call, []).append(index)
        for call in calls:
            latest[call] = index
            for result in early.pop(call, ()):
                join(index, result)
    units: dict[int, list[int]] = {}
    for index in parent:  # in the history's order
        units.setdefault(root(index), []).append(index)
    return sorted(units.values(), key=lambda unit: unit[0])


class Compacted(list[Message]):
    """What ``compact_with_budget`` returns: the messages, as a plain ``list`` of them, and
    ``estimated_tokens``, the estimate of those messages with the estimator it was given
    (the sum it compared with the budget: free to read, nothing is counted again).
    ``over_budget`` is True when it is over ``max_tokens``, which happens when what always
    stays (the system prompt, the pinned context, user messages, the last
    ``keep_full_last`` messages) is over it alone: the caller decides then (a smaller
    ``keep_full_last``, a summary, or a refusal). A copy or slice of it is a plain list."""

    def __init__(self, messages: Iterable[Message] = (), *, estimated_tokens: int = 0,
                 max_tokens: int = 0) -> None:
        super().__init__(messages)
        self.estimated_tokens = estimated_tokens
        self.max_tokens = max_tokens

    @property
    def over_budget(self) -> bool:
        return self.estimated_tokens > self.max_tokens


def compact_with_budget(
    history: Sequence[Message],
    max_tokens: int = 8000,
    estimate_tokens: Callable[[Message], int] = estimate_tokens,
    keep_full_last: int = 5,
    placeholder: str | None = None,
) -> Compacted:
    """Compact, then evict the oldest tool exchanges until the history fits ``max_tokens``.

    An exchange is a tool call (an assistant turn with ``tool_calls``, ``tool_use`` blocks, or a
    ``function_call`` item) together with its results: evicted together, so that no call is
    ever left without its result (OpenAI answers 400 to that) nor a result without its call.
    Results whose call is not in the history are evicted alone. Only exchanges wholly older
    than the last ``keep_full_last`` messages are evictable: the system prompt, the pinned
    context, user messages and the last turns always stay. If the history is still over
    budget once nothing evictable is left, what remains is returned as is (over budget):
    dropping the instructions would be worse than a long prompt. The result says so: its
    ``estimated_tokens`` and ``over_budget`` (``Compacted``), e.g.::

        messages = compact_with_budget(history, max_tokens=2000)
        if messages.over_budget:
            ...  # messages.estimated_tokens > 2000: what always stays is over it alone

    With ``placeholder``, the results of an evicted exchange are replaced by that short text
    and the call is kept.
    """
    compact = compact_history(history, keep_full_last)
    split = max(len(compact) - max(keep_full_last, 0), 0)
    sizes = [estimate_tokens(m) for m in compact]
    total = sum(sizes)
    evicted: set[int] = set()
    for unit in _exchanges(compact) if total > max_tokens else ():  # oldest first
        if total <= max_tokens:
            break
        if max(unit) >= split or any(is_pinned(compact[i]) for i in unit):
            continue
        if any(_role(compact[i]) in ("system", "user") and not _is_tool_result(compact[i])
               for i in unit):
            continue
        if placeholder is None:
            evicted.update(unit)
            total -= sum(sizes[i] for i in unit)
            continue
        for i in unit:
            if not _is_tool_result(compact[i]):
                continue
            compact[i] = _placeholder(compact[i], placeholder)
            new_size = estimate_tokens(compact[i])
            total -= sizes[i] - new_size
            sizes[i] = new_size
    # A signal, not an error: the history is still returned whole (found by a newcomer: a
    # 2,000-token budget returned ~2,257 with nothing to tell the caller).
    return Compacted((m for i, m in enumerate(compact) if i not in evicted),
                     estimated_tokens=total, max_tokens=max_tokens)


def _placeholder(message: Any, text: str) -> Any:
    if _get(message, "type") == "function_call_output":
        return _replace(message, output=text)
    blocks = _blocks(message)
    if any(isinstance(b, Mapping) and b.get("type") == "tool_result" for b in blocks):
        return _replace(message, content=[
            {**b, "content": text} if isinstance(b, Mapping) and b.get("type") == "tool_result"
            else b for b in blocks])
    return _replace(message, content=text)


def strip_markers(history: Iterable[Message]) -> list[Message]:
    """The history without the pinned marker key, for providers that reject unknown keys."""
    return [m if _is_object(m) else {k: v for k, v in m.items() if k != PINNED_KEY}
            for m in history]


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

    def observe(self, error: str | BaseException | None) -> dict[str, Any] | None:
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

    def text(self) -> str | None:
        if not self._instructions:
            return None
        return "\n".join([self.title, *(f"- {i}" for i in self._instructions)])

    def message(self) -> dict[str, Any] | None:
        text = self.text()
        return None if text is None else {"role": self.role, "content": text, PINNED_KEY: True}

    def langchain_message(self) -> Any:
        """The pinned context as a LangChain message (needs langchain-core)."""
        from langchain_core.messages import HumanMessage, SystemMessage

        text = self.text()
        if text is None:
            return None
        kind = SystemMessage if self.role == "system" else HumanMessage
        return kind(content=text, id=PINNED_ID)

    def inject(self, history: Sequence[Message]) -> list[Message]:
        """A new history with one pinned message right after the system prompt (or first, if
        there is none), replacing any earlier pinned message; without instructions, none.
        In a history of LangChain messages the pinned message is a LangChain message too."""
        rest = [_copy(m) for m in history if not is_pinned(m)]
        objects = any(_is_object(m) for m in history)
        message = self.langchain_message() if objects else self.message()
        if message is None:
            return rest
        at = 1 if rest and _role(rest[0]) in ("system", "developer") else 0
        return [*rest[:at], message, *rest[at:]]
