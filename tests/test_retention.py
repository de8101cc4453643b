"""Retention (docs/reliability.md): `prune_audit` exports, then deletes, the audit records older
than each team's retention_days, and never touches a running run. Both databases."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from io import StringIO
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from django.core.management import CommandError, call_command
from django.db import DatabaseError, connection, transaction
from django.test import Client
from django.utils import timezone

from policies.models import OperatorEvent, Team
from policies.services import agent_key_create, audit, team_ensure
from runs.audit.retention import prune_audit
from runs.models import Decision, Run
from tests.conftest import ON_POSTGRES

pytestmark = pytest.mark.django_db

NOW = timezone.now()


@contextmanager
def at(moment: datetime) -> Iterator[None]:
    """Everything done inside happens at `moment` (auto_now_add fields included)."""
    with mock.patch("django.utils.timezone.now", return_value=moment):
        yield


class Agent:
    def __init__(self, team: Team) -> None:
        token = agent_key_create(team=team, name="k").token
        self.client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = self.client.post(path, body, content_type="application/json")
        assert response.status_code in (200, 201), response.content
        return response.json()

    def run(self, *, checks: int, finish: str | None = "completed", name: str = "search"
            ) -> str:
        run_id = self.post("/api/v1/runs", {"agent": "bot"})["run_id"]
        for i in range(checks):
            self.post(f"/api/v1/runs/{run_id}/check", {"action": {"name": name, "args": {"i": i}}})
        if finish:
            self.post(f"/api/v1/runs/{run_id}/finish", {"status": finish})
        return run_id


@pytest.fixture
def world() -> dict[str, Any]:
    """Team `support` keeps 30 days, team `archive` 365; runs and events of various ages."""
    old, recent = NOW - timedelta(days=40), NOW - timedelta(days=10)
    with at(old):
        support = team_ensure(slug="support")[0]
        archive = team_ensure(slug="archive")[0]
        Team.objects.filter(pk=support.pk).update(retention_days=30)
        Team.objects.filter(pk=archive.pk).update(retention_days=365)
        a, b = Agent(support), Agent(archive)
        ids = {
            "old_completed": a.run(checks=3),
            "old_running": a.run(checks=2, finish=None),
            "ended_recently": a.run(checks=1, finish=None),
            "other_team_old": b.run(checks=2),
        }
        # Four identical calls: stopped by loop_detected, then finished (keeps its reason).
        stopped = a.post("/api/v1/runs", {"agent": "bot"})["run_id"]
        for _ in range(4):
            a.post(f"/api/v1/runs/{stopped}/check", {"action": {"name": "same"}})
        ids["old_stopped"] = stopped
        audit(actor=None, action="global.thing", team=None, target="everyone")
        audit(actor=None, action="killswitch.engage", team=None, target="global")
        # Runs that stay running for weeks: as under a policy with max_idle_seconds null,
        # else SPEC 14 would end them abandoned an hour after their last check.
        Run.objects.filter(pk__in=[ids["old_running"], ids["ended_recently"]]).update(
            idle_deadline=None)
    with at(recent):
        ids["recent_completed"] = a.run(checks=2)
        a.post(f"/api/v1/runs/{ids['ended_recently']}/finish", {"status": "failed"})
        audit(actor=None, action="key.revoke", team=support, target="recent")
    return {"support": support, "archive": archive, "ids": ids, "agent": a}


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_it_exports_then_deletes_only_what_is_older_than_the_team_retention(
        world: dict[str, Any], tmp_path: Path) -> None:
    ids, support = world["ids"], world["support"]
    gone = [ids["old_completed"], ids["old_stopped"]]
    assert Run.objects.get(pk=ids["old_stopped"]).stop_reason == "loop_detected"
    gone_decisions = set(Decision.objects.filter(run_id__in=gone).values_list("id", flat=True))
    gone_events = set(OperatorEvent.objects.filter(team=support, at__lt=NOW - timedelta(days=30))
                      .values_list("id", flat=True))
    kept_events = set(OperatorEvent.objects.exclude(pk__in=gone_events)
                      .values_list("id", flat=True))
    kept_decisions = set(Decision.objects.exclude(pk__in=gone_decisions)
                         .values_list("id", flat=True))
    assert len(gone_decisions) == 3 + 4 and gone_events and kept_events

    results = {r.team: r for r in prune_audit(export_dir=tmp_path, now=NOW)}

    support_result = results["support"]
    assert (support_result.runs, support_result.decisions, support_result.operator_events) == (
        2, len(gone_decisions), len(gone_events))
    assert set(Run.objects.values_list("id", flat=True)) == {
        Run.objects.get(pk=ids[k]).pk for k in
        ("old_running", "ended_recently", "other_team_old", "recent_completed")}
    assert set(Decision.objects.values_list("id", flat=True)) == kept_decisions
    assert set(OperatorEvent.objects.values_list("id", flat=True)) == kept_events
    # archive keeps a year: nothing of it went, and it got no export file.
    assert (results["archive"].runs, results["archive"].export) == (0, None)

    exported = lines(support_result.export)
    assert support_result.export.parent == tmp_path / "support"
    assert {r["run_id"] for r in exported if r["kind"] == "run"} == set(gone)
    assert {r["id"] for r in exported if r["kind"] == "decision"} == gone_decisions
    assert {r["id"] for r in exported if r["kind"] == "operator_event"} == gone_events
    stopped = next(r for r in exported if r["kind"] == "run" and r["run_id"] == ids["old_stopped"])
    assert (stopped["status"], stopped["stop_reason"], stopped["steps"]) == (
        "stopped", "loop_detected", 4)
    loop = [r for r in exported if r["kind"] == "decision" and r["run_id"] == ids["old_stopped"]]
    assert [(r["step"], r["outcome"]) for r in loop] == [
        (1, "allow"), (2, "allow"), (3, "allow"), (4, "stop")]


def test_the_batch_read_is_a_range_of_the_ended_runs_index(world: dict[str, Any]) -> None:
    """Each batch reads the team's oldest ended runs in index order, never the whole runs
    table sorted (0.3 s a batch at 500,000 runs, docs/performance.md "Cost as the work
    grows"). Whether the index *can* serve the read is the question, so a scan is priced out
    on PostgreSQL: on a test's few rows the planner would rightly prefer one."""
    from runs.audit.retention import BATCH, prunable_runs

    read = (prunable_runs(world["support"], NOW - timedelta(days=30)).select_for_update()
            .order_by("ended_at", "id")[:BATCH])
    with transaction.atomic():
        if ON_POSTGRES:
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL enable_seqscan = off")
                # Likewise a sort over another index of the team's runs, which on a full
                # suite's statistics can price just under the ordered range.
                cursor.execute("SET LOCAL enable_sort = off")
        plan = read.explain()
        got = [run.pk for run in read]
    old = Run.objects.filter(pk__in=[world["ids"]["old_completed"], world["ids"]["old_stopped"]])
    assert got == [run.pk for run in sorted(old, key=lambda run: (run.ended_at, run.pk))]
    assert "run_team_ended" in plan
    # The index's order is the batch's: nothing sorted afterwards.
    assert "Sort" not in plan and "TEMP B-TREE" not in plan


def test_a_running_run_is_never_pruned_however_old(world: dict[str, Any], tmp_path: Path) -> None:
    running = world["ids"]["old_running"]
    prune_audit(export_dir=tmp_path, now=NOW + timedelta(days=1000))
    assert Run.objects.get(pk=running).status == "running"
    assert Decision.objects.filter(run_id=running).count() == 2
    # ...and its next check is decided on its full history (stopped: 40 days > max_seconds).
    answer = world["agent"].post(f"/api/v1/runs/{running}/check", {"action": {"name": "next"}})
    assert (answer["reason"], answer["step"]) == ("max_seconds", 3)


def test_a_persons_events_without_a_team_go_after_the_longest_retention(
        world: dict[str, Any], tmp_path: Path) -> None:
    # A token for all of its owner's teams writes an event without a team at each read:
    # they were kept for ever. Past the longest retention of any team (archive's 365 days)
    # they go, exported; the global kill switch's are every team's history and stay.
    results = {r.team: r for r in prune_audit(export_dir=tmp_path, now=NOW)}
    assert results["(no team)"].operator_events == 0  # 40 days old: archive keeps 365
    assert OperatorEvent.objects.filter(team=None, action="global.thing").exists()
    later = {r.team: r for r in prune_audit(export_dir=tmp_path,
                                            now=NOW + timedelta(days=1000))}
    assert later["(no team)"].operator_events == 1
    assert not OperatorEvent.objects.filter(team=None, action="global.thing").exists()
    assert OperatorEvent.objects.filter(team=None, action="killswitch.engage").exists()
    exported = lines(later["(no team)"].export)
    assert [r["action"] for r in exported] == ["global.thing"]
    assert later["(no team)"].export.parent == tmp_path / "_no-team"


def test_pruning_twice_changes_nothing_the_second_time(
        world: dict[str, Any], tmp_path: Path) -> None:
    first = prune_audit(export_dir=tmp_path, now=NOW)
    counts = (Run.objects.count(), Decision.objects.count(), OperatorEvent.objects.count())
    second = prune_audit(export_dir=tmp_path, now=NOW)
    assert [(r.runs, r.decisions, r.operator_events, r.export) for r in second] == [
        (0, 0, 0, None)] * len(second)
    assert (Run.objects.count(), Decision.objects.count(), OperatorEvent.objects.count()) == counts
    assert len(list(tmp_path.rglob("*.jsonl"))) == sum(r.export is not None for r in first)


def test_a_dry_run_counts_and_changes_nothing(world: dict[str, Any], tmp_path: Path) -> None:
    before = (Run.objects.count(), Decision.objects.count(), OperatorEvent.objects.count())
    results = {r.team: r for r in prune_audit(export_dir=tmp_path, now=NOW, dry_run=True)}
    assert (results["support"].runs, results["support"].decisions) == (2, 7)
    assert (Run.objects.count(), Decision.objects.count(), OperatorEvent.objects.count()) == before
    assert not list(tmp_path.rglob("*"))


def test_a_check_of_a_pruned_run_is_not_found(world: dict[str, Any], tmp_path: Path) -> None:
    prune_audit(export_dir=tmp_path, now=NOW)
    response = world["agent"].client.post(
        f"/api/v1/runs/{world['ids']['old_completed']}/check", {"action": {"name": "x"}},
        content_type="application/json")
    assert response.status_code == 404


@pytest.mark.postgres
def test_the_append_only_guard_is_back_after_a_prune(world: dict[str, Any], tmp_path: Path) -> None:
    assert ON_POSTGRES
    prune_audit(export_dir=tmp_path, now=NOW)
    with pytest.raises(DatabaseError), transaction.atomic():
        Decision.objects.filter(run_id=world["ids"]["recent_completed"]).delete()


def test_the_command_prints_what_it_did(world: dict[str, Any], tmp_path: Path) -> None:
    out = StringIO()
    call_command("prune_audit", "--export-dir", str(tmp_path), "--team", "support", stdout=out)
    text = out.getvalue()
    assert "support: pruned 2 runs, 7 decisions" in text
    assert str(tmp_path / "support") in text
    assert "archive" not in text
    assert Run.objects.filter(team=world["archive"]).count() == 1


def test_the_command_refuses_an_unknown_team(world: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(CommandError, match="nope"):
        call_command("prune_audit", "--export-dir", str(tmp_path), "--team", "nope")


def test_the_daily_task_prunes_into_the_configured_directory(
        world: dict[str, Any], tmp_path: Path, settings: Any) -> None:
    from runs.audit.tasks import prune_audit as task

    settings.AUDIT_EXPORT_DIR = tmp_path
    results = task.apply().get()
    support = next(r for r in results if r["team"] == "support")
    assert support["runs"] == 2 and Path(support["export"]).parent == tmp_path / "support"
    # A month later the runs that ended ten days ago have aged out too; the running one stays.
    with at(NOW + timedelta(days=31)):
        results = task.apply().get()
    assert next(r for r in results if r["team"] == "support")["runs"] == 2
    assert list(Run.objects.filter(team=world["support"]).values_list("status", flat=True)) == [
        "running"]


def test_beat_runs_the_prune_daily() -> None:
    from celery.schedules import crontab
    from django.conf import settings

    from governance.celery import app

    entry = settings.CELERY_BEAT_SCHEDULE["prune-audit-daily"]
    assert entry["task"] == "policies.tasks.prune_audit"
    assert isinstance(entry["schedule"], crontab)
    app.loader.import_default_modules()
    assert "policies.tasks.prune_audit" in app.tasks
