"""Celery tasks of the policies app: the purge of expired sign-in sessions (beat, every
SESSION_PURGE_SECONDS: governance/settings.py CELERY_BEAT_SCHEDULE). Idempotent."""

from __future__ import annotations

from importlib import import_module

from celery import shared_task
from django.conf import settings


@shared_task(name="policies.tasks.clear_sessions")
def clear_sessions() -> None:
    """Delete the sessions past their expiry, as `manage.py clearsessions` does: a visitor's
    sign-in that was never finished lives STATE_MAX_AGE_S (policies/sso_views.py), and
    nothing else removed a session once expired."""
    import_module(settings.SESSION_ENGINE).SessionStore.clear_expired()
