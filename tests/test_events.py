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
        # Signed with this process's origin, which its own listener skips.
        assert message is not None
        assert message["data"] == events.FROM_PREFIX + events.ORIGIN + b" changed"
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
    monkeypatch.setattr(events.publish_failures, "failing", 0)  # no outage before this one
    team_id = unused_team_id()
    caplog.set_level(logging.WARNING, logger="runs.live.events")
    with redis_publisher._cond:  # the thread cannot even start sending before we return
        publish_team_event(team_id)
    assert redis_publisher.flush(timeout=5)
    assert "could not publish live events to Redis" in caplog.text
    monkeypatch.setattr(events, "_redis_client", None)  # the next test gets the real one


def test_an_outage_is_said_once_then_once_a_minute_and_its_end(
        caplog: Any, monkeypatch: Any) -> None:
    """Twenty coalesced publishes a second, each logged with its traceback, filled the logs
    while Redis hung (found by an attacker)."""
    now = [1000.0]
    monkeypatch.setattr(events.time, "monotonic", lambda: now[0])
    said = events.PublishFailures()
    caplog.set_level(logging.WARNING, logger="runs.live.events")
    for _ in range(40):
        said.failed(TimeoutError("Timeout reading from socket"))
        now[0] += 0.05
    assert len(caplog.records) == 1 and "1 failure so far" in caplog.text
    assert "Traceback" not in caplog.text and "TimeoutError" in caplog.text
    now[0] += 60
    said.failed(TimeoutError("again"))
    assert len(caplog.records) == 2 and "41 failures so far" in caplog.records[1].getMessage()
    said.succeeded()
    said.succeeded()
    assert len(caplog.records) == 3 and "again, after 41 failures" in caplog.text
    said.failed(ConnectionError("a new outage"))  # said at once
    assert len(caplog.records) == 4 and "1 failure so far" in caplog.records[3].getMessage()


# --- The async side (live streams under `manage.py serve`) ---------------------------------

class _Run:
    def __init__(self, team_id: int, pk: str):
        self.team_id, self.pk = team_id, pk


def test_an_async_stream_is_woken_by_a_check_on_another_thread_and_told_which_run(
        settings: Any) -> None:
    import asyncio

    settings.REDIS_URL = ""
    team_id = unused_team_id()

    async def first_change() -> Any:
        stream = events.awakeups(team_id, poll=5, lifetime=10)
        threading.Timer(0.2, events.publish_run_event, args=[_Run(team_id, "run-a")]).start()
        started = time.monotonic()
        changes = await stream.__anext__()
        return changes, time.monotonic() - started

    changes, took = asyncio.run(first_change())
    assert changes == frozenset({"run-a"})
    assert took < 4  # woken by the publish, not by the 5 s poll


def test_changes_since_names_the_runs_or_says_anything_for_a_team_wide_change() -> None:
    broker = events.LocalBroker()
    team_id = unused_team_id()
    seen = broker.seq(team_id)
    assert broker.changes_since(team_id, seen) == (seen, frozenset())
    broker.publish(team_id, frozenset({"a"}))
    broker.publish(team_id, frozenset({"b"}))
    now, changes = broker.changes_since(team_id, seen)
    assert (now, changes) == (seen + 2, frozenset({"a", "b"}))
    broker.publish(team_id)  # a kill switch: every screen looks
    assert broker.changes_since(team_id, now) == (now + 1, None)
    # Older than the log remembers: anything may have changed.
    for i in range(events.LocalBroker.LOG_SIZE + 1):
        broker.publish(team_id, frozenset({str(i)}))
    assert broker.changes_since(team_id, now + 1)[1] is None


def test_a_run_page_looks_only_for_its_own_run_or_a_team_wide_change() -> None:
    from runs.dashboard.stream import RunSource, Source

    source = RunSource.__new__(RunSource)
    source.run_id = "3f6c1d9e-0000-0000-0000-000000000001"
    assert source.concerned(frozenset({source.run_id}))
    assert not source.concerned(frozenset({"another-run"}))
    assert not source.concerned(frozenset())
    assert source.concerned(None)
    overview = Source.concerned
    assert overview(source, frozenset({"another-run"})) and not overview(source, frozenset())


@pytest.mark.django_db(transaction=True)  # on PostgreSQL a look sets its read deadline
def test_the_look_lane_serves_viewers_in_turn() -> None:
    """One viewer's many streams wait behind each other, not in front of another viewer."""
    import asyncio

    from runs.dashboard.stream import Frame, LookLane, Source

    order: list[str] = []

    class Tab(Source):
        def __init__(self, name: str):
            self.name, self.team_id = name, 0

        def frames(self) -> list[Frame]:
            order.append(self.name)
            time.sleep(0.01)
            return [Frame("x", self.name)]

    lane = LookLane()

    async def crowd() -> list[str]:
        greedy = [lane.look(Tab(f"greedy-{i}"), viewer="greedy") for i in range(6)]
        tasks = [asyncio.ensure_future(g) for g in greedy]
        await asyncio.sleep(0)  # the greedy viewer's looks are queued first
        other = asyncio.ensure_future(lane.look(Tab("other"), viewer="other"))
        return await asyncio.gather(*tasks, other)

    answers = asyncio.run(crowd())
    lane.lane.stop(timeout=5)  # and its thread's connection with it
    assert all("data: " in a for a in answers)
    assert order.index("other") <= 2  # not behind the greedy viewer's six


@pytest.mark.redis
def test_with_redis_one_subscription_per_process_wakes_async_streams_with_the_runs() -> None:
    """A check answered by another process: its message names the run, and the process's
    one listener turns it into a local wake-up for every async stream of the team."""
    import asyncio

    team_id = unused_team_id()
    events.redis_listener.ensure_running()
    client = events.redis_client()
    deadline = time.monotonic() + 5  # the listener's subscription is confirmed
    while time.monotonic() < deadline and not any(
            n for _, n in client.pubsub_numsub(f"{CHANNEL_PREFIX}{team_id}")) and \
            client.execute_command("PUBSUB", "NUMPAT") == 0:
        time.sleep(0.05)

    async def first_change() -> Any:
        stream = events.awakeups(team_id, poll=5, lifetime=10)
        asyncio.get_running_loop().call_later(
            0.2, client.publish, f"{CHANNEL_PREFIX}{team_id}", b"runs:run-x,run-y")
        return await stream.__anext__()

    assert asyncio.run(first_change()) == frozenset({"run-x", "run-y"})
