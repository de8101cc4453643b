"""The pure replay of SPEC 13 (governance_client.replay): recorded steps and a draft in, the
draft's outcome out. Recorded outcomes this branch's check never makes (`pending`, `wait`,
approval outcomes, `abandoned`) are written here as SPEC 11, 12 and 14 record them."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from governance_client.keys import repeat_key
from governance_client.replay import (
    Recorded,
    changed,
    last_result_of,
    recorded_stop,
    replay,
)
from governance_client.rules import Policy

T0 = datetime(2026, 1, 1, tzinfo=UTC)
LOOSE = Policy(max_steps=100, max_repeat_action=100, no_progress_window=100, max_seconds=None,
               max_usd=None)


def call(step: int, name: str = "search", outcome: str = "allow", reason: str = "step_ok",
         **kw: Any) -> Recorded:
    args = kw.pop("args", {"q": step})
    key = kw.pop("repeat_key", repeat_key(name, args))
    return Recorded(outcome=outcome, reason=reason, step=step, name=name, args=args,
                    repeat_key=key, elapsed_s=kw.pop("elapsed_s", float(step)), **kw)


def test_an_identical_draft_reproduces_the_recorded_stop():
    steps = [call(i, args={"q": "same"}) for i in (1, 2, 3)]
    steps.append(call(4, args={"q": "same"}, outcome="stop", reason="loop_detected"))
    outcome = replay(Policy(max_repeat_action=3), steps, started_at=T0, recorded=Policy())
    assert (outcome.status, outcome.stop_reason, outcome.step) == ("stopped", "loop_detected", 4)
    assert not changed(recorded_stop(steps), outcome)


def test_checks_after_the_first_stop_are_skipped():
    steps = [call(1), call(2, outcome="stop", reason="max_steps"),
             call(2, outcome="stop", reason="max_steps"), call(2, outcome="stop",
                                                               reason="max_steps")]
    outcome = replay(LOOSE, steps, started_at=T0, recorded=Policy(max_steps=1), trace=True)
    assert outcome.stop is None and len(outcome.decisions) == 2


def test_checks_of_a_finished_run_are_not_a_stop():
    steps = [call(1), call(2), call(2, outcome="stop", reason="run_finished")]
    assert recorded_stop(steps) is None
    outcome = replay(Policy(max_steps=1), steps, started_at=T0, recorded=LOOSE)
    assert outcome.stop == ("max_steps", 2)


def test_recorded_waits_register_nothing():
    wait = call(2, outcome="wait", reason="rate_limited", cost_usd=Decimal("5"))
    steps = [call(1), wait, wait, call(2), call(3)]
    outcome = replay(Policy(max_steps=3, max_usd=Decimal("1"), max_seconds=None), steps,
                     started_at=T0, recorded=LOOSE)
    assert outcome.stop is None


def test_an_approved_check_is_replayed_as_allowed():
    steps = [call(1, args={"q": "x"}),
             call(2, name="deploy", outcome="pending", reason="approval_required"),
             call(2, name="deploy", outcome="allow", reason="step_ok"),
             call(3, args={"q": "x"})]
    outcome = replay(LOOSE, steps, started_at=T0, recorded=LOOSE, trace=True)
    assert outcome.stop is None
    assert [d.step for _, d in outcome.decisions] == [1, 2, 3]


def test_a_denied_or_expired_approval_stops_the_draft_where_it_stopped_the_run():
    for reason in ("approval_denied", "approval_expired"):
        steps = [call(1), call(2, name="deploy", outcome="pending", reason="approval_required"),
                 call(2, name="deploy", outcome="stop", reason=reason)]
        assert recorded_stop(steps) == (reason, 2)
        outcome = replay(LOOSE, steps, started_at=T0, recorded=LOOSE)
        assert (outcome.status, outcome.stop_reason, outcome.step) == ("stopped", reason, 2)
        assert not changed(recorded_stop(steps), outcome)


def test_a_draft_that_stops_the_pending_check_wins_over_its_approval():
    steps = [call(1), call(2, name="deploy", outcome="pending", reason="approval_required"),
             call(2, name="deploy", outcome="stop", reason="approval_denied")]
    outcome = replay(Policy(deny=("deploy",), max_seconds=None), steps, started_at=T0,
                     recorded=LOOSE)
    assert outcome.stop == ("tool_denied", 2)


def test_a_kill_while_pending_is_kept():
    steps = [call(1), call(2, name="deploy", outcome="pending", reason="approval_required"),
             Recorded(outcome="stop", reason="killed", step=2, name="")]
    outcome = replay(LOOSE, steps, started_at=T0, recorded=LOOSE)
    assert (outcome.status, outcome.stop_reason, outcome.step) == ("killed", "killed", 2)


def test_a_fanout_kill_ends_the_replay_without_moving_the_step():
    steps = [call(1), call(2), Recorded(outcome="stop", reason="killed", step=2, name="")]
    outcome = replay(LOOSE, steps, started_at=T0, recorded=LOOSE)
    assert (outcome.status, outcome.step) == ("killed", 2)
    # The draft stopping earlier means the kill never came.
    assert replay(Policy(max_steps=1, max_seconds=None), steps, started_at=T0,
                  recorded=LOOSE).stop == ("max_steps", 2)


def test_an_abandonment_is_replayed_as_recorded():
    steps = [call(1), Recorded(outcome="stop", reason="abandoned", step=1, name="")]
    outcome = replay(LOOSE, steps, started_at=T0, recorded=LOOSE)
    assert (outcome.status, outcome.stop_reason, outcome.step) == ("stopped", "abandoned", 1)


def test_a_run_ended_out_of_time_by_the_sweep_is_replayed_as_recorded():
    # The sweep's record of a run whose time budget ran out with no check (issue 26) has no
    # action: no check was decided there. Replayed as a check it was an allow of an action
    # named "" at exactly max_seconds, so the unchanged policy said "not stopped".
    swept = Recorded(outcome="stop", reason="max_seconds", step=1, name="", elapsed_s=45.0)
    steps = [call(1), swept]
    policy = Policy(max_seconds=45)
    outcome = replay(policy, steps, started_at=T0, recorded=policy, trace=True)
    assert (outcome.status, outcome.stop_reason, outcome.step) == ("stopped", "max_seconds", 1)
    assert not changed(recorded_stop(steps), outcome)
    assert [rec.name for rec, _ in outcome.decisions] == ["search"]
    # A draft that stops earlier still wins: the silence that followed never came.
    later = Recorded(outcome="stop", reason="max_seconds", step=2, name="", elapsed_s=45.0)
    assert replay(Policy(max_steps=1, max_seconds=None), [call(1), call(2), later],
                  started_at=T0, recorded=policy).stop == ("max_steps", 2)


def test_a_kill_answered_to_a_check_counts_that_check():
    steps = [call(1), call(2, outcome="stop", reason="killed")]
    outcome = replay(LOOSE, steps, started_at=T0, recorded=LOOSE)
    assert (outcome.status, outcome.step) == ("killed", 2)


def test_a_retry_stopped_by_a_kill_counts_nothing_again():
    # A check_id sent again after the engage, before the fan-out: its stop is recorded at
    # the step its first answer counted (SPEC 5.2), and the replay keeps it there.
    steps = [call(1), call(2), call(2, outcome="stop", reason="killed")]
    outcome = replay(LOOSE, steps, started_at=T0, recorded=LOOSE)
    assert (outcome.status, outcome.stop_reason, outcome.step) == ("killed", "killed", 2)
    assert not changed(recorded_stop(steps), outcome)


def test_a_shadow_draft_only_keeps_the_kill():
    steps = [call(i, args={"q": "same"}) for i in range(1, 6)]
    steps.append(call(6, outcome="stop", reason="killed", args={"q": "same"}))
    outcome = replay(Policy(mode="shadow", max_repeat_action=1), steps, started_at=T0,
                     recorded=LOOSE, trace=True)
    assert outcome.stop == ("killed", 6)
    assert [d.outcome for _, d in outcome.decisions][:3] == ["allow", "would_stop",
                                                             "would_stop"]


def test_the_recorded_elapsed_seconds_drive_max_seconds():
    steps = [call(i, elapsed_s=10.0 * i) for i in range(1, 6)]
    assert replay(Policy(max_seconds=30, max_usd=None), steps, started_at=T0,
                  recorded=LOOSE).stop == ("max_seconds", 4)
    assert replay(Policy(max_seconds=30.0, max_usd=None),
                  [call(i, elapsed_s=30.0) for i in range(1, 4)], started_at=T0,
                  recorded=LOOSE).stop is None


def test_the_recorded_results_and_errors_feed_the_rules():
    error = last_result_of({"status": "error", "error": "boom"})
    steps = [call(i, last_result=error) for i in range(1, 5)]
    draft = Policy(error_threshold=2, error_action="stop", max_seconds=None,
                   no_progress_window=100)
    assert replay(draft, steps, started_at=T0, recorded=LOOSE).stop == ("repeated_error", 2)
    assert last_result_of(None) is None and last_result_of({}) is None


def test_keys_are_recomputed_only_where_no_redacted_value_is_part_of_them():
    recorded = Policy(redact_args=("token",), ignore_args=())
    def redacted(step: int, **args: Any) -> Recorded:
        stored = {k: "[redacted]" if k.lower() == "token" else v for k, v in args.items()}
        return call(step, args=stored, repeat_key=repeat_key("search", args))

    steps = [redacted(i, q="x", token=f"t{i}", rid=i) for i in range(1, 5)]
    # Ignoring rid: the redacted token is part of the key, so the recorded (distinct) keys.
    ignore_rid = replay(Policy(ignore_args=("rid",), max_repeat_action=3, max_seconds=None),
                        steps, started_at=T0, recorded=recorded)
    assert ignore_rid.stop is None and ignore_rid.key_fallbacks == 4
    # Ignoring rid and the token: recomputed exactly, four identical calls.
    both = replay(Policy(ignore_args=("rid", "token"), max_repeat_action=3, max_seconds=None),
                  steps, started_at=T0, recorded=recorded)
    assert both.stop == ("loop_detected", 4) and both.key_fallbacks == 0


def test_a_parents_steps_counted_by_its_sub_agents_are_replayed_where_they_fell():
    # SPEC 20: a parent's recorded steps include its descendants' checks (here 2 between its
    # own first and second check), then its tree stopped it. An unchanged draft is no change
    # (it reported "would stop 1 run earlier" at step 2 against the recorded 4).
    steps = [call(1), call(4, outcome="stop", reason="parent_stopped")]
    outcome = replay(LOOSE, steps, started_at=T0, recorded=LOOSE)
    assert (outcome.stop_reason, outcome.step) == ("parent_stopped", 4)
    assert not changed(recorded_stop(steps), outcome)
    # The draft's step limit counts them too: max_steps 3 stops the check at step 4.
    limited = replay(replace(LOOSE, max_steps=3), [call(1), call(4), call(5)],
                     started_at=T0, recorded=LOOSE)
    assert (limited.stop_reason, limited.step) == ("max_steps", 4)


def test_a_check_that_expired_before_it_was_decided_counts_nothing():
    steps = [call(1), call(1, outcome="expired", reason="deadline_expired"), call(2),
             call(3, outcome="stop", reason="max_steps")]
    outcome = replay(replace(LOOSE, max_steps=2), steps, started_at=T0, recorded=LOOSE)
    assert (outcome.stop_reason, outcome.step) == ("max_steps", 3)
    assert not changed(recorded_stop(steps), outcome)


def test_a_draft_that_stops_a_run_later_says_so_in_its_summary():
    # Found by a newcomer: "5 would change" then "would stop 2 of 30 runs earlier", the 3
    # others unexplained: runs the draft stops later (or for another reason at that step).
    from governance_client.estimate import Estimator

    steps = [call(1), call(2), call(3, outcome="stop", reason="max_steps")]
    draft = replace(LOOSE, max_steps=3)
    outcome = replay(draft, [*steps[:2], call(3), call(4)], started_at=T0, recorded=LOOSE)
    estimator = Estimator(draft)
    effect = estimator.add_run(run="r", agent="a", started_at=T0, steps=steps,
                               outcome=outcome, recorded_steps=3, recorded_cost=Decimal(0))
    assert effect.stopped_otherwise and not effect.stopped_earlier
    assert "stop 1 run later or for another reason" in estimator.result().summary()


def test_a_parent_ended_without_a_check_of_its_own_keeps_its_trees_steps():
    # SPEC 20 and 13: a parent whose steps all came from its sub-agents' checks (here 3),
    # then killed by the fan-out or ended by the sweep out of time, is no change under an
    # unchanged draft. The replay reported the stop at step 0 against the recorded 3, so
    # backtesting the current policy listed every such tree's runs as changed.
    for reason in ("killed", "max_seconds"):
        steps = [Recorded(outcome="stop", reason=reason, step=3, name="", elapsed_s=45.0)]
        outcome = replay(Policy(max_seconds=45), steps, started_at=T0,
                         recorded=Policy(max_seconds=45))
        assert (outcome.stop_reason, outcome.step) == (reason, 3)
        assert not changed(recorded_stop(steps), outcome)
        # A check of its own, then two of its sub-agents', then the end.
        steps = [call(1), Recorded(outcome="stop", reason=reason, step=3, name="",
                                   elapsed_s=45.0)]
        outcome = replay(Policy(max_seconds=45), steps, started_at=T0,
                         recorded=Policy(max_seconds=45))
        assert outcome.step == 3 and not changed(recorded_stop(steps), outcome)
