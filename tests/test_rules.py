"""The pure decision rules of SPEC section 4 (governance_client/rules.py), rule by rule and
boundary by boundary, in the order of SPEC 4.4, then terminal runs, shadow mode, the kill
switch, finish, kill, redaction, replays and the seed scenarios.

Everything here is pure: no database, no clock (``now`` is passed in), no network.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from governance_client.keys import repeat_key
from governance_client.rules import (
    ALLOW,
    KILLED,
    REASONS,
    RUNNING,
    STOP,
    STOPPED,
    WOULD_STOP,
    Check,
    Decision,
    FinishError,
    LastResult,
    Policy,
    RunState,
    evaluate,
    finish,
    kill,
    progress_token,
    redact,
    replay_allowed,
    terminal_decision,
)

from governance_client import rules
from policies.document import default_policy

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)

# Every limit out of the way, so that a test switches on only the rule it is about.
LOOSE = Policy(
    max_steps=10000,
    max_repeat_action=1000,
    no_progress_window=1000,
    max_seconds=None,
    max_usd=None,
    max_tool_calls=None,
)


def loose(**changes: Any) -> Policy:
    return replace(LOOSE, **changes)


def fresh(**changes: Any) -> RunState:
    return RunState(started_at=T0, **changes)


def step(i: int, *, name: str = "search.docs", **changes: Any) -> Check:
    """A check whose args differ from every other step's, so no loop builds up by accident."""
    return Check(name=name, args={"query": f"question {i}"}, **changes)


def same(**changes: Any) -> Check:
    """The same call every time: search.docs with the same query."""
    return Check(name="search.docs", args={"query": "refund policy"}, **changes)


def error(text: str, digest: str | None = None) -> LastResult:
    return LastResult(status="error", error=text, digest=digest)


def drive(
    policy: Policy,
    checks: Iterable[Check],
    state: RunState | None = None,
    *,
    now: datetime = T0,
    kill: str | None = None,
) -> tuple[list[Decision], RunState]:
    """Evaluate the checks one after the other, as the service does, threading the state."""
    state = state if state is not None else fresh()
    decisions = []
    for check in checks:
        decision, state = evaluate(policy, state, check, now=now, kill=kill)
        decisions.append(decision)
    return decisions, state


def answers(decisions: Sequence[Decision]) -> list[str]:
    return [d.answer for d in decisions]


def reasons(decisions: Sequence[Decision]) -> list[str]:
    return [d.reason for d in decisions]


# --- The defaults ----------------------------------------------------------------------------


def test_the_rules_policy_defaults_are_the_documents_defaults() -> None:
    assert Policy.from_document(default_policy()) == Policy()


def test_the_defaults_are_the_seeds_limits() -> None:
    assert Policy().limits() == {
        "max_steps": 18,
        "max_repeat_action": 3,
        "no_progress_window": 4,
        "max_seconds": 45,
        "max_usd": 1.0,
        "max_tool_calls": None,
    }


def test_a_normal_step_is_allowed_with_step_ok_and_carries_no_message() -> None:
    decision, state = evaluate(Policy(), fresh(), step(1), now=T0)

    assert (decision.outcome, decision.answer, decision.reason) == (ALLOW, ALLOW, "step_ok")
    assert decision.step == 1
    assert decision.repeat_count == 1
    assert decision.message is None
    assert decision.next_action is None
    assert decision.directive is None
    assert decision.shadow is None
    assert (state.status, state.steps, state.tool_calls) == (RUNNING, 1, 1)


# --- 4.4 step counter ------------------------------------------------------------------------


def test_the_step_counter_counts_every_check_of_a_running_run_the_stopped_one_included() -> None:
    decisions, state = drive(Policy(max_steps=2), [step(1), step(2), step(3)])

    assert [d.step for d in decisions] == [1, 2, 3]
    assert state.steps == 3


# --- 4.4 rule 2: max_steps -------------------------------------------------------------------


def test_step_18_is_allowed_with_max_steps_18() -> None:
    decisions, state = drive(Policy(max_steps=18), [step(i) for i in range(18)])

    assert answers(decisions) == [ALLOW] * 18
    assert decisions[-1].step == 18
    assert state.status == RUNNING


def test_step_19_is_stopped_with_max_steps_18() -> None:
    decisions, state = drive(Policy(max_steps=18), [step(i) for i in range(19)])

    last = decisions[-1]
    assert (last.answer, last.reason, last.step) == (STOP, "max_steps", 19)
    assert "max_steps=18" in (last.message or "")
    assert "19" in (last.message or "")
    assert last.next_action
    assert (state.status, state.stop_reason, state.ended_at) == (STOPPED, "max_steps", T0)


def test_max_steps_1_allows_exactly_one_step() -> None:
    decisions, _ = drive(loose(max_steps=1), [step(1), step(2)])

    assert reasons(decisions) == ["step_ok", "max_steps"]


# --- 4.4 rule 3: tool_denied -----------------------------------------------------------------


@pytest.mark.parametrize("action_type", ["tool", "llm", "other"])
def test_a_denied_name_is_stopped_whatever_the_action_type(action_type: str) -> None:
    decision, state = evaluate(
        loose(deny=("shell.*",)), fresh(), Check(name="shell.exec", type=action_type), now=T0
    )

    assert (decision.answer, decision.reason) == (STOP, "tool_denied")
    assert "shell.*" in (decision.message or "")
    assert state.stop_reason == "tool_denied"


@pytest.mark.parametrize("action_type", ["tool", "llm", "other"])
def test_a_name_outside_the_allow_list_is_stopped_whatever_the_action_type(
    action_type: str,
) -> None:
    decision, _ = evaluate(
        loose(allow=("search.*",)), fresh(), Check(name="crm.update", type=action_type), now=T0
    )

    assert (decision.answer, decision.reason) == (STOP, "tool_denied")
    assert "search.*" in (decision.message or "")


def test_a_name_in_the_allow_list_is_allowed() -> None:
    decision, _ = evaluate(
        loose(allow=("search.*", "crm.read")), fresh(), Check(name="crm.read"), now=T0
    )

    assert decision.answer == ALLOW


