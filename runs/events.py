"""Live-update notifications for screens.

The database is the source of truth for what a screen shows; an event only says "team T /
run R changed, look again". Without Redis (embedded default) notifications stay in this
process; with Redis they go through pub/sub so a browser connected to one server process
hears about a check answered by another. Publishing never fails a request: a screen that
misses a wake-up catches up on its next poll.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from django.conf import settings

log = logging.getLogger(__name__)

CHANNEL_PREFIX = "governance:team:"


class LocalBroker:
    """In-process wake-ups: a sequence number per team and one condition variable."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._seq: dict[int, int] = {}

    def publish(self, team_id: int) -> None:
        with self._cond:
            self._seq[team_id] = self._seq.get(team_id, 0) + 1
            self._cond.notify_all()

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

            _redis_client = redis.Redis.from_url(
                settings.REDIS_URL, socket_timeout=0.5, socket_connect_timeout=0.5
            )
        return _redis_client


def publish_run_event(run: Any, *, kind: str, decision_id: int | None = None) -> None:
    local_broker.publish(run.team_id)
    client = redis_client()
    if client is None:
        return
    message = json.dumps({"kind": kind, "run": str(run.pk), "decision": decision_id})
    try:
        client.publish(f"{CHANNEL_PREFIX}{run.team_id}", message)
    except Exception:  # Redis is never the authority: a lost wake-up only delays a screen
        log.warning("could not publish a live event to Redis", exc_info=True)


def publish_team_event(team_id: int, *, kind: str) -> None:
    """A change that is not about one run (a kill switch engaged or released): screens of
    the team look again, like for a run event."""
    local_broker.publish(team_id)
    client = redis_client()
    if client is None:
        return
    try:
        client.publish(f"{CHANNEL_PREFIX}{team_id}", json.dumps({"kind": kind, "run": None}))
    except Exception:  # as for run events: a lost wake-up only delays a screen
        log.warning("could not publish a live event to Redis", exc_info=True)


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
