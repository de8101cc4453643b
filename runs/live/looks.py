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
from governance.shares import TimeShare
from runs.background import BackgroundThread

T = TypeVar("T")


class LookLane(BackgroundThread):
    """Every async look at the database, on one thread per process, resting after each look
    so that together they take at most ``DASHBOARD_STREAM_SHARE`` of the process's CPU time,
    however many wait: more waiters are served less often, and the checks keep their CPU.
    Viewers (a person, a team's long polls) take turns (round robin), so one viewer's hundred
    tabs slow their own screens, not everyone's. The thread keeps one database connection for
    all of them. Each look's statements get the dashboard's read deadline
    (governance/deadlines.py), so one look cannot hold the lane, and every stream behind it,
    for longer than that."""

    BURST_S = 0.1
    # Looks that say how to be served together (`run(..., together=...)`) are, up to this
    # many per turn, taken from the viewers in turn: a hundred run pages' step looks cost two
    # queries instead of two hundred (runs/dashboard/stream.py).
    BATCH_MAX = 100
    BATCH_EVERY_S = 0.1
    name = "stream-look"

    def _reset(self) -> None:
        super()._reset()
        self._queues: OrderedDict[Hashable, deque[_Look[Any]]] = OrderedDict()
        self._share = TimeShare(self.BURST_S)
        self._batch_at = 0.0  # when the last batch was served

    async def run(self, look: Any, viewer: Hashable,
                  together: Callable[[list[Any]], list[Any]] | None = None) -> Any:
        """`look()` on the lane's thread, in `viewer`'s turn; its result or its exception.
        With ``together``, `look` is what that function takes: it serves the queued looks
        of the same ``together`` in one call, ``together([look, ...])``, which returns their
        results in order (and handles each one's failure itself)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        with self._cond:
            self._queues.setdefault(viewer, deque()).append(_Look(look, loop, future, together))
            self._start()
            self._cond.notify()
        return await future

    def _pop(self, viewer: Hashable) -> _Look[Any]:
        # Under _cond: the viewer's first look; the next viewer's turn after it.
        queue = self._queues[viewer]
        item = queue.popleft()
        if queue:
            self._queues.move_to_end(viewer)
        else:
            del self._queues[viewer]
        return item

    def _first_together(self) -> _Look[Any] | None:
        # Under _cond: the first queued look to be served together, taken off its queue.
        for viewer, queue in self._queues.items():
            for item in queue:
                if item.together is not None:
                    queue.remove(item)
                    if queue:
                        self._queues.move_to_end(viewer)  # the next viewer's turn
                    else:
                        del self._queues[viewer]
                    return item
        return None

    def _next(self) -> list[_Look[Any]] | None:
        """The next look, in its viewer's turn, with the queued looks to be served together
        with it, taken from the viewers in turn (one each per round, up to ``BATCH_MAX``);
        None when the lane is to stop."""
        with self._cond:
            if not self._wait_for(lambda: bool(self._queues)):
                return None
            # A batch goes first when the last one was BATCH_EVERY_S ago: a step look (a
            # decision on its way to a page) does not wait behind every full look queued
            # before it, and the full looks (pages opening) still get most turns.
            due = time.monotonic() - self._batch_at >= self.BATCH_EVERY_S
            first = self._first_together() if due else None
            batch = [self._pop(next(iter(self._queues)))] if first is None else [first]
            together = batch[0].together
            if together is None:
                return batch
            self._batch_at = time.monotonic()
            mine = {viewer: deque(item for item in queue if item.together is together)
                    for viewer, queue in self._queues.items()}
            taken: set[int] = set()
            while len(batch) < self.BATCH_MAX and any(mine.values()):
                for items in mine.values():
                    if items and len(batch) < self.BATCH_MAX:
                        item = items.popleft()
                        batch.append(item)
                        taken.add(id(item))
            for viewer in list(self._queues):
                rest = deque(item for item in self._queues[viewer] if id(item) not in taken)
                if rest:
                    self._queues[viewer] = rest
                else:
                    del self._queues[viewer]
            return batch

    def _serve(self) -> None:
        while (batch := self._next()) is not None:
            batch = [item for item in batch if not item.future.cancelled()]  # waiters gone
            if not batch:
                continue
            # A quiet process's looks start at once and a crowded one's wait their turn; a
            # look spends the CPU time it took (governance/shares.py).
            if wait := self._share.wait_s(settings.DASHBOARD_STREAM_SHARE):
                # A stop cuts the rest short; the look in hand is served all the same.
                self._rest(min(5.0, wait))
                self._share.forgive()
            spent = time.thread_time()
            results: list[Any] = [None] * len(batch)
            failure: BaseException | None = None
            try:
                close_old_connections()  # a broken or old connection is replaced
                with read_deadline():
                    together = batch[0].together
                    if together is None:
                        results = [batch[0].look()]
                    else:
                        results = together([item.look for item in batch])
            except Exception as exc:
                failure = exc
            # What the look took from the process is this thread's CPU time: on a loaded
            # machine its wall time was mostly waiting, for a core, the GIL or PostgreSQL,
            # which charged the lane several times what it took and starved the screens.
            self._share.spend(time.thread_time() - spent)
            for item, result in zip(batch, results, strict=True):
                with contextlib.suppress(RuntimeError):  # RuntimeError: that loop is closed
                    item.loop.call_soon_threadsafe(_settle, item.future, result, failure)
        connections.close_all()  # stopped: the thread's own connection goes with it


@dataclass
class _Look(Generic[T]):
    look: Any  # a callable, or what `together` takes
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[T]
    together: Callable[[list[Any]], list[Any]] | None = None


def _settle(future: asyncio.Future[Any], result: Any, failure: BaseException | None) -> None:
    if future.done():
        return
    if failure is not None:
        future.set_exception(failure)
    else:
        future.set_result(result)


look_lane = LookLane()
