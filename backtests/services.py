"""Writes of the dashboard's backtests: start one (bounded per team) and run it (the Celery
task's body). The backtest itself only reads (selectors.py); what is written here is the
job's own row: its progress for the page to poll, then its result."""

from __future__ import annotations

import logging
import uuid
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from governance_client import rules
from policies.models import Team

from . import selectors
from .models import Backtest, Status

log = logging.getLogger(__name__)

ACTIVE = (Status.QUEUED, Status.RUNNING)


class Busy(Exception):
    """The team already runs as many backtests as it may."""


def active_backtests(team: Team) -> int:
    stale = timezone.now() - timedelta(seconds=settings.BACKTEST_STALE_SECONDS)
    return Backtest.objects.filter(team=team, status__in=ACTIVE, heartbeat_at__gt=stale).count()


def backtest_start(*, team: Team, user: Any, drafts: list[dict[str, Any]], source: str,
                   since: timedelta, limit: int) -> Backtest:
    """Queue a backtest of ``drafts`` ([{"policy", "document"}]); raises Busy when the team
    already has BACKTEST_MAX_PER_TEAM running. A backtest costs CPU only, but any viewer may
    start one, so a team gets a bounded share of the workers."""
    with transaction.atomic():
        # The team's row lock serializes the backtest starts of one team: the count and the
        # insert cannot interleave with another start's. NO KEY UPDATE, so the FOR KEY SHARE
        # that inserting a run (its foreign key) takes on the team is never made to wait.
        Team.objects.select_for_update(no_key=True).filter(pk=team.pk).values_list(
            "pk").first()
        if active_backtests(team) >= settings.BACKTEST_MAX_PER_TEAM:
            raise Busy()
        now = timezone.now()
        job = Backtest.objects.create(
            team=team, created_by=user if getattr(user, "is_authenticated", False) else None,
            created_at=now, source=source, drafts=drafts,
            since_s=int(since.total_seconds()), limit=limit, heartbeat_at=now,
        )
        from .tasks import backtest_run_task

        job_id = str(job.pk)
        transaction.on_commit(lambda: backtest_run_task.delay(job_id))
    return job


def backtest_run(*, job_id: uuid.UUID | str) -> None:
    """Run a queued backtest. Idempotent: a finished one is left alone, and a redelivered
    one (its worker died) starts over, since it only ever writes its own row."""
    now = timezone.now()
    if not Backtest.objects.filter(pk=job_id, status__in=ACTIVE).update(
            status=Status.RUNNING, heartbeat_at=now):
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
            results.append({"report": report.as_json(), "decisions": report.decisions,
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
