"""The check answer (SPEC 5.2, 15), built in one place.

Every answer an agent reads and every audit record shaped like one takes its fields from
here: the server's check, an abandonment (SPEC 14), a kill by the fan-out (SPEC 6), an
approval's final answer (SPEC 11), an uploaded local decision (SPEC 10), a check past its
deadline, and the client's FakeGovernance. Pure, like the rules: a decision, the run's usage
and the policy's limits in, a dict out; no I/O (an import-linter contract).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from governance_client import rules

# SPEC 15: every check answer carries these, null where they do not apply. Answers stored
# before a field existed get them on replay.
ANSWER_DEFAULTS: dict[str, Any] = {
    "directive": None, "shadow": None, "approval": None, "retry_after_s": None,
}
# SPEC 18: the trace the check's span is in (the server sets it while tracing is on).
ANSWER_DEFAULTS["trace_id"] = None

# The fields of an answer that depend on the run; the rest of a kill's answer is the same
# for every run one switch kills (the fan-out's SQL adds these to `kill_answer_fixed`).
PER_RUN = ("step", "usage", "limits")


def answer(decision: rules.Decision, *, usage: Any, limits: Any) -> dict[str, Any]:
    """The answer to a check the rules decided: every field of SPEC 15."""
    return {
        "trace_id": None,  # SPEC 18: the server's check sets it while tracing is on
        "decision": decision.answer,
        "reason": decision.reason,
        "step": decision.step,
        "repeat_key": decision.repeat_key,
        "repeat_count": decision.repeat_count,
        "message": decision.message,
        "next_action": decision.next_action,
        "usage": usage,
        "limits": limits,
        "directive": decision.directive,
        "shadow": decision.shadow,
        "approval": decision.approval,
        "retry_after_s": decision.retry_after_s,
    }


def answer_of(decision: rules.Decision, state: rules.RunState, policy: rules.Policy,
              now: datetime) -> dict[str, Any]:
    """The answer, with the run's usage after the decision and the policy's limits."""
    return answer(decision, usage=state.usage(now), limits=policy.limits())


def abandon_decision(state: rules.RunState, policy: rules.Policy) -> rules.Decision:
    """An abandonment (SPEC 14), audited like a kill: stop, no action, the step unchanged.
    A run whose time budget ran out with no check to stop it (`rules.overdue`) is ended the
    same way, its reason `max_seconds` and its message naming the budget."""
    if state.stop_reason == "max_seconds":
        reason, message = "max_seconds", rules.out_of_time_message(policy)
    else:
        reason, message = rules.ABANDONED, rules.abandoned_message(policy)
    return rules.Decision(outcome=rules.STOP, reason=reason, step=state.steps,
                          repeat_key="", repeat_count=0, message=message,
                          next_action=rules.NEXT_ACTION[reason])


def abandon_answer(state: rules.RunState, policy: rules.Policy, now: datetime
                   ) -> dict[str, Any]:
    """The audit record of an abandonment, shaped like a check answer (as a kill's is) so
    screens show it the same way."""
    return answer_of(abandon_decision(state, policy), state, policy, now)


SWITCH_SCOPES = {"global": "the global kill switch", "team": "the team kill switch",
                 "agent": "the kill switch of agent {agent}", "run": "the kill switch of this run"}


def switch_in_words(scope: str, *, by: str, reason: str, agent: str | None = None) -> str:
    """A switch for the agent it stops (SPEC 6): the message of a refused start or a killed
    check names the switch, who engaged it and why."""
    return f"{SWITCH_SCOPES[scope].format(agent=agent)}, engaged by {by}: {reason}"


def kill_decision(words: str, *, step: int) -> rules.Decision:
    """A kill by the fan-out (SPEC 6): stop, no action, the step unchanged. ``words``: the
    switch as the agent reads it (runs/killswitch/cover.py `switch_in_words`)."""
    return rules.Decision(outcome=rules.STOP, reason=rules.KILLED, step=step,
                          repeat_key="", repeat_count=0,
                          message=f"Stopped by a kill switch: {words}.",
                          next_action=rules.NEXT_ACTION[rules.KILLED])


def kill_answer(switch_id: int, words: str, state: rules.RunState, limits: dict[str, Any],
                now: datetime) -> dict[str, Any]:
    """The audit record of a kill, shaped like a check answer; it names the switch."""
    return {**answer(kill_decision(words, step=state.steps), usage=state.usage(now),
                     limits=limits),
            "kill_switch": switch_id}


def kill_answer_fixed(switch_id: int, words: str) -> dict[str, Any]:
    """The part of a kill's answer that is the same for every run the switch kills: the
    whole answer but PER_RUN."""
    whole = {**answer(kill_decision(words, step=0), usage=None, limits=None),
             "kill_switch": switch_id}
    return {name: value for name, value in whole.items() if name not in PER_RUN}


# The expiry of a check past its deadline is a rule (`rules.expire`); its answer is built here.
EXPIRED = rules.EXPIRED  # the audited outcome
DEADLINE_EXPIRED = rules.DEADLINE_EXPIRED
EXPIRED_MESSAGE = rules.EXPIRED_MESSAGE
EXPIRED_NEXT = rules.EXPIRED_NEXT


def expired_answer(decided: dict[str, Any], state: rules.RunState, now: datetime,
                   check_id: str | None) -> dict[str, Any]:
    """The answer of an expired check: the answer the rules ``decided``, told as a stop with
    the state before the check (the rest of it, the repeat count and the limits among them,
    stays as decided) and the check_id it was sent with."""
    return {**decided, "decision": rules.STOP, "reason": DEADLINE_EXPIRED,
            "step": state.steps, "message": EXPIRED_MESSAGE, "next_action": EXPIRED_NEXT,
            "usage": state.usage(now), "directive": None, "shadow": None,
            "check_id": check_id}


def local_answer(decision: rules.Decision, state: rules.RunState, policy: rules.Policy,
                 now: datetime, *, decided_at: str, violation: str | None) -> dict[str, Any]:
    """The audit record of a decision a fail-open client made (SPEC 10): the answer, marked
    local, with the client's time and whether the allow broke the policy."""
    return {**answer_of(decision, state, policy, now), "local": True,
            "decided_at": decided_at, "policy_violation": violation is not None,
            "violation": violation}
