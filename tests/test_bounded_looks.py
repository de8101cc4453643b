"""SPEC 10 ("Bounded work per request"), 11 and 14: whoever looks first settles, a bounded
share per request (runs/first_look.py). With a backlog of 1,000 overdue runs (or expired
approvals), one read of the team's runs ends at most `LOOK_BATCH` of them, and still shows
every row it returns as it will be: ended `abandoned` at its deadline."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from policies.models import Team
from policies.tokens import operator_token_create
from runs.first_look import LOOK_BATCH
from runs.models import Approval, ApprovalStatus, Decision, Run
from tests.conftest import set_policy

BACKLOG = 1_000


def overdue_runs(team: Team, count: int = BACKLOG, **fields: Any) -> list[Run]:
    """``count`` running runs of the team, each past its idle deadline (an hour ago and
    earlier), newest started first. Their policy has no time budget: with one, a run
    started two hours ago ran out of time first and ends `max_seconds` (issue 26)."""
    set_policy(team, budgets={"max_seconds": None})
    version = team.policies.get(name="default").current
    now = timezone.now()
    runs = [Run(**{"team": team, "agent": "bot", "policy_version": version,
                   "status": "running", "started_at": now - timedelta(hours=2, seconds=i),
                   "idle_deadline": now - timedelta(hours=1, seconds=i), **fields})
            for i in range(count)]
    Run.objects.bulk_create(runs, batch_size=500)
    return runs


def at(text: str) -> datetime:
    return datetime.fromisoformat(text)


def ms(moment: datetime | None) -> datetime:
    """A moment as the API writes it: to the millisecond."""
    assert moment is not None
    return moment.replace(microsecond=moment.microsecond // 1000 * 1000)


def abandoned() -> int:
    return Run.objects.filter(stop_reason="abandoned").count()


@pytest.mark.django_db
def test_listing_runs_over_a_backlog_ends_a_bounded_share_and_shows_every_row_ended(
        api: Any, team: Team) -> None:
    runs = overdue_runs(team)
    body = api.get("/api/v1/runs?limit=100").json()
    assert abandoned() <= LOOK_BATCH
    assert Decision.objects.filter(reason="abandoned").count() == abandoned()
    listed = body["runs"]
    assert [r["run_id"] for r in listed] == [str(r.pk) for r in runs[:100]]
    deadlines = {str(r.pk): r.idle_deadline for r in runs}
    for row in listed:
        assert (row["status"], row["stop_reason"]) == ("stopped", "abandoned")
        assert at(row["ended_at"]) == ms(deadlines[row["run_id"]])


@pytest.mark.django_db
def test_a_running_filter_over_a_backlog_lists_no_overdue_run(api: Any, team: Team) -> None:
    overdue_runs(team)
    assert api.get("/api/v1/runs?status=running&limit=500").json()["runs"] == []
    assert abandoned() <= LOOK_BATCH
    # The look's share goes to the longest overdue: each look ends the next ones.
    api.get("/api/v1/runs?status=running")
    assert LOOK_BATCH < abandoned() <= 2 * LOOK_BATCH


@pytest.mark.django_db
def test_the_runs_page_and_the_overview_end_a_bounded_share_of_a_backlog(
        client: Any, team: Team, users: dict[str, Any]) -> None:
    runs = overdue_runs(team)
    client.force_login(users["viewer"])
    page = client.get(f"/teams/{team.slug}/runs/")
    assert page.status_code == 200
    assert abandoned() <= LOOK_BATCH
    shown = page.context["runs"]
    assert [r.pk for r in shown] == [r.pk for r in runs[:len(shown)]]
    assert {(r.status, r.stop_reason) for r in shown} == {("stopped", "abandoned")}
    running = client.get(f"/teams/{team.slug}/runs/?status=running")
    assert running.context["runs"] == []
    overview = client.get(f"/teams/{team.slug}/")
    assert overview.status_code == 200
    assert (overview.context["running"], overview.context["running_count"]) == ([], 0)
    assert abandoned() <= 3 * LOOK_BATCH


def expired_requests(team: Team) -> datetime:
    """BACKLOG runs waiting for approvals that expired an hour ago: their expiry."""
    expires = timezone.now() - timedelta(hours=1)
    pending = {"approval_id": "", "since": (expires - timedelta(minutes=15)).isoformat(),
               "expires_at": expires.isoformat(), "step": 1, "check_id": "c",
               "action_name": "deploy", "action_type": "tool", "repeat_key": "k"}
    runs = overdue_runs(team, idle_deadline=None, steps=1)
    approvals = [Approval(team=team, run=run, step=1, check_id="c", action_name="deploy",
                          action_type="tool", pattern="deploy", expires_at=expires,
                          requested_at=expires - timedelta(minutes=15))
                 for run in runs]
    Approval.objects.bulk_create(approvals, batch_size=500)
    for run, approval in zip(runs, approvals, strict=True):
        run.memory = {"pending": {**pending, "approval_id": str(approval.pk)}}
    Run.objects.bulk_update(runs, ["memory"], batch_size=500)
    return expires


def settled() -> int:
    return Approval.objects.exclude(status=ApprovalStatus.PENDING).count()


@pytest.mark.django_db
def test_a_look_settles_a_bounded_share_of_expired_approvals(api: Any, team: Team) -> None:
    """One look settles at most its share; every listed run reads stopped /
    approval_expired as of the expiry, and none is listed as running."""
    expires = expired_requests(team)
    listed = api.get("/api/v1/runs?limit=50").json()["runs"]
    assert 0 < settled() <= LOOK_BATCH
    assert len(listed) == 50
    for row in listed:
        assert (row["status"], row["stop_reason"]) == ("stopped", "approval_expired")
        assert at(row["ended_at"]) == ms(expires)
    assert api.get("/api/v1/runs?status=running&limit=50").json()["runs"] == []
    assert settled() <= 2 * LOOK_BATCH


@pytest.mark.django_db
def test_the_pages_show_no_run_waiting_for_an_expired_request(
        client: Any, team: Team, users: dict[str, Any]) -> None:
    expired_requests(team)
    client.force_login(users["viewer"])
    shown = client.get(f"/teams/{team.slug}/runs/").context["runs"]
    assert {(r.status, r.stop_reason) for r in shown} == {("stopped", "approval_expired")}
    assert client.get(f"/teams/{team.slug}/runs/?status=running").context["runs"] == []
    overview = client.get(f"/teams/{team.slug}/")
    assert overview.context["running"] == []
    assert settled() <= 3 * LOOK_BATCH


def operator(users: dict[str, Any]) -> Client:
    """The operator API as the team's viewer's token reads it."""
    token = operator_token_create(user=users["viewer"], name="ci", role="viewer").secret
    return Client(HTTP_AUTHORIZATION=f"Bearer {token}")


@pytest.mark.django_db
def test_the_operator_api_lists_no_request_past_its_expiry_as_pending(
        team: Team, users: dict[str, Any]) -> None:
    """Found by an attacker: each read settled a share of the expired requests and listed
    the rest `pending`, while the agent API answered `expired` for the same request. Past
    the look's share they are now shown as their expiry will settle them."""
    expires = expired_requests(team)
    reads = operator(users)
    path = f"/api/v1/teams/{team.slug}/approvals"
    assert reads.get(f"{path}?status=pending&limit=500").json()["approvals"] == []
    assert 0 < settled() <= LOOK_BATCH
    for query in ("limit=100", "status=expired&limit=100"):
        listed = reads.get(f"{path}?{query}").json()["approvals"]
        assert len(listed) == 100, query
        for row in listed:
            assert row["status"] == "expired", (query, row)
            assert at(row["decided_at"]) == expires
            assert (row["decision"]["decision"], row["decision"]["reason"]) == (
                "stop", "approval_expired")
    assert settled() <= 3 * LOOK_BATCH


