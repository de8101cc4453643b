"""One parse of a policy (issue 25): the client reads a run's ``policy`` as the API shows it
(SPEC 5.1) with the server's own ``rules.Policy.from_document``, every section the answer
carries included, and what another server may send malformed keeps the defaults."""

from __future__ import annotations

from decimal import Decimal

from governance_client import rules
from governance_client.local import LocalLimits, policy_from_json

AS_THE_API_SHOWS_IT = {
    "name": "default", "version": 3, "mode": "shadow",
    "step_limits": {"max_steps": 30, "max_repeat_action": 2, "no_progress_window": 5},
    "budgets": {"max_seconds": 60, "max_usd": 2.5, "max_tool_calls": None,
                "max_idle_seconds": 120},
    "tools": {"allow": ["search.*"], "deny": ["shell.*"]},
    "repeat_key": {"ignore_args": ["request_id"]},
    "on_repeated_error": {"threshold": 4, "action": "stop"},
    "approvals": {"tools": ["payments.*"], "timeout_s": 600},
}


def test_every_section_the_api_sends_is_read() -> None:
    policy = policy_from_json(AS_THE_API_SHOWS_IT)

    assert (policy.mode, policy.max_steps, policy.max_repeat_action,
            policy.no_progress_window) == ("shadow", 30, 2, 5)
    assert (policy.max_seconds, policy.max_usd, policy.max_tool_calls,
            policy.max_idle_seconds) == (60, Decimal("2.5"), None, 120)
    assert (policy.allow, policy.deny, policy.ignore_args) == (
        ("search.*",), ("shell.*",), ("request_id",))
    assert (policy.error_threshold, policy.error_action) == (4, "stop")
    assert (policy.approval_tools, policy.approval_timeout_s) == (("payments.*",), 600)
    assert LocalLimits().policy(AS_THE_API_SHOWS_IT) == policy


def test_what_a_client_may_be_sent_malformed_keeps_the_defaults() -> None:
    new = rules.Policy()
    policy = policy_from_json({"mode": "", "step_limits": {"max_steps": "many"},
                               "approvals": {"tools": None, "timeout_s": None},
                               "redact_args": None})

    assert (policy.mode, policy.max_steps, policy.approval_tools,
            policy.approval_timeout_s, policy.redact_args) == (
        new.mode, new.max_steps, (), new.approval_timeout_s, new.redact_args)
    assert policy_from_json(None).max_steps == new.max_steps
