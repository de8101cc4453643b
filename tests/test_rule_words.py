"""A decision's rule in words (SPEC 16: the timeline's "why" and the stop banner's sentence),
as a newcomer read them: a warning is not a limit reached, and a sub-agent stopped by its
ancestor's limit is told so."""

from __future__ import annotations

import pytest

from runs.dashboard.presenters import rule_in_words, rule_sentence

pytestmark = pytest.mark.stack_independent

CHILD_STOP = {"name": "max_steps", "policy": "default", "version": 1,
              "limit": {"max_steps": 18}, "observed": {"steps": 19},
              "scope": "8d3c6f9e-0000-4000-8000-000000000001"}

def test_a_budget_warning_is_on_its_way_to_the_limit_not_at_it() -> None:
    warning = {"name": "budget", "policy": "default", "version": 1,
               "limit": {"max_steps": 18, "warnings.budget_fraction": 0.8},
               "observed": {"steps": 15}, "scope": "run"}
    assert rule_in_words(warning) == ("budget warning: steps 15 of max_steps 18, "
                                      "warnings.budget_fraction 0.8 (policy default v1)")

def test_a_stop_says_its_count_went_past_the_limit() -> None:
    stop = {**CHILD_STOP, "scope": "run", "observed": {"steps": 19}}
    assert rule_in_words(stop) == "max_steps: steps 19 past max_steps 18 (policy default v1)"
    assert rule_sentence(stop, "max_steps") == (
        "The rule max_steps of policy default v1 stopped this run: steps 19 past "
        "max_steps 18.")

def test_a_sub_agent_stopped_by_its_ancestors_limit_is_told_whose_it_is() -> None:
    assert rule_sentence(CHILD_STOP, "max_steps") == (
        "The rule max_steps of policy default v1 (the limit of ancestor run "
        f"{CHILD_STOP['scope']}, counted over its tree) stopped this run: steps 19 past "
        "max_steps 18.")


# Each kind in words that fit it (found by a newcomer: every kind read "{observed} reached
# {limit}", e.g. "decided_by operator, note too large reached approvals required").
KINDS = [
    # A switch, not a rule of the run's policy, even where the rule names the policy
    # (found by a newcomer: "The rule killed of policy default v2 stopped this run").
    ({"name": "killed", "policy": "default", "version": 2,
      "limit": {"scope": "agent", "team": "support", "agent": "ks-bot"},
      "observed": {"engaged_by": "operator", "reason": "looping, INC-7"}},
     "killed: the agent kill switch (team support, agent ks-bot), engaged by operator: "
     "looping, INC-7",
     "A kill switch stopped this run: the agent kill switch (team support, agent ks-bot), "
     "engaged by operator: looping, INC-7."),
    ({"name": "approval_denied", "policy": "default", "version": 2,
      "limit": {"approvals": "required"},
      "observed": {"decided_by": "operator", "note": "amount too large"}},
     "approval_denied: operator denied the action it had to approve (note: amount too large) "
     "(policy default v2)",
     "The rule approval_denied of policy default v2 stopped this run: operator denied the "
     "action it had to approve (note: amount too large)."),
    ({"name": "approval_expired", "limit": {"timeout_s": 8.0},
      "observed": {"expires_at": "2026-12-04T22:32:46Z"}},
     "approval_expired: nobody decided on the action it had to approve within 8 s (it "
     "expired at 2026-12-04T22:32:46Z)", None),
    ({"name": "tool_denied", "limit": {"deny": "shell.*"}, "observed": {"action": "shell.exec"}},
     "tool_denied: action shell.exec matches deny shell.*", None),
    ({"name": "tool_denied", "limit": {"allow": ["search.*", "kb.read"]},
      "observed": {"action": "shell.exec"}},
     "tool_denied: action shell.exec is not in allow [search.*, kb.read]", None),
    ({"name": "approval_required", "limit": {"approvals.tools": "payments.*", "timeout_s": 600},
      "observed": {"action": "payments.refund"}},
     "approval_required: action payments.refund matches approvals.tools payments.*", None),
]


