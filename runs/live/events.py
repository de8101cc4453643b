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
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from django.conf import settings

from runs.background import BackgroundThread

log = logging.getLogger(__name__)

CHANNEL_PREFIX = "governance:team:"
RUNS_PREFIX = b"runs:"  # a message naming the runs that changed; anything else: the whole team
# A message may start with the process it comes from, `from:<origin> `, so that process's
# listener skips it: its own streams heard of the change already (`local_broker`), and a second
# wake-up would cost each of them a second look at the database.
FROM_PREFIX = b"from:"
ORIGIN = uuid.uuid4().hex.encode()  # this process's; a forked child draws its own


def _new_origin() -> None:
    global ORIGIN
    ORIGIN = uuid.uuid4().hex.encode()


os.register_at_fork(after_in_child=_new_origin)

# What changed in a team: the ids of the runs that did, or None for anything.
Changes: TypeAlias = frozenset[str] | None


@dataclass
class _LoopWaiters:
    """The streams of one team waiting on one event loop: they share one asyncio event, so a
    publish costs one hand-off to that loop however many streams wait there."""

    event: asyncio.Event = field(default_factory=asyncio.Event)
    scheduled: bool = False
    count: int = 0


class RunWatch:
    """One async stream's interest in one run, for the stream's life (`LocalBroker.watch_run`).

    A publish naming the run, or a team-wide one, marks the watch and wakes it; a publish of
    the team's other runs costs it nothing. With a thousand run pages open in a team, a check
    wakes the one page of its run instead of all thousand (each of which then found the run
    was not its own), and what changed is kept on the watch itself, so however many of the
    team's other runs change meanwhile, the stream is never told "anything may have changed"
    (which cost a full look) because a shared log overflowed."""

    def __init__(self, broker: LocalBroker, team_id: int, run_id: str,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.broker, self.team_id, self.run_id, self.loop = broker, team_id, run_id, loop
        self.event = asyncio.Event()
        self.pending: Changes = frozenset()  # what changed since the last `next`

    async def next(self, timeout: float) -> Changes:
        """What changed since the last call (this run, None for anything, or an empty set
        when ``timeout`` passed quietly)."""
        if not self.pending:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.event.wait(), timeout)
        with self.broker._cond:
            self.event.clear()
            changes, self.pending = self.pending, frozenset()
        return changes

    def close(self) -> None:
        self.broker._unwatch(self)


