"""The webhook delivery task lives with the webhooks (runs/webhooks/tasks.py) under the name
it was first queued under, so a message an older version put in the queue still runs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.utils import timezone

from governance.celery import app
from runs.models import KillSwitch, WebhookDelivery
from tests.workers import Receiver

OLD_NAME = "runs.tasks.webhook_deliver"


@pytest.fixture
def receiver(team: Any, settings: Any) -> Iterator[Receiver]:
    settings.WEBHOOK_ALLOWED_HOSTS = ["127.0.0.1"]  # the receiver listens on loopback
    rec = Receiver(secrets={team.slug: team.webhook_secret}).start()
    yield rec
    rec.stop()


def test_a_worker_finds_the_task_by_its_old_name_on_the_webhooks_queue() -> None:
    app.loader.import_default_modules()  # what a worker does at start: autodiscovery
    task = app.tasks[OLD_NAME]
    assert task.__module__ == "runs.webhooks.tasks"
    assert app.amqp.router.route({}, OLD_NAME)["queue"].name == "webhooks"


@pytest.mark.django_db(transaction=True)
def test_a_message_queued_under_the_old_name_delivers(team: Any, receiver: Receiver) -> None:
    team.webhook_url = f"{receiver.url}/{team.slug}"
    team.save()
    switch = KillSwitch.objects.create(scope="team", team=team, target=f"team:{team.pk}",
                                       reason="r", engaged_by_label="x",
                                       engaged_at=timezone.now())
    delivery = WebhookDelivery.objects.create(switch=switch, team=team, url=team.webhook_url,
                                              payload={"id": switch.pk})
    app.loader.import_default_modules()
    # A message is a task name and its arguments; the worker looks the name up, as here.
    app.tasks[OLD_NAME].apply(args=(delivery.pk, 1)).get()
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts) == ("delivered", 1)
    assert receiver.valid[team.slug] == 1


@pytest.mark.django_db(transaction=True)
def test_a_worker_process_builds_its_tls_context_once_at_start(
        team: Any, receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    """Building one reads the CA bundle (a quarter of a second of CPU on a busy machine): a
    kill's webhook must not pay it, nor every retry."""
    from celery.signals import worker_process_init

    from runs.webhooks import delivery as webhooks

    built: list[object] = []

    def counting() -> object:
        built.append(object())
        return real()

    real = webhooks.httpx.create_ssl_context
    monkeypatch.setattr(webhooks.httpx, "create_ssl_context", counting)
    webhooks.ssl_context.cache_clear()
    app.loader.import_default_modules()
    worker_process_init.send(sender=None)  # what each worker process does once forked
    assert len(built) == 1
    team.webhook_url = f"{receiver.url}/{team.slug}"
    team.save()
    for n in range(2):  # two switches: one delivery each
        switch = KillSwitch.objects.create(scope="team", team=team, target=f"test:{n}",
                                           reason="r", engaged_by_label="x",
                                           engaged_at=timezone.now())
        delivery = WebhookDelivery.objects.create(switch=switch, team=team,
                                                  url=team.webhook_url, payload={"id": n})
        app.tasks[OLD_NAME].apply(args=(delivery.pk, 1)).get()
    assert receiver.valid[team.slug] == 2
    assert len(built) == 1
    webhooks.ssl_context.cache_clear()
