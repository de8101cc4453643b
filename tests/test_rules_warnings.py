"""SPEC 16 warnings in the pure rules: examples, then properties over random check sequences
(in the style of tests/test_rules_properties.py): a warning is always an allow, never changes
a counter, the nearest to its limit is sent, and a `budget` warning comes once per budget per
run."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from decimal import Decimal

from governance_client.rules import (
    ALLOW,
    BUDGETS,
    WARNING_CODES,
    Check,
    LastResult,
    Policy,
    RunState,
    evaluate,
    warnings_of,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_rules_properties import LOOSE, T0, policies, sequences

SEQUENCES = settings(max_examples=40, deadline=None)
OFF = {"warn_repeat_action": None, "warn_no_progress": None, "warn_budget_fraction": None}


def drive(policy: Policy, checks: list[Check], *, seconds: float = 0):
    state = RunState(started_at=T0)
    out = []
    for i, check in enumerate(checks):
        decision, state = evaluate(policy, state, check, now=T0 + timedelta(seconds=i * seconds))
        out.append(decision)
    return out, state


SAME = Check(name="search.docs", args={"q": "refund"})


def test_the_repeat_warning_comes_at_its_threshold_and_says_what_happens_next() -> None:
    decisions, _ = drive(Policy(**{**LOOSE, **OFF, "max_repeat_action": 3,
                                   "warn_repeat_action": 2}), [SAME] * 4)
    assert [d.answer for d in decisions] == [ALLOW, ALLOW, ALLOW, "stop"]
    assert decisions[0].directive is None and decisions[0].rule is None
    warned = decisions[1]
    assert warned.directive == {
        "type": "inject_message", "role": "user", "code": "repeat_action",
        "content": "search.docs was called 2 times with the same arguments; "
                   "max_repeat_action is 3: 1 more identical call may run, and the one after "
                   "is not run and stops this run. Use the result you have or change approach."}
    assert warned.rule == {"name": "repeat_action",
                           "limit": {"max_repeat_action": 3, "warnings.repeat_action": 2},
                           "observed": {"repeat_count": 2}}
    assert "the next identical call is not run" in decisions[2].directive["content"]
    assert decisions[3].rule == {"name": "loop_detected", "limit": {"max_repeat_action": 3},
                                 "observed": {"repeat_count": 3}}


def test_the_no_progress_warning_names_the_streak_and_the_window() -> None:
    same = replace(SAME, progress="p")
    decisions, _ = drive(Policy(**{**LOOSE, **OFF, "no_progress_window": 4,
                                   "warn_no_progress": 3}),
                         [replace(same, args={"i": i}) for i in range(5)])
    # p is new at the first check; then 1, 2, 3 in a row bring nothing new.
    assert [d.directive and d.directive["code"] for d in decisions[:4]] == [
        None, None, None, "no_progress"]
    assert "3 steps in a row reported no new progress or result; at 4 in a row" in \
        decisions[3].directive["content"]
    assert decisions[4].reason == "no_progress"


def test_a_budget_warning_comes_once_per_budget() -> None:
    policy = Policy(**{**LOOSE, **OFF, "max_steps": 10, "warn_budget_fraction": 0.8})
    decisions, state = drive(policy, [replace(SAME, args={"i": i}) for i in range(10)])
    codes = [d.directive and d.directive["code"] for d in decisions]
    # SPEC 16: "the first allow past this fraction": step 9 is past 0.8 of 10, step 8 at it.
    assert codes == [None] * 8 + ["budget", None]
    assert decisions[8].rule == {"name": "budget",
                                 "limit": {"max_steps": 10, "warnings.budget_fraction": 0.8},
                                 "observed": {"steps": 9}}
    assert "step 9 of max_steps=10" in decisions[8].directive["content"]
    assert state.budget_warned == frozenset({"max_steps"})
    assert state.memory()["budget_warned"] == ["max_steps"]


def test_money_reads_in_cents_in_the_warning_and_the_stop() -> None:
    # As the dashboard writes money (found by a newcomer: "has spent $0.6", "$1.2"); the
    # limit as configured stays as written (max_usd=1).
    policy = Policy(**{**LOOSE, **OFF, "max_usd": Decimal(1), "warn_budget_fraction": 0.5})
    decisions, _ = drive(policy, [replace(SAME, args={"i": i}, cost_usd=Decimal("0.3"))
                                  for i in range(4)])
    assert "has spent $0.60 of max_usd=1: once it reaches $1.00 " in \
        decisions[1].directive["content"]
    assert decisions[3].message.startswith("The run has spent $1.20, reaching max_usd=1:")
    decisions, _ = drive(policy, [replace(SAME, cost_usd=Decimal("0.500125"))])
    assert "has spent $0.500125 of max_usd=1" in decisions[0].directive["content"]


def test_the_nearest_to_its_limit_wins() -> None:
    # Repeat count 2 of 3 (0.67) against steps 9 of 10 (0.9): the budget is nearer.
    policy = Policy(**{**LOOSE, **OFF, "max_steps": 10, "max_repeat_action": 3,
                       "warn_repeat_action": 2, "warn_budget_fraction": 0.85})
    checks = [replace(SAME, args={"i": i}) for i in range(7)] + [SAME, SAME]
    decisions, _ = drive(policy, checks)
    assert decisions[8].directive["code"] == "budget"
    # Once the budget's warning is sent, the repeat warning applies again.
    decisions, _ = drive(policy, [*checks, replace(SAME, name="x")])
    assert decisions[8].rule["observed"] == {"steps": 9}


def test_the_repeated_error_nudge_is_a_warning_with_its_code() -> None:
    err = LastResult(status="error", error="boom")
    decisions, _ = drive(Policy(**{**LOOSE, **OFF, "error_threshold": 2}),
                         [replace(SAME, args={"i": i}, last_result=err) for i in range(2)])
    assert decisions[1].directive["code"] == "repeated_error"
    assert decisions[1].rule["observed"] == {"error_count": 2}


def test_shadow_mode_warns_as_enforce_does() -> None:
    enforce = Policy(**{**LOOSE, "max_repeat_action": 3})
    shadow = replace(enforce, mode="shadow")
    a, _ = drive(enforce, [SAME] * 3)
    b, _ = drive(shadow, [SAME] * 3)
    assert [d.directive for d in a] == [d.directive for d in b]


def test_a_shadow_warning_past_its_limit_says_enforcing_would_have_stopped() -> None:
    """A shadow policy runs past its limits, and each warning then said the stop was still
    ahead ("the next identical call is not run")."""
    shadow = Policy(**{**LOOSE, **OFF, "mode": "shadow", "max_repeat_action": 3,
                       "warn_repeat_action": 2})
    decisions, _ = drive(shadow, [SAME] * 5)
    assert "the next identical call is not run" in decisions[2].directive["content"]
    for past in decisions[3:]:
        assert past.shadow["reason"] == "loop_detected"
        assert "enforcing policy would have stopped this run at identical call 4; shadow " \
            "mode runs it" in past.directive["content"]
    same = replace(SAME, progress="p")
    stalled, _ = drive(Policy(**{**LOOSE, **OFF, "mode": "shadow", "no_progress_window": 3,
                                 "warn_no_progress": 2}),
                       [replace(same, args={"i": i}) for i in range(5)])
    assert "at 3 in a row (no_progress_window=3) the next action is not run" in \
        stalled[2].directive["content"]
    assert "3 steps in a row reported no new progress or result; an enforcing policy would " \
        "have stopped this run at 3 in a row" in stalled[3].directive["content"]
    # A budget warned only once it is passed: the warning turned on while the run was past.
    quiet = Policy(**{**LOOSE, **OFF, "mode": "shadow", "max_steps": 2})
    _, state = drive(quiet, [replace(SAME, args={"i": i}) for i in range(2)])
    decision, _ = evaluate(replace(quiet, warn_budget_fraction=0.8), state,
                           replace(SAME, args={"i": 2}), now=T0)
    assert decision.shadow["reason"] == "max_steps"
    assert decision.directive["content"].startswith(
        "This run is at step 3, past max_steps=2: an enforcing policy would have stopped "
        "this run;")


@SEQUENCES
@given(policy=policies, sequence=sequences,
       warn=st.tuples(st.none() | st.integers(1, 4), st.none() | st.integers(1, 4),
                      st.none() | st.sampled_from([0.1, 0.5, 0.8, 0.99])))
def test_warnings_never_change_an_outcome_or_a_counter(policy: Policy, sequence: list[Check],
                                                       warn: tuple) -> None:
    on = replace(policy, warn_repeat_action=warn[0], warn_no_progress=warn[1],
                 warn_budget_fraction=warn[2])
    off = replace(policy, **OFF)
    a, b = RunState(started_at=T0), RunState(started_at=T0)
    for i, check in enumerate(sequence):
        now = T0 + timedelta(seconds=i)
        da, a = evaluate(on, a, check, now=now)
        db, b = evaluate(off, b, check, now=now)
        assert (da.outcome, da.reason, da.step, da.repeat_count, da.message) == \
            (db.outcome, db.reason, db.step, db.repeat_count, db.message)
        assert replace(a, budget_warned=frozenset()) == b
        if da.directive is not None:
            # A warning is an allow (or a shadow would-stop, whose action runs too).
            assert da.answer == ALLOW
            assert da.directive["code"] in WARNING_CODES
            assert da.directive["type"] == "inject_message" and da.directive["role"] == "user"
        if db.directive is not None:  # the nudge is there either way
            assert db.directive["code"] == "repeated_error"


@SEQUENCES
@given(policy=policies, sequence=sequences,
       fraction=st.sampled_from([0.1, 0.5, 0.8, 0.99]))
def test_a_budget_warning_is_sent_at_most_once_per_budget_per_run(
        policy: Policy, sequence: list[Check], fraction: float) -> None:
    policy = replace(policy, warn_budget_fraction=fraction)
    state = RunState(started_at=T0)
    sent: list[str] = []
    for i, check in enumerate(sequence):
        decision, new = evaluate(policy, state, check, now=T0 + timedelta(seconds=i))
        added = new.budget_warned - state.budget_warned
        budget = decision.directive is not None and decision.directive["code"] == "budget"
        assert len(added) == (1 if budget else 0)
        assert added <= set(BUDGETS)
        sent.extend(added)
        state = new
    assert len(sent) == len(set(sent))


@SEQUENCES
@given(policy=policies, sequence=sequences)
def test_the_warning_sent_is_the_nearest_to_its_limit(policy: Policy,
                                                     sequence: list[Check]) -> None:
    policy = replace(policy, warn_repeat_action=1, warn_no_progress=1,
                     warn_budget_fraction=0.5)
    state = RunState(started_at=T0)
    for i, check in enumerate(sequence):
        now = T0 + timedelta(seconds=i)
        decision, new = evaluate(policy, state, check, now=now)
        if decision.directive is not None and decision.outcome == ALLOW:
            found = warnings_of(policy, replace(new, budget_warned=state.budget_warned),
                                check, decision.repeat_key, now)
            assert decision.rule in [w.rule for w in found]
            best = max(w.nearness for w in found)
            chosen = next(w for w in found if w.rule == decision.rule)
            assert chosen.nearness == best
        state = new


def test_a_child_is_warned_of_its_ancestors_budget_once_with_its_scope() -> None:
    # SPEC 20: the ancestors' budgets bound a child and are what stop it, so the child is
    # warned of them as of its own (found by trying sub-agents: a parent at 10 of 18 steps
    # stopped its child at the child's step 8 without a word).
    from governance_client.rules import Ancestor

    own = Policy(**{**LOOSE, **OFF, "max_steps": 100})
    parent_policy = replace(Policy(**{**LOOSE, "max_steps": 18, "warn_budget_fraction": 0.8}),
                            name="parent-policy", version=3)
    parent = RunState(started_at=T0, steps=13)
    state, sent = RunState(started_at=T0), []
    for i in range(3):
        tree = [Ancestor("root-id", parent_policy, replace(parent, steps=13 + i))]
        decision, state = evaluate(own, state, Check(name="search", args={"n": i}), now=T0,
                                   tree=tree)
        sent.append(decision)
    # The parent counts this check too: 14 steps then 15 (0.8 of 18 is 14.4): the warning
    # comes at the second check, once, naming the ancestor, its policy and its limit.
    assert [d.directive is not None for d in sent] == [False, True, False]
    warned = sent[1]
    assert warned.answer == ALLOW and warned.scope == "root-id"
    assert warned.rule["limit"] == {"max_steps": 18, "warnings.budget_fraction": 0.8}
    assert warned.rule["observed"] == {"steps": 15}
    assert warned.rule["policy"] == ("parent-policy", 3)
    assert warned.directive["content"].startswith(
        "Ancestor run root-id's tree is at step 15 of max_steps=18: an action past step 18 "
        "is not run and stops this run.")
    assert state.budget_warned == frozenset({"root-id:max_steps"})
    # The run's own budget is still warned of on its own, once.
    assert warnings_of(replace(own, max_steps=2, warn_budget_fraction=0.5), state,
                       Check(name="x"), "k", T0)[0].scope is None


def test_a_budget_fraction_is_passed_exactly_whatever_its_floating_point() -> None:
    # 0.07 x 100 is 7.000000000000001: step 7 is at the fraction, step 8 the first past it,
    # in floating point as in decimals.
    policy = Policy(**{**LOOSE, **OFF, "max_steps": 100, "warn_budget_fraction": 0.07})
    decisions, _ = drive(policy, [replace(SAME, args={"i": i}) for i in range(9)])
    assert [d.directive is not None for d in decisions] == [False] * 7 + [True, False]
    # And 0.3 x 10 is 3.0000000000000004: step 3 is at it, not past it.
    policy = Policy(**{**LOOSE, **OFF, "max_steps": 10, "warn_budget_fraction": 0.3})
    decisions, _ = drive(policy, [replace(SAME, args={"i": i}) for i in range(5)])
    assert [d.directive is not None for d in decisions] == [False] * 3 + [True, False]


def test_a_tie_of_nearness_goes_to_the_warning_lowest_in_the_docs_table() -> None:
    # docs/policies.md: "on a tie the order of the table from the bottom up (repeated_error
    # first)": repeated_error, then budget, then no_progress, then repeat_action.
    policy = Policy(**{**LOOSE, **OFF, "max_repeat_action": 4, "warn_repeat_action": 2,
                       "no_progress_window": 4, "warn_no_progress": 2})
    # The progress "p" is new at the first check, then seen twice: a streak of 2 of 4 (0.5)
    # at the third check, where search.docs is called the 2nd time of 4 (0.5).
    checks = [replace(SAME, name="other", progress="p"), replace(SAME, progress="p"),
              replace(SAME, progress="p")]
    decisions, _ = drive(policy, checks)
    assert decisions[2].rule["observed"] == {"no_progress_streak": 2}
    # Steps 9 of 10 (0.9) against search.docs called the 9th time of 10 (0.9): the budget.
    policy = Policy(**{**LOOSE, **OFF, "max_steps": 10, "max_repeat_action": 10,
                       "warn_repeat_action": 9, "warn_budget_fraction": 0.85})
    decisions, _ = drive(policy, [SAME] * 9)
    assert decisions[8].rule["observed"] == {"steps": 9}