class LocalBroker:
    """In-process wake-ups: a sequence number per team, one condition variable for blocking
    waiters and, for async ones (live streams under ASGI), one event per team and loop, or a
    `RunWatch` per stream of a run page."""

    LOG_SIZE = 256

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._seq: dict[int, int] = {}
        # The team's latest changes, (seq, runs changed or None for "anything"), so a run's
        # stream can tell whether its own run changed (`changes_since`).
        self._log: dict[int, deque[tuple[int, frozenset[str] | None]]] = {}
        self._loops: dict[int, dict[asyncio.AbstractEventLoop, _LoopWaiters]] = {}
        self._watches: dict[int, dict[str, set[RunWatch]]] = {}  # by team, then run
        # The watches to wake on each loop, handed over in one call per loop and publish burst.
        self._to_wake: dict[asyncio.AbstractEventLoop, list[RunWatch]] = {}

    def publish(self, team_id: int, runs: frozenset[str] | None = None) -> None:
        """Team `team_id` changed: only the runs `runs`, or anything (None)."""
        with self._cond:
            seq = self._seq[team_id] = self._seq.get(team_id, 0) + 1
            log = self._log.get(team_id)
            if log is None:
                log = self._log[team_id] = deque(maxlen=self.LOG_SIZE)
            log.append((seq, runs))
            self._cond.notify_all()
            for loop, waiters in self._loops.get(team_id, {}).items():
                if not waiters.scheduled:
                    waiters.scheduled = True
                    try:
                        loop.call_soon_threadsafe(self._wake, waiters)
                    except RuntimeError:  # that loop is closed: its waiters are gone
                        waiters.scheduled = False
            self._mark_watches(team_id, runs)

    def _mark_watches(self, team_id: int, runs: frozenset[str] | None) -> None:
        # Under _cond. Only the watches of the runs named (all of the team's for None).
        by_run = self._watches.get(team_id)
        if not by_run:
            return
        if runs is None:
            marked = [w for watches in by_run.values() for w in watches]
        else:
            marked = [w for run in runs for w in by_run.get(run, ())]
        for watch in marked:
            if runs is None or watch.pending is None:
                watch.pending = None
            else:
                watch.pending = watch.pending | {watch.run_id}
            queue = self._to_wake.get(watch.loop)
            if queue is None:
                queue = self._to_wake[watch.loop] = []
                try:
                    watch.loop.call_soon_threadsafe(self._wake_watches, watch.loop)
                except RuntimeError:  # that loop is closed: its watches are gone
                    del self._to_wake[watch.loop]
                    continue
            queue.append(watch)

    def _wake_watches(self, loop: asyncio.AbstractEventLoop) -> None:
        # On that loop: every watch marked there since the last hand-over.
        with self._cond:
            queue = self._to_wake.pop(loop, [])
        for watch in queue:
            watch.event.set()

    def watch_run(self, team_id: int, run_id: str) -> RunWatch:
        """A `RunWatch` of this run on the running loop; `close()` it when the stream ends."""
        watch = RunWatch(self, team_id, run_id, asyncio.get_running_loop())
        with self._cond:
            self._watches.setdefault(team_id, {}).setdefault(run_id, set()).add(watch)
        return watch

    def _unwatch(self, watch: RunWatch) -> None:
        with self._cond:
            by_run = self._watches.get(watch.team_id, {})
            watches = by_run.get(watch.run_id)
            if watches is not None:
                watches.discard(watch)
                if not watches:
                    del by_run[watch.run_id]
                    if not by_run:
                        self._watches.pop(watch.team_id, None)

    def _wake(self, waiters: _LoopWaiters) -> None:
        # On the waiters' loop: wake them all and give the next wait a fresh event.
        with self._cond:
            waiters.scheduled = False
            event, waiters.event = waiters.event, asyncio.Event()
        event.set()

    def seq(self, team_id: int) -> int:
        with self._cond:
            return self._seq.get(team_id, 0)

    def changes_since(self, team_id: int, seen: int) -> tuple[int, Changes]:
        """The team's sequence number now and what changed after `seen`: the runs, or None
        when anything may have (a team-wide change, or more than the log remembers)."""
        with self._cond:
            now = self._seq.get(team_id, 0)
            if now == seen:
                return now, frozenset()
            log = self._log.get(team_id) or deque()
            if not log or log[0][0] > seen + 1:
                return now, None
            runs: set[str] = set()
            for seq, changed in reversed(log):
                if seq <= seen:
                    break
                if changed is None:
                    return now, None
                runs |= changed
            return now, frozenset(runs)

    def wait(self, team_id: int, seen: int, timeout: float) -> int:
        with self._cond:
            self._cond.wait_for(lambda: self._seq.get(team_id, 0) != seen, timeout=timeout)
            return self._seq.get(team_id, 0)

    async def await_change(self, team_id: int, seen: int, timeout: float) -> int:
        """`wait` for a coroutine: holds no thread while it waits."""
        loop = asyncio.get_running_loop()
        with self._cond:
            if self._seq.get(team_id, 0) != seen:
                return self._seq[team_id]
            waiters = self._loops.setdefault(team_id, {}).setdefault(loop, _LoopWaiters())
            waiters.count += 1
            event = waiters.event
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            pass
        finally:
            with self._cond:
                waiters.count -= 1
                if waiters.count == 0:
                    team_loops = self._loops.get(team_id, {})
                    if team_loops.get(loop) is waiters and not waiters.scheduled:
                        del team_loops[loop]
                        if not team_loops:
                            self._loops.pop(team_id, None)
        return self.seq(team_id)


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


