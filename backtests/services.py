"""Writes of the dashboard's and the operator API's backtests: start one (bounded per team)
and run it (the Celery task's body, on the workers' bulk queue). The backtest itself only
reads (selectors.py); what is written here is the job's own row: its progress for the page
to poll, then its result."""

from __future__ import annotations

import logging
import time
import uuid
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from governance_client import rules
from policies.models import Team

from . import selectors
from .models import Backtest, Status

log = logging.getLogger(__name__)

ACTIVE = (Status.QUEUED, Status.RUNNING)
# Policies one backtest replays at most: an imported document may name every policy of the
# team, and each replays up to `limit` runs.
MAX_DRAFTS = 10


class Busy(Exception):
    """The team already runs as many backtests as it may."""


class TooManyDrafts(Exception):
    """More policies than one backtest replays."""


def _stale(now: datetime) -> datetime:
    return now - timedelta(seconds=settings.BACKTEST_STALE_SECONDS)


def waited_too_long() -> str:
    return (f"it waited more than {settings.BACKTEST_STALE_SECONDS} s for a free worker "
            "(the workers are busy): start it again later.")


def active_backtests(team: Team, *, now: datetime | None = None) -> int:
    """The team's backtests that will still run: every queued one (a queued one that waited
    too long is failed first, by the team's next start or when a worker takes it), and the
    running ones whose task still reports progress (one that stopped is lost: its worker
    died and nothing took it again)."""
    now = now or timezone.now()
    return Backtest.objects.filter(
        Q(status=Status.QUEUED) | Q(status=Status.RUNNING, heartbeat_at__gt=_stale(now)),
        team=team).count()


def _fail_waited_too_long(jobs: QuerySet[Backtest], now: datetime) -> int:
    """Queued jobs no worker took within BACKTEST_STALE_SECONDS are failed, never run: the
    team's bound counts every queued job, so a backlog cannot let a team queue more."""
    return jobs.filter(status=Status.QUEUED, heartbeat_at__lte=_stale(now)).update(
        status=Status.FAILED, error=waited_too_long(), finished_at=now)


def backtest_start(*, team: Team, user: Any, drafts: list[dict[str, Any]], source: str,
                   since: timedelta, limit: int) -> Backtest:
    """Queue a backtest of ``drafts`` ([{"policy", "document"}]); raises Busy when the team
    already has BACKTEST_MAX_PER_TEAM running. A backtest costs CPU only, but any viewer may
    start one, so a team gets a bounded share of the workers. Raises TooManyDrafts past
    MAX_DRAFTS policies."""
    if len(drafts) > MAX_DRAFTS:
        raise TooManyDrafts()
    with transaction.atomic():
        # The team's row lock serializes the backtest starts of one team: the count and the
        # insert cannot interleave with another start's. NO KEY UPDATE, so the FOR KEY SHARE
        # that inserting a run (its foreign key) takes on the team is never made to wait.
        Team.objects.select_for_update(no_key=True).filter(pk=team.pk).values_list(
            "pk").first()
        now = timezone.now()
        _fail_waited_too_long(Backtest.objects.filter(team=team), now)
        if active_backtests(team, now=now) >= settings.BACKTEST_MAX_PER_TEAM:
            raise Busy()
        job = Backtest.objects.create(
            team=team, created_by=user if getattr(user, "is_authenticated", False) else None,
            created_at=now, source=source, drafts=drafts,
            since_s=int(since.total_seconds()), limit=limit, heartbeat_at=now,
        )
        from .tasks import backtest_run_task

        job_id = str(job.pk)
        transaction.on_commit(lambda: _enqueue(backtest_run_task, job_id))
    return job