def test_deny_wins_over_allow() -> None:
    policy = loose(allow=("search.*",), deny=("search.admin",))

    denied, _ = evaluate(policy, fresh(), Check(name="search.admin"), now=T0)
    allowed, _ = evaluate(policy, fresh(), Check(name="search.docs"), now=T0)

    assert (denied.answer, denied.reason) == (STOP, "tool_denied")
    assert allowed.answer == ALLOW


def test_no_allow_list_allows_every_name() -> None:
    decision, _ = evaluate(loose(allow=None), fresh(), Check(name="anything.at.all"), now=T0)

    assert decision.answer == ALLOW


def test_an_empty_allow_list_allows_no_name() -> None:
    decision, _ = evaluate(loose(allow=()), fresh(), Check(name="search.docs"), now=T0)

    assert decision.reason == "tool_denied"


@pytest.mark.parametrize(
    ("policy", "name"),
    [
        (loose(deny=("Shell.*",)), "shell.exec"),
        (loose(deny=("shell.*",)), "Shell.exec"),
        (loose(deny=("SHELL",)), "shell"),
    ],
)
def test_deny_patterns_are_case_sensitive(policy: Policy, name: str) -> None:
    decision, _ = evaluate(policy, fresh(), Check(name=name), now=T0)

    assert decision.answer == ALLOW


def test_allow_patterns_are_case_sensitive() -> None:
    decision, _ = evaluate(loose(allow=("search.*",)), fresh(), Check(name="Search.docs"), now=T0)

    assert decision.reason == "tool_denied"


@pytest.mark.parametrize(
    ("pattern", "name", "denied"),
    [
        ("db.?rop", "db.drop", True),
        ("db.?rop", "db.ddrop", False),
        ("fs.[rw]*", "fs.write", True),
        ("fs.[rw]*", "fs.list", False),
        ("fs.[!r]*", "fs.read", False),
        ("*", "whatever", True),
        ("*.delete", "crm.contacts.delete", True),
        ("exact", "exact", True),
        ("exact", "exactly", False),
    ],
)
def test_patterns_are_fnmatch_globs(pattern: str, name: str, denied: bool) -> None:
    decision, _ = evaluate(loose(deny=(pattern,)), fresh(), Check(name=name), now=T0)

    assert (decision.reason == "tool_denied") is denied


# --- 4.4 rule 4: max_seconds -----------------------------------------------------------------


def test_a_check_at_exactly_max_seconds_is_allowed() -> None:
    decision, _ = evaluate(loose(max_seconds=45), fresh(), step(1), now=T0 + timedelta(seconds=45))

    assert decision.answer == ALLOW


def test_a_check_just_past_max_seconds_is_stopped() -> None:
    now = T0 + timedelta(seconds=45, milliseconds=1)

    decision, state = evaluate(loose(max_seconds=45), fresh(), step(1), now=now)

    assert (decision.answer, decision.reason) == (STOP, "max_seconds")
    assert "max_seconds=45" in (decision.message or "")
    assert state.ended_at == now


def test_max_seconds_accepts_a_fraction() -> None:
    policy = loose(max_seconds=0.5)

    inside, _ = evaluate(policy, fresh(), step(1), now=T0 + timedelta(milliseconds=500))
    past, _ = evaluate(policy, fresh(), step(1), now=T0 + timedelta(milliseconds=501))

    assert (inside.answer, past.reason) == (ALLOW, "max_seconds")


# --- 4.4 rule 5: max_usd ---------------------------------------------------------------------


def test_spend_just_under_max_usd_is_allowed() -> None:
    costs = [Decimal("0.5"), Decimal("0.499999")]

    decisions, state = drive(
        loose(max_usd=Decimal("1.00")), [step(i, cost_usd=c) for i, c in enumerate(costs)]
    )

    assert answers(decisions) == [ALLOW, ALLOW]
    assert state.cost_usd == Decimal("0.999999")


def test_spend_reaching_max_usd_is_stopped() -> None:
    costs = [Decimal("0.5"), Decimal("0.49"), Decimal("0.01")]

    decisions, state = drive(
        loose(max_usd=Decimal("1.00")), [step(i, cost_usd=c) for i, c in enumerate(costs)]
    )

    assert reasons(decisions) == ["step_ok", "step_ok", "max_usd"]
    assert "max_usd=1" in (decisions[-1].message or "")
    assert state.cost_usd == Decimal("1.00")


def test_max_usd_counts_this_checks_cost() -> None:
    decision, state = evaluate(
        loose(max_usd=Decimal("1.00")), fresh(), step(1, cost_usd=Decimal("1.00")), now=T0
    )

    assert (decision.answer, decision.reason) == (STOP, "max_usd")
    assert state.cost_usd == Decimal("1.00")


def test_a_free_check_is_allowed_below_max_usd() -> None:
    decision, _ = evaluate(
        loose(max_usd=Decimal("0.000001")), fresh(), step(1, cost_usd=Decimal(0)), now=T0
    )

    assert decision.answer == ALLOW


# --- 4.4 rule 6: max_tool_calls --------------------------------------------------------------


def test_max_tool_calls_counts_tool_calls_only() -> None:
    types = ["tool", "llm", "other", "tool", "llm", "other", "tool"]

    decisions, state = drive(
        loose(max_tool_calls=2), [step(i, type=t) for i, t in enumerate(types)]
    )

    assert reasons(decisions) == ["step_ok"] * 6 + ["max_tool_calls"]
    assert state.tool_calls == 2
    assert "max_tool_calls=2" in (decisions[-1].message or "")


def test_a_non_tool_action_is_allowed_when_the_tool_budget_is_spent() -> None:
    checks = [step(1), step(2), step(3, type="llm"), step(4, type="other")]

    decisions, state = drive(loose(max_tool_calls=2), checks)

    assert answers(decisions) == [ALLOW] * 4
    assert state.tool_calls == 2


# --- 4.4 rule 7: loop_detected ---------------------------------------------------------------


def test_the_3rd_identical_call_is_allowed_with_max_repeat_action_3() -> None:
    decisions, _ = drive(Policy(max_repeat_action=3), [same()] * 3)

    assert answers(decisions) == [ALLOW] * 3
    assert [d.repeat_count for d in decisions] == [1, 2, 3]


