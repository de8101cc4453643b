"""Celery tasks of the check's side: the sweep of abandoned runs (SPEC 14) and of rate-limit
hits no window can reach (SPEC 12). On the `default` queue (governance/settings.py): the
prune grows with the traffic, so it stays off the kill switch's worker. Idempotent."""

from __future__ import annotations

from celery import shared_task
from django.db import DatabaseError, InterfaceError
from django.utils import timezone

from runs.check.abandon import sweep_idle_runs
from runs.check.rate_limits import prune_hits


@shared_task(name="runs.tasks.idle_sweep", acks_late=True,
             autoretry_for=(DatabaseError, InterfaceError), retry_backoff=True,
             retry_backoff_max=60, max_retries=10)
def idle_sweep_task() -> dict[str, int]:
    """Beat, every minute: end the runs past their idle deadline (batches for up to
    SWEEP_SECONDS) and forget the rate-limit hits older than the longest window. Both are
    idempotent: a second run changes nothing."""
    now = timezone.now()
    ended = sweep_idle_runs(now=now)
    return {"abandoned": len(ended), "hits_pruned": prune_hits(now=now)}
