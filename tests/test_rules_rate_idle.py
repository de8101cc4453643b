"""The pure rules of SPEC 12 (rate limits) and SPEC 14 (abandoned runs) in
governance_client.rules: windows, retry_after_s, the wait answer, shadow mode, idleness.

Pure like tests/test_rules.py: no database, ``now`` passed in.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from governance_client.rules import (
    ABANDONED,
    ALLOW,
    RATE_LIMITED,
    RUNNING,
    STOP,
    STOPPED,
    WAIT,
    WOULD_STOP,
    Check,
    Pending,
    Policy,
    RateLimit,
    RateWindow,
    RunState,
    abandon,
    budget_deadline,
    evaluate,
    idle_deadline,
    next_deadline,
    out_of_time_message,
    overdue,
    rate_limits_matching,
    rate_wait,
    retry_after_s,
    settle,
    wait_past_budget,
    window_of,
)
from hypothesis import example, given
from hypothesis import strategies as st

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
HTTP = RateLimit(match="http.*", per="agent", max=3, window_s=60)
LOOSE = Policy(max_steps=10000, max_repeat_action=1000, no_progress_window=1000,
               max_seconds=None, max_usd=None, max_tool_calls=None, rate_limits=(HTTP,))


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def state(**changes: Any) -> RunState:
    return replace(RunState(started_at=T0), **changes)


# --- windows ----------------------------------------------------------------------------------

def test_a_rule_with_fewer_than_max_actions_in_its_window_has_room() -> None:
    window = window_of(HTTP, [at(1), at(2)], at(10))
    assert window.nth_recent is None
    assert retry_after_s(window) is None


def test_a_full_rule_has_room_when_its_oldest_needed_action_leaves_the_window() -> None:
    # max 3: the 3rd most recent (at 2 s) must leave the 60 s window: at 62 s.
    window = window_of(HTTP, [at(1), at(2), at(5), at(9)], at(10))
    assert window.nth_recent == at(2)
    assert retry_after_s(window) == 52.0


def test_actions_older_than_the_window_do_not_count() -> None:
    assert window_of(HTTP, [at(0), at(30), at(40)], at(60)).nth_recent is None
    assert window_of(HTTP, [at(0.001), at(30), at(40)], at(60)).nth_recent == at(0.001)


def test_retry_after_is_rounded_up_to_the_millisecond_and_never_zero() -> None:
    rule = RateLimit(match="*", per="run", max=1, window_s=1)
    assert retry_after_s(RateWindow(rule, at(0), at(0.5))) == 0.5
    assert retry_after_s(RateWindow(rule, at(0), at(0.499999))) == 0.501
    assert retry_after_s(RateWindow(rule, at(0), at(0.999999))) == 0.001
    assert retry_after_s(RateWindow(rule, at(0), at(0.2345))) == 0.766


@given(st.lists(st.integers(min_value=0, max_value=120_000_000), max_size=30),
       st.integers(min_value=1, max_value=5), st.integers(min_value=1, max_value=90))
def test_retry_after_is_the_least_wait_that_gives_the_rule_room(
        stamps_us: list[int], max_: int, window_s: int) -> None:
    rule = RateLimit(match="*", per="run", max=max_, window_s=window_s)
    now = at(120)
    stamps = [T0 + timedelta(microseconds=u) for u in stamps_us]
    wait = retry_after_s(window_of(rule, stamps, now))

    def in_window(t: datetime) -> int:
        return sum(1 for s in stamps if t - timedelta(seconds=window_s) < s <= now)

    if wait is None:
        assert in_window(now) < max_
    else:
        assert wait > 0
        assert in_window(now) >= max_
        assert in_window(now + timedelta(seconds=wait)) < max_
        # A millisecond less is still full (rounding up never gives room too early).
        assert in_window(now + timedelta(seconds=wait - 0.001)) >= max_ or wait == 0.001


def test_every_matching_rule_applies_and_the_longest_wait_wins() -> None:
    short = RateLimit(match="http.*", per="run", max=1, window_s=10)
    long = RateLimit(match="http.get", per="agent", max=1, window_s=60)
    windows = [window_of(short, [at(0)], at(1)), window_of(long, [at(0)], at(1))]
    window, wait = rate_wait(windows)  # type: ignore[misc]
    assert (window.rule, wait) == (long, 59.0)
    assert rate_wait([window_of(short, [], at(1))]) is None


def test_the_rules_that_match_an_action_are_found_by_glob() -> None:
    other = RateLimit(match="mail.send", per="team", max=1, window_s=1)
    policy = replace(LOOSE, rate_limits=(HTTP, other))
    assert rate_limits_matching(policy, "http.get") == (HTTP,)
    assert rate_limits_matching(policy, "mail.send") == (other,)
    assert rate_limits_matching(policy, "HTTP.get") == ()  # case-sensitive, like tools


# --- the wait answer --------------------------------------------------------------------------

def full() -> list[RateWindow]:
    return [window_of(HTTP, [at(1), at(2), at(3)], at(10))]


def test_a_full_rule_answers_wait_and_registers_nothing() -> None:
    before = state(steps=4, tool_calls=3, repeat_counts={"x": 1})
    check = Check(name="http.get", args={"u": 1}, progress="p1", cost_usd=1)
    decision, after = evaluate(LOOSE, before, check, now=at(10), rate=full())

    assert (decision.outcome, decision.answer, decision.reason) == (WAIT, WAIT, RATE_LIMITED)
    assert decision.step == 5  # steps + 1, but not counted
    assert decision.retry_after_s == 51.0
    assert "match='http.*' per=agent max=3 window_s=60" in (decision.message or "")
    assert decision.next_action
    assert (after.steps, after.tool_calls, after.cost_usd) == (4, 3, 0)
    assert after.progress_seen == set() and after.repeat_counts == {"x": 1}
    assert after.idle_deadline == at(10 + 3600)  # a wait is activity (SPEC 14)


def test_a_rule_with_room_allows() -> None:
    decision, after = evaluate(LOOSE, state(), Check(name="http.get"), now=at(10),
                               rate=[window_of(HTTP, [at(1)], at(10))])
    assert (decision.outcome, decision.retry_after_s, after.steps) == (ALLOW, None, 1)


def test_the_stop_rules_come_before_the_rate_limits() -> None:
    decision, _ = evaluate(replace(LOOSE, max_steps=1), state(steps=1), Check(name="http.get"),
                           now=at(10), rate=full())
    assert (decision.outcome, decision.reason) == (STOP, "max_steps")
    decision, _ = evaluate(LOOSE, state(), Check(name="http.get"), now=at(10), rate=full(),
                           kill="the team kill switch")
    assert (decision.outcome, decision.reason) == (STOP, "killed")


def test_in_shadow_mode_a_full_rule_is_a_would_stop_counted_like_an_allow() -> None:
    policy = replace(LOOSE, mode="shadow")
    decision, after = evaluate(policy, state(), Check(name="http.get"), now=at(10), rate=full())
    assert (decision.outcome, decision.answer, decision.reason) == (WOULD_STOP, ALLOW, "step_ok")
    assert decision.shadow is not None and decision.shadow["reason"] == RATE_LIMITED
    assert decision.retry_after_s is None
    assert (after.steps, after.tool_calls) == (1, 1)


def test_shadow_mode_reports_an_earlier_would_stop_first() -> None:
    policy = replace(LOOSE, mode="shadow", max_tool_calls=1)
    decision, _ = evaluate(policy, state(tool_calls=1), Check(name="http.get"), now=at(10),
                           rate=full())
    assert decision.shadow is not None and decision.shadow["reason"] == "max_tool_calls"


# --- abandoned runs ---------------------------------------------------------------------------

def test_the_idle_deadline_is_the_activity_plus_max_idle_seconds() -> None:
    assert idle_deadline(LOOSE, at(5)) == at(3605)
    assert idle_deadline(replace(LOOSE, max_idle_seconds=None), at(5)) is None


def test_every_counted_check_moves_the_deadline() -> None:
    _, after = evaluate(LOOSE, state(idle_deadline=at(100)), Check(name="x"), now=at(50))
    assert after.idle_deadline == at(3650)


def test_a_run_past_its_deadline_is_abandoned_at_the_deadline() -> None:
    over = abandon(state(idle_deadline=at(100), steps=3), now=at(100))
    assert over is not None
    assert (over.status, over.stop_reason, over.ended_at, over.steps) == (
        STOPPED, ABANDONED, at(100), 3)
    assert abandon(state(idle_deadline=at(100)), now=at(99.999)) is None
    assert abandon(state(idle_deadline=None), now=at(10**6)) is None
    assert abandon(state(idle_deadline=at(1), status="completed"), now=at(2)) is None


@pytest.mark.parametrize("mode", ["enforce", "shadow"])
def test_a_check_after_the_deadline_answers_stop_abandoned_counting_nothing(mode: str) -> None:
    policy = replace(LOOSE, mode=mode)
    decision, after = evaluate(policy, state(idle_deadline=at(100), steps=2),
                               Check(name="x"), now=at(101))
    assert (decision.outcome, decision.reason, decision.step) == (STOP, ABANDONED, 2)
    assert (after.status, after.steps, after.ended_at) == (STOPPED, 2, at(100))


def test_a_check_before_the_deadline_goes_on() -> None:
    decision, after = evaluate(LOOSE, state(idle_deadline=at(100)), Check(name="x"),
                               now=at(99))
    assert (decision.outcome, after.status) == (ALLOW, RUNNING)


# --- runs out of time, and waits longer than the time left (issue 26) ------------------------

TIMED = replace(LOOSE, max_seconds=45)


def test_the_stored_deadline_is_the_first_of_idleness_and_the_time_budget() -> None:
    assert budget_deadline(TIMED, state()) == at(45)
    assert budget_deadline(TIMED, state(paused_s=30)) == at(75)  # time pending is not active
    assert next_deadline(TIMED, state(), at(10)) == at(45)
    assert next_deadline(replace(TIMED, max_idle_seconds=20), state(), at(10)) == at(30)
    assert next_deadline(replace(TIMED, max_idle_seconds=None), state(), at(10)) == at(45)
    assert next_deadline(LOOSE, state(), at(10)) == at(3610)
    assert next_deadline(replace(LOOSE, max_idle_seconds=None), state(), at(10)) is None
    # A shadow run never stops for its time; a run waiting for an approval has no clock.
    assert budget_deadline(replace(TIMED, mode="shadow"), state()) is None
    pending = Pending(approval_id="a", check_id="c", step=1, action_name="x",
                      action_type="tool", repeat_key="k", since=at(5), expires_at=at(905))
    assert budget_deadline(TIMED, state(pending=pending)) is None


def test_a_check_and_a_wait_store_the_budget_deadline_when_it_comes_first() -> None:
    _, after = evaluate(TIMED, state(), Check(name="x"), now=at(10))
    assert after.idle_deadline == at(45)
    _, waited = evaluate(replace(TIMED, max_seconds=100), state(), Check(name="http.get"),
                         now=at(10), rate=full())
    assert waited.idle_deadline == at(100)


def test_a_run_out_of_time_with_no_check_is_stopped_max_seconds_at_its_budget() -> None:
    before = state(steps=3, idle_deadline=at(45))
    assert overdue(before, TIMED, now=at(44.999)) is None
    over = overdue(before, TIMED, now=at(60))
    assert over is not None
    assert (over.status, over.stop_reason, over.ended_at, over.steps) == (
        STOPPED, "max_seconds", at(45), 3)
    assert over.elapsed_s(at(600)) == 45
    # ...which is no abandonment: a check after it is stopped by rule 4 (counted, at its time).
    assert abandon(before, now=at(60), policy=TIMED) is None
    decision, after = evaluate(TIMED, before, Check(name="x"), now=at(60))
    assert (decision.outcome, decision.reason, decision.step) == (STOP, "max_seconds", 4)
    assert after.ended_at == at(60)
    assert "max_seconds=45" in out_of_time_message(TIMED)


def test_the_first_deadline_decides_the_reason() -> None:
    idle_first = state(idle_deadline=at(30))
    over = overdue(idle_first, TIMED, now=at(60))
    assert over is not None and (over.stop_reason, over.ended_at) == (ABANDONED, at(30))
    # A deadline stored before the budget was part of it: the budget still came first.
    stored_late = state(idle_deadline=at(3600))
    over = overdue(stored_late, TIMED, now=at(3600))
    assert over is not None and (over.stop_reason, over.ended_at) == ("max_seconds", at(45))
    assert overdue(state(idle_deadline=at(45), status="completed"), TIMED, now=at(60)) is None


@given(max_seconds=st.none() | st.floats(min_value=0.5, max_value=5000),
       idle=st.none() | st.floats(min_value=1, max_value=5000),
       paused=st.floats(min_value=0, max_value=1000),
       activity=st.floats(min_value=0, max_value=5000),
       later=st.floats(min_value=0, max_value=10000),
       shadow=st.booleans())
@example(max_seconds=45, idle=None, paused=0, activity=0, later=45, shadow=False)
@example(max_seconds=None, idle=30, paused=0, activity=10, later=30, shadow=False)
def test_a_stored_deadline_ends_the_run_as_soon_as_it_is_due_for_its_own_reason(
        max_seconds: float | None, idle: float | None, paused: float, activity: float,
        later: float, shadow: bool) -> None:
    """An idle deadline is due when it is reached; a time budget once it is passed (rule 4
    stops a check *over* max_seconds, so the very moment it is spent is still in time)."""
    policy = replace(LOOSE, max_seconds=max_seconds, max_idle_seconds=idle,
                     mode="shadow" if shadow else "enforce")
    before = state(paused_s=paused)
    before.idle_deadline = next_deadline(policy, before, at(activity))
    now = at(activity + later)
    over = overdue(before, policy, now=now)
    budget = budget_deadline(policy, before)
    if before.idle_deadline is None or now < before.idle_deadline or (
            now == before.idle_deadline == budget):
        assert over is None
        return
    assert over is not None and over.ended_at == before.idle_deadline
    assert over.stop_reason == ("max_seconds" if budget == before.idle_deadline else ABANDONED)
    if over.stop_reason == "max_seconds":
        assert not shadow
        assert over.elapsed_s(now) == pytest.approx(max_seconds, abs=1e-5)


def test_a_wait_longer_than_the_time_left_is_a_stop_naming_both() -> None:
    check = Check(name="http.get", args={"u": 1})
    # 51 s to wait at second 10: 35 s of a 45 s budget left.
    decision, after = evaluate(TIMED, state(steps=4), check, now=at(10), rate=full())
    assert (decision.outcome, decision.reason, decision.step) == (STOP, "max_seconds", 5)
    assert decision.retry_after_s is None
    assert "wait 51.000 s" in (decision.message or "")
    assert "35.0 s left of the run's time budget (max_seconds=45)" in (decision.message or "")
    assert (after.status, after.stop_reason, after.ended_at) == (STOPPED, "max_seconds", at(10))
    # Shadow mode waits for nothing: it reports the stop enforce mode would have made.
    shadowed, going = evaluate(replace(TIMED, mode="shadow"), state(), check, now=at(10),
                               rate=full())
    assert (shadowed.outcome, (shadowed.shadow or {}).get("reason")) == (
        WOULD_STOP, "max_seconds")
    assert going.status == RUNNING


def test_a_wait_the_time_left_covers_is_a_wait() -> None:
    decision, _ = evaluate(replace(TIMED, max_seconds=61), state(), Check(name="http.get"),
                           now=at(10), rate=full())
    assert (decision.outcome, decision.retry_after_s) == (WAIT, 51.0)
    assert wait_past_budget(replace(TIMED, max_seconds=None), state(), "x", 10**6, at(0)) is None


def test_a_window_the_store_could_not_read_is_no_long_wait() -> None:
    busy = RateWindow(HTTP, None, at(44.99), busy_retry_s=0.05)
    decision, _ = evaluate(TIMED, state(), Check(name="http.get"), now=at(44.99), rate=[busy])
    assert decision.outcome == WAIT


@given(elapsed=st.floats(min_value=0, max_value=100), window_s=st.integers(1, 120),
       max_seconds=st.none() | st.floats(min_value=1, max_value=100))
def test_no_wait_is_ever_longer_than_the_time_left(elapsed: float, window_s: int,
                                                   max_seconds: float | None) -> None:
    rule = RateLimit(match="http.*", per="run", max=1, window_s=window_s)
    policy = replace(LOOSE, max_seconds=max_seconds, rate_limits=(rule,))
    now = at(elapsed)
    window = window_of(rule, [now - timedelta(microseconds=1)], now)
    decision, after = evaluate(policy, state(), Check(name="http.get"), now=now, rate=[window])
    elapsed = state().elapsed_s(now)  # as the clock reads it, to the microsecond
    if max_seconds is not None and elapsed > max_seconds:
        assert (decision.outcome, decision.reason) == (STOP, "max_seconds")  # rule 4
    elif decision.outcome == WAIT:
        assert max_seconds is None or decision.retry_after_s <= max_seconds - elapsed + 1e-9
    else:
        assert (decision.outcome, decision.reason, after.ended_at) == (
            STOP, "max_seconds", now)
        assert decision.message is not None and "left of the run's time budget" in \
            decision.message


def test_an_approved_wait_moves_the_budget_deadline_by_the_time_it_waited() -> None:
    pending = Pending(approval_id="a", check_id="c", step=1, action_name="x",
                      action_type="tool", repeat_key="k", since=at(10), expires_at=at(910))
    waiting = state(steps=1, pending=pending, idle_deadline=None)
    _, approved = settle(waiting, "approved", now=at(100), policy=TIMED)
    assert approved.paused_s == 90
    assert approved.idle_deadline == at(45 + 90)
    assert overdue(approved, TIMED, now=at(134)) is None
    over = overdue(approved, TIMED, now=at(136))
    assert over is not None and (over.stop_reason, over.ended_at) == ("max_seconds", at(135))
