"""A caller whose checks are heavy (each more than a few ms of CPU: 60 KiB of small JSON
values to walk) holds one of the API pool's threads at a time and waits, on the event loop,
until what its last checks took is paid back at `WEB_HEAVY_CHECKS_SHARE` of the process's time
(governance/pools.py `FairPool.heavy`, governance/asgi.py `check_in_share`). Found by an
attacker: one team's such checks made another team's check p99 7 to 40x its own (SPEC 10),
though the pool left that team a thread. A light caller is never paced."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from django.conf import settings

from governance import asgi, pools


def burn(seconds: float) -> str:
    """CPU, not a wait: what the pool measures is the thread's CPU time."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass
    return "done"


def test_a_caller_whose_jobs_are_heavy_holds_one_thread() -> None:
    fair = pools.FairPool(ThreadPoolExecutor(4), 4)
    assert fair.share_of("heavy") == 3
    assert fair.submit("heavy", lambda: burn(0.02)).result() == "done"
    assert fair.submit("light", lambda: "done").result() == "done"
    assert fair.heavy("heavy") and fair.share_of("heavy") == 1
    assert not fair.heavy("light") and fair.share_of("light") == 3
    # Light again once its jobs are: the average follows the recent ones.
    for _ in range(20):
        fair.submit("heavy", lambda: "done").result()
    assert not fair.heavy("heavy")


def test_a_heavy_callers_checks_are_paced_and_a_light_ones_are_not() -> None:
    app = asgi.Application()

    async def run(caller: str, job, times: int) -> float:
        started = time.monotonic()
        for _ in range(times):
            assert await app.check_in_share("api", caller, job) == "done"
        return time.monotonic() - started

    cost = 0.02
    heavy = asyncio.run(run("team:heavy-test", lambda: burn(cost), 6))
    # The first check makes the caller heavy; from the second on, each owes what the last
    # took, paid back at HEAVY_CHECKS_SHARE (0.1: its own run refilling a tenth of it): the
    # six take about 1 s, at least 0.6 s, where unpaced they take 0.12 s.
    assert heavy >= 3 * cost / settings.HEAVY_CHECKS_SHARE, heavy
    assert pools.fair("api").heavy("team:heavy-test")
    asyncio.run(run("team:light-test", lambda: "done", 6))
    assert not pools.fair("api").heavy("team:light-test")
    assert "heavy-checks:team:light-test" not in app.shares
