"""History helpers on what frameworks pass around: LangChain messages, parts lists, Anthropic
blocks, Agents SDK items; eviction that never orphans a tool call."""

from __future__ import annotations

from typing import Any

import pytest

from governance_client.history import (
    PINNED_ID,
    PinnedContext,
    compact_history,
    compact_with_budget,
    is_pinned,
)

LONG = "line of a very long tool output\n" * 40  # about 1,300 characters


def openai_exchange(i: int) -> list[dict[str, Any]]:
    return [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": f"c{i}a", "type": "function",
                         "function": {"name": "search", "arguments": "{}"}},
                        {"id": f"c{i}b", "type": "function",
                         "function": {"name": "fetch", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": f"c{i}a", "content": LONG},
        {"role": "tool", "tool_call_id": f"c{i}b", "content": LONG},
    ]


def assert_no_orphans(history: list[Any]) -> None:
    """Every call has its results and every result its call, as OpenAI requires."""
    from governance_client.history import _call_ids, _result_ids

    calls = {c for m in history for c in _call_ids(m)}
    results = {r for m in history for r in _result_ids(m)}
    assert calls == results


def test_budget_eviction_takes_a_call_with_all_its_results() -> None:
    history = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}]
    for i in range(6):
        history += openai_exchange(i)

    compact = compact_with_budget(history, max_tokens=600, keep_full_last=3)

    assert len(compact) < len(history)
    assert compact[:2] == history[:2]
    assert_no_orphans(compact)


def test_budget_eviction_with_a_placeholder_keeps_every_call() -> None:
    history = [{"role": "user", "content": "task"}]
    for i in range(4):
        history += openai_exchange(i)

    compact = compact_with_budget(history, max_tokens=300, keep_full_last=3,
                                  placeholder="[evicted]")

    assert len(compact) == len(history)
    assert_no_orphans(compact)
    assert compact[2]["content"] == "[evicted]"


def test_an_exchange_partly_in_the_kept_tail_is_not_evicted() -> None:
    history = [{"role": "user", "content": "task"}, *openai_exchange(0)]
    compact = compact_with_budget(history, max_tokens=10, keep_full_last=1)
    assert_no_orphans(compact)
    assert len(compact) == len(history)


def test_list_of_parts_content_is_compacted() -> None:
    history = [
        {"role": "tool", "tool_call_id": "x", "content": [{"type": "text", "text": LONG}]},
        {"role": "user", "content": "a"}, {"role": "user", "content": "b"},
    ]
    compact = compact_history(history, keep_full_last=2)
    (part,) = compact[0]["content"]
    assert part["text"].startswith("[result truncated: line of a very long")
    assert history[0]["content"][0]["text"] == LONG  # input untouched


def test_anthropic_tool_result_blocks_are_compacted_and_evicted_with_their_tool_use() -> None:
    history: list[dict[str, Any]] = [{"role": "user", "content": "task"}]
    for i in range(4):
        history += [
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": f"tu{i}", "name": "search", "input": {"q": i}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": f"tu{i}", "content": LONG}]},
        ]
    compact = compact_history(history, keep_full_last=2)
    assert compact[2]["content"][0]["content"].startswith("[result truncated:")
    assert compact[2]["content"][0]["tool_use_id"] == "tu0"

    evicted = compact_with_budget(history, max_tokens=200, keep_full_last=2)
    assert_no_orphans(evicted)
    assert evicted[0] == history[0] and len(evicted) < len(history)


def test_agents_sdk_function_call_output_items_are_compacted_and_evicted_in_pairs() -> None:
    items: list[dict[str, Any]] = [{"role": "user", "content": "task"}]
    for i in range(4):
        items += [
            {"type": "function_call", "call_id": f"fc{i}", "name": "search", "arguments": "{}"},
            {"type": "function_call_output", "call_id": f"fc{i}", "output": LONG},
        ]
    compact = compact_history(items, keep_full_last=2)
    assert compact[2]["output"].startswith("[result truncated:")

    evicted = compact_with_budget(items, max_tokens=150, keep_full_last=2)
    assert_no_orphans(evicted)
    assert len(evicted) < len(items) and evicted[0] == items[0]


def langchain_history(exchanges: int) -> list[Any]:
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

    history: list[Any] = [SystemMessage("sys"), HumanMessage("task")]
    for i in range(exchanges):
        history += [
            AIMessage(content="", tool_calls=[
                {"name": "search", "args": {"q": i}, "id": f"lc{i}a"},
                {"name": "fetch", "args": {"u": i}, "id": f"lc{i}b"}]),
            ToolMessage(content=LONG, tool_call_id=f"lc{i}a"),
            ToolMessage(content=[{"type": "text", "text": LONG}], tool_call_id=f"lc{i}b"),
        ]
    return history


def test_langchain_messages_are_compacted_as_messages() -> None:
    pytest.importorskip("langchain_core")
    from langchain_core.messages import BaseMessage, ToolMessage

    history = langchain_history(3)
    compact = compact_history(history, keep_full_last=3)

    assert all(isinstance(m, BaseMessage) for m in compact)
    assert isinstance(compact[3], ToolMessage)
    assert compact[3].content.startswith("[result truncated:")
    assert compact[3].tool_call_id == "lc0a"
    assert compact[4].content[0]["text"].startswith("[result truncated:")
    assert history[3].content == LONG


def test_langchain_budget_eviction_never_orphans_tool_calls() -> None:
    pytest.importorskip("langchain_core")
    history = langchain_history(6)

    compact = compact_with_budget(history, max_tokens=400, keep_full_last=3)

    assert len(compact) < len(history)
    assert [m.type for m in compact[:2]] == ["system", "human"]
    assert_no_orphans(compact)


def test_pinned_context_is_a_langchain_message_in_a_langchain_history() -> None:
    pytest.importorskip("langchain_core")
    from langchain_core.messages import SystemMessage

    pinned = PinnedContext(["Rename in auth.py only."])
    history = langchain_history(1)

    once = pinned.inject(history)
    twice = pinned.inject(once)

    assert isinstance(once[1], SystemMessage) and once[1].id == PINNED_ID
    assert is_pinned(once[1])
    assert len(twice) == len(history) + 1
    assert "Rename in auth.py only." in twice[1].content
