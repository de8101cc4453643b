"""Celery publishes made for a request, off the request's thread (SPEC 10: an engage, a check
that opens an approval, a "Send test" never wait for Redis).

A request commits its rows first, then hands the task's name and arguments to ``publisher``:
one thread of the process publishes them with short broker timeouts and no retries of its
own, and while the broker is down or hung it retries the whole backlog with a backoff capped
at ``MAX_DELAY_S``. What it never manages to publish (the process dies first, it gives up
after ``GIVE_UP_AFTER_S``, the backlog is full) is restarted by the beat sweep
(runs/killswitch/sweep.py ``stale_work``: a switch without ``fanout_done_at``, a pending
delivery older than a minute), so every publish handed here is safe to lose and to repeat.

Workers publish their own follow-ups directly: a task may wait for the broker, and every
publish is bounded by the broker's socket timeouts (the settings'
CELERY_BROKER_TRANSPORT_OPTIONS).
"""

from __future__ import annotations

import atexit
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from celery import current_app
from django.db import connections

from runs.background import BackgroundThread

log = logging.getLogger(__name__)

Key = tuple[str, tuple[int | str, ...]]  # a task's name and its arguments


@dataclass
class _Entry:
    submitted: float  # time.monotonic() of the first submission
    while_down: Callable[[], None] | None  # run once if the first try fails
    ran_while_down: bool = False


class Publisher(BackgroundThread):
    """Publishes tasks from one thread of the process, in submission order, each at most
    once at a time (a task submitted again while pending is not queued twice)."""

    name = "celery-publish"

    CONNECT_TIMEOUT_S = 1.0
    SOCKET_TIMEOUT_S = 1.0
    GIVE_UP_AFTER_S = 600.0  # then the beat sweep takes over
    MAX_DELAY_S = 5.0
    # Tasks kept while the broker is down: beyond that a submission is dropped (and logged)
    # for the sweep to restart, so an outage cannot grow the server's memory without end.
    MAX_PENDING = 10_000

    def _reset(self) -> None:
        super()._reset()
        self._pending: dict[Key, _Entry] = {}
        self._busy = False

    def submit(self, task: str, *args: int | str,
               while_down: Callable[[], None] | None = None) -> None:
        """Publish ``task(*args)`` soon. ``while_down`` runs once, on this thread, if the
        first try fails: what can be done without a worker meanwhile (the kill switch marks
        its runs killed)."""
        with self._cond:
            if (task, args) not in self._pending and len(self._pending) >= self.MAX_PENDING:
                log.error("%s publishes are waiting for the broker: %s%s is left to the beat "
                          "sweep", len(self._pending), task, args)
                return
            self._pending.setdefault((task, args), _Entry(time.monotonic(), while_down))
            self._start()
            self._cond.notify_all()

    def flush(self, timeout: float = 2.0) -> bool:
        """Wait until everything submitted was published (or given up on); False on
        timeout. Called at exit, so that `manage.py killswitch engage` publishes its own."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._busy,
                                       timeout=timeout)

    def _serve(self) -> None:
        delay = 0.25
        while True:
            with self._cond:
                if not self._wait_for(lambda: bool(self._pending)):
                    return
                batch, self._busy = list(self._pending.items()), True
            published = self._publish([key for key, _ in batch])
            done = set(published)
            failed = len(done) < len(batch)
            if failed:
                now = time.monotonic()
                for key, entry in batch:
                    if key in done:
                        continue
                    if entry.while_down is not None and not entry.ran_while_down:
                        entry.ran_while_down = True
                        self._run(entry.while_down, key)
                    if now - entry.submitted > self.GIVE_UP_AFTER_S:
                        done.add(key)
                        log.error("gave up publishing %s%s; the beat sweep will start it", *key)
            with self._cond:
                for key in done:
                    self._pending.pop(key, None)
                self._busy = False
                self._cond.notify_all()
                if failed:
                    # Sleeps only this thread; a new submission does not cut the wait short,
                    # the broker being down for it too.
                    self._cond.wait(timeout=delay)
                    delay = min(self.MAX_DELAY_S, delay * 2)
                else:
                    delay = 0.25

    @staticmethod
    def _run(action: Callable[[], None], key: Key) -> None:
        try:
            action()
        except Exception:
            log.exception("the fallback of %s%s failed", *key)
        finally:
            connections.close_all()  # this thread's own connections

    def _publish(self, keys: list[Key]) -> list[Key]:
        """Publish in order on one connection; stops at the first failure (the broker is
        down for the rest too). Returns the keys published."""
        published: list[Key] = []
        try:
            with current_app.connection_for_write(
                connect_timeout=self.CONNECT_TIMEOUT_S,
                transport_options={"socket_timeout": self.SOCKET_TIMEOUT_S,
                                   "socket_connect_timeout": self.CONNECT_TIMEOUT_S,
                                   "max_retries": 0},
            ) as conn:
                for task, args in keys:
                    current_app.send_task(task, args, connection=conn, retry=False)
                    published.append((task, args))
        except Exception:
            log.warning("could not publish %s task(s) (broker unreachable); retrying",
                        len(keys) - len(published), exc_info=True)
        return published


publisher = Publisher()
atexit.register(publisher.flush)