def test_the_4th_identical_call_is_stopped_with_max_repeat_action_3() -> None:
    decisions, state = drive(Policy(max_repeat_action=3), [same()] * 4)

    last = decisions[-1]
    assert (last.answer, last.reason, last.step) == (STOP, "loop_detected", 4)
    assert last.repeat_count == 3
    assert last.message == (
        "search.docs was already called 3 times with the same arguments, all that "
        "max_repeat_action=3 allows: this call was not run and the run is stopped."
    )
    assert last.next_action
    assert state.repeat_counts[last.repeat_key] == 3


def test_other_calls_in_between_do_not_reset_the_repeat_count() -> None:
    checks = [same(), step(1), same(), step(2), same(), step(3), same()]

    decisions, _ = drive(Policy(max_repeat_action=3), checks)

    assert reasons(decisions) == ["step_ok"] * 6 + ["loop_detected"]


def test_equivalent_args_are_the_same_call() -> None:
    checks = [
        Check(name="search.docs", args={"query": "refund policy", "page": 1}),
        Check(name="search.docs", args={"page": 1.0, "query": "  refund   policy "}),
    ]

    decisions, _ = drive(loose(max_repeat_action=1), checks)

    assert decisions[0].repeat_key == decisions[1].repeat_key
    assert reasons(decisions) == ["step_ok", "loop_detected"]


def test_ignored_args_do_not_hide_a_loop() -> None:
    checks = [
        Check(name="search.docs", args={"query": "refund", "request_id": str(i)}) for i in range(4)
    ]

    decisions, _ = drive(Policy(ignore_args=("request_id",)), checks)

    assert reasons(decisions) == ["step_ok"] * 3 + ["loop_detected"]


def test_the_action_type_is_not_part_of_the_repeat_key() -> None:
    checks = [same(type="tool"), same(type="llm"), same(type="other"), same(type="tool")]

    decisions, _ = drive(Policy(), checks)

    assert len({d.repeat_key for d in decisions}) == 1
    assert reasons(decisions) == ["step_ok"] * 3 + ["loop_detected"]


def test_the_repeat_key_is_the_shared_client_key() -> None:
    check = Check(name="search.docs", args={"query": "x", "request_id": "r1"})

    decision, _ = evaluate(Policy(ignore_args=("request_id",)), fresh(), check, now=T0)

    assert decision.repeat_key == repeat_key("search.docs", {"query": "x"})
    name, digest = decision.repeat_key.split(":")
    assert name == "search.docs"
    assert len(digest) >= 16
    int(digest, 16)


def test_redact_args_never_change_the_repeat_key() -> None:
    a = Check(name="login", args={"user": "ann", "password": "one"})
    b = Check(name="login", args={"user": "ann", "password": "two"})

    (da, db), _ = drive(Policy(redact_args=("password",)), [a, b])

    assert da.repeat_key != db.repeat_key


# --- 4.3 / 4.4 rule 8: no_progress -----------------------------------------------------------


def test_the_3rd_informative_check_without_progress_is_allowed_with_window_4() -> None:
    checks = [step(i, progress="page-1") for i in range(4)]

    decisions, state = drive(Policy(no_progress_window=4), checks)

    assert answers(decisions) == [ALLOW] * 4
    assert state.no_progress_streak == 3


def test_the_4th_informative_check_without_progress_is_stopped_with_window_4() -> None:
    checks = [step(i, progress="page-1") for i in range(5)]

    decisions, state = drive(Policy(no_progress_window=4), checks)

    assert reasons(decisions) == ["step_ok"] * 4 + ["no_progress"]
    assert "no_progress_window=4" in (decisions[-1].message or "")
    assert state.no_progress_streak == 4
    assert state.stop_reason == "no_progress"


def test_a_new_progress_value_resets_the_streak() -> None:
    checks = [step(i, progress="page-1") for i in range(4)]
    checks += [step(10 + i, progress="page-2") for i in range(5)]

    decisions, _ = drive(Policy(no_progress_window=4), checks)

    assert reasons(decisions) == ["step_ok"] * 8 + ["no_progress"]


def test_a_check_without_progress_or_result_leaves_the_streak_unchanged() -> None:
    checks = [step(i, progress="p") for i in range(4)]  # streak 3
    checks += [step(10 + i) for i in range(10)]  # not informative
    checks += [step(99, progress="p")]  # streak 4

    decisions, _ = drive(Policy(no_progress_window=4, max_steps=100), checks)

    assert reasons(decisions) == ["step_ok"] * 14 + ["no_progress"]


def test_an_ok_result_without_digest_is_not_informative() -> None:
    ok = LastResult(status="ok", summary="found 3 pages")
    checks = [step(i, progress="p") for i in range(4)]  # streak 3
    checks += [step(10 + i, last_result=ok) for i in range(10)]

    decisions, state = drive(Policy(no_progress_window=4, max_steps=100), checks)

    assert answers(decisions) == [ALLOW] * 14
    assert state.no_progress_streak == 3


def test_repeated_result_digests_are_no_progress() -> None:
    result = LastResult(status="ok", digest="sha-of-the-same-page")
    checks = [step(i, last_result=result) for i in range(5)]

    decisions, _ = drive(Policy(no_progress_window=4), checks)

    assert reasons(decisions) == ["step_ok"] * 4 + ["no_progress"]


def test_a_new_result_digest_is_progress() -> None:
    checks = [step(i, last_result=LastResult(status="ok", digest=f"d{i}")) for i in range(10)]

    decisions, state = drive(Policy(no_progress_window=1, max_steps=100), checks)

    assert answers(decisions) == [ALLOW] * 10
    assert state.no_progress_streak == 0


def test_a_repeated_error_text_is_no_progress() -> None:
    checks = [step(i, last_result=error("File not found")) for i in range(5)]

    decisions, _ = drive(Policy(no_progress_window=4), checks)

    assert reasons(decisions) == ["step_ok"] * 4 + ["no_progress"]


def test_the_error_signature_is_normalized_and_keeps_case() -> None:
    checks = [
        step(1, last_result=error("File not found")),
        step(2, last_result=error("  File \n not   found ")),
        step(3, last_result=error("file not found")),
    ]

    _, state = drive(loose(), checks)

    assert state.signatures_seen == {"error:File not found", "error:file not found"}
    assert state.no_progress_streak == 0  # the third one was new


