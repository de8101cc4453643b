"""SPEC 4.4: a check on a terminal run changes no counter; nor does an upload of local
decisions (runs/check/local.py). Found by an attacker: 52 allows uploaded to a run stopped at
max_steps 2 made it 54 steps and 250 USD, and in a tree its ancestors with it. The upload is
still taken (200, the client keeps nothing to send again): each entry is audited, marked
local and ``after_end``, at the run's step, an allow decided after the end flagged as a
policy violation; the run and its ancestors keep their counters. Both stacks."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.test import Client

from governance_client import rules
from policies.models import Team
from runs.models import Decision, Run
from tests.conftest import set_policy

pytestmark = pytest.mark.django_db


def post(api: Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = api.post(path, json.dumps(body), content_type="application/json")
    return {**response.json(), "http": response.status_code}


def start(api: Client, **extra: Any) -> str:
    body = post(api, "/api/v1/runs", {"agent": "support-bot", **extra})
    assert body["http"] == 201, body
    return body["run_id"]


def allows(count: int, prefix: str = "local") -> dict[str, Any]:
    return {"decisions": [{"check_id": f"{prefix}-{i}", "cost_usd": 5,
                           "action": {"name": "search", "args": {"i": i}, "type": "tool"},
                           "decision": "allow", "reason": "step_ok"} for i in range(count)]}


def counters(run_id: str) -> tuple[str, str | None, int, int, Decimal]:
    run = Run.objects.get(pk=run_id)
    return run.status, run.stop_reason, run.steps, run.tool_calls, run.cost_usd


def test_an_upload_to_a_stopped_run_is_audited_and_counts_nothing(api: Client,
                                                                  team: Team) -> None:
    set_policy(team, step_limits={"max_steps": 2})
    run_id = start(api)
    for i in range(3):
        post(api, f"/api/v1/runs/{run_id}/check", {"action": {"name": "search",
                                                               "args": {"q": i}}})
    before = counters(run_id)
    assert before[:3] == ("stopped", "max_steps", 3)

    body = post(api, f"/api/v1/runs/{run_id}/local-decisions", allows(52))
    assert body["http"] == 200 and (body["recorded"], body["skipped"]) == (52, 0), body
    assert counters(run_id) == before
    assert (body["run"]["steps"], body["run"]["status"]) == (3, "stopped")
    uploaded = Decision.objects.filter(run_id=run_id, check_id__startswith="local-")
    assert uploaded.count() == 52
    for decision in uploaded:
        assert (decision.outcome, decision.step) == ("allow", 3)
        assert decision.answer["local"] and decision.answer["after_end"]
        assert decision.answer["policy_violation"]  # the service would have answered stop
        assert decision.answer["violation"].startswith("max_steps: the run was already")
    listed = api.get(f"/api/v1/runs/{run_id}/decisions?limit=100").json()["decisions"]
    assert sum(d["local"] and d["policy_violation"] for d in listed) == 52


def test_an_upload_to_a_finished_child_counts_on_no_ancestor(api: Client, team: Team) -> None:
    root = start(api)
    child = start(api, parent_run_id=root)
    assert post(api, f"/api/v1/runs/{child}/finish", {"status": "completed"})["http"] == 200
    before = counters(root), counters(child)
    body = post(api, f"/api/v1/runs/{child}/local-decisions", allows(10))
    assert body["http"] == 200 and body["recorded"] == 10, body
    assert (counters(root), counters(child)) == before
    assert before[0][2:] == (0, 0, Decimal(0))


def test_allows_after_a_local_stop_in_the_same_upload_count_nothing(api: Client) -> None:
    run_id = start(api)
    upload = allows(2, "before")["decisions"] + [
        {"check_id": "stop", "action": {"name": "search", "type": "tool"},
         "decision": "stop", "reason": "loop_detected"}] + allows(5, "after")["decisions"]
    body = post(api, f"/api/v1/runs/{run_id}/local-decisions", {"decisions": upload})
    assert body["http"] == 200 and body["recorded"] == 8, body
    assert counters(run_id) == ("stopped", "loop_detected", 3, 2, Decimal(10))
    after = Decision.objects.filter(run_id=run_id, check_id__startswith="after-")
    assert {(d.step, d.answer["after_end"]) for d in after} == {(3, True)}
    counted = Decision.objects.filter(run_id=run_id, check_id__startswith="before-")
    assert {d.answer["after_end"] for d in counted} == {False}


def test_the_rules_count_nothing_recorded_on_a_terminal_run() -> None:
    now = datetime(2025, 3, 1, 12, tzinfo=UTC)
    policy = rules.Policy()
    ended = rules.finish(rules.RunState(started_at=now, steps=4, tool_calls=2,
                                        cost_usd=Decimal(1)),
                         "completed", already_finished=False, now=now)
    for allowed in (True, False):
        decision, after = rules.record_outcome(
            policy, ended, rules.Check(name="search", cost_usd=Decimal(7)), allowed=allowed,
            reason=rules.STEP_OK if allowed else "max_usd", now=now + timedelta(seconds=1))
        assert after == ended and after is not ended
        assert decision.step == 4
        assert decision.outcome == (rules.ALLOW if allowed else rules.STOP)
