"""The dashboard's backtests are bounded per team (SPEC 10, "No tenant slows another"):
queued ones always count against BACKTEST_MAX_PER_TEAM, one that waited too long in the
queue is failed rather than run, a message delivered twice (late acknowledgement past the
broker's visibility timeout) runs once, and an import replays at most MAX_DRAFTS policies."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import yaml
from django.test import Client
from django.utils import timezone

from backtests import services
from backtests.models import Backtest, Status
from governance.celery import app as celery_app
from policies.document import parse_policy
from policies.models import Team
from policies.services import policy_save

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _eager() -> Iterator[None]:
    before = celery_app.conf.task_always_eager
    celery_app.conf.task_always_eager = True
    yield
    celery_app.conf.task_always_eager = before


@pytest.fixture
def no_worker(monkeypatch: Any) -> list[str]:
    """The queue, with no worker taking anything: the ids of the jobs sent to it."""
    from backtests.tasks import backtest_run_task

    queued: list[str] = []
    monkeypatch.setattr(backtest_run_task, "delay", queued.append)
    return queued


def draft(team: Team, name: str = "default") -> dict[str, Any]:
    return {"policy": name, "document": team.policies.get(name=name).current.document}


def start(team: Team, drafts: list[dict[str, Any]] | None = None) -> Backtest:
    return services.backtest_start(team=team, user=None, drafts=drafts or [draft(team)],
                                   source="editor", since=timedelta(days=1), limit=10)


def age(job_ids: list[str], seconds: float) -> None:
    Backtest.objects.filter(pk__in=job_ids).update(
        heartbeat_at=timezone.now() - timedelta(seconds=seconds))


def test_queued_backtests_count_however_long_they_wait_and_only_the_bound_ever_runs(
        team: Team, settings: Any, django_capture_on_commit_callbacks: Any,
        no_worker: list[str]) -> None:
    """During a backlog the team's queued jobs outlive BACKTEST_STALE_SECONDS: the team may
    start again, but the jobs that waited too long are failed, never run, so no more than
    the bound of its backtests ever take a worker."""
    settings.BACKTEST_MAX_PER_TEAM = 2
    with django_capture_on_commit_callbacks(execute=True):
        start(team), start(team)
    with pytest.raises(services.Busy):
        start(team)
    age(no_worker, settings.BACKTEST_STALE_SECONDS - 60)  # waiting, not for too long
    with pytest.raises(services.Busy):
        start(team)
    age(no_worker, settings.BACKTEST_STALE_SECONDS + 1)
    with django_capture_on_commit_callbacks(execute=True):
        start(team), start(team)
    with pytest.raises(services.Busy):
        start(team)
    for job_id in no_worker:  # the backlog clears: a worker takes every message
        services.backtest_run(job_id=job_id)
    statuses = [Backtest.objects.get(pk=job_id).status for job_id in no_worker]
    assert statuses == [Status.FAILED, Status.FAILED, Status.DONE, Status.DONE]


def test_a_backtest_that_waited_too_long_in_the_queue_is_failed_when_taken(
        team: Team, settings: Any, client: Any, users: dict[str, Any],
        django_capture_on_commit_callbacks: Any, no_worker: list[str]) -> None:
    with django_capture_on_commit_callbacks(execute=True):
        job = start(team)
    age(no_worker, settings.BACKTEST_STALE_SECONDS + 1)
    services.backtest_run(job_id=no_worker[0])
    job.refresh_from_db()
    assert (job.status, job.results, job.done) == (Status.FAILED, None, 0)
    assert "waited more than 300 s for a free worker" in job.error
    client.force_login(users["viewer"])
    page = client.get(f"/teams/{team.slug}/backtests/{job.pk}/").content.decode()
    assert "The backtest failed: it waited more than 300 s" in page


def test_a_backtest_delivered_again_while_it_runs_is_not_run_twice(
        team: Team, settings: Any, django_capture_on_commit_callbacks: Any,
        no_worker: list[str]) -> None:
    """Celery acknowledges a backtest late: past the broker's visibility timeout a second
    worker gets the same message while the first still replays."""
    with django_capture_on_commit_callbacks(execute=True):
        job = start(team)
    Backtest.objects.filter(pk=job.pk).update(status=Status.RUNNING, done=7, total=10,
                                              heartbeat_at=timezone.now())
    services.backtest_run(job_id=job.pk)
    job.refresh_from_db()
    assert (job.status, job.done, job.results) == (Status.RUNNING, 7, None)
    # Its worker died: no progress for BACKTEST_STALE_SECONDS, and the message comes back.
    age([str(job.pk)], settings.BACKTEST_STALE_SECONDS + 1)
    services.backtest_run(job_id=job.pk)
    job.refresh_from_db()
    assert job.status == Status.DONE and job.results is not None


def test_an_import_replays_at_most_max_drafts_policies(team: Team, users: dict[str, Any]
                                                       ) -> None:
    document = team.policies.get(name="default").current.document
    names = [f"p{i}" for i in range(services.MAX_DRAFTS)]
    for name in names:
        policy_save(team=team, document=parse_policy({**document, "name": name}), actor=None,
                    source="test")
    client = Client()
    client.force_login(users["viewer"])
    text = yaml.safe_dump({"teams": [{"slug": team.slug, "policies": [
        {**document, "name": name} for name in ["default", *names]]}]})
    message = (f"names {services.MAX_DRAFTS + 1} policies of the team: a backtest replays "
               f"at most {services.MAX_DRAFTS}")
    panel = client.post(f"/teams/{team.slug}/policies-import/backtest", {"document": text},
                        HTTP_HX_REQUEST="true")
    assert message in panel.content.decode()
    page = client.post(f"/teams/{team.slug}/policies-import/backtest", {"document": text})
    assert page.status_code == 422 and message in page.content.decode()
    assert not Backtest.objects.exists()
    # The bound itself is allowed.
    with pytest.raises(services.TooManyDrafts):
        start(team, [draft(team, name) for name in ["default", *names]])
    assert start(team, [draft(team, name) for name in names]).status in (Status.DONE,
                                                                           Status.QUEUED)
