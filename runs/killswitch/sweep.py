"""What the beat sweep of the kill switch restarts (`killswitch_sweep_task`, every
``KILLSWITCH_SWEEP_SECONDS``, a minute by default): fan-outs an outage left unfinished and
webhook deliveries left unattempted, a bounded number a pass. Both are idempotent, so
restarting them twice is harmless.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.utils import timezone

from runs.models import KillSwitch, WebhookDelivery
from runs.webhooks.delivery import PENDING

# What one pass of the sweep restarts at most, of each kind: a pass publishes a bounded number
# of messages however much an outage left behind; the next pass (a minute later) takes the
# next ones, as the restarted deliveries end (delivered, or failed after their attempts).
STALE_BATCH = 200


def stale_work(*, now: datetime | None = None) -> tuple[list[int], list[tuple[int, int]]]:
    """Fan-outs not finished and pending deliveries not attempted for a sweep's period
    (``KILLSWITCH_SWEEP_SECONDS``), oldest first, at most STALE_BATCH of each: the switch ids
    to fan out again, and (delivery id, attempt number) pairs to try again."""
    cutoff = (now or timezone.now()) - timedelta(seconds=settings.KILLSWITCH_SWEEP_SECONDS)
    fanouts = list(KillSwitch.objects.filter(fanout_done_at__isnull=True, engaged_at__lt=cutoff)
                   .order_by("engaged_at", "pk").values_list("pk", flat=True)[:STALE_BATCH])
    # An old pending delivery is named even if its chain is alive; the delivery's own claim
    # (runs/webhooks/delivery.py) lets a message through only when its attempt is really due,
    # so a live chain is not doubled.
    deliveries = [(pk, max(attempts, 1)) for pk, attempts in WebhookDelivery.objects.filter(
        status=PENDING, created_at__lt=cutoff).order_by("created_at", "pk")
        .values_list("pk", "attempts")[:STALE_BATCH]]
    return fanouts, deliveries
