"""Live-update notifications for screens.

The database is the source of truth for what a screen shows; an event only says "team T
changed, look again". Without Redis (embedded default) notifications stay in this
process; with Redis they go through pub/sub so a browser connected to one server process
hears about a check answered by another. Publishing never fails a request: a screen that
misses a wake-up catches up on its next poll.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from django.conf import settings

log = logging.getLogger(__name__)

CHANNEL_PREFIX = "governance:team:"


class LocalBroker:
    """In-process wake-ups: a sequence number per team and one condition variable."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._seq: dict[int, int] = {}
        # Coroutines waiting (the approvals long poll), each with the loop that runs it.
        self._async: dict[int, set[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}

    def publish(self, team_id: int) -> None:
        with self._cond:
            self._seq[team_id] = self._seq.get(team_id, 0) + 1
            self._cond.notify_all()
            waiters = list(self._async.get(team_id, ()))
        for loop, event in waiters:
            with contextlib.suppress(RuntimeError):  # that loop has closed meanwhile
                loop.call_soon_threadsafe(event.set)

    async def wait_async(self, team_id: int, seen: int, timeout: float) -> int:
        """`wait` for a coroutine: the event loop goes on while it waits, no thread does."""
        event = asyncio.Event()
        waiter = (asyncio.get_running_loop(), event)
        with self._cond:
            if self._seq.get(team_id, 0) != seen:
                return self._seq.get(team_id, 0)
            self._async.setdefault(team_id, set()).add(waiter)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), timeout)
        finally:
            with self._cond:
                self._async.get(team_id, set()).discard(waiter)
        return self.seq(team_id)

    def seq(self, team_id: int) -> int:
        with self._cond:
            return self._seq.get(team_id, 0)

    def wait(self, team_id: int, seen: int, timeout: float) -> int:
        with self._cond:
            self._cond.wait_for(lambda: self._seq.get(team_id, 0) != seen, timeout=timeout)
            return self._seq.get(team_id, 0)


local_broker = LocalBroker()
_redis_client: Any = None
_redis_lock = threading.Lock()


def redis_client() -> Any:
    """One shared Redis client per process (it pools connections), or None without Redis."""
    global _redis_client
    if not settings.REDIS_URL:
        return None
    with _redis_lock:
        if _redis_client is None:
            import redis

            # Short deadlines (SPEC 10: 100 ms), for the publisher's thread, /readyz and the
            # streams alike; a subscriber's wait for a message has its own timeout.
            _redis_client = redis.Redis.from_url(
                settings.REDIS_URL, socket_timeout=settings.REDIS_TIMEOUT_S,
                socket_connect_timeout=settings.REDIS_TIMEOUT_S,
            )
        return _redis_client