class RedisPublisher(BackgroundThread):
    """Sends the wake-ups to Redis from one thread of this process, off the request path.

    A check only marks its team as changed (a set insert under a lock); the thread publishes
    one message per changed team within COALESCE_S of the first mark. Under load, the checks
    of a team that arrive in that time or while a publish is on the wire become one message:
    the message only ever said "look again", so nothing is lost, and the check saves a Redis
    round trip (about a tenth of its CPU on the benchmark's machine). A slow or unreachable
    Redis delays wake-ups and never a check.
    """

    COALESCE_S = 0.05
    name = "live-events"

    def _reset(self) -> None:
        super()._reset()
        self._pending: dict[int, set[str] | None] = {}
        self._busy = False

    def mark(self, team_id: int, run_id: str | None = None) -> None:
        """The team changed: run `run_id` only, or anything (None)."""
        with self._cond:
            if run_id is None:
                self._pending[team_id] = None
            else:
                runs = self._pending.setdefault(team_id, set())
                if runs is not None:
                    runs.add(run_id)
            self._start()
            self._cond.notify_all()

    def flush(self, timeout: float = 1.0) -> bool:
        """Wait until every marked team was published (or given up on); False on timeout.
        Called at exit, so a command that engages a kill switch still wakes the screens."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._busy,
                                       timeout=timeout)

    def _serve(self) -> None:
        while True:
            with self._cond:
                if not self._wait_for(lambda: bool(self._pending)):
                    return
                self._busy = True
            # The marks of the next few milliseconds join this message: under load one
            # publish per check was 5% of a check's Python (redis-py's pipeline), 2.5% with a
            # 10 ms window; one per COALESCE_S is at most twenty a second, and a screen hears
            # of a change at most that much later (its stream looks again within a second).
            # (A stop cuts the wait short; what was marked is still sent.)
            self._rest(self.COALESCE_S)
            with self._cond:
                teams, self._pending = self._pending, {}
            try:
                self._send(teams)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    @staticmethod
    def _send(teams: dict[int, set[str] | None]) -> None:
        client = redis_client()
        if client is None:
            return
        try:
            pipe = client.pipeline(transaction=False)
            for team_id, runs in teams.items():
                data = FROM_PREFIX + ORIGIN + b" " + (b"changed" if runs is None else (
                    RUNS_PREFIX + ",".join(sorted(runs)).encode()))
                pipe.publish(f"{CHANNEL_PREFIX}{team_id}", data)
            pipe.execute()
        except Exception as exc:  # Redis is never the authority: a lost wake-up only delays
            publish_failures.failed(exc)  # a screen
        else:
            publish_failures.succeeded()


class PublishFailures:
    """What the live events' publishing says of a Redis that fails it: the first failure of
    an outage at once, then one line a minute with the count, and its end. Logged each
    time with its traceback, a Redis that hung or refused made up to twenty tracebacks a
    second per process (one per coalesced publish: found by an attacker), filling the logs
    this product exists to keep quiet. Only the publisher's thread calls it."""

    EVERY_S = 60.0

    def __init__(self) -> None:
        self.failing = 0  # failures since the outage began (0: none)
        self.warned_at = 0.0

    def failed(self, exc: Exception) -> None:
        self.failing += 1
        now = time.monotonic()
        if self.failing > 1 and now - self.warned_at < self.EVERY_S:
            return
        self.warned_at = now
        log.warning("could not publish live events to Redis (%s failure%s so far in this "
                    "outage; latest: %r); a screen catches up on its next poll until it is "
                    "back", self.failing, "" if self.failing == 1 else "s", exc)

    def succeeded(self) -> None:
        if self.failing:
            log.warning("live events publish to Redis again, after %s failure%s",
                        self.failing, "" if self.failing == 1 else "s")
            self.failing = 0


