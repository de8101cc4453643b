from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models

from policies.models import Team


class Status(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class Backtest(models.Model):
    """A backtest asked for in the dashboard, run by a Celery task: its drafts, its progress
    (polled by the page) and its result. The replay itself writes nothing else."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="+")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                                   on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField()
    source = models.CharField(max_length=20)  # editor | import
    # [{"policy": name, "document": normalized policy document}], replayed in order.
    drafts = models.JSONField()
    since_s = models.PositiveIntegerField()
    limit = models.PositiveIntegerField()
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.QUEUED)
    total = models.PositiveIntegerField(default=0)  # runs to replay, once selected
    done = models.PositiveIntegerField(default=0)
    # Moves while the task works: a backtest whose heartbeat stopped (its worker died and
    # nothing redelivered it) no longer counts against the team's bound.
    heartbeat_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)
    results = models.JSONField(null=True, blank=True)  # one SPEC 13 report per draft
    error = models.TextField(blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["team", "status"], name="backtest_team_status")]
