"""A kill switch's webhook is never queued behind approvals' (SPEC 10: no tenant delays any
kill switch's fan-out). Found by an attacker: a team whose receiver never answered opened 130
approvals, and another team's kill-switch webhook reached its receiver 100 s after the
engage, in line behind them on the one `webhooks` queue. Approvals' and tests' deliveries now
go on that queue at a lower priority: a worker takes a kill switch's first. On the production
stack, with a real worker."""

from __future__ import annotations

from typing import Any

import pytest
from django.utils import timezone

from runs.models import KillSwitch, WebhookDelivery
from runs.webhooks import delivery as webhooks
from tests.workers import Receiver, start_worker, wait_for, workers_fixture  # noqa: F401

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow,
              pytest.mark.postgres]

QUEUED = 5
SLOW_TEAMS_QUEUED = 3  # each waits for the one before it: a lease (7 s) a look


def hook_of(team: Any, receiver: Receiver) -> str:
    """`receiver`'s URL for `team`, made the team's webhook URL, as the product's deliveries
    are made to it (and each attempt follows it)."""
    url = f"{receiver.url}/{team.slug}"
    type(team).objects.filter(pk=team.pk).update(webhook_url=url)
    return url


def queue_approvals(team: Any, receiver: Receiver, count: int) -> None:
    """`count` approval notifications of `team` to `receiver`, queued as the service does."""
    url = hook_of(team, receiver)
    for n in range(count):
        approval = WebhookDelivery.objects.create(
            team=team, url=url, event="approval.requested",
            payload={"event": "approval.requested", "n": n})
        webhooks.schedule_delivery(approval.pk, 1, 0, urgent=False)


def switch_delivery(team: Any, receiver: Receiver, *, scope: str = "team",
                    target: str | None = None, reason: str = "runaway") -> WebhookDelivery:
    """A kill switch of `team` engaged now, and its webhook delivery to `receiver` (not
    scheduled yet)."""
    switch = KillSwitch.objects.create(scope=scope, team=team, target=target or f"team:{team.pk}",
                                       reason=reason, engaged_by_label="ops",
                                       engaged_at=timezone.now())
    return WebhookDelivery.objects.create(switch=switch, team=team, url=hook_of(team, receiver),
                                          payload={"event": "killswitch.engaged"})


def test_a_kill_switchs_delivery_goes_before_every_queued_approval_delivery(
        team: Any, other_team: Any, workers: list[Any]) -> None:
    slow = Receiver(secrets={other_team.slug: other_team.webhook_secret}, delay=1.5).start()
    quick = Receiver(secrets={team.slug: team.webhook_secret}).start()
    try:
        # One process takes the webhooks, as the Makefile's worker with its processes busy.
        workers.append(start_worker(pools={"webhooks": "webhooks"}))
        queue_approvals(other_team, slow, QUEUED)
        assert slow.first_request.wait(30), "no approval delivery was attempted"
        kill = switch_delivery(team, quick)
        webhooks.schedule_delivery(kill.pk, 1, 0)  # urgent: looked up, a switch's
        wait_for(lambda: quick.valid[team.slug] == 1, timeout=30,
                 what="the kill switch's delivery")
        # The one at work when the switch was engaged (and at most one more taken meanwhile)
        # went before it; the rest waited.
        assert sum(slow.valid.values()) <= 2, slow.valid
        wait_for(lambda: set(WebhookDelivery.objects.values_list("status", flat=True))
                 == {"delivered"}, timeout=60, what="the approvals' deliveries, after it")
        assert sum(slow.valid.values()) == QUEUED
    finally:
        slow.stop()
        quick.stop()


def test_a_team_whose_receiver_is_slow_holds_one_webhook_process_not_all(
        team: Any, other_team: Any, workers: list[Any]) -> None:
    """One routine attempt of a team at a time: another team's approval notification goes
    on the worker's other process instead of waiting for every one of the slow team's."""
    slow = Receiver(secrets={other_team.slug: other_team.webhook_secret}, delay=2.0).start()
    quick = Receiver(secrets={team.slug: team.webhook_secret}).start()
    try:
        workers.append(start_worker(pools={"webhooks": "webhooks"}, concurrency=2))
        queue_approvals(other_team, slow, SLOW_TEAMS_QUEUED)
        assert slow.first_request.wait(30), "no approval delivery was attempted"
        mine = WebhookDelivery.objects.create(team=team, url=hook_of(team, quick),
                                              event="approval.requested",
                                              payload={"event": "approval.requested"})
        webhooks.schedule_delivery(mine.pk, 1, 0, urgent=False)
        wait_for(lambda: quick.valid[team.slug] == 1, timeout=30,
                 what="the other team's approval delivery")
        # The slow team had one attempt at a time: at most its first and a second.
        assert sum(slow.valid.values()) <= 2, slow.valid
        wait_for(lambda: set(WebhookDelivery.objects.values_list("status", flat=True))
                 == {"delivered"}, timeout=90, what="the slow team's deliveries, one by one")
    finally:
        slow.stop()
        quick.stop()


def queue_switches(team: Any, receiver: Receiver, count: int) -> None:
    """`count` kill switches of `team`, each with its webhook delivery queued as the
    service does."""
    for n in range(count):
        delivery = switch_delivery(team, receiver, scope="agent",
                                   target=f"agent:{team.pk}:flood-{n}", reason="flood")
        webhooks.schedule_delivery(delivery.pk, 1, 0, urgent=True)


def test_a_teams_kill_switches_hold_one_webhook_process_not_all(
        team: Any, other_team: Any, workers: list[Any]) -> None:
    """One kill-switch attempt of a team at a time too. Found by an attacker: 12 kill
    switches of a team whose receiver never answered took both of the webhook worker's
    processes, and another team's kill-switch webhook reached its receiver 29 s after its
    engage (SPEC 10: no tenant delays any kill switch's fan-out). Here the hanging team's
    receiver answers after 6 s (past the 5 s deadline): its first attempt holds one process,
    the others wait for it, and the other team's delivery goes on the second process while
    that first attempt is still the hanging team's only one."""
    hanging = Receiver(secrets={other_team.slug: other_team.webhook_secret}, delay=6.0).start()
    quick = Receiver(secrets={team.slug: team.webhook_secret}).start()
    try:
        workers.append(start_worker(pools={"webhooks": "webhooks"}, concurrency=2))
        queue_switches(other_team, hanging, 4)
        assert hanging.first_request.wait(30), "no kill-switch delivery was attempted"
        kill = switch_delivery(team, quick)
        webhooks.schedule_delivery(kill.pk, 1, 0)
        wait_for(lambda: quick.valid[team.slug] == 1, timeout=30,
                 what="the other team's kill-switch delivery")
        # Before: both processes took the hanging team's first two, and the delivery waited
        # for the 5 s deadline of one of them (and then for the two queued before it).
        started = sum(hanging.valid.values())
        assert started == 1, hanging.valid
        # The others are attempted in turn, one at a time, once the first is over.
        wait_for(lambda: sum(hanging.valid.values()) >= 2, timeout=30,
                 what="the hanging team's next delivery")
    finally:
        hanging.stop()
        quick.stop()
