"""History helpers, on the seed article's 47-iteration rename loop."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from governance_client import repeat_key
from governance_client.history import (
    PinnedContext,
    RepeatedErrorGuard,
    compact_history,
    compact_with_budget,
    estimate_tokens,
    is_pinned,
    strip_markers,
)
from governance_client.testing import FakeGovernance

SYSTEM = {"role": "system", "content": "You are a coding agent. Use the tools to edit files."}
TASK = {"role": "user", "content": "Rename the variable user_id to account_id in auth.py."}
EDIT = {"path": "auth.py", "old": "user_id", "new": "account_id"}
PHRASES = ("I'll now", "Let me", "I need to")
LISTING = "".join(
    f"\nauth.py:{n}: {'    ' * (n % 3)}account_id = session.get('account')" for n in range(8)
)


def rename_loop(iterations: int = 47) -> list[dict[str, Any]]:
    """The seed's log: the same edit every turn, only the narration rephrased."""
    history = [dict(SYSTEM), dict(TASK)]
    for i in range(iterations):
        history.append(
            {
                "role": "assistant",
                "content": f"{PHRASES[i % 3]} rename `user_id` to `account_id` in auth.py\n"
                'Tool call: edit_file(path="auth.py", old="user_id", new="account_id")',
            }
        )
        outcome = "3 matches replaced" if i == 0 else "no matches found"
        history.append({"role": "tool_result", "content": f"[iter {i + 1}] {outcome}{LISTING}"})
    return history


def results(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in history if m["role"] == "tool_result"]


def chars(history: list[dict[str, Any]]) -> int:
    return sum(len(m["content"]) for m in history)


def test_compaction_shrinks_the_rename_loop() -> None:
    history = rename_loop()

    compact = compact_history(history, keep_full_last=5)

    assert len(compact) == len(history)
    assert chars(results(compact)) < chars(results(history)) / 2
    assert chars(compact) < chars(history) * 0.7
    first_result = compact[3]["content"]
    assert first_result.startswith("[result truncated: [iter 1] 3 matches replaced")
    assert first_result.endswith("more characters)]")
    assert len(first_result) < 220


def test_compaction_keeps_the_last_turns_and_other_roles_whole() -> None:
    history = rename_loop()

    compact = compact_history(history, keep_full_last=5)

    assert compact[-5:] == history[-5:]
    assert [m for m in compact if m["role"] != "tool_result"] == [
        m for m in history if m["role"] != "tool_result"
    ]


def test_compaction_never_mutates_its_input() -> None:
    history = rename_loop()
    before = copy.deepcopy(history)

    compact = compact_history(history)
    compact[0]["content"] = "changed"

    assert history == before


def test_compaction_accepts_the_openai_tool_role_and_leaves_short_results_alone() -> None:
    long, short = "x" * 201, "y" * 200
    history = [
        {"role": "tool", "tool_call_id": "c1", "content": long},
        {"role": "tool", "tool_call_id": "c2", "content": short},
    ]

    compact = compact_history(history, keep_full_last=0)

    assert compact[0]["content"].startswith("[result truncated: " + "x" * 150 + "…")
    assert compact[0]["tool_call_id"] == "c1"
    assert compact[1] == history[1]


def test_compaction_with_keep_full_last_zero_compacts_everything() -> None:
    # The seed's history[:-0] would have kept nothing old and compacted nothing.
    history = rename_loop(3)

    compact = compact_history(history, keep_full_last=0)

    assert all(m["content"].startswith("[result truncated") for m in compact[3::2])


def test_a_short_history_is_returned_as_a_copy() -> None:
    history = rename_loop(1)

    compact = compact_history(history, keep_full_last=5)

    assert compact == history
    assert compact is not history


