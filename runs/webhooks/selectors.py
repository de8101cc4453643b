"""Reads of the webhook deliveries for people: the kill switch page's delivery log. The
deliveries themselves (claim, POST, retries) are in delivery.py."""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from policies.models import Team
from runs.models import WebhookAttempt, WebhookDelivery
from runs.webhooks.delivery import IN_FLIGHT, LEASE_S, MAX_DELAY_S, PENDING

# A delivery nobody attempted for this long has no worker taking it (the sweep's own
# threshold, KILLSWITCH_SWEEP_SECONDS, is a minute by default too).
UNTAKEN_AFTER = timedelta(minutes=1)


def deliveries_for_team(team: Team, *, limit: int = 20) -> list[WebhookDelivery]:
    return list(
        WebhookDelivery.objects.filter(team=team).select_related("switch")
        .prefetch_related("tries").order_by("-created_at", "-pk")[:limit]
    )


def overdue(delivery: WebhookDelivery) -> bool:
    """A pending delivery with no attempt for long: no worker is taking it."""
    return (delivery.status == PENDING and delivery.attempts == 0
            and timezone.now() - delivery.created_at > UNTAKEN_AFTER)


# A pending delivery that had an attempt and none for this long: its next one never came
# (the longest backoff, an attempt's lease, and a margin).
STALLED_AFTER = timedelta(seconds=MAX_DELAY_S + LEASE_S + 30)


def stalled(delivery: WebhookDelivery) -> bool:
    """A pending delivery whose next attempt never came (its attempts prefetched): no worker
    took it, or, without Redis, the process that made it exited (a `manage.py` command: found
    by a newcomer, such deliveries read "pending" for good while the page promised retries)."""
    if delivery.status != PENDING or delivery.attempts == 0:
        return False
    last = max((attempt.at for attempt in delivery.tries.all()), default=None)
    return last is not None and timezone.now() - last > STALLED_AFTER


# How far back a failed attempt still makes the overview say notifications are failing.
FAILING_WITHIN = timedelta(hours=24)


def failing_notice(team: Team) -> WebhookAttempt | None:
    """The team's latest finished webhook attempt when it failed (within a day): kill switch
    and approval notifications are not reaching the receiver, which the overview says. A
    later success clears it. One indexed read of the day's attempts, newest first."""
    latest = (WebhookAttempt.objects
              .filter(delivery__team=team, at__gte=timezone.now() - FAILING_WITHIN)
              .exclude(error=IN_FLIGHT).select_related("delivery")
              .order_by("-at", "-pk").first())
    if latest is None or not latest.error:
        return None
    return latest
