"""The process's background threads share one base (runs/background.py): started by the first
hand-over and again if one died, a fresh start in a forked child, and a stop that joins. The
four that use it (the Celery publisher, the live wake-ups' Redis publisher and listener, the
look lane) stop and start again through it."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import deque
from typing import Any

import pytest

from runs.background import BackgroundThread


class Echo(BackgroundThread):
    """A toy helper: hands each item back, doubled, on its thread."""

    name = "echo"

    def _reset(self) -> None:
        super()._reset()
        self.todo: deque[int] = deque()
        self.done: list[int] = []
        self.threads: set[int] = set()

    def put(self, item: int) -> None:
        with self._cond:
            self.todo.append(item)
            self._start()
            self._cond.notify_all()

    def wait_done(self, count: int, timeout: float = 10) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: len(self.done) >= count, timeout=timeout)

    def _serve(self) -> None:
        while True:
            with self._cond:
                if not self._wait_for(lambda: bool(self.todo)):
                    return
                item = self.todo.popleft()
            if item < 0:
                raise RuntimeError("a bug in the loop")
            with self._cond:
                self.done.append(item * 2)
                self.threads.add(threading.get_ident())
                self._cond.notify_all()


def test_no_thread_runs_before_the_first_hand_over_and_one_serves_them_all() -> None:
    echo = Echo()
    assert echo._thread is None
    for n in range(5):
        echo.put(n)
    assert echo.wait_done(5)
    assert echo.done == [0, 2, 4, 6, 8]
    assert len(echo.threads) == 1
    assert echo._thread is not None and echo._thread.name == "echo" and echo._thread.daemon
    assert echo.stop(timeout=5)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_thread_that_died_is_started_again_by_the_next_hand_over() -> None:
    echo = Echo()
    echo.put(-1)  # its loop raises: the thread ends
    deadline = time.monotonic() + 5
    while echo._thread is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert echo._thread is None
    echo.put(3)
    assert echo.wait_done(1)
    assert echo.done == [6]
    assert echo.stop(timeout=5)


def test_stop_ends_and_joins_the_thread_and_the_next_hand_over_starts_another() -> None:
    echo = Echo()
    echo.put(1)
    assert echo.wait_done(1)
    first = echo._thread
    assert first is not None
    assert echo.stop(timeout=5)
    assert not first.is_alive() and echo._thread is None
    echo.put(2)
    assert echo.wait_done(2)
    assert echo._thread is not None and echo._thread is not first
    assert echo.stop(timeout=5)


def test_stop_without_a_thread_is_at_once_true() -> None:
    assert Echo().stop(timeout=0)


def test_a_forked_child_starts_fresh_though_a_thread_of_the_parent_held_the_lock() -> None:
    """Without the reset at fork, the child would wait for ever on a lock whose holder (a
    thread of the parent) does not exist in it."""
    echo = Echo()
    echo.put(1)
    assert echo.wait_done(1)
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with echo._cond:
            holding.set()
            release.wait(30)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert holding.wait(5)
    pid = os.fork()
    if pid == 0:  # the child: no thread of the parent's, a fresh lock and queue
        code = 1
        try:
            fresh = echo._thread is None and echo.done == []
            echo.put(21)
            code = 0 if fresh and echo.wait_done(1, timeout=5) and echo.done == [42] else 1
        finally:
            os._exit(code)
    try:
        deadline = time.monotonic() + 20
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                pytest.fail("the forked child hung on its parent's lock")
            time.sleep(0.05)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        release.set()
        holder.join(5)
        echo.stop(timeout=5)


# --- The four helpers stop through it ----------------------------------------------------

def test_the_publisher_stops_while_the_broker_is_down_and_keeps_its_backlog() -> None:
    from runs.publisher import Key, Publisher

    tries = threading.Event()

    class BrokerDown(Publisher):
        def _publish(self, keys: list[Key]) -> list[Key]:
            tries.set()
            return []

    local = BrokerDown()
    local.submit("runs.tasks.webhook_deliver", 1, 1)
    assert tries.wait(5)
    assert local.stop(timeout=5)
    assert list(local._pending) == [("runs.tasks.webhook_deliver", (1, 1))]


def test_the_redis_publisher_stops() -> None:
    from runs.live.events import RedisPublisher

    sent: list[Any] = []

    class Recording(RedisPublisher):
        @staticmethod
        def _send(teams: dict[int, Any]) -> None:
            sent.append(teams)

    local = Recording()
    local.mark(7)
    assert local.flush(timeout=5)
    assert sent == [{7: None}]
    assert local.stop(timeout=5)
    assert local._thread is None


@pytest.mark.django_db(transaction=True)  # on PostgreSQL a look sets its read deadline
def test_the_look_lane_stops_and_serves_again() -> None:
    from runs.live.looks import LookLane

    lane = LookLane()
    assert asyncio.run(lane.run(lambda: 1, "viewer")) == 1
    assert lane.stop(timeout=5)
    assert lane._thread is None
    assert asyncio.run(lane.run(lambda: 2, "viewer")) == 2
    assert lane.stop(timeout=5)


def test_the_redis_listener_stops_while_it_retries(settings: Any, monkeypatch: Any) -> None:
    from runs.live import events

    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nobody listens: it retries every 2 s
    monkeypatch.setattr(events, "_redis_client", None)
    listener = events.RedisListener()
    listener.ensure_running()
    assert listener._thread is not None
    assert listener.stop(timeout=10)
    assert listener._thread is None
    monkeypatch.setattr(events, "_redis_client", None)  # the next test gets the real one
