"""The engage never waits for the broker (SPEC 10): its fan-out is published from a
background thread (runs/publisher.py), which marks the runs itself while the broker does not
answer and publishes as soon as it does."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from governance.celery import app as celery_app
from runs.killswitch.services import killswitch_engage
from runs.models import Run
from runs.publisher import publisher as fanout_publisher
from tests.faults import HAS_REDIS_SERVER, hung_listener, throwaway_redis
from tests.workers import wait_for

pytestmark = [pytest.mark.django_db(transaction=True),
              pytest.mark.skipif(not HAS_REDIS_SERVER, reason="needs redis-server")]


@pytest.fixture
def broker() -> Iterator[Any]:
    """A broker the test points Celery at (``set(url)``), as the production stack does."""
    before = (celery_app.conf.task_always_eager, celery_app.conf.broker_url)
    celery_app.conf.task_always_eager = False

    class Broker:
        @staticmethod
        def set(url: str) -> None:
            celery_app.conf.broker_url = url

    yield Broker
    fanout_publisher.flush(timeout=10)
    celery_app.conf.task_always_eager, celery_app.conf.broker_url = before


def test_an_engage_with_a_hung_broker_returns_at_once_and_publishes_when_it_answers(
        api, team, broker):
    run_id = api.post("/api/v1/runs", {"agent": "bot"},
                      content_type="application/json").json()["run_id"]
    with hung_listener() as listener:
        broker.set(listener.url)
        started = time.monotonic()
        switch = killswitch_engage(scope="team", team=team, reason="drill")
        took = time.monotonic() - started
        assert took < 2.0, took
        # The publish fails (the broker never answers); the thread marks the run meanwhile.
        wait_for(lambda: Run.objects.get(pk=run_id).status == "killed", timeout=20,
                 what="the run marked killed without a broker")
        with throwaway_redis() as redis_server:
            broker.set(redis_server.url)  # the broker answers again
            import redis

            client = redis.Redis.from_url(redis_server.url)
            wait_for(lambda: client.llen("killswitch") >= 1, timeout=20,
                     what="the fan-out task published once the broker answers")
            message = json.loads(client.lindex("killswitch", 0))
            assert message["headers"]["task"] == "runs.tasks.killswitch_fanout"
            args, _kwargs, _embed = json.loads(base64.b64decode(message["body"]))
            assert args == [switch.pk]
            assert fanout_publisher.flush(timeout=10)
