"""Celery publishes never hold a request (SPEC 10): an approval's notification and a "Send
test" are published by the process's publisher thread (runs/publisher.py), which waits for
the broker in their place and publishes as soon as it answers; a worker's own publish is
bounded by the broker's socket timeouts (settings CELERY_BROKER_TRANSPORT_OPTIONS)."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from governance.celery import app as celery_app
from policies.models import Team
from runs.models import WebhookDelivery
from runs.publisher import publisher
from runs.webhooks import delivery as webhooks
from tests.conftest import set_policy
from tests.faults import HAS_REDIS_SERVER, hung_listener, throwaway_redis
from tests.workers import wait_for

pytestmark = [pytest.mark.django_db(transaction=True),
              pytest.mark.skipif(not HAS_REDIS_SERVER, reason="needs redis-server")]

PAY = {"name": "payments.refund", "args": {"order": 42}}


@pytest.fixture
def broker() -> Iterator[Any]:
    """A broker the test points Celery at (``set(url)``), as the production stack does."""
    before = (celery_app.conf.task_always_eager, celery_app.conf.broker_url)
    celery_app.conf.task_always_eager = False

    def fresh_pools() -> None:
        # A worker's publish (apply_async) goes through the app's cached producer pool, which
        # keeps the broker it was made for: drop it, as a forked worker process does.
        celery_app._pool = None
        celery_app.amqp._producer_pool = None

    class Broker:
        @staticmethod
        def set(url: str) -> None:
            celery_app.conf.broker_url = url
            fresh_pools()

    yield Broker
    publisher.flush(timeout=10)
    celery_app.conf.task_always_eager, celery_app.conf.broker_url = before
    fresh_pools()


# The Redis transport's list of the `webhooks` queue at priority 6: approvals' and tests'.
ROUTINE = "webhooks\x06\x166"


def queued(client: Any, queue: str) -> list[tuple[str, list[Any]]]:
    """(task name, args) of every message waiting in ``queue``."""
    out = []
    for raw in client.lrange(queue, 0, -1):
        message = json.loads(raw)
        args, _kwargs, _embed = json.loads(base64.b64decode(message["body"]))
        out.append((message["headers"]["task"], args))
    return out


def timed(call: Callable[[], Any], *, limit: float = 10) -> tuple[Any, float]:
    """``call()``'s result and how long it took, on a thread of its own: a call that hangs
    fails the test instead of hanging it."""
    outcome: dict[str, Any] = {}
    started = time.monotonic()
    thread = threading.Thread(target=lambda: outcome.update(value=call()), daemon=True)
    thread.start()
    thread.join(timeout=limit)
    assert not thread.is_alive(), f"still waiting after {limit} s"
    return outcome["value"], time.monotonic() - started


def test_a_check_that_opens_an_approval_never_waits_for_a_hung_broker(api, team, broker):
    """Before: the check's commit hook published the webhook task on the request's thread,
    and kombu waits for a Redis that never answers for ever."""
    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 600})
    Team.objects.filter(pk=team.pk).update(webhook_url="http://127.0.0.1:9/hook")
    run_id = api.post("/api/v1/runs", {"agent": "bot"},
                      content_type="application/json").json()["run_id"]
    with hung_listener() as listener:
        broker.set(listener.url)
        answer, took = timed(lambda: api.post(f"/api/v1/runs/{run_id}/check",
                                              {"action": PAY, "check_id": "pay-1"},
                                              content_type="application/json").json())
        assert took < 2.0, took
        assert answer["decision"] == "pending", answer
        delivery = WebhookDelivery.objects.get(team=team, event=webhooks.APPROVAL_REQUESTED)
        with throwaway_redis() as redis_server:
            broker.set(redis_server.url)  # the broker answers again
            import redis

            client = redis.Redis.from_url(redis_server.url)
            # An approval's delivery: the webhooks queue's list of priority 6 (settings).
            wait_for(lambda: queued(client, ROUTINE), timeout=20,
                     what="the delivery published once the broker answers")
            assert queued(client, ROUTINE) == [("runs.tasks.webhook_deliver_routine",
                                                [delivery.pk, 1])]
            assert publisher.flush(timeout=10)


def test_a_send_test_returns_at_once_with_a_hung_broker(team, broker):
    team.webhook_url = "http://127.0.0.1:9/hook"
    team.save()
    with hung_listener() as listener:
        broker.set(listener.url)
        delivery, took = timed(lambda: webhooks.send_test(team=team, sent_by="admin"))
        assert took < 2.0, took
        assert delivery.status == webhooks.PENDING
        with throwaway_redis() as redis_server:
            broker.set(redis_server.url)
            import redis

            client = redis.Redis.from_url(redis_server.url)
            wait_for(lambda: queued(client, ROUTINE), timeout=20,
                     what="the test delivery published once the broker answers")
            assert queued(client, ROUTINE) == [("runs.tasks.webhook_deliver_routine",
                                                [delivery.pk, 1])]
            assert publisher.flush(timeout=10)


def test_a_workers_publish_to_a_hung_broker_fails_within_its_timeouts(team, broker):
    """A worker publishes its follow-ups itself (the next attempt, the fan-out's
    deliveries): bounded by the broker's socket timeouts and publish retries, it fails and
    the task's own retry (or the sweep) takes over, instead of holding the process."""
    delivery = WebhookDelivery.objects.create(team=team, event=webhooks.TEST_EVENT,
                                              url="http://127.0.0.1:9/hook", payload={})

    def publish() -> Exception | None:
        try:
            webhooks.schedule_delivery(delivery.pk, 2, 1)
        except Exception as exc:
            return exc
        return None

    with hung_listener() as listener:
        broker.set(listener.url)
        error, _ = timed(publish, limit=40)
    assert error is not None


def test_while_the_broker_is_down_the_backlog_is_bounded():
    """Every publish a request hands over is kept until the broker answers, up to a bound
    (the sweep restarts the rest): an outage cannot grow a server's memory without end."""
    from runs.publisher import Key, Publisher

    class BrokerDown(Publisher):
        MAX_PENDING = 3

        def _publish(self, keys: list[Key]) -> list[Key]:
            return []

    local = BrokerDown()
    for n in range(10):
        local.submit("runs.tasks.webhook_deliver", n, 1)
    local.submit("runs.tasks.webhook_deliver", 0, 1)  # one already waiting is no new entry
    assert sorted(local._pending) == [("runs.tasks.webhook_deliver", (n, 1)) for n in range(3)]
