"""The process's one lane of database looks for everything that waits on the event loop: the
live screens' streams (runs/dashboard/stream.py) and the approvals' long polls
(runs/approvals/waits.py). None of them takes a thread of the API pool, so however many are
open the checks keep their threads, and the lane's bounded share of the process's time keeps
them their CPU (docs/serving.md)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from django.conf import settings
from django.db import close_old_connections, connections

from governance.deadlines import read_deadline
from runs.background import BackgroundThread

T = TypeVar("T")


class LookLane(BackgroundThread):
    """Every async look at the database, on one thread per process, resting after each look
    so that together they take at most ``DASHBOARD_STREAM_SHARE`` of the process's time,
    however many wait: more waiters are served less often, and the checks keep their CPU.
    Viewers (a person, a team's long polls) take turns (round robin), so one viewer's hundred
    tabs slow their own screens, not everyone's. The thread keeps one database connection for
    all of them. Each look's statements get the dashboard's read deadline
    (governance/deadlines.py), so one look cannot hold the lane, and every stream behind it,
    for longer than that."""

    BURST_S = 0.1
    name = "stream-look"

    def _reset(self) -> None:
        super()._reset()
        self._queues: OrderedDict[Hashable, deque[_Look[Any]]] = OrderedDict()
        self._budget = 0.0
        self._filled_at = time.monotonic()

    async def run(self, look: Callable[[], T], viewer: Hashable) -> T:
        """`look()` on the lane's thread, in `viewer`'s turn; its result or its exception."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self._cond:
            self._queues.setdefault(viewer, deque()).append(_Look(look, loop, future))
            self._start()
            self._cond.notify()
        return await future

    def _next(self) -> _Look[Any] | None:
        """The next look, in its viewer's turn; None when the lane is to stop."""
        with self._cond:
            if not self._wait_for(lambda: bool(self._queues)):
                return None
            viewer, queue = next(iter(self._queues.items()))
            item = queue.popleft()
            if queue:
                self._queues.move_to_end(viewer)  # the next viewer's turn
            else:
                del self._queues[viewer]
            return item

    def _serve(self) -> None:
        while (item := self._next()) is not None:
            if item.future.cancelled():  # its waiter went away meanwhile
                continue
            # A token bucket of look time: it fills at `share` seconds per second, up to a
            # short burst, so a quiet process's looks start at once and a crowded one's
            # wait their turn; a look spends what it took.
            share = min(1.0, max(0.01, settings.DASHBOARD_STREAM_SHARE))
            now = time.monotonic()
            self._budget = min(self.BURST_S, self._budget + (now - self._filled_at) * share)
            self._filled_at = now
            if self._budget < 0:
                # A stop cuts the rest short; the look in hand is served all the same.
                self._rest(min(5.0, -self._budget / share))
                self._budget, self._filled_at = 0.0, time.monotonic()
            started = time.monotonic()
            result: Any = None
            failure: BaseException | None = None
            try:
                close_old_connections()  # a broken or old connection is replaced
                with read_deadline():
                    result = item.look()
            except Exception as exc:
                failure = exc
            self._budget -= time.monotonic() - started
            with contextlib.suppress(RuntimeError):  # RuntimeError: that loop is closed
                item.loop.call_soon_threadsafe(_settle, item.future, result, failure)
        connections.close_all()  # stopped: the thread's own connection goes with it


@dataclass
class _Look(Generic[T]):
    look: Callable[[], T]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[T]


def _settle(future: asyncio.Future[Any], result: Any, failure: BaseException | None) -> None:
    if future.done():
        return
    if failure is not None:
        future.set_exception(failure)
    else:
        future.set_result(result)


look_lane = LookLane()
