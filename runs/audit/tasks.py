"""Celery tasks of the policies app. Beat runs ``prune_audit`` daily (CELERY_BEAT_SCHEDULE)."""

from __future__ import annotations

from typing import Any

from celery import shared_task
from django.conf import settings

from runs.audit import retention


@shared_task(name="policies.tasks.prune_audit")
def prune_audit() -> list[dict[str, Any]]:
    # Safe to run twice or to retry after a crash: what is already gone is not found again,
    # and each batch is exported before the transaction that deletes it commits.
    results = retention.prune_audit(export_dir=settings.AUDIT_EXPORT_DIR)
    return [r.as_dict() for r in results]
