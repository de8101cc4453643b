"""The thread pools of one server process (docs/serving.md).

Under `manage.py serve` a request holds no thread until its body has arrived (governance/asgi.py
reads it on the event loop); then its synchronous part runs on one of two bounded pools: the
API's (`/api/`: the agents' calls) or the dashboard's (pages, forms, the opening of live
streams). Neither can take the other's threads, so dashboard traffic cannot queue the checks.
A thread of a pool keeps its database connection across requests, as a WSGI thread does
(``CONN_MAX_AGE``); `run_request` closes a connection that is broken or too old before and
after each request, as Django's request signals do under WSGI.

An async API view (``async def``, e.g. a long poll) runs on the event loop and holds no
thread while it waits; it runs its database work on the API pool with `api_thread`.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

from asgiref.sync import AsyncToSync, sync_to_async
from django.conf import settings
from django.db import close_old_connections, reset_queries

from operator_api.paths import engages_a_switch, waits_for_backtest
from operator_api.paths import serves as operator_path

# Paths served by the API's pool; everything else is the dashboard's, but the operator API's
# (SPEC 17), which has a pool of its own: an operator call never takes a check's thread nor
# queues behind the pages (SPEC 21); and the agents' bulk calls, below.
API_PREFIXES = ("/api/", "/healthz", "/readyz")
# The agents' bulk calls have a pool of their own: a run's decisions (up to 1,000, each up to
# 64 KiB of arguments), an upload of up to 1,000 local decisions, the team's runs (up to 500).
# Each can hold a thread for a second or more, and on the API's pool eight of them, from one
# team's key, queued every team's checks for seconds (found by an attacker: another team's
# check p99 2.5 to 6 s, its kill switch answered 4.6 s late).
AGENT_BULK = re.compile(r"/api/v1/runs/[^/]+/(decisions|local-decisions)/?")
AGENT_RUNS = "/api/v1/runs"
# And the reads of one run or one decision, paced with their team's bulk calls but never
# refused for the calls in progress (`paced_only`). They cost about what a check costs (their
# args as stored, their children's ids as strings), yet a hundred and more a second of them
# from one key on the checks' pool made another team's check p99 14x (a decision of 64 KiB
# of args; 16 to 39x before they were made cheap: found by an attacker). Capped as the other
# bulk calls are (one at a time per key and process), an agent reading its runs from a few
# threads got 429s.
AGENT_READS = re.compile(r"/api/v1/(runs|decisions)/[^/]+/?")

P = ParamSpec("P")
R = TypeVar("R")

_lock = threading.Lock()
_pools: dict[str, ThreadPoolExecutor] = {}
_fair: dict[str, FairPool] = {}


def _reset() -> None:
    # A forked child has none of the parent's threads: it makes its own pools.
    global _lock
    _lock = threading.Lock()
    _pools.clear()
    _fair.clear()


os.register_at_fork(after_in_child=_reset)


def pool(name: str) -> ThreadPoolExecutor:
    """The process's pool `api`, `agent-bulk`, `operator`, `backtest`, `killswitch`,
    `dashboard-killswitch` or `dashboard`, made on first use."""
    try:
        return _pools[name]
    except KeyError:
        pass
    with _lock:
        if name not in _pools:
            _pools[name] = ThreadPoolExecutor(max_workers=_size(name), thread_name_prefix=name)
        return _pools[name]


def _size(name: str) -> int:
    # Only this pool's setting is read: a settings module that serves fewer pools (the
    # benchmark's minimal server) need not name the others.
    return getattr(settings, {"api": "API_THREADS", "agent-bulk": "AGENT_BULK_THREADS",
                              "operator": "OPERATOR_THREADS",
                              "backtest": "BACKTEST_API_THREADS",
                              "killswitch": "KILLSWITCH_API_THREADS",
                              "dashboard-killswitch": "KILLSWITCH_API_THREADS",
                              "dashboard": "DASHBOARD_THREADS"}[name])


# A caller whose jobs each take more than this much CPU, on a recent average, holds one of a
# pool's threads at a time (`FairPool`). Threads share the process's one interpreter lock:
# three threads of one team walking checks of 60 KiB of small JSON values (10 to 70 ms of
# CPU each) made another team's check wait for the lock after each of its round trips, p99
# 7 to 40x its own (found by an attacker, SPEC 10), though a thread was left to it. A check
# takes about 1 ms of its thread's CPU; the agents' bulk calls and pages have pools of
# their own.
HEAVY_CPU_S = 0.005
# The weight of a job's CPU in its caller's running average (the rest is the average's).
CPU_WEIGHT = 0.3
# Callers whose average is kept: the table is emptied when full (a caller unknown again is
# light until its next job says otherwise).
CPU_CALLERS_MAX = 10_000


class FairPool:
    """A pool's threads, in arrival order, but no caller holding more than ``share`` of them:
    at most ``size`` jobs at work on ``executor``; when one ends, the job that arrived first
    among the callers under their share starts. A ThreadPoolExecutor serves in arrival order
    alone, so one key's 40 concurrent checks took every thread and every other team's check
    waited behind all 40 (found by an attacker: another team's check p99 10 times its p99
    alone); with a share, a thread is always left to the others. Not round robin: taking the
    callers in turn gave another team's 8 agents on one key as many threads as a team's 32
    agents on another (the benchmark's heavy_rate_limits attack: p99 2.2 to 2.65x instead of
    1.24 to 1.54x). Thread-safe: jobs are submitted from the event loop and started when one
    ends, on the pool's threads."""

    def __init__(self, executor: ThreadPoolExecutor, size: int, share: int | None = None
                 ) -> None:
        self.executor = executor
        self.size = size
        self.share = share if share is not None else max(1, size - 1)
        self._lock = threading.Lock()
        # Each caller's jobs in arrival order, numbered in the pool's arrival order.
        self._waiting: dict[Hashable, deque[tuple[int, Future[Any], Callable[[], Any]]]] = {}
        self._held: dict[Hashable, int] = {}
        # Each caller's CPU a job, a running average (HEAVY_CPU_S).
        self._cpu: dict[Hashable, float] = {}
        self._arrived = 0
        self._running = 0

    def submit(self, caller: Hashable, job: Callable[[], R]) -> Future[R]:
        future: Future[R] = Future()
        with self._lock:
            self._arrived += 1
            self._waiting.setdefault(caller, deque()).append((self._arrived, future, job))
            self._start_locked()
        return future

    def _start_locked(self) -> None:
        while self._running < self.size:
            # The first to arrive among the callers under their share (few wait at once).
            ready = [caller for caller in self._waiting
                     if self._held.get(caller, 0) < self.share_of(caller)]
            if not ready:
                return
            caller = min(ready, key=lambda c: self._waiting[c][0][0])
            line = self._waiting[caller]
            _, future, job = line.popleft()
            if not line:
                del self._waiting[caller]
            if future.set_running_or_notify_cancel():
                self._running += 1
                self._held[caller] = self._held.get(caller, 0) + 1
                self.executor.submit(self._run, caller, future, job)

    def heavy(self, caller: Hashable) -> bool:
        """Whether ``caller``'s jobs take more than HEAVY_CPU_S of CPU each, of late."""
        return self._cpu.get(caller, 0.0) > HEAVY_CPU_S

    def share_of(self, caller: Hashable) -> int:
        """The threads ``caller`` may hold at once: one while its jobs are heavy."""
        return 1 if self.heavy(caller) else self.share

    def _run(self, caller: Hashable, future: Future[Any], job: Callable[[], Any]) -> None:
        started = time.thread_time()
        error: BaseException | None = None
        try:
            result = job()
        except BaseException as exc:  # the caller's to handle, as the executor's would be
            error = exc
        cpu = time.thread_time() - started
        # What the job took of its thread's CPU, for the caller's pacing: set before the
        # future is done, when the event loop reads it.
        future.cpu_s = cpu  # type: ignore[attr-defined]
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
        with self._lock:
            if caller not in self._cpu and len(self._cpu) >= CPU_CALLERS_MAX:
                self._cpu.clear()
            average = self._cpu.get(caller, cpu)
            self._cpu[caller] = average + CPU_WEIGHT * (cpu - average)
            self._running -= 1
            left = self._held.pop(caller) - 1
            if left:
                self._held[caller] = left
            self._start_locked()