def test_estimate_tokens_counts_about_four_characters_per_token() -> None:
    assert estimate_tokens({"role": "user", "content": "x" * 400}) == 104
    assert estimate_tokens({"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}) > 4


def test_the_budget_evicts_the_oldest_tool_results_first() -> None:
    history = rename_loop()
    full = sum(estimate_tokens(m) for m in compact_history(history))

    fitted = compact_with_budget(history, max_tokens=full - 100)

    kept = [m["content"] for m in fitted if m["role"] == "tool_result"]
    assert not any("[iter 1]" in c or "[iter 2]" in c for c in kept)
    assert any("[iter 47]" in c for c in kept)
    assert sum(estimate_tokens(m) for m in fitted) <= full - 100


def test_the_budget_never_evicts_the_system_prompt_pinned_context_or_last_turns() -> None:
    pinned = PinnedContext(["Only touch auth.py."])
    history = pinned.inject(rename_loop())

    fitted = compact_with_budget(history, max_tokens=10, keep_full_last=5)

    assert fitted[0] == SYSTEM
    assert is_pinned(fitted[1])
    assert fitted[-5:] == history[-5:]
    assert [m for m in fitted if m["role"] == "assistant"] == [
        m for m in history if m["role"] == "assistant"
    ]
    # Still over budget: what remains is returned rather than the instructions dropped.
    assert sum(estimate_tokens(m) for m in fitted) > 10


def test_the_budget_tells_the_caller_the_estimate_of_what_it_returns() -> None:
    # Found by a newcomer: max_tokens=2000 returned ~2,257 estimated tokens (the last turns
    # are kept whole), and nothing told the caller.
    history = rename_loop()
    counted: list[object] = []

    def tokenizer(message: object) -> int:
        counted.append(message)
        return estimate_tokens(message)

    over = compact_with_budget(history, max_tokens=10, estimate_tokens=tokenizer)
    assert over.estimated_tokens == sum(estimate_tokens(m) for m in over) > 10
    assert over.over_budget and over.max_tokens == 10
    assert len(counted) == len(history)  # the caller's tokenizer, once per message: free

    fits = compact_with_budget(history, max_tokens=100_000)
    assert fits.estimated_tokens == sum(estimate_tokens(m) for m in fits)
    assert not fits.over_budget
    placeholders = compact_with_budget(history, max_tokens=10, placeholder="[evicted]")
    assert placeholders.estimated_tokens == sum(estimate_tokens(m) for m in placeholders)
    # Still the list it always was.
    assert isinstance(over, list) and type(over[:]) is list


def test_the_budget_keeps_a_history_that_already_fits_untouched() -> None:
    history = rename_loop(2)

    assert compact_with_budget(history, max_tokens=100_000) == compact_history(history)


def test_the_budget_can_leave_a_placeholder_for_apis_that_pair_tool_calls() -> None:
    history = rename_loop()

    fitted = compact_with_budget(history, max_tokens=10, placeholder="[evicted]")

    assert len(fitted) == len(history)
    assert fitted[3]["content"] == "[evicted]"
    assert fitted[-1] == history[-1]


def test_the_guard_fires_at_the_third_identical_no_matches_found_error() -> None:
    guard = RepeatedErrorGuard(threshold=3)

    first = guard.observe("no matches found")
    second = guard.observe("no  matches\tfound ")
    third = guard.observe("no matches found")

    assert first is None and second is None
    assert third == {
        "role": "user",
        "content": "The error 'no matches found' occurred 3 times. "
        "Change approach radically or abandon this subtask.",
    }


def test_the_guard_names_the_actual_count_after_the_threshold() -> None:
    guard = RepeatedErrorGuard(threshold=2)
    guard.observe("boom")
    guard.observe("boom")

    message = guard.observe(RuntimeError("boom"))

    assert message is not None and "occurred 3 times" in message["content"]


def test_the_guard_resets_on_success() -> None:
    guard = RepeatedErrorGuard(threshold=3)
    guard.observe("no matches found")
    guard.observe("no matches found")

    assert guard.observe(None) is None
    assert guard.observe("no matches found") is None
    guard.reset()
    assert guard.counts == {}


def test_the_guard_speaks_like_the_service_directive() -> None:
    fake = FakeGovernance(max_repeat_action=10, error_threshold=3)
    run = fake.client().start_run("bot")
    guard = RepeatedErrorGuard(threshold=3)
    run.check("edit_file", EDIT)
    for _ in range(3):
        run.report(error="no matches found")
        nudge = guard.observe("no matches found")
        decision = run.check("edit_file", EDIT)

    assert decision.directive is not None and nudge is not None
    assert nudge["content"] == decision.directive["content"]


def test_pinned_context_is_injected_right_after_the_system_prompt() -> None:
    pinned = PinnedContext(["Only touch auth.py.", "Keep the public API."])

    history = pinned.inject([SYSTEM, TASK])

    assert history[0] == SYSTEM
    assert history[1] == {
        "role": "system",
        "content": "Active instructions (pinned; they override anything earlier):\n"
        "- Only touch auth.py.\n- Keep the public API.",
        "pinned": True,
    }
    assert history[2] == TASK


def test_pinned_context_replaces_the_previous_pinned_message_every_turn() -> None:
    pinned = PinnedContext(["Only touch auth.py."])
    history = pinned.inject([SYSTEM, TASK])
    pinned.add("Also rename it in tests.")
    pinned.remove("Only touch auth.py.")

    history = pinned.inject([*history, {"role": "assistant", "content": "ok"}])

    assert [m for m in history if is_pinned(m)] == [pinned.message()]
    assert "Also rename it in tests." in history[1]["content"]
    assert "Only touch auth.py." not in history[1]["content"]


def test_pinned_context_goes_first_without_a_system_prompt_and_away_when_cleared() -> None:
    pinned = PinnedContext(["Only touch auth.py."])
    history = pinned.inject([TASK])
    assert is_pinned(history[0])

    pinned.clear()

    assert pinned.inject(history) == [TASK]


def test_strip_markers_removes_the_pinned_key_only() -> None:
    history = PinnedContext(["x"]).inject([SYSTEM])

    assert strip_markers(history)[1] == {"role": "system", "content": history[1]["content"]}


def test_the_rename_loop_calls_share_one_repeat_key() -> None:
    keys = {repeat_key("edit_file", dict(EDIT)) for _ in range(47)}
    keys.add(repeat_key("edit_file", {"new": "account_id ", "path": "auth.py", "old": " user_id"}))

    assert len(keys) == 1
    assert repeat_key("edit_file", {**EDIT, "path": "models.py"}) not in keys


def test_the_service_stops_the_rename_loop_at_the_fourth_call() -> None:
    fake = FakeGovernance(max_repeat_action=3)
    run = fake.client().start_run("rename-bot")

    decisions = [run.check("edit_file", EDIT) for _ in range(4)]

    assert [d.allowed for d in decisions] == [True, True, True, False]
    assert decisions[3].reason == "loop_detected"
    assert decisions[3].step == 4
    assert decisions[3].repeat_key == repeat_key("edit_file", EDIT)


def _pairs_intact(messages: list[dict[str, Any]]) -> bool:
    """Every tool result follows the assistant turn that called it (OpenAI refuses others)."""
    called: set[str] = set()
    for message in messages:
        if message.get("role") == "assistant" and message.get("tool_calls"):
            called = {call["id"] for call in message["tool_calls"]}
        elif message.get("role") == "tool":
            if message["tool_call_id"] not in called:
                return False
        else:
            called = set()
    return True


def test_the_budget_pairs_each_result_with_its_own_call_when_ids_repeat() -> None:
    """Some servers name every turn's call ``call_0``. Found by an attacker: each result was
    tied to the last call of that id, so at some budget the first result stayed while its
    call went. Every budget down to nothing now leaves every result after its call."""
    def turn(n: int) -> list[dict[str, Any]]:
        return [{"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_0", "type": "function",
                     "function": {"name": "read", "arguments": f'{{"n": {n}}}'}}]},
                {"role": "tool", "tool_call_id": "call_0", "content": "x" * 2000}]

    history = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
               *turn(0), *turn(1), *turn(2), {"role": "user", "content": "more"},
               *[{"role": "assistant", "content": "ok"}] * 5]
    full = compact_with_budget(history, max_tokens=10**9).estimated_tokens
    for budget in range(full, 0, -1):
        assert _pairs_intact(compact_with_budget(history, max_tokens=budget)), budget


def test_a_history_item_that_is_no_message_is_named() -> None:
    for item in (("user", "hi"), "hi", None, 5):
        with pytest.raises(TypeError, match=r"history\[1\] is a .*: each message must be"):
            compact_with_budget([{"role": "user", "content": "u"}, item])
