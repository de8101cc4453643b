"""The approvals' Celery task (SPEC 11), named like the other runs tasks ("runs.tasks.*",
routed to the kill-switch queue with them)."""

from __future__ import annotations

from celery import shared_task
from django.db import DatabaseError, InterfaceError

from runs.approvals import services as approvals


@shared_task(name="runs.tasks.approvals_expire", acks_late=True,
             autoretry_for=(DatabaseError, InterfaceError), retry_backoff=True,
             retry_backoff_max=60, max_retries=10)
def approvals_expire_task() -> int:
    """Beat, every 10 s: settle the approvals past their expiry that no check, GET or page
    looked at: each ends its run stopped / approval_expired. Idempotent: an approval already
    settled is skipped by the conditional UPDATE."""
    return approvals.expire_due()