@pytest.mark.parametrize(("rule", "why", "sentence"), KINDS)
def test_each_kind_of_rule_reads_as_what_happened(rule, why, sentence) -> None:
    assert rule_in_words(rule) == why
    if sentence is not None:
        assert rule_sentence(rule, rule["name"]) == sentence


# A check that arrives after its run ended is answered the run's end (SPEC 4.4); when no
# stop of the run is on record (its agent finished it), the rule's limit is the status a
# check needs, `{"status": "running"}`, not a number (found by a newcomer: "status stopped,
# stop_reason agent_stopped reached status running", "stop_reason None reached status
# running"). Such a row says the run was already over, and names no policy: none stopped it.
AFTER_THE_END = [
    ("agent_stopped", {"status": "stopped", "stop_reason": "agent_stopped"},
     "agent_stopped: the run was already stopped by its agent",
     "The run was already stopped by its agent."),
    ("run_finished", {"status": "completed", "stop_reason": None},
     "run_finished: the run was already completed", "The run was already completed."),
    ("run_finished", {"status": "failed", "stop_reason": None},
     "run_finished: the run was already failed", "The run was already failed."),
    ("max_steps", {"status": "stopped", "stop_reason": "max_steps"},
     "max_steps: the run was already stopped (max_steps)",
     "The run was already stopped (max_steps)."),
    ("killed", {"status": "killed", "stop_reason": "killed"},
     "killed: the run was already killed by a kill switch",
     "The run was already killed by a kill switch."),
    ("abandoned", {"status": "stopped", "stop_reason": "abandoned"},
     "abandoned: the run was already abandoned (no activity for its max_idle_seconds)",
     "The run was already abandoned (no activity for its max_idle_seconds)."),
]


@pytest.mark.parametrize(("name", "observed", "why", "sentence"), AFTER_THE_END)
def test_a_check_after_the_run_ended_says_the_run_was_already_over(
        name, observed, why, sentence) -> None:
    late = {"name": name, "policy": "default", "version": 5, "limit": {"status": "running"},
            "observed": observed, "scope": "run"}
    assert rule_in_words(late) == why
    assert rule_sentence(late, name) == sentence



ANCESTOR = "8d3c6f9e-0000-4000-8000-000000000002"

# `parent_stopped` is no limit of the ancestor (docs/subagents.md): its ancestor ended, for
# whatever reason (found by a newcomer: "The rule parent_stopped of policy default v1 (the
# limit of ancestor run X, counted over its tree) stopped this run: its ancestor run X is
# completed (completed)."). An ancestor found past its idle deadline is still `running` in
# the rule: it had ended all the same.
PARENT_ENDS = [
    ({"status": "completed", "reason": "completed"}, "completed"),
    ({"status": "failed", "reason": "failed"}, "failed"),
    ({"status": "stopped", "reason": "agent_stopped"}, "stopped by its agent"),
    ({"status": "stopped", "reason": "max_steps"}, "stopped (max_steps)"),
    ({"status": "killed", "reason": "killed"}, "killed by a kill switch"),
    ({"status": "stopped", "reason": "abandoned"},
     "abandoned (no activity for its max_idle_seconds)"),
    ({"status": "running", "reason": "abandoned"},
     "abandoned (no activity for its max_idle_seconds)"),
    ({"status": "running", "reason": "max_seconds"}, "stopped (max_seconds)"),
]


@pytest.mark.parametrize(("observed", "ended"), PARENT_ENDS)
def test_a_sub_agent_stopped_by_its_trees_end_is_told_its_ancestor_ended(observed, ended
                                                                         ) -> None:
    stop = {"name": "parent_stopped", "policy": "default", "version": 1,
            "limit": {"ancestor": ANCESTOR}, "observed": observed, "scope": ANCESTOR}
    assert rule_sentence(stop, "parent_stopped") == (
        f"Stopped because its ancestor run {ANCESTOR} had ended ({ended}).")
    assert rule_in_words(stop) == (
        f"parent_stopped: its ancestor run {ANCESTOR} had ended ({ended})")