def test_a_digest_is_the_signature_even_of_an_error() -> None:
    checks = [step(i, last_result=error("File not found", digest=f"d{i}")) for i in range(6)]

    decisions, state = drive(Policy(no_progress_window=1, max_steps=100), checks)

    assert answers(decisions) == [ALLOW] * 6
    assert state.signatures_seen == {f"d{i}" for i in range(6)}


def test_a_new_progress_value_with_an_old_digest_is_progress() -> None:
    result = LastResult(status="ok", digest="same")
    checks = [step(i, progress=f"p{i}", last_result=result) for i in range(6)]

    _, state = drive(loose(no_progress_window=1), checks)

    assert state.no_progress_streak == 0
    assert state.status == RUNNING


def test_a_new_digest_with_an_old_progress_value_is_progress() -> None:
    checks = [
        step(i, progress="p", last_result=LastResult(status="ok", digest=f"d{i}")) for i in range(6)
    ]

    _, state = drive(loose(no_progress_window=1), checks)

    assert state.no_progress_streak == 0
    assert state.status == RUNNING


def test_progress_1_and_1_0_are_the_same_value() -> None:
    checks = [step(1, progress=1)] + [step(10 + i, progress=1.0) for i in range(4)]

    decisions, _ = drive(Policy(no_progress_window=4), checks)

    assert progress_token(1) == progress_token(1.0)
    assert reasons(decisions) == ["step_ok"] * 4 + ["no_progress"]


def test_progress_string_1_and_number_1_are_different_values() -> None:
    checks = [step(1, progress=1), step(2, progress="1")]

    _, state = drive(loose(no_progress_window=1), checks)

    assert progress_token(1) != progress_token("1")
    assert state.no_progress_streak == 0
    assert len(state.progress_seen) == 2


def test_the_streak_counts_before_the_rules_run() -> None:
    # With window 1 the first repetition already stops: registration precedes the rules.
    checks = [step(1, progress="p"), step(2, progress="p")]

    decisions, _ = drive(Policy(no_progress_window=1), checks)

    assert reasons(decisions) == ["step_ok", "no_progress"]


# --- 4.4 rule 9 and the nudge: repeated errors -----------------------------------------------


def test_the_nudge_comes_with_the_3rd_report_of_an_error_and_names_the_count() -> None:
    checks = [step(i, last_result=error("File not found")) for i in range(4)]

    decisions, state = drive(loose(error_threshold=3, error_action="nudge"), checks)

    assert answers(decisions) == [ALLOW] * 4
    assert [d.directive for d in decisions[:2]] == [None, None]
    assert decisions[2].directive == {
        "type": "inject_message",
        "role": "user",
        "code": "repeated_error",
        "content": "The error 'File not found' occurred 3 times. "
        "Change approach radically or abandon this subtask.",
    }
    assert decisions[3].directive is not None
    assert "occurred 4 times" in decisions[3].directive["content"]
    assert state.error_counts == {"File not found": 4}


def test_the_nudge_counts_normalized_error_texts_with_case_kept() -> None:
    checks = [
        step(1, last_result=error("File not found")),
        step(2, last_result=error("  File   not\tfound\n")),
        step(3, last_result=error("FILE NOT FOUND")),
        step(4, last_result=error("File not found ")),
    ]

    decisions, state = drive(loose(error_threshold=3), checks)

    assert [d.directive is not None for d in decisions] == [False, False, False, True]
    assert state.error_counts == {"File not found": 3, "FILE NOT FOUND": 1}


def test_an_ok_result_never_counts_as_an_error() -> None:
    ok = LastResult(status="ok", error="File not found", digest=None)
    checks = [step(i, last_result=ok) for i in range(5)]

    decisions, state = drive(loose(error_threshold=1), checks)

    assert all(d.directive is None for d in decisions)
    assert state.error_counts == {}


def test_a_nudge_threshold_of_1_nudges_on_the_first_error() -> None:
    check = step(1, last_result=error("x"))

    decision, _ = evaluate(loose(error_threshold=1), fresh(), check, now=T0)

    assert decision.directive is not None
    assert "occurred 1 times" in decision.directive["content"]


def test_the_nudge_is_no_stop() -> None:
    checks = [step(i, last_result=error("boom")) for i in range(20)]

    decisions, _ = drive(loose(error_threshold=3, error_action="nudge"), checks)

    assert answers(decisions) == [ALLOW] * 20
    assert sum(d.directive is not None for d in decisions) == 18


def test_the_3rd_report_of_an_error_is_stopped_when_the_action_is_stop() -> None:
    checks = [step(i, last_result=error("File not found")) for i in range(3)]

    decisions, state = drive(loose(error_threshold=3, error_action="stop"), checks)

    assert reasons(decisions) == ["step_ok", "step_ok", "repeated_error"]
    last = decisions[-1]
    assert last.directive is None
    assert "File not found" in (last.message or "")
    assert "threshold=3" in (last.message or "")
    assert last.next_action
    assert state.stop_reason == "repeated_error"


def test_repeated_error_needs_this_check_to_report_the_error() -> None:
    state = fresh(error_counts={"boom": 5})
    policy = loose(error_threshold=2, error_action="stop")

    silent, _ = evaluate(policy, state, step(1), now=T0)
    ok, _ = evaluate(policy, state, step(2, last_result=LastResult(status="ok")), now=T0)
    failing, _ = evaluate(policy, state, step(3, last_result=error("boom")), now=T0)

    assert (silent.answer, ok.answer) == (ALLOW, ALLOW)
    assert failing.reason == "repeated_error"
    assert "occurred 6 times" in (failing.message or "")


def test_an_earlier_error_does_not_stop_a_check_that_reports_another_one() -> None:
    checks = [
        step(1, last_result=error("boom")),
        step(2, last_result=error("boom")),
        step(3, last_result=error("bang")),
    ]

    decisions, _ = drive(loose(error_threshold=3, error_action="stop"), checks)

    assert answers(decisions) == [ALLOW] * 3


# --- 4.4 evaluation order --------------------------------------------------------------------

KEY = repeat_key("search.docs", {"query": "x"})
EVERYTHING_FIRES = Check(
    name="search.docs",
    type="tool",
    args={"query": "x"},
    progress="p",
    last_result=error("boom"),
    cost_usd=Decimal("0.5"),
)