@pytest.mark.django_db
def test_a_request_shown_expired_reads_as_the_agent_api_then_settles_it(
        api: Any, team: Team, users: dict[str, Any]) -> None:
    """The operator's list shows a request the look left due as the settling the agent's
    read then makes: the same status, time and final answer (but the audit record's id,
    which only the settling makes)."""
    expired_requests(team)  # expired an hour ago: the look's share goes to them first
    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 600})
    run_id = api.post("/api/v1/runs", {"agent": "support-bot"},
                      content_type="application/json").json()["run_id"]
    asked = api.post(f"/api/v1/runs/{run_id}/check", {"action": {"name": "payments.refund"},
                                                      "check_id": "p1", "cost_usd": 0.5},
                     content_type="application/json").json()
    assert asked["decision"] == "pending", asked
    approval_id = asked["approval"]["id"]
    expired = timezone.now() - timedelta(seconds=1)  # backdated: no sleep
    run = Run.objects.get(pk=run_id)
    run.memory["pending"]["expires_at"] = expired.isoformat()
    Run.objects.filter(pk=run_id).update(memory=run.memory)
    Approval.objects.filter(pk=approval_id).update(expires_at=expired)

    listed = operator(users).get(f"/api/v1/teams/{team.slug}/approvals?limit=1").json()
    shown = listed["approvals"][0]
    assert shown["id"] == approval_id
    assert Approval.objects.get(pk=approval_id).status == ApprovalStatus.PENDING  # left due
    polled = api.get(f"/api/v1/approvals/{approval_id}").json()
    assert polled["status"] == shown["status"] == "expired"
    assert shown["decided_at"] == polled["decided_at"]
    assert shown["decision"]["decision_id"] is None
    assert polled["decision"]["decision_id"] is not None
    unrecorded = {"decision_id", "trace_id"}
    assert ({k: v for k, v in shown["decision"].items() if k not in unrecorded}
            == {k: v for k, v in polled["decision"].items() if k not in unrecorded})
    assert shown["decision"]["usage"]["cost_usd"] == 0.5


@pytest.mark.django_db
def test_the_approvals_page_and_command_list_no_request_past_its_expiry_as_pending(
        team: Team, users: dict[str, Any], capsys: Any) -> None:
    """As the operator API: what the look's share (and the command's batch) left past its
    expiry shows expired, never among the pending requests to decide."""
    from django.core.management import call_command

    expired_requests(team)
    viewer = Client()
    viewer.force_login(users["viewer"])
    page = viewer.get(f"/teams/{team.slug}/approvals/")
    assert page.status_code == 200
    assert page.context["approvals_pending"] == 0 and page.context["pending"] == []
    assert 0 < settled() <= LOOK_BATCH
    call_command("approvals", "list", "--team", team.slug)
    assert capsys.readouterr().out.strip() == "No pending approval."
