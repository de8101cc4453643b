"""A command that exits at once still sends its webhook on the embedded default (no Redis:
deliveries run on a thread of the process that made them). Found by a newcomer on `make
demo`: the deliveries of `manage.py killswitch engage` and `manage.py approvals decide`
stayed "pending, no worker has taken it yet", 0 attempts, for good: the process exited
before its delivery thread made the first attempt."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings

from runs.models import WebhookDelivery
from tests.conftest import ROOT, server_env
from tests.workers import Receiver

pytestmark = pytest.mark.skipif(bool(settings.REDIS_URL),
                                reason="the embedded default's threads (a worker delivers "
                                       "on the production stack)")


@pytest.fixture
def receiver(team: Any) -> Iterator[Receiver]:
    # Answers late: the command must not exit before the answer is recorded.
    rec = Receiver(secrets={team.slug: team.webhook_secret}, delay=0.5).start()
    yield rec
    rec.stop()


@pytest.mark.django_db(transaction=True)
def test_manage_py_killswitch_engage_delivers_its_webhook_before_it_exits(team, receiver):
    team.webhook_url = f"{receiver.url}/{team.slug}"
    team.save()
    done = subprocess.run(
        [sys.executable, "manage.py", "killswitch", "engage", "--scope", "team", "--team",
         team.slug, "--reason", "incident 42"],
        cwd=ROOT, env=server_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    [delivery] = WebhookDelivery.objects.filter(team=team)
    assert (delivery.event, delivery.status, delivery.attempts) == (
        "killswitch.engaged", "delivered", 1)
    assert receiver.valid[team.slug] == 1


@pytest.mark.django_db
def test_a_pending_delivery_whose_next_attempt_never_came_says_so(team, users):
    """What a command's failed first attempt leaves on the embedded default (its retries die
    with the process): the page said "pending" beside "retried with backoff" for good."""
    from datetime import timedelta

    from django.test import Client
    from django.utils import timezone

    from runs.models import WebhookAttempt

    team.webhook_url = "https://hooks.example.com/gov"
    team.save()
    long_ago = timezone.now() - timedelta(minutes=5)
    stuck = WebhookDelivery.objects.create(team=team, event="webhook.test", url=team.webhook_url,
                                           payload={}, attempts=1)
    WebhookAttempt.objects.create(delivery=stuck, number=1, at=long_ago, status_code=500)
    fresh = WebhookDelivery.objects.create(team=team, event="webhook.test", url=team.webhook_url,
                                           payload={}, attempts=1)
    WebhookAttempt.objects.create(delivery=fresh, number=1, at=timezone.now(), status_code=500)
    viewer = Client()
    viewer.force_login(users["viewer"])
    page = viewer.get(f"/teams/{team.slug}/killswitch/").content.decode()
    rows = {pk: page.split(f'data-delivery="{pk}"', 1)[1].split("</tr>", 1)[0]
            for pk in (stuck.pk, fresh.pk)}
    assert "its next attempt never came" in rows[stuck.pk]
    assert "its next attempt never came" not in rows[fresh.pk]