def _everything_fires(first: int) -> tuple[Policy, RunState, str | None, datetime]:
    """A check that every rule of SPEC 4.4 stops, with the rules before ``first`` disarmed."""
    armed = {
        "max_steps": 5,
        "deny": ("search.*",),
        "max_seconds": 10,
        "max_usd": Decimal("1"),
        "max_tool_calls": 1,
        "max_repeat_action": 1,
        "no_progress_window": 1,
    }
    disarmed = {
        "max_steps": 10000,
        "deny": (),
        "max_seconds": None,
        "max_usd": None,
        "max_tool_calls": None,
        "max_repeat_action": 1000,
        "no_progress_window": 1000,
    }
    order = ["max_steps", "deny", "max_seconds", "max_usd", "max_tool_calls",
             "max_repeat_action", "no_progress_window"]  # rules 2 to 8
    settings = {name: (disarmed if i + 1 < first else armed)[name] for i, name in
                enumerate(order)}
    policy = Policy(error_threshold=1, error_action="stop", **settings)
    state = fresh(
        steps=5,
        tool_calls=1,
        cost_usd=Decimal("0.5"),
        repeat_counts={KEY: 1},
        progress_seen={progress_token("p")},
        signatures_seen={"error:boom"},
    )
    kill_switch = "the global kill switch" if first == 0 else None
    return policy, state, kill_switch, T0 + timedelta(seconds=60)


@pytest.mark.parametrize(("first", "reason"), list(enumerate(REASONS)))
def test_the_first_rule_that_stops_wins(first: int, reason: str) -> None:
    policy, state, kill_switch, now = _everything_fires(first)

    decision, new = evaluate(policy, state, EVERYTHING_FIRES, now=now, kill=kill_switch)

    assert (decision.answer, decision.reason) == (STOP, reason)
    assert new.stop_reason == reason
    assert new.status == (KILLED if reason == "killed" else STOPPED)


def test_the_reasons_are_in_spec_order() -> None:
    assert REASONS == (
        "killed",
        "max_steps",
        "tool_denied",
        "max_seconds",
        "max_usd",
        "max_tool_calls",
        "loop_detected",
        "no_progress",
        "repeated_error",
    )


def test_max_steps_wins_over_loop_detected() -> None:
    decisions, _ = drive(Policy(max_steps=3, max_repeat_action=3), [same()] * 4)

    assert decisions[-1].reason == "max_steps"


def test_a_stopped_check_is_not_counted_as_an_allowed_call() -> None:
    decisions, state = drive(Policy(max_steps=1), [same(), same()])

    assert decisions[-1].reason == "max_steps"
    assert decisions[-1].repeat_count == 1
    assert state.repeat_counts == {decisions[0].repeat_key: 1}
    assert state.tool_calls == 1


def test_every_stop_carries_a_message_and_a_next_action() -> None:
    for first, reason in enumerate(REASONS):
        policy, state, kill_switch, now = _everything_fires(first)
        decision, _ = evaluate(policy, state, EVERYTHING_FIRES, now=now, kill=kill_switch)
        assert decision.reason == reason
        assert decision.message, reason
        assert decision.next_action, reason


@pytest.mark.parametrize(
    ("first", "names"),
    [
        (1, "max_steps=5"),
        (3, "max_seconds=10"),
        (4, "max_usd=1"),
        (5, "max_tool_calls=1"),
        (6, "max_repeat_action=1"),
        (7, "no_progress_window=1"),
        (8, "threshold=1"),
    ],
)
def test_a_stop_message_names_the_limit_and_its_value(first: int, names: str) -> None:
    policy, state, kill_switch, now = _everything_fires(first)

    decision, _ = evaluate(policy, state, EVERYTHING_FIRES, now=now, kill=kill_switch)

    assert names in (decision.message or "")


@pytest.mark.parametrize(
    ("changes", "written"),
    [
        ({"max_seconds": 1_000_000}, "max_seconds=1000000."),
        ({"max_seconds": 31_536_000}, "max_seconds=31536000."),
        ({"max_seconds": 0.5}, "max_seconds=0.5."),
        ({"max_usd": Decimal("0.000001")}, "max_usd=0.000001."),
        ({"max_usd": Decimal("250.00")}, "max_usd=250."),
    ],
)
def test_a_limit_is_written_in_the_message_as_people_write_it(
    changes: dict[str, Any], written: str
) -> None:
    check = step(1, cost_usd=Decimal(1000))

    decision, _ = evaluate(loose(**changes), fresh(), check, now=T0 + timedelta(days=400))

    assert f"{written[:-1]}: " in (decision.message or "")


# --- 4.4 terminal runs -----------------------------------------------------------------------


def _stopped_run(reason: str = "loop_detected", status: str = STOPPED) -> RunState:
    return fresh(
        status=status,
        stop_reason=reason,
        ended_at=T0 + timedelta(seconds=3),
        steps=4,
        tool_calls=3,
        cost_usd=Decimal("0.04"),
        repeat_counts={repeat_key("search.docs", {"query": "refund policy"}): 3},
        progress_seen={progress_token("p")},
        signatures_seen={"d"},
        no_progress_streak=2,
        error_counts={"boom": 1},
    )


def _busy_run() -> RunState:
    """A running run with something in every counter."""
    return _stopped_run(None, RUNNING)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("status", "stop_reason", "answered"),
    [
        ("stopped", "loop_detected", "loop_detected"),
        ("stopped", "max_usd", "max_usd"),
        ("stopped", "agent_stopped", "agent_stopped"),
        ("killed", "killed", "killed"),
        ("completed", None, "run_finished"),
        ("failed", None, "run_finished"),
    ],
)
def test_a_check_on_a_terminal_run_answers_its_stop_and_changes_nothing(
    status: str, stop_reason: str | None, answered: str
) -> None:
    state = _stopped_run(stop_reason, status)  # type: ignore[arg-type]
    before = copy.deepcopy(state)
    check = same(progress="new", last_result=error("new error"), cost_usd=Decimal("5"))

    decision, new = evaluate(Policy(), state, check, now=T0 + timedelta(hours=1))

    assert (decision.outcome, decision.answer, decision.reason) == (STOP, STOP, answered)
    assert decision.step == 4
    assert decision.repeat_count == 3
    assert decision.message
    assert decision.next_action
    assert decision.directive is None
    assert new == before
    assert state == before