def test_an_expired_check_and_a_rate_limit_wait_read_as_what_happened() -> None:
    expired = {"name": "deadline_expired", "policy": "default", "version": 1, "limit": {},
               "observed": {"past_deadline": True}, "scope": "run"}
    assert rule_in_words(expired) == (
        "deadline_expired: the agent no longer waited for the answer (its deadline had "
        "passed), so nothing was decided or counted")
    limited = {"name": "rate_limited", "policy": "default", "version": 1,
               "limit": {"index": 0, "match": "search.*", "per": "run", "max": 5,
                         "window_s": 60},
               "observed": {"retry_after_s": 2.5}, "scope": "run"}
    assert rule_in_words(limited) == (
        "rate_limited: rate_limits[0] (search.* at most 5 per run in 60 s): retry after 2.5 s "
        "(policy default v1)")
    # A wait the run's time cannot cover is a max_seconds stop: its elapsed time is not past
    # the limit, the wait would take it there.
    waited = {"name": "max_seconds", "policy": "default", "version": 1,
              "limit": {"max_seconds": 45}, "observed": {"elapsed_s": 40.0, "retry_after_s": 30},
              "scope": "run"}
    assert rule_in_words(waited) == (
        "max_seconds: elapsed_s 40 and a rate-limit wait of 30 s would pass max_seconds 45 "
        "(policy default v1)")


# `no_progress` and `repeated_error` name a warning and a stop both (for repeated_error with
# the very same limit and observed value): a stop of either is no warning, and its count
# reached the limit (found by a newcomer: a no_progress stop's row read "why: no_progress
# warning: no_progress_streak 4 of no_progress_window 4", its banner "...stopped this run:
# no_progress_streak 4 of no_progress_window 4.").
NO_PROGRESS_STOP = {"name": "no_progress", "policy": "default", "version": 1,
                    "limit": {"no_progress_window": 4},
                    "observed": {"no_progress_streak": 4}, "scope": "run"}
NO_PROGRESS_WARNING = {"name": "no_progress", "policy": "default", "version": 1,
                       "limit": {"no_progress_window": 4, "warnings.no_progress": 3},
                       "observed": {"no_progress_streak": 3}, "scope": "run"}
ERROR_RULE = {"name": "repeated_error", "policy": "default", "version": 1,
              "limit": {"on_repeated_error.threshold": 3}, "observed": {"error_count": 3},
              "scope": "run"}


def _row(outcome: str, rule: dict, directive_code: str | None):
    from datetime import UTC, datetime

    from runs.dashboard.presenters import step_row
    from runs.models import Decision

    answer = {"rule": rule, "directive": None if directive_code is None else {
        "type": "inject_message", "role": "user", "code": directive_code, "content": "..."}}
    return step_row(Decision(step=5, outcome=outcome, reason="step_ok" if outcome == "allow"
                             else rule["name"], action_name="search.web", action_type="tool",
                             args={}, answer=answer, rule=rule, at=datetime.now(UTC)))


def test_a_no_progress_stop_reads_as_a_stop_not_a_warning() -> None:
    assert rule_sentence(NO_PROGRESS_STOP, "no_progress") == (
        "The rule no_progress of policy default v1 stopped this run: no_progress_streak 4 "
        "reached no_progress_window 4.")
    assert rule_in_words(NO_PROGRESS_STOP) == (
        "no_progress: no_progress_streak 4 reached no_progress_window 4 (policy default v1)")
    assert _row("stop", NO_PROGRESS_STOP, None).why == (
        "no_progress: no_progress_streak 4 reached no_progress_window 4 (policy default v1)")
    assert _row("allow", NO_PROGRESS_WARNING, "no_progress").why == (
        "no_progress warning: no_progress_streak 3 of no_progress_window 4, "
        "warnings.no_progress 3 (policy default v1)")


def test_a_repeated_error_stop_and_its_nudge_read_apart() -> None:
    assert _row("stop", ERROR_RULE, None).why == (
        "repeated_error: error_count 3 reached on_repeated_error.threshold 3 "
        "(policy default v1)")
    assert _row("allow", ERROR_RULE, "repeated_error").why == (
        "repeated_error warning: error_count 3 of on_repeated_error.threshold 3 "
        "(policy default v1)")
    assert rule_sentence(ERROR_RULE, "repeated_error") == (
        "The rule repeated_error of policy default v1 stopped this run: error_count 3 "
        "reached on_repeated_error.threshold 3.")