def fair(name: str) -> FairPool:
    """Pool `name`'s threads, no caller holding more than its share (`FairPool`), made on
    first use."""
    try:
        return _fair[name]
    except KeyError:
        pass
    executor = pool(name)
    with _lock:
        if name not in _fair:
            _fair[name] = FairPool(executor, _size(name))
        return _fair[name]


# The methods that read the runs list: Django upper-cases the request line's method (a
# lowercase ``get`` is served as GET) and the API serves HEAD as GET without the body
# (governance/middleware.py). Compared as sent, ``get`` and ``HEAD /api/v1/runs`` went to the
# checks' pool, escaping the bulk pool's caps and pacing (found by an attacker: another
# team's check p99 20 to 35x).
_READS = frozenset({"GET", "HEAD"})


# The dashboard's kill switch forms: a team's or the global switch engaged or released, a
# run's kill button. On a pool of their own, so that no page, however many are asked for or
# however long each takes, is ever in front of a kill switch (found by an attacker: one
# team's viewers looping a policy's history diff on 32 connections delayed another team's
# engage from the dashboard by 2 to 6 s).
DASHBOARD_KILLSWITCH = re.compile(r"/(teams/[^/]+/)?killswitch/(engage|release)"
                                  r"|/teams/[^/]+/runs/[^/]+/kill")


