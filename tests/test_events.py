"""Live-update wake-ups (runs/live/events.py): the in-process broker, and Redis through the
publisher thread, which coalesces a team's wake-ups and never holds a request."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Any

import pytest

from runs.live import events
from runs.live.events import CHANNEL_PREFIX, publish_team_event, redis_publisher, wakeups


def unused_team_id() -> int:
    # Channels are shared by every database of a Redis server: a random id keeps another
    # test's (or another suite's) messages out.
    return 10**9 + secrets.randbelow(10**9)


def test_without_redis_a_wakeup_reaches_a_stream_of_this_process(settings: Any) -> None:
    settings.REDIS_URL = ""
    team_id = unused_team_id()
    stream = wakeups(team_id, poll=5, lifetime=10)
    threading.Timer(0.2, publish_team_event, args=[team_id]).start()
    assert next(stream) is True  # woken by the publish, not by the 5 s poll


def test_a_quiet_team_yields_false_at_each_poll(settings: Any) -> None:
    settings.REDIS_URL = ""
    assert next(wakeups(unused_team_id(), poll=0.05, lifetime=1)) is False


def subscribed(*team_ids: int) -> Any:
    """A pub/sub connection whose subscriptions Redis has confirmed: a publish sent after this
    returns reaches it."""
    pubsub = events.redis_client().pubsub()
    pubsub.subscribe(*(f"{CHANNEL_PREFIX}{t}" for t in team_ids))
    for _ in team_ids:
        confirmation = pubsub.get_message(timeout=5)
        assert confirmation is not None and confirmation["type"] == "subscribe"
    return pubsub


@pytest.mark.redis
def test_with_redis_a_wakeup_is_published_by_the_thread() -> None:
    team_id = unused_team_id()
    pubsub = subscribed(team_id)
    try:
        publish_team_event(team_id)
        assert redis_publisher.flush(timeout=5)
        message = pubsub.get_message(timeout=5)
        assert message is not None and message["data"] == b"changed"
    finally:
        pubsub.close()


@pytest.mark.redis
def test_the_wakeups_of_a_team_marked_while_a_publish_is_under_way_share_one_message() -> None:
    team_id, other_team_id = unused_team_id(), unused_team_id()
    pubsub = subscribed(team_id, other_team_id)
    try:
        # Holding the publisher's lock stands for "the thread is busy sending": 100 checks
        # of one team and one of another come in meanwhile.
        with redis_publisher._cond:
            for _ in range(100):
                publish_team_event(team_id)
            publish_team_event(other_team_id)
        assert redis_publisher.flush(timeout=5)
        received: list[bytes] = []
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            message = pubsub.get_message(timeout=0.2)
            if message is not None:
                received.append(message["channel"])
        assert sorted(received) == sorted([f"{CHANNEL_PREFIX}{team_id}".encode(),
                                           f"{CHANNEL_PREFIX}{other_team_id}".encode()])
    finally:
        pubsub.close()


@pytest.mark.redis
def test_an_unreachable_redis_costs_the_request_nothing_and_is_logged(
        settings: Any, caplog: Any, monkeypatch: Any) -> None:
    # A port nobody listens on: connecting fails; the request must not wait for it.
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    monkeypatch.setattr(events, "_redis_client", None)
    team_id = unused_team_id()
    caplog.set_level(logging.WARNING, logger="runs.events")
    with redis_publisher._cond:  # the thread cannot even start sending before we return
        publish_team_event(team_id)
    assert redis_publisher.flush(timeout=5)
    assert "could not publish live events to Redis" in caplog.text
    monkeypatch.setattr(events, "_redis_client", None)  # the next test gets the real one
