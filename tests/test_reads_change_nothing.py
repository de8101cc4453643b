"""Reads that write (issue 25): whoever looks first settles (SPEC 11, 14), but the look is
the view's, made before its reads (runs/first_look.py). The selectors and presenters the
pages, the streams and the API read through write nothing, however much is due on what they
read; the rows still due are shown as they will be. The views still settle first."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import orjson
import pytest
from django.db import connection
from django.http import QueryDict
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from policies.models import AgentKey, Team
from runs import due
from runs.approvals import selectors as approvals
from runs.audit import selectors as audit
from runs.dashboard import presenters
from runs.dashboard.selectors import RunFilters
from runs.models import Approval, ApprovalStatus, Run
from tests.test_bounded_looks import overdue_runs

WRITES = ("INSERT", "UPDATE", "DELETE")


def waiting_past_expiry(team: Team, count: int) -> list[Run]:
    """Running runs waiting for requests that expired an hour ago (no idle deadline while
    waiting, SPEC 11)."""
    expires = timezone.now() - timedelta(hours=1)
    runs = overdue_runs(team, count, idle_deadline=None, steps=1)
    for run in runs:
        approval = Approval.objects.create(
            team=team, run=run, step=1, check_id="c", action_name="deploy",
            action_type="tool", pattern="deploy", expires_at=expires,
            requested_at=expires - timedelta(minutes=15))
        run.memory = {"pending": {
            "approval_id": str(approval.pk), "since": approval.requested_at.isoformat(),
            "expires_at": expires.isoformat(), "step": 1, "check_id": "c",
            "action_name": "deploy", "action_type": "tool", "repeat_key": "k"}}
        run.save(update_fields=["memory"])
    return runs


def writes_of(queries: CaptureQueriesContext) -> list[str]:
    return [q["sql"] for q in queries.captured_queries
            if q["sql"].lstrip().upper().startswith(WRITES) or "FOR UPDATE" in q["sql"].upper()]


@pytest.mark.django_db
def test_the_selectors_and_presenters_write_nothing(team: Team, agent_token: str) -> None:
    idle = overdue_runs(team, 3)
    waiting = waiting_past_expiry(team, 2)
    key = AgentKey.objects.get(team=team)
    filters = RunFilters.from_query(QueryDict())
    with CaptureQueriesContext(connection) as queries:
        overview = presenters.overview_context(team)
        listed = presenters.runs_list_context(team, filters)["runs"]
        api_page = orjson.loads(audit.runs_page(team))["runs"]
        shown = presenters.approvals_context(team)
        for run in [*idle, *waiting]:
            one = audit.run_for_team(team, run.pk)
            presenters.run_context(one)
            presenters.run_approval_context(one)
            audit.run_json(one)
        for approval in Approval.objects.filter(team=team):
            approvals.approval_json(approvals.approval_for_key(key, approval.pk))
        # The operator API's list (operator_api/api.py).
        will_be = [approvals.approval_json(a) for a in due.approvals_as_they_will_be(
            Approval.objects.filter(team=team).select_related("run"), now=timezone.now())]
    assert writes_of(queries) == []
    assert Run.objects.filter(team=team, status="running").count() == 5
    assert Approval.objects.filter(status=ApprovalStatus.PENDING).count() == 2
    # Still due, and shown as the settling will leave them.
    assert (overview["running"], overview["running_count"]) == ([], 0)
    api_listed = {(r["status"], r["stop_reason"]) for r in api_page}
    for shows in ({(r.status, r.stop_reason) for r in listed}, api_listed):
        assert shows == {("stopped", "abandoned"), ("stopped", "approval_expired")}
    # The approvals page shows them as their expiry will settle them, as the operator API.
    assert shown["pending"] == [] and shown["approvals_pending"] == 0
    assert {card.status for card in shown["decided"]} == {"expired"}
    assert {a["status"] for a in will_be} == {"expired"}


@pytest.mark.django_db
def test_the_views_settle_before_they_read(client: Any, api: Any, team: Team,
                                           users: dict[str, Any]) -> None:
    idle = overdue_runs(team, 2)
    waiting = waiting_past_expiry(team, 2)
    client.force_login(users["viewer"])
    assert client.get(f"/teams/{team.slug}/approvals/").context["pending"] == []
    assert Approval.objects.filter(status=ApprovalStatus.PENDING).count() == 0
    page = client.get(f"/teams/{team.slug}/runs/{idle[0].pk}/")
    assert (page.context["run"].status, page.context["run"].stop_reason) == (
        "stopped", "abandoned")
    assert api.get(f"/api/v1/runs/{idle[1].pk}").json()["stop_reason"] == "abandoned"
    assert {r.stop_reason for r in Run.objects.filter(team=team)} == {"abandoned",
                                                                      "approval_expired"}
    assert len(waiting) == 2