def pool_name(path: str, method: str = "GET") -> str:
    if path.startswith(API_PREFIXES):
        if not operator_path(path):
            if AGENT_BULK.fullmatch(path) or (method.upper() in _READS and (
                    path.rstrip("/") == AGENT_RUNS or AGENT_READS.fullmatch(path))):
                return "agent-bulk"
            return "api"
        if waits_for_backtest(path):
            return "backtest"
        return "killswitch" if engages_a_switch(path) else "operator"
    if method.upper() == "POST" and DASHBOARD_KILLSWITCH.fullmatch(path):
        return "dashboard-killswitch"
    return "dashboard"


def paced_only(path: str) -> bool:
    """Whether a call of the agents' bulk pool is paced with its team's but never refused for
    the calls its key or address has in progress: the reads of one run or one decision."""
    return AGENT_READS.fullmatch(path) is not None


def run_request(fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """Run one request's synchronous part on this (pool) thread, with the connection
    housekeeping Django's request_started / request_finished signals do under WSGI (their
    receivers, called directly: governance/asgi.py `respond_sync`)."""
    if settings.DEBUG:
        reset_queries()  # DEBUG's query log is per request
    close_old_connections()
    try:
        return fn(*args, **kwargs)
    finally:
        close_old_connections()


def api_thread(fn: Callable[P, R]) -> Callable[P, Coroutine[Any, Any, R]]:
    """`fn` as a coroutine function that runs on the API pool: database work of an async API
    view. (asgiref's default, ``thread_sensitive=True``, would run it on one thread shared
    by the whole process.)"""
    async def call(*args: P.args, **kwargs: P.kwargs) -> R:
        if getattr(AsyncToSync.executors, "current", None) is not None:
            # The view was called from a synchronous thread (Django's test client, whose
            # test holds a transaction open on that thread's connection): that thread does
            # the work, as asgiref's default would; only it sees the transaction's writes.
            # Under the server no such thread exists and the work goes to the API pool.
            return await sync_to_async(fn)(*args, **kwargs)
        # The pool is looked up at each call, never at import: a worker forked after the
        # import makes its own.
        runner = sync_to_async(run_request, thread_sensitive=False, executor=pool("api"))
        return await runner(fn, *args, **kwargs)

    return call