def _enqueue(task: Any, job_id: str) -> None:
    """Hand the committed job to the workers. The embedded default runs it eagerly, here; with
    a broker the publish goes to the process's publisher thread (runs/publisher.py), as the
    kill switch's and the webhooks' do, so the request never waits for Redis (SPEC 10). It
    was published on the request's thread: with a Redis that hangs each start held its
    thread about 2.5 s (the publish's timeouts and retries) and then answered 500, raised
    out of the commit (found by an attacker). While the broker is down the job stays queued,
    counting against the team's bound, and runs once the publisher gets it through; one never
    published is failed when it is BACKTEST_STALE_SECONDS old, as any job no worker took."""
    if task.app.conf.task_always_eager:
        task.delay(job_id)
        return
    from runs.publisher import publisher

    publisher.submit(task.name, job_id)


def backtest_run(*, job_id: uuid.UUID | str) -> None:
    """Run a queued backtest. Idempotent: a finished one is left alone, and a redelivered
    one whose worker died (no progress for BACKTEST_STALE_SECONDS) starts over, since it
    only ever writes its own row. One still reporting progress is left to its worker: the
    broker gives a message acknowledged late to a second worker once its visibility timeout
    is over, however long the first one still takes. One that waited too long in the queue
    is failed instead of run (see `active_backtests`)."""
    now = timezone.now()
    job_row = Backtest.objects.filter(pk=job_id)
    claimed = job_row.filter(
        Q(status=Status.QUEUED, heartbeat_at__gt=_stale(now))
        | Q(status=Status.RUNNING, heartbeat_at__lte=_stale(now))
    ).update(status=Status.RUNNING, heartbeat_at=now)
    if not claimed:
        _fail_waited_too_long(job_row, now)
        return
    job = Backtest.objects.select_related("team").get(pk=job_id)
    since = timedelta(seconds=job.since_s)
    try:
        plans = []
        for draft in job.drafts:
            policy = selectors.policy_of(job.team, draft["policy"])
            runs = ([] if policy is None else
                    selectors.runs_to_replay(job.team, policy, since=since, limit=job.limit))
            plans.append((draft, runs))
            Backtest.objects.filter(pk=job.pk).update(heartbeat_at=timezone.now())
        total = sum(len(runs) for _, runs in plans)
        Backtest.objects.filter(pk=job.pk).update(total=total, heartbeat_at=timezone.now())
        results: list[dict[str, Any]] = []
        offset = 0
        for draft, runs in plans:
            def progress(done: int, _all: int, offset: int = offset) -> None:
                Backtest.objects.filter(pk=job.pk).update(done=offset + done,
                                                          heartbeat_at=timezone.now())

            report = selectors.replay_runs(
                runs, rules.Policy.from_document(draft["document"]),
                policy=draft["policy"], progress=progress)
            results.append({"report": report.as_json(), "summary": report.summary,
                            "decisions": report.decisions,
                            "key_fallbacks": report.key_fallbacks})
            offset += len(runs)
        Backtest.objects.filter(pk=job.pk).update(
            status=Status.DONE, done=total, results=results, finished_at=timezone.now(),
            heartbeat_at=timezone.now())
    except Exception as exc:
        log.exception("backtest %s failed", job_id)
        Backtest.objects.filter(pk=job.pk).update(
            status=Status.FAILED, error=f"{type(exc).__name__}: {exc}"[:2000],
            finished_at=timezone.now())


def backtest_wait(job: Backtest, *, seconds: float, poll_s: float = 0.25) -> Backtest:
    """The job once it is over (done or failed), or as it stands after ``seconds``. The
    operator API's backtest waits here, on a thread of its own pool, while a worker replays:
    the web process spends no CPU on the replay (SPEC 10: no tenant slows another).
    A caller inside a transaction of its own (a test's) cannot have sent the task yet, and
    no worker could read the uncommitted job: it is run here (the task, sent at the commit,
    then finds it done and leaves it)."""
    if transaction.get_connection().in_atomic_block and job.status == Status.QUEUED:
        backtest_run(job_id=job.pk)
        job.refresh_from_db(fields=["status", "done", "total", "results", "error"])
    deadline = time.monotonic() + seconds
    while job.status in ACTIVE and time.monotonic() < deadline:
        time.sleep(poll_s)
        job.refresh_from_db(fields=["status", "done", "total", "results", "error"])
    return job
