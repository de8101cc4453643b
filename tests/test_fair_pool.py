"""The API's threads are taken by its callers in turn (governance/pools.py `FairPool`): one
key's many concurrent checks never put another key's behind all of them (found by an
attacker: 40 concurrent checks from one key made another team's check p99 10 times its own
alone, the pool serving in arrival order)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from governance.pools import FairPool


def test_another_callers_job_waits_for_one_job_of_the_busy_caller_not_all() -> None:
    done: list[str] = []
    release = threading.Event()
    with ThreadPoolExecutor(max_workers=1) as executor:
        fair = FairPool(executor, size=1)

        def job(name: str) -> str:
            if name == "a0":
                release.wait(10)  # the one at work when the others arrive
            done.append(name)
            return name

        futures = [fair.submit("key-a", lambda n=f"a{i}": job(n)) for i in range(10)]
        futures.append(fair.submit("key-b", lambda: job("b0")))
        futures.append(fair.submit("key-c", lambda: job("c0")))
        release.set()
        assert [f.result(timeout=10) for f in futures][-2:] == ["b0", "c0"]
    # key-a's first (at work), then each waiting caller in turn: b and c after one more of a.
    assert done[:4] == ["a0", "a1", "b0", "c0"]
    assert sorted(done) == sorted([f"a{i}" for i in range(10)] + ["b0", "c0"])


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