def test_a_terminal_run_keeps_its_reason_when_a_kill_switch_covers_it() -> None:
    state = _stopped_run("max_steps")

    decision, new = evaluate(Policy(), state, same(), now=T0, kill="the global kill switch")

    assert decision.reason == "max_steps"
    assert (new.status, new.stop_reason) == (STOPPED, "max_steps")


def test_a_completed_run_answers_run_finished_even_when_killed() -> None:
    state = _stopped_run(None, "completed")  # type: ignore[arg-type]

    decision, new = evaluate(Policy(), state, same(), now=T0, kill="the team kill switch")

    assert decision.reason == "run_finished"
    assert new.status == "completed"


def test_a_stopped_run_answers_every_later_check_with_its_stop() -> None:
    decisions, state = drive(Policy(max_steps=2), [step(i) for i in range(6)])

    assert reasons(decisions) == ["step_ok", "step_ok"] + ["max_steps"] * 4
    assert [d.step for d in decisions] == [1, 2, 3, 3, 3, 3]
    assert state.steps == 3


def test_terminal_decision_uses_the_runs_counters() -> None:
    state = _stopped_run()

    decision = terminal_decision(state, "other:key")

    assert (decision.reason, decision.step, decision.repeat_count) == ("loop_detected", 4, 0)


# --- 4.4 shadow mode -------------------------------------------------------------------------


def test_shadow_mode_answers_a_would_be_stop_with_allow_and_the_shadow_reason() -> None:
    decisions, state = drive(Policy(mode="shadow", max_steps=2), [step(i) for i in range(3)])

    last = decisions[-1]
    assert last.outcome == WOULD_STOP
    assert last.answer == ALLOW
    assert last.reason == "step_ok"
    assert last.shadow is not None
    assert last.shadow["reason"] == "max_steps"
    assert last.message is None
    assert last.next_action is None
    assert state.status == RUNNING
    assert state.stop_reason is None
    assert state.ended_at is None


def test_shadow_mode_counts_a_would_be_stop_like_an_allow() -> None:
    decisions, state = drive(Policy(mode="shadow"), [same()] * 5)

    assert [d.outcome for d in decisions] == [ALLOW] * 3 + [WOULD_STOP] * 2
    assert [d.shadow and d.shadow["reason"] for d in decisions[3:]] == ["loop_detected"] * 2
    assert [d.repeat_count for d in decisions] == [1, 2, 3, 4, 5]
    assert state.tool_calls == 5
    assert state.steps == 5


def test_in_shadow_mode_the_run_goes_on_past_every_limit() -> None:
    policy = Policy(
        mode="shadow",
        max_steps=2,
        max_usd=Decimal("0.01"),
        max_tool_calls=1,
        deny=("search.*",),
        error_action="stop",
        error_threshold=1,
    )
    checks = [same(cost_usd=Decimal("1"), last_result=error("x"), progress="p")] * 30

    decisions, state = drive(policy, checks, now=T0 + timedelta(hours=2))

    assert answers(decisions) == [ALLOW] * 30
    assert all(d.outcome == WOULD_STOP for d in decisions)
    assert state.status == RUNNING
    assert state.steps == 30


def test_shadow_mode_reports_the_first_would_be_stop() -> None:
    policy = Policy(mode="shadow", max_steps=1, deny=("search.*",))

    decisions, _ = drive(policy, [same(), same()])

    assert [d.shadow and d.shadow["reason"] for d in decisions] == ["tool_denied", "max_steps"]


def test_shadow_mode_allows_without_a_shadow_field_when_nothing_would_stop() -> None:
    decision, _ = evaluate(Policy(mode="shadow"), fresh(), step(1), now=T0)

    assert (decision.outcome, decision.shadow) == (ALLOW, None)


def test_shadow_mode_still_nudges() -> None:
    checks = [step(i, last_result=error("boom")) for i in range(3)]

    decisions, _ = drive(Policy(mode="shadow", error_threshold=3), checks)

    assert decisions[-1].directive is not None


def test_shadow_mode_enforces_the_kill_switch() -> None:
    decision, state = evaluate(
        Policy(mode="shadow"), fresh(), step(1), now=T0, kill="the global kill switch"
    )

    assert (decision.outcome, decision.answer, decision.reason) == (STOP, STOP, "killed")
    assert decision.shadow is None
    assert (state.status, state.stop_reason) == (KILLED, "killed")


# --- 4.4 rule 1: the kill switch -------------------------------------------------------------


def test_a_kill_switch_stops_the_run_as_killed() -> None:
    now = T0 + timedelta(seconds=2)

    decision, state = evaluate(
        Policy(), fresh(steps=3), step(1), now=now, kill="the team kill switch, engaged by ann"
    )

    assert (decision.answer, decision.reason, decision.step) == (STOP, "killed", 4)
    assert "the team kill switch, engaged by ann" in (decision.message or "")
    assert decision.next_action
    assert (state.status, state.stop_reason, state.ended_at) == (KILLED, "killed", now)


def test_the_kill_switch_wins_over_every_other_rule() -> None:
    policy, state, _, now = _everything_fires(1)

    decision, _ = evaluate(policy, state, EVERYTHING_FIRES, now=now, kill="global")

    assert decision.reason == "killed"


def test_a_killed_run_answers_killed_to_later_checks() -> None:
    _, state = evaluate(Policy(), fresh(), step(1), now=T0, kill="global")

    decision, _ = evaluate(Policy(), state, step(2), now=T0)

    assert (decision.answer, decision.reason, decision.step) == (STOP, "killed", 1)


# --- 5.1 finish ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "reason"), [("completed", None), ("failed", None), ("stopped", "agent_stopped")]
)
def test_finishing_a_running_run_sets_its_status(status: str, reason: str | None) -> None:
    state = fresh(steps=2)
    now = T0 + timedelta(seconds=9)

    new = finish(state, status, already_finished=False, now=now)

    assert (new.status, new.stop_reason, new.ended_at) == (status, reason, now)
    assert new.steps == 2
    assert state.status == RUNNING


