"""The API's threads are served in arrival order, no caller holding more than its share
(governance/pools.py `FairPool`): one key's many concurrent checks never put another key's
behind all of them (found by an attacker: 40 concurrent checks from one key made another
team's check p99 10 times its own alone, the pool serving in arrival order alone)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from governance.pools import FairPool


def test_a_thread_is_always_left_to_another_caller() -> None:
    release = threading.Event()
    started: list[str] = []

    def job(name: str) -> str:
        started.append(name)
        if name.startswith("a"):
            release.wait(10)  # key-a's checks are slow: they hold what they get
        return name

    with ThreadPoolExecutor(max_workers=2) as executor:
        fair = FairPool(executor, size=2)  # a caller's share: all threads but one
        flood = [fair.submit("key-a", lambda n=f"a{i}": job(n)) for i in range(10)]
        other = fair.submit("key-b", lambda: job("b0"))
        # In arrival order alone, b0 would wait for all ten; it takes the thread key-a may
        # not have, while key-a's first still holds the other.
        assert other.result(timeout=10) == "b0"
        # a0 and b0, in either order: each on a thread of its own, which may start first.
        assert not flood[0].done() and sorted(started[:2]) == ["a0", "b0"]
        release.set()
        assert [f.result(timeout=10) for f in flood] == [f"a{i}" for i in range(10)]


def test_callers_under_their_share_are_served_in_arrival_order() -> None:
    release = threading.Event()
    started: list[str] = []

    def job(name: str) -> str:
        started.append(name)
        if name == "a0":
            release.wait(10)
        return name

    with ThreadPoolExecutor(max_workers=1) as executor:
        fair = FairPool(executor, size=1, share=1)
        futures = [fair.submit("key-a", lambda: job("a0")),
                   fair.submit("key-a", lambda: job("a1")),
                   fair.submit("key-b", lambda: job("b0")),
                   fair.submit("key-a", lambda: job("a2"))]
        release.set()
        for future in futures:
            future.result(timeout=10)
    assert started == ["a0", "a1", "b0", "a2"]


def test_at_most_size_jobs_run_at_once_and_failures_reach_their_caller() -> None:
    running, most = 0, 0
    lock = threading.Lock()

    def job() -> None:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        threading.Event().wait(0.02)
        with lock:
            running -= 1

    def fails() -> None:
        raise ValueError("the view's own error")

    with ThreadPoolExecutor(max_workers=8) as executor:
        fair = FairPool(executor, size=3)
        futures = [fair.submit(f"key-{i % 4}", job) for i in range(24)]
        failed = fair.submit("key-x", fails)
        for future in futures:
            future.result(timeout=10)
        with pytest.raises(ValueError, match="the view's own error"):
            failed.result(timeout=10)
    assert most == 3
