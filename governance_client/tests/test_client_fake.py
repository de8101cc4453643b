"""FakeGovernance records what it answered, and is built from the team's real policy file."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import pytest

from governance_client import rules
from governance_client.testing import FakeGovernance, RateLimit

POLICY_FILE = """\
teams:
  - slug: support
    name: Customer support
    policies:
      - name: default
        mode: enforce
        step_limits: {max_steps: 5, max_repeat_action: 2, no_progress_window: 4}
        budgets: {max_seconds: null, max_usd: 0.50}
        tools: {allow: null, deny: ["shell.*"]}
        approvals: {tools: ["payments.refund"], timeout_s: 60}
        rate_limits:
          - {match: "http.*", per: run, max: 1, window_s: 30}
      - name: research
        mode: shadow
        step_limits: {max_steps: 40, max_repeat_action: 4, no_progress_window: 6}
  - slug: billing
    policies: []
"""


def test_a_wait_and_a_pending_answer_are_recorded_as_answered_not_as_allows() -> None:
    fake = FakeGovernance(approvals=["refund.*"], operator=lambda _a: None,
                          rate_limits=[RateLimit(match="http.*", max=1, window_s=60)])
    run = fake.client(wait_budget=0, approval_timeout=0).start_run("bot")
    run.check("http.get", {"n": 1})
    run.check("http.get", {"n": 2})
    run.check("refund.issue", {"order": 1})

    assert [(d["decision"], d["reason"]) for d in fake.runs[run.id].decisions] == [
        ("allow", "step_ok"), ("wait", "rate_limited"), ("pending", "approval_required")]


def test_a_policy_as_written_in_a_file_takes_the_defaults_of_what_it_omits() -> None:
    policy = rules.Policy.from_document({"name": "lean", "step_limits": {"max_steps": 5},
                                         "budgets": {"max_usd": None}})

    assert (policy.max_steps, policy.max_repeat_action, policy.max_usd) == (5, 3, None)
    assert (policy.max_seconds, policy.deny, policy.redact_args) == (
        45, (), rules.DEFAULT_REDACT)


def test_a_fake_is_built_from_the_teams_policy_file(tmp_path: Path) -> None:
    path = tmp_path / "policies.yaml"
    path.write_text(POLICY_FILE)

    fake = FakeGovernance.from_policy_file(path, team="support")

    assert fake.policy.max_steps == 5 and fake.policy.max_usd == Decimal("0.50")
    assert fake.policy.max_seconds is None and fake.policy.max_idle_seconds == 3600
    assert fake.policy.redact_args == rules.DEFAULT_REDACT
    assert fake.approval_patterns == ("payments.refund",) and fake.approval_timeout_s == 60
    assert fake.rate_limits == (RateLimit(match="http.*", max=1, window_s=30, per="run"),)
    run = fake.client().start_run("bot")
    assert run.check("shell.exec", {"cmd": "ls"}).reason == "tool_denied"

    research = FakeGovernance.from_policy_file(path, team="support", policy="research")
    assert research.policy.mode == "shadow" and research.policy.max_steps == 40
    default = FakeGovernance.from_policy_file(path, team="billing")
    assert default.policy == rules.Policy()  # a team's default policy, never written


def test_a_policy_file_that_does_not_say_which_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "policies.yaml"
    path.write_text(POLICY_FILE)

    with pytest.raises(ValueError, match="has 2 teams"):
        FakeGovernance.from_policy_file(path)
    with pytest.raises(ValueError, match="no policy 'nope'"):
        FakeGovernance.from_policy_file(path, team="support", policy="nope")


def test_a_rate_limit_wait_longer_than_the_runs_time_left_is_a_stop_as_on_the_service() -> None:
    fake = FakeGovernance(max_seconds=45, rate_limits=[RateLimit(match="http.*", max=1,
                                                                 window_s=60)])
    run = fake.client(wait_budget=0).start_run("bot")
    run.check("http.get", {"n": 1})
    run.check("http.get", {"n": 2})

    answered = fake.runs[run.id].decisions
    assert [(d["decision"], d["reason"], d["step"]) for d in answered] == [
        ("allow", "step_ok", 1), ("stop", "max_seconds", 2)]
    assert "wait 60.000 s" in answered[1]["message"]
    assert "left of the run's time budget (max_seconds=45)" in answered[1]["message"]
    assert fake.runs[run.id].state.stop_reason == "max_seconds"


def test_an_expired_approval_ends_the_run_at_its_expiry_not_when_it_is_noticed() -> None:
    # As on the service (rules.settle): the run stops as of expires_at.
    fake = FakeGovernance(approvals=["refund.*"], approval_timeout_s=120)
    run = fake.client(approval_timeout=0).start_run("bot")
    assert run.check("refund.issue", {"order": 1}).decision == "pending"
    fake.advance(500)

    assert run.check("refund.issue", {"order": 1}).reason == "approval_expired"
    state = fake.runs[run.id].state
    assert state.ended_at == fake.now() - timedelta(seconds=380)
    assert state.usage(fake.now())["elapsed_s"] == 0.0  # the wait is no active time
