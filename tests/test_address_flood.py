"""SPEC 10: a flood of cheap requests from one address (bad keys, health probes) does not slow
another team's checks (docs/serving.md, "Cheap answers are paced per client address").

Against the real server (`manage.py serve`, 2 workers), loopback only, bounded in time: one
client at FLOOD_SOURCE sends on a few kept-alive connections its next request as soon as the
last was answered (bench/attacks.py), while another team's two agents check one step every
20 ms each from another address. Before the pacing, random bad keys at about 600 a second
raised that team's check p99 from 12-28 ms to 118-557 ms and its slowest check to 3.5 s;
health probes at 2,700 a second, p99 536 ms.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from bench import attacks
from policies.services import agent_key_create
from tests.conftest import Server, server_env, set_policy, start_server

# One suite's attacks at a time on this machine (tests/conftest.py `attack_turn`).
pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True),
              pytest.mark.usefixtures("attack_turn")]

DEADLINE_S = 2.0
QUIET_S = 2.5
FLOOD_S = 5.0
AGENTS = 2
EVERY_S = 0.02


@pytest.fixture(scope="module")
def flooded(attack_turn: None, django_db_setup: Any, django_db_blocker: Any
            ) -> Iterator[Server]:
    # The failed-key throttle as in production (the suites' servers raise it), and the pace.
    srv = start_server(workers=2, env=server_env(THROTTLE_API_KEY_FAILURES="30",
                                                 WEB_CHEAP_ANSWERS_PER_ADDRESS="20"))
    yield srv
    srv.stop()


def check_steadily(url: str, token: str, run_id: str, seconds: float) -> list[float]:
    """One agent checking its run every EVERY_S on a kept-alive connection; how long each
    check took. Every answer must be right and come within the deadline."""
    took: list[float] = []
    deadline = time.monotonic() + seconds
    with httpx.Client(base_url=url, timeout=DEADLINE_S,
                      headers={"Authorization": f"Bearer {token}"}) as http:
        step = 0
        while time.monotonic() < deadline:
            step += 1
            started = time.monotonic()
            try:
                answer = http.post(f"/api/v1/runs/{run_id}/check",
                                   json={"action": {"name": "search.docs", "args": {"n": step}}})
            except httpx.TimeoutException as exc:
                raise AssertionError(f"a valid check had no answer within {DEADLINE_S} s"
                                     ) from exc
            took.append(time.monotonic() - started)
            assert answer.status_code == 200, answer.text
            assert answer.json()["decision"] == "allow", answer.text
            time.sleep(EVERY_S)
    return took


def checks_of(url: str, token: str, run_ids: list[str], seconds: float) -> list[float]:
    """AGENTS agents checking at once (`check_steadily`); every check's time."""
    results: list[list[float]] = [[] for _ in run_ids]
    failures: list[BaseException] = []

    def agent(i: int) -> None:
        try:
            results[i] = check_steadily(url, token, run_ids[i], seconds)
        except BaseException as exc:  # raised in the test's thread below
            failures.append(exc)

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(len(run_ids))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 30)
    if failures:
        raise failures[0]
    return [t for result in results for t in result]


def p99(times: list[float]) -> float:
    return statistics.quantiles(times, n=100)[98]


@pytest.mark.parametrize("flood", [attacks.bad_key_flood, attacks.probe_flood])
def test_a_flood_of_cheap_requests_from_one_address_does_not_slow_another_teams_checks(
        flooded, team, other_team, flood):
    set_policy(other_team, step_limits={"max_steps": 10_000, "max_repeat_action": 1000,
                                        "no_progress_window": 1000},
               budgets={"max_seconds": None, "max_usd": None})
    token = agent_key_create(team=other_team, name="steady").token
    with httpx.Client(base_url=flooded.url, timeout=10,
                      headers={"Authorization": f"Bearer {token}"}) as http:
        run_ids = [http.post("/api/v1/runs", json={"agent": f"steady-{i}"}).json()["run_id"]
                   for i in range(AGENTS)]
    before = checks_of(flooded.url, token, run_ids, QUIET_S)
    target = attacks.Target(port=int(flooded.url.rsplit(":", 1)[1]))
    with attacks.running(flood, target) as stats:
        loud = checks_of(flooded.url, token, run_ids, FLOOD_S)
    after = checks_of(flooded.url, token, run_ids, QUIET_S)
    # The quieter of the slices before and after: one hiccup of this shared machine in a
    # quiet slice made its p99 5x, and the flood's p99 passed for that.
    quiet = min(before, after, key=p99)
    sent = sum(stats.answers.values())
    figures = {"quiet_p99_ms": round(p99(quiet) * 1000, 1),
               "flood_p99_ms": round(p99(loud) * 1000, 1),
               "flood_slowest_ms": round(max(loud) * 1000, 1), "checks": len(loud),
               "answers": dict(stats.answers)}
    print(figures)  # shown with -s: the figures docs/serving.md quotes
    # The flood really ran, and the checks went on meanwhile.
    assert sent >= 50, stats.dump()
    assert len(loud) >= FLOOD_S / EVERY_S / 4
    # Its answers were paced: about WEB_CHEAP_ANSWERS_PER_ADDRESS (20) a second from each of
    # the 2 processes, after a burst of 40 each, over the attack's second of settling and the
    # slice (unpaced: 2,500 to 3,300 here).
    assert sent <= 2 * (20 * (1 + FLOOD_S + 1) + 40), stats.dump()
    # SPEC 10 asks for 2x of the p99 without it, measured by the benchmark; here, on a shared
    # machine, a generous bound, which the unpaced bad keys broke on SQLite (p99 5 to 20x),
    # not always on PostgreSQL (3 to 4x, under the floor).
    assert p99(loud) < max(3 * p99(quiet), 0.1), figures