@pytest.mark.parametrize("status", ["completed", "failed", "stopped"])
@pytest.mark.parametrize(("run_status", "reason"), [("stopped", "max_usd"), ("killed", "killed")])
def test_finishing_a_stopped_or_killed_run_keeps_its_status_and_reason(
    status: str, run_status: str, reason: str
) -> None:
    ended = T0 + timedelta(seconds=3)
    state = fresh(status=run_status, stop_reason=reason, ended_at=ended, steps=5)

    new = finish(state, status, already_finished=False, now=T0 + timedelta(seconds=30))

    assert (new.status, new.stop_reason, new.ended_at, new.steps) == (
        run_status,
        reason,
        ended,
        5,
    )


@pytest.mark.parametrize("run_status", ["running", "stopped", "killed", "completed", "failed"])
def test_finishing_a_run_a_second_time_raises_run_finished(run_status: str) -> None:
    state = fresh(status=run_status)

    with pytest.raises(FinishError, match="run_finished"):
        finish(state, "completed", already_finished=True, now=T0)


# --- 6 kill (the fan-out) --------------------------------------------------------------------


def test_kill_marks_a_running_run_killed() -> None:
    state = fresh(steps=7)
    now = T0 + timedelta(seconds=5)

    new = kill(state, now=now)

    assert new is not None
    assert (new.status, new.stop_reason, new.ended_at, new.steps) == (KILLED, "killed", now, 7)
    assert state.status == RUNNING


@pytest.mark.parametrize(
    ("status", "reason"),
    [("killed", "killed"), ("stopped", "max_steps"), ("completed", None), ("failed", None)],
)
def test_kill_leaves_a_finished_run_alone(status: str, reason: str | None) -> None:
    assert kill(fresh(status=status, stop_reason=reason), now=T0) is None


def test_kill_twice_changes_nothing_the_second_time() -> None:
    once = kill(fresh(), now=T0)

    assert once is not None
    assert kill(once, now=T0 + timedelta(seconds=1)) is None


# --- 5.1 redaction ---------------------------------------------------------------------------


def test_redact_replaces_named_keys_in_any_case_at_any_depth() -> None:
    args = {
        "user": "ann",
        "Password": "hunter2",
        "nested": {"API_KEY": "k", "deeper": {"Token": "t", "keep": 1}},
        "items": [{"secret": "s", "name": "a"}, ["x", {"authorization": "Bearer x"}], 3],
    }

    out = redact(args, ("password", "api_key", "token", "secret", "authorization"))

    assert out == {
        "user": "ann",
        "Password": "[redacted]",
        "nested": {"API_KEY": "[redacted]", "deeper": {"Token": "[redacted]", "keep": 1}},
        "items": [{"secret": "[redacted]", "name": "a"}, ["x", {"authorization": "[redacted]"}], 3],
    }


def test_redact_matches_names_given_in_any_case() -> None:
    assert redact({"password": "p"}, ("PassWord",)) == {"password": "[redacted]"}


def test_redact_hides_a_whole_nested_value() -> None:
    assert redact({"secret": {"a": [1, 2]}}, ("secret",)) == {"secret": "[redacted]"}


def test_redact_keeps_values_that_only_look_like_names() -> None:
    args = {"field": "password", "list": ["token"]}

    assert redact(args, ("password", "token")) == args


def test_redact_leaves_its_input_alone() -> None:
    args = {"password": "p", "nested": {"token": "t"}, "items": [{"secret": "s"}]}
    before = copy.deepcopy(args)

    redact(args, ("password", "token", "secret"))

    assert args == before


def test_redact_with_no_names_changes_nothing() -> None:
    args = {"password": "p"}

    assert redact(args, ()) == args


# --- 4.5 replays -----------------------------------------------------------------------------


def _decision(answer: str) -> Decision:
    reason = "step_ok" if answer == ALLOW else "max_steps"
    return Decision(outcome=answer, reason=reason, step=1, repeat_key="k", repeat_count=1)


def test_a_replay_returns_the_first_answer_while_the_run_is_running() -> None:
    assert replay_allowed(fresh(), _decision(ALLOW))
    assert replay_allowed(fresh(), _decision(STOP))


@pytest.mark.parametrize("status", ["stopped", "killed", "completed", "failed"])
def test_a_replayed_allow_is_not_returned_once_the_run_is_over(status: str) -> None:
    assert not replay_allowed(fresh(status=status), _decision(ALLOW))


def test_a_replayed_stop_is_returned_on_a_terminal_run() -> None:
    assert replay_allowed(fresh(status=KILLED, stop_reason="killed"), _decision(STOP))


def test_a_shadow_would_stop_counts_as_an_allow_for_replays() -> None:
    first = Decision(outcome=WOULD_STOP, reason="step_ok", step=1, repeat_key="k", repeat_count=1)

    assert replay_allowed(fresh(), first)
    assert not replay_allowed(fresh(status=KILLED, stop_reason="killed"), first)


def test_a_run_ending_at_this_check_replays_only_its_stops_and_its_pending_request() -> None:
    """A switch covers the run, or an ancestor is over (SPEC 4.5, 20): an allow is decided
    again (the stop), a stop replays, a pending answer too while the run goes on (its
    request is settled by a decision or the expiry, never by deciding the check again)."""
    assert not replay_allowed(fresh(), _decision(ALLOW), ends_now=True)
    assert replay_allowed(fresh(), _decision(STOP), ends_now=True)
    assert replay_allowed(fresh(), "pending", ends_now=True)
    assert not replay_allowed(fresh(status=KILLED, stop_reason="killed"), "pending",
                              ends_now=True)


def test_there_is_nothing_to_replay_without_a_first_answer() -> None:
    assert not replay_allowed(fresh(), None)


# --- The seed scenarios ----------------------------------------------------------------------


def test_seed_scenario_1_step_19_is_stopped_with_max_steps_and_audited() -> None:
    """Runtime forms step 19 and increments the counter; the policy stops it (max_steps)."""
    checks = [step(i, progress=f"milestone {i}", cost_usd=Decimal("0.01")) for i in range(19)]

    decisions, state = drive(Policy(), checks, now=T0 + timedelta(seconds=30))

    assert answers(decisions) == [ALLOW] * 18 + [STOP]
    assert (decisions[-1].reason, decisions[-1].step) == ("max_steps", 19)
    assert (state.status, state.stop_reason, state.steps) == (STOPPED, "max_steps", 19)