class RedisPublisher:
    """Sends the wake-ups to Redis from one thread of this process, off the request path.

    A check only marks its team as changed (a set insert under a lock); the thread publishes
    one message per changed team as soon as it runs. Under load, the checks of a team that
    arrive while a publish is on the wire become one message: the message only ever said
    "look again", so nothing is lost, and the check saves a Redis round trip (about a tenth of
    its CPU on the benchmark's machine). A slow or unreachable Redis delays wake-ups and never
    a check.
    """

    def __init__(self) -> None:
        self._reset()
        # A forked child (granian and Celery workers) has none of the parent's threads.
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._pending: set[int] = set()
        self._busy = False
        self._thread: threading.Thread | None = None

    def mark(self, team_id: int) -> None:
        with self._cond:
            self._pending.add(team_id)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="live-events",
                                                daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def flush(self, timeout: float = 1.0) -> bool:
        """Wait until every marked team was published (or given up on); False on timeout.
        Called at exit, so a command that engages a kill switch still wakes the screens."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._busy,
                                       timeout=timeout)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._pending))
                teams, self._pending, self._busy = self._pending, set(), True
            try:
                self._send(teams)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    @staticmethod
    def _send(teams: set[int]) -> None:
        client = redis_client()
        if client is None:
            return
        try:
            pipe = client.pipeline(transaction=False)
            for team_id in teams:
                pipe.publish(f"{CHANNEL_PREFIX}{team_id}", b"changed")
            pipe.execute()
        except Exception:  # Redis is never the authority: a lost wake-up only delays a screen
            log.warning("could not publish live events to Redis", exc_info=True)


redis_publisher = RedisPublisher()
atexit.register(redis_publisher.flush)


def publish_team_event(team_id: int) -> None:
    """Screens of this team look again: a run started, decided or ended, or a kill switch
    changed. Never raises and never waits for Redis."""
    local_broker.publish(team_id)
    if settings.REDIS_URL:
        redis_publisher.mark(team_id)


def publish_run_event(run: Any) -> None:
    publish_team_event(run.team_id)


def wakeups(team_id: int, *, poll: float = 1.0, lifetime: float = 300.0) -> Iterator[bool]:
    """Yield True when the team may have changed, False on a quiet poll interval.

    Blocking, for a streaming response: listens to Redis pub/sub when configured and
    reachable, else to this process's broker; either way it yields at least every ``poll``
    seconds so a missed wake-up costs at most one interval.
    """
    deadline = time.monotonic() + lifetime
    client = redis_client()
    pubsub = None
    if client is not None:
        try:
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            pubsub.subscribe(f"{CHANNEL_PREFIX}{team_id}")
        except Exception:
            log.warning("live events fall back to polling: Redis unreachable", exc_info=True)
            pubsub = None
    seen = local_broker.seq(team_id)
    try:
        while time.monotonic() < deadline:
            if pubsub is not None:
                try:
                    message = pubsub.get_message(timeout=poll)
                except Exception:
                    pubsub = None
                    message = None
                got = message is not None
                if got:
                    # Drain the burst: one look at the database serves them all.
                    while pubsub.get_message(timeout=0) is not None:
                        pass
            else:
                now_seq = local_broker.wait(team_id, seen, poll)
                got, seen = now_seq != seen, now_seq
            yield got
    finally:
        if pubsub is not None:
            try:
                pubsub.close()
            except Exception:
                log.debug("pubsub close failed", exc_info=True)


async def awakeups(team_id: int, *, poll: float = 1.0, lifetime: float = 60.0
                   ) -> AsyncIterator[bool]:
    """`wakeups` for async views: the same wake-ups (Redis pub/sub when configured and
    reachable, else this process's broker) awaited on the event loop, so a waiting request
    holds no thread. Yields at least every ``poll`` seconds, so a missed wake-up costs at
    most one interval (the caller re-reads the database then)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + lifetime
    client = pubsub = None
    if settings.REDIS_URL:
        try:
            import redis.asyncio as aredis

            client = aredis.Redis.from_url(settings.REDIS_URL, socket_timeout=2.0,
                                           socket_connect_timeout=0.5)
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            await asyncio.wait_for(pubsub.subscribe(f"{CHANNEL_PREFIX}{team_id}"), 0.5)
        except Exception:
            log.warning("long poll falls back to the local broker: Redis unreachable",
                        exc_info=True)
            pubsub = None
    seen = local_broker.seq(team_id)
    try:
        while (left := deadline - loop.time()) > 0:
            wait = min(poll, left)
            if pubsub is not None:
                try:
                    message = await pubsub.get_message(timeout=wait)
                except Exception:
                    log.warning("long poll lost Redis; polling the database", exc_info=True)
                    pubsub, message = None, None
                    await asyncio.sleep(wait)
                got = message is not None
                while got and pubsub is not None and (
                        await pubsub.get_message(timeout=0)) is not None:
                    pass  # one look at the database serves the whole burst
            else:
                now_seq = await local_broker.wait_async(team_id, seen, wait)
                got, seen = now_seq != seen, now_seq
            yield got
    finally:
        for closing in (pubsub, client):
            if closing is not None:
                with contextlib.suppress(Exception):
                    await closing.aclose()
