"""Migration 0010 repairs what older versions left: a run that is over with an approval still
pending (a local stop uploaded while it waited). The request is cancelled as of the run's end,
the run's memory stops naming it, and every look at them works again (SPEC 10, "No impossible
states"). Requests of running runs, and decided ones, are left as they are."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.test import Client
from django.utils import timezone

from policies.models import Team
from runs.approvals.services import expire_due
from runs.models import Approval, Run
from tests.conftest import set_policy

pytestmark = pytest.mark.django_db(transaction=True)

BEFORE = [("runs", "0009_check_id_expression")]
AFTER = [("runs", "0010_settle_stale_approvals")]
PAY = {"name": "payments.refund", "args": {"order": 42}}


def migrate(target: list[tuple[str, str]]) -> Any:
    executor = MigrationExecutor(connection)
    executor.migrate(target)
    return executor.loader.project_state(target).apps


@pytest.fixture
def at_the_end() -> Iterator[None]:
    """Whatever happens, the database ends at the latest migration for the next test."""
    yield
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())


def post(api: Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = api.post(path, json.dumps(body), content_type="application/json")
    assert response.status_code in (200, 201), response.content
    return response.json()


def waiting_run(api: Client, check_id: str = "pay-1") -> tuple[str, str]:
    run_id = post(api, "/api/v1/runs", {"agent": "support-bot"})["run_id"]
    answer = post(api, f"/api/v1/runs/{run_id}/check", {"action": PAY, "check_id": check_id})
    assert answer["decision"] == "pending", answer
    return run_id, answer["approval"]["id"]


def test_pending_approvals_of_ended_runs_are_cancelled_as_of_their_end(
        api: Client, team: Team, at_the_end: None) -> None:
    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 60})
    stopped, stale = waiting_run(api)
    memory_only, _ = waiting_run(api)
    running, waits = waiting_run(api)
    expired_run, expired = waiting_run(api)
    expire_due(now=timezone.now() + timedelta(seconds=61))  # every one expires...
    # ...but the first two are back as the defect left them, and the third waits again.
    ended = (timezone.now() + timedelta(seconds=2)).replace(microsecond=0)

    old = migrate(BEFORE)
    OldRun, OldApproval = old.get_model("runs", "Run"), old.get_model("runs", "Approval")
    for run_id in (stopped, memory_only, running):
        approval = OldApproval.objects.get(run_id=run_id)
        OldApproval.objects.filter(pk=approval.pk).update(
            status="pending", decided_at=None, decision=None,
            expires_at=approval.requested_at + timedelta(seconds=600))
        memory = {**OldRun.objects.get(pk=run_id).memory, "paused_s": 0.0, "pending": {
            "approval_id": str(approval.pk), "check_id": "pay-1", "step": 1,
            "action_name": PAY["name"], "action_type": "tool", "repeat_key": "k",
            "since": (ended - timedelta(seconds=30)).isoformat(),
            "expires_at": (ended + timedelta(seconds=570)).isoformat()}}
        OldRun.objects.filter(pk=run_id).update(memory=memory)
    OldRun.objects.filter(pk=stopped).update(status="stopped", stop_reason="loop_detected",
                                             ended_at=ended)
    OldRun.objects.filter(pk=running).update(status="running", stop_reason=None,
                                             ended_at=None)
    # An ended run whose request was settled, its memory alone still naming it.
    OldApproval.objects.filter(run_id=memory_only).update(status="denied", decided_at=ended)
    OldRun.objects.filter(pk=memory_only).update(status="stopped",
                                                 stop_reason="approval_denied", ended_at=ended)

    migrate(AFTER)
    # On to the latest schema, which today's models (and the check below) read.
    migrate(MigrationExecutor(connection).loader.graph.leaf_nodes())

    approval = Approval.objects.get(pk=stale)
    assert (approval.status, approval.decided_at) == ("cancelled", ended)
    run = Run.objects.get(pk=stopped)
    assert (run.status, run.stop_reason) == ("stopped", "loop_detected")
    assert run.memory["pending"] is None and run.memory["paused_s"] == pytest.approx(30.0)
    assert Run.objects.get(pk=memory_only).memory["pending"] is None
    assert Approval.objects.get(run_id=memory_only).status == "denied"
    # Left as they were: a running run's request, an expired one.
    assert Approval.objects.get(pk=waits).status == "pending"
    assert Run.objects.get(pk=running).memory["pending"]["approval_id"] == waits
    assert Approval.objects.get(pk=expired).status == "expired"
    assert Run.objects.get(pk=expired_run).stop_reason == "approval_expired"

    # The request answers its run's stop, as a replay of its check does, and the sweep
    # passes over everything without a failure.
    got = api.get(f"/api/v1/approvals/{stale}").json()
    assert (got["status"], got["decision"]["decision"], got["decision"]["reason"]) == (
        "cancelled", "stop", "loop_detected")
    assert expire_due(now=timezone.now() + timedelta(days=1)) == 1  # the running one