def test_seed_scenario_2_a_loop_on_search_docs_is_stopped_before_the_next_call() -> None:
    """search.docs called again and again with the same args because of a flaky answer."""
    flaky = LastResult(status="ok", digest="same unstable page")
    checks = [same(last_result=flaky if i else None, cost_usd=Decimal("0.01")) for i in range(6)]

    decisions, state = drive(Policy(), checks, now=T0 + timedelta(seconds=2))

    assert reasons(decisions)[:4] == ["step_ok"] * 3 + ["loop_detected"]
    assert decisions[3].repeat_count == 3
    assert decisions[3].message == (
        "search.docs was already called 3 times with the same arguments, all that "
        "max_repeat_action=3 allows: this call was not run and the run is stopped."
    )
    assert state.tool_calls == 3
    assert state.stop_reason == "loop_detected"


def test_seed_scenario_3_a_normal_run_is_allowed_step_by_step() -> None:
    checks = [
        Check(name="search.docs", args={"query": "refund policy"}, cost_usd=Decimal("0.01")),
        Check(
            name="llm.answer",
            type="llm",
            args={"prompt": "summarize"},
            last_result=LastResult(status="ok", digest="page-1"),
            progress="found policy",
            cost_usd=Decimal("0.02"),
        ),
        Check(
            name="crm.reply",
            args={"ticket": 42},
            last_result=LastResult(status="ok", digest="summary-1"),
            progress="answer drafted",
            cost_usd=Decimal("0.01"),
        ),
    ]

    decisions, state = drive(Policy(), checks, now=T0 + timedelta(seconds=5))

    assert reasons(decisions) == ["step_ok"] * 3
    assert all(d.message is None and d.next_action is None for d in decisions)
    assert (state.steps, state.tool_calls, state.cost_usd) == (3, 2, Decimal("0.04"))
    assert state.status == RUNNING


def test_seed_the_agent_that_renamed_a_variable_47_times_is_stopped_at_the_4th_edit() -> None:
    edit = Check(name="edit_file", args={"path": "auth.py", "old": "user_id", "new": "account_id"})

    decisions, _ = drive(Policy(), [edit] * 47)

    assert reasons(decisions)[:4] == ["step_ok"] * 3 + ["loop_detected"]
    assert answers(decisions)[3:] == [STOP] * 44


def test_seed_the_same_error_three_times_injects_the_change_approach_message() -> None:
    failing = [
        Check(name="edit_file", args={"path": f"f{i}.py"}, last_result=error("no matches found"))
        for i in range(3)
    ]

    decisions, _ = drive(Policy(), failing)

    assert decisions[-1].directive is not None
    assert decisions[-1].directive["content"].startswith("The error 'no matches found' occurred 3")


# --- The input state is never mutated --------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "state", "check", "kill_switch"),
    [
        pytest.param(Policy(), _busy_run(), step(1), None, id="allow"),
        pytest.param(
            Policy(), _busy_run(), same(last_result=error("boom")), None, id="loop"
        ),
        pytest.param(Policy(), _busy_run(), step(1), "global", id="killed"),
        pytest.param(
            Policy(mode="shadow"), _busy_run(), same(progress="p"), None,
            id="shadow",
        ),
        pytest.param(Policy(), _stopped_run(), same(), None, id="terminal"),
    ],
)
def test_evaluate_never_mutates_the_input_state(
    policy: Policy, state: RunState, check: Check, kill_switch: str | None
) -> None:
    before = copy.deepcopy(state)

    _, new = evaluate(policy, state, check, now=T0 + timedelta(seconds=1), kill=kill_switch)

    assert state == before
    if new is not state:
        assert new.repeat_counts is not state.repeat_counts
        assert new.progress_seen is not state.progress_seen
        assert new.signatures_seen is not state.signatures_seen
        assert new.error_counts is not state.error_counts


def test_finish_and_kill_never_mutate_the_input_state() -> None:
    state = fresh(steps=3)
    before = copy.deepcopy(state)

    finish(state, "stopped", already_finished=False, now=T0)
    kill(state, now=T0)

    assert state == before


def test_memory_round_trips_through_json_ready_data() -> None:
    _, state = drive(
        Policy(),
        [same(progress=1.0, last_result=error("boom")), step(2, progress="p")],
    )

    restored = fresh(steps=state.steps, tool_calls=state.tool_calls).load_memory(state.memory())

    assert restored.memory() == state.memory()
    assert restored.repeat_counts == state.repeat_counts
    assert restored.progress_seen == state.progress_seen


def test_a_check_past_its_deadline_is_expired_and_the_state_before_it_stands() -> None:
    """rules.expire: the agent gave up on the check, so what the rules decided does not
    stand; the expired decision keeps the repeat key, with the count before the check."""
    _, state = drive(loose(), [same(), same()])
    before = copy.deepcopy(state)
    decision, new = evaluate(loose(), state, same(), now=T0)
    assert decision.repeat_count == 3

    expired, kept = rules.expire(state, decision, new, past_deadline=True)

    assert kept is state and state == before
    assert (expired.outcome, expired.reason, expired.step) == ("expired", "deadline_expired", 2)
    assert (expired.repeat_key, expired.repeat_count) == (decision.repeat_key, 2)
    assert expired.message == rules.EXPIRED_MESSAGE
    assert expired.next_action == rules.EXPIRED_NEXT


def test_a_check_in_time_or_that_changed_nothing_is_not_expired() -> None:
    state = fresh()
    decision, new = evaluate(loose(), state, same(), now=T0)
    assert rules.expire(state, decision, new, past_deadline=False) is None
    over = fresh(status=STOPPED, stop_reason="max_steps")
    stop, same_state = evaluate(loose(), over, same(), now=T0)
    assert same_state is over
    assert rules.expire(over, stop, same_state, past_deadline=True) is None


@pytest.mark.parametrize(("max_seconds", "written"), [
    (45, "45"), (0.25, "0.25"), (31_536_000, "31536000"), (0.000001, "0.000001"),
    (5e-324, "5e-324"), (1.5e-7, "1.5e-7")])
def test_a_limit_is_written_as_people_write_it_however_small(max_seconds: float,
                                                              written: str) -> None:
    """Found by an attacker: a max_seconds of 5e-324 is a valid policy, and every stop's
    message spelt out its 300-digit expansion."""
    message = rules.out_of_time_message(rules.Policy(max_seconds=max_seconds))
    assert f"(max_seconds={written})" in message and len(message) < 150
