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
    "directive": None, "shadow": None, "approval": None, "retry_after_s": None, "rule": None,
}
# SPEC 18: the trace the check's span is in (the server sets it while tracing is on).
ANSWER_DEFAULTS["trace_id"] = None

# SPEC 16 `rule.scope`: the run's own limit. A sub-agent's check stopped by an ancestor's
# limit (SPEC 20) names that ancestor's run id instead.
RUN_SCOPE = "run"


def rule_of(fired: dict[str, Any] | None, *, policy: tuple[str, int] | None,
            scope: str = RUN_SCOPE) -> dict[str, Any] | None:
    """An answer's ``rule`` (SPEC 16): null for a plain allow, else the rule that decided
    (``fired``, the rules' name, limit and observed values) with the policy's name and
    version and the scope whose limit it is. An ancestor's limit names the ancestor's
    policy, which the rules put in ``fired``; any other rule names ``policy``."""
    if fired is None:
        return None
    name, version = fired.get("policy") or policy or (None, None)
    return {"name": fired["name"], "policy": name, "version": version,
            "limit": fired.get("limit") or {}, "observed": fired.get("observed") or {},
            "scope": scope}


def policy_ref(policy: rules.Policy) -> tuple[str, int]:
    return policy.name, policy.version

# The fields of an answer that depend on the run; the rest of a kill's answer is the same
# for every run one switch kills (the fan-out's SQL adds these to `kill_answer_fixed`).
PER_RUN = ("step", "usage", "limits")


def answer(decision: rules.Decision, *, usage: Any, limits: Any,
           policy: tuple[str, int] | None = None, scope: str = RUN_SCOPE) -> dict[str, Any]:
    """The answer to a check the rules decided: every field of SPEC 15 and 16. ``policy``:
    the (name, version) the rule names; ``scope``: whose limit it is (SPEC 16, 20)."""
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
        "rule": rule_of(decision.rule, policy=policy, scope=decision.scope or scope),
    }


def answer_of(decision: rules.Decision, state: rules.RunState, policy: rules.Policy,
              now: datetime, *, scope: str = RUN_SCOPE) -> dict[str, Any]:
    """The answer, with the run's usage after the decision and the policy's limits."""
    return answer(decision, usage=state.usage(now), limits=policy.limits(),
                  policy=policy_ref(policy), scope=scope)


def abandon_decision(state: rules.RunState, policy: rules.Policy) -> rules.Decision:
    """An abandonment (SPEC 14), audited like a kill: stop, no action, the step unchanged.
    A run whose time budget ran out with no check to stop it (`rules.overdue`) is ended the
    same way, its reason `max_seconds` and its message naming the budget."""
    if state.stop_reason == "max_seconds":
        reason, message = "max_seconds", rules.out_of_time_message(policy)
        fired = rules.rule(reason, {"max_seconds": policy.max_seconds},
                           {"elapsed_s": policy.max_seconds})
    else:
        reason, message = rules.ABANDONED, rules.abandoned_message(policy)
        fired = rules.rule(reason, {"max_idle_seconds": policy.max_idle_seconds},
                           {"idle_s": policy.max_idle_seconds})
    return rules.Decision(outcome=rules.STOP, reason=reason, step=state.steps,
                          repeat_key="", repeat_count=0, message=message,
                          next_action=rules.NEXT_ACTION[reason], rule=fired)


def abandon_answer(state: rules.RunState, policy: rules.Policy, now: datetime
                   ) -> dict[str, Any]:
    """The audit record of an abandonment, shaped like a check answer (as a kill's is) so
    screens show it the same way."""
    return answer_of(abandon_decision(state, policy), state, policy, now)


# A run switch is named by its run: it stops the run's sub-agents too (SPEC 20), whose agents
# "this run" would tell the switch is on their own run (found by a newcomer).
SWITCH_SCOPES = {"global": "the global kill switch", "team": "the team kill switch",
                 "agent": "the kill switch of agent {agent}", "run": "the kill switch of run {run}"}


def kill_rule(scope: str, *, team: str | None, by: str, reason: str,
              agent: str | None = None, run: str | None = None) -> dict[str, Any]:
    """The switch as a stop's ``rule`` names it (SPEC 16): its scope and what it covers as
    the limit, who engaged it and why as the observed values."""
    limit: dict[str, Any] = {"scope": scope}
    if scope != "global":
        limit["team"] = team
    if scope == "agent":
        limit["agent"] = agent
    if scope == "run" and run is not None:
        limit["run"] = run
    return rules.rule(rules.KILLED, limit, {"engaged_by": by, "reason": reason})


def switch_in_words(scope: str, *, by: str, reason: str, agent: str | None = None,
                    run: Any = None) -> str:
    """A switch for the agent it stops (SPEC 6): the message of a refused start or a killed
    check names the switch, who engaged it and why."""
    return f"{SWITCH_SCOPES[scope].format(agent=agent, run=run)}, engaged by {by}: {reason}"