publish_failures = PublishFailures()


redis_publisher = RedisPublisher()
atexit.register(redis_publisher.flush)


def publish_team_event(team_id: int) -> None:
    """Every screen of this team looks again (a kill switch changed). Never raises and never
    waits for Redis."""
    local_broker.publish(team_id)
    if settings.REDIS_URL:
        redis_publisher.mark(team_id)


def publish_run_event(run: Any) -> None:
    """A run started, was decided or ended: the team's overview and lists look again, and of
    the run pages only this run's."""
    run_id = str(run.pk)
    local_broker.publish(run.team_id, frozenset((run_id,)))
    if settings.REDIS_URL:
        redis_publisher.mark(run.team_id, run_id)


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


class RedisListener(BackgroundThread):
    """One Redis subscription per process, for every async stream in it: each team message
    from another process becomes a local wake-up (`local_broker`). A stream then costs no
    Redis connection of its own. While Redis is unreachable it retries every few seconds;
    the streams meanwhile look at the database on their own schedule."""

    RETRY_S = 2.0
    name = "live-events-listen"

    def ensure_running(self) -> None:
        if not settings.REDIS_URL:
            return
        with self._cond:
            self._start()

    def _serve(self) -> None:
        while True:
            try:
                self._listen()
            except Exception:
                log.warning("live events: Redis subscription lost, retrying", exc_info=True)
            if not self._rest(self.RETRY_S):
                return

    def _listen(self) -> None:
        client = redis_client()
        if client is None:
            return
        pubsub = client.pubsub(ignore_subscribe_messages=True)
        try:
            pubsub.psubscribe(f"{CHANNEL_PREFIX}*")
            # Each wait for a message is a second at most: a stop ends it by then.
            while not self._stopping:
                message = pubsub.get_message(timeout=1.0)
                if message is None:
                    continue
                channel = message.get("channel", b"")
                if isinstance(channel, bytes):
                    channel = channel.decode(errors="replace")
                try:
                    team_id = int(str(channel).rsplit(":", 1)[1])
                except (IndexError, ValueError):
                    continue
                data = message.get("data", b"")
                if isinstance(data, bytes) and data.startswith(FROM_PREFIX):
                    origin, _, data = data[len(FROM_PREFIX):].partition(b" ")
                    if origin == ORIGIN:
                        continue  # published by this process: its streams know already
                runs = None
                if isinstance(data, bytes) and data.startswith(RUNS_PREFIX):
                    runs = frozenset(r for r in data[len(RUNS_PREFIX):].decode(
                        errors="replace").split(",") if r)
                local_broker.publish(team_id, runs)
        finally:
            pubsub.close()


redis_listener = RedisListener()


async def awakeups(team_id: int, *, poll: float = 1.0, lifetime: float = 300.0,
                   run_id: str | None = None) -> AsyncIterator[Changes]:
    """`wakeups` for a coroutine, holding no thread: yields what changed in the team (here
    or, via Redis, in another process) since the last yield: the runs that did, None for
    anything, an empty set on a quiet ``poll`` interval. With ``run_id``, only that run's
    changes and the team-wide ones wake it (a `RunWatch`)."""
    redis_listener.ensure_running()
    deadline = time.monotonic() + lifetime
    if run_id is not None:
        watch = local_broker.watch_run(team_id, run_id)
        try:
            while (left := deadline - time.monotonic()) > 0:
                yield await watch.next(min(poll, left))
        finally:
            watch.close()
        return
    seen = local_broker.seq(team_id)
    while (left := deadline - time.monotonic()) > 0:
        # The last wait ends at the deadline: a long poll answers when its wait is up.
        await local_broker.await_change(team_id, seen, min(poll, left))
        seen, changes = local_broker.changes_since(team_id, seen)
        yield changes