def kill_decision(words: str, *, step: int, fired: dict[str, Any] | None = None
                  ) -> rules.Decision:
    """A kill by the fan-out (SPEC 6): stop, no action, the step unchanged. ``words``: the
    switch as the agent reads it (runs/killswitch/cover.py `switch_in_words`); ``fired``:
    the switch as a rule (`kill_rule`)."""
    return rules.Decision(outcome=rules.STOP, reason=rules.KILLED, step=step,
                          repeat_key="", repeat_count=0,
                          message=f"Stopped by a kill switch: {words}.",
                          next_action=rules.NEXT_ACTION[rules.KILLED],
                          rule=fired or rules.rule(rules.KILLED, {}, {}))


def kill_answer(switch_id: int, words: str, state: rules.RunState, limits: dict[str, Any],
                now: datetime, *, fired: dict[str, Any] | None = None,
                policy: tuple[str, int] | None = None) -> dict[str, Any]:
    """The audit record of a kill, shaped like a check answer; it names the switch."""
    return {**answer(kill_decision(words, step=state.steps, fired=fired),
                     usage=state.usage(now), limits=limits, policy=policy),
            "kill_switch": switch_id}


# The fields of a kill's answer that depend on the run, besides PER_RUN: its rule names the
# run's policy and version (the fan-out's SQL sets them per run).
PER_RUN_RULE = ("policy", "version")


def kill_answer_fixed(switch_id: int, words: str, fired: dict[str, Any] | None = None
                      ) -> dict[str, Any]:
    """The part of a kill's answer that is the same for every run the switch kills: the
    whole answer but PER_RUN (its ``rule`` without PER_RUN_RULE)."""
    whole = {**answer(kill_decision(words, step=0, fired=fired), usage=None, limits=None),
             "kill_switch": switch_id}
    return {name: value for name, value in whole.items() if name not in PER_RUN}


# The expiry of a check past its deadline is a rule (`rules.expire`); its answer is built here.
EXPIRED = rules.EXPIRED  # the audited outcome
DEADLINE_EXPIRED = rules.DEADLINE_EXPIRED
EXPIRED_MESSAGE = rules.EXPIRED_MESSAGE
EXPIRED_NEXT = rules.EXPIRED_NEXT


def expired_answer(decided: dict[str, Any], state: rules.RunState, now: datetime,
                   check_id: str | None, policy: rules.Policy | None = None
                   ) -> dict[str, Any]:
    """The answer of an expired check: the answer the rules ``decided``, told as a stop with
    the state before the check and the check_id it was sent with, as `rules.expire` audits
    it (SPEC 4.5: the answer is the audited decision). Of what was decided only the action's
    key and the limits stay: its repeat count is the count before it, as this check counted
    nothing, and an approval it would have opened or a wait it would have asked for were
    never made (found by an attacker: an expired check named an approval id that answered
    404, and a repeat count its audit row did not have)."""
    fired = rules.rule(DEADLINE_EXPIRED, {}, {"past_deadline": True})
    return {**decided, "decision": rules.STOP, "reason": DEADLINE_EXPIRED,
            "step": state.steps, "message": EXPIRED_MESSAGE, "next_action": EXPIRED_NEXT,
            "repeat_count": state.repeat_counts.get(decided["repeat_key"], 0),
            "usage": state.usage(now), "directive": None, "shadow": None,
            "approval": None, "retry_after_s": None, "check_id": check_id,
            "rule": rule_of(fired, policy=policy_ref(policy) if policy else None)}


def local_answer(decision: rules.Decision, state: rules.RunState, policy: rules.Policy,
                 now: datetime, *, decided_at: str, violation: str | None,
                 after_end: bool = False, directive: dict[str, Any] | None = None,
                 warning: rules.WarningFound | None = None) -> dict[str, Any]:
    """The audit record of a decision a fail-open client made (SPEC 10): the answer, marked
    local, with the client's time and whether the allow broke the policy; ``after_end``
    when it reached a run already over, which it did not count (SPEC 4.4). ``directive``:
    the warning the client gave its agent with a local allow (SPEC 16), recorded as what
    the agent was told; its rule is ``warning``'s, the rules' own finding of it
    (`rules.local_warning`), or, where they find none, the code's, decided locally."""
    recorded = answer_of(decision, state, policy, now)
    if directive is not None and decision.answer == rules.ALLOW:
        recorded["directive"] = directive
        recorded["rule"] = rule_of(
            rules.rule(directive["code"], {}, {"decided": "locally"}) if warning is None
            else warning.rule, policy=policy_ref(policy),
            scope=RUN_SCOPE if warning is None else warning.scope or RUN_SCOPE)
    return {**recorded, "local": True,
            "decided_at": decided_at, "policy_violation": violation is not None,
            "violation": violation, "after_end": after_end}
