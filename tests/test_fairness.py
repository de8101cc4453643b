"""No tenant slows another (SPEC 10, third round; issue 24's fairness test).

On the production stack as the README runs it (`manage.py serve` with 2 workers, the
Makefile's Celery pools), other teams do all at once what hurt their neighbours before: 500
approval long polls, agents checking under 50 rate-limit rules, imports of a YAML alias bomb
by a viewer, and as many backtests as a team may run. Meanwhile team bravo's valid checks are
each answered within SPEC 10's 2 s and their p99 stays within 2x of the p99 measured just
before without the others (with a floor of 1 s: a fraction of a second of scheduling noise on
a shared 2-core machine is not a tenant's doing), and bravo's kill switch fans out within 1 s.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import httpx
import pytest
from django.conf import settings

from backtests.models import Backtest
from backtests.services import backtest_start
from bench import attacks
from bench.backtest import generate
from bench.scenarios import neighbour_state
from policies.models import Policy, Team
from policies.services import agent_key_create, membership_set, team_ensure
from runs.killswitch.services import killswitch_engage
from runs.models import KillSwitch, Run
from tests.conftest import Server, server_env, start_server
from tests.test_availability import port_of, sign_in
from tests.workers import Receiver, Worker, new_worker, wait_for, workers_fixture  # noqa: F401

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.slow,
              pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("attack_turn")]

DEADLINE_S = 2.0
FAN_OUT_S = 1.0
P99_FLOOR_S = 1.0
CHECKS = 60
BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
    f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
    f"*{chr(97 + i)}]\n" for i in range(8))


@pytest.fixture(scope="module")
def served(attack_turn: None, django_db_setup: Any, django_db_blocker: Any) -> Any:
    srv = start_server(workers=2, env=server_env())
    yield srv
    srv.stop()


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def bravo_checks(server: Server, token: str, n: int) -> list[float]:
    """`n` valid checks of team bravo, four per run (allow x3, then the loop stop), each on a
    kept-alive connection; every answer right and within the deadline. Their latencies."""
    took: list[float] = []
    with httpx.Client(base_url=server.url, timeout=DEADLINE_S,
                      headers={"Authorization": f"Bearer {token}"}) as http:
        while len(took) < n:
            run = http.post("/api/v1/runs", json={"agent": "bravo-bot"})
            assert run.status_code == 201, run.text
            for i in range(4):
                started = time.monotonic()
                answer = http.post(f"/api/v1/runs/{run.json()['run_id']}/check",
                                   json={"action": {"name": "search.docs", "args": {"q": 1}}})
                took.append(time.monotonic() - started)
                assert answer.status_code == 200, answer.text
                assert answer.json()["decision"] == ("allow" if i < 3 else "stop")
                assert took[-1] < DEADLINE_S, f"a check of bravo took {took[-1]:.2f} s"
    return took


def import_bombs(server: Server, cookie: str, stop: threading.Event, seen: list[int]) -> None:
    """A viewer of another team posting the alias bomb to its import page's backtest, again
    and again (each refused at once: the parse is bounded before any walk)."""
    with httpx.Client(base_url=server.url, timeout=30) as browser:
        browser.cookies.set("sessionid", cookie)
        page = browser.get("/teams/alpha/policies-import")
        token = page.text.split('name="csrfmiddlewaretoken" value="')[1].split('"')[0]
        while not stop.is_set() and len(seen) < 40:
            answer = browser.post("/teams/alpha/policies-import/backtest",
                                  data={"document": BOMB, "csrfmiddlewaretoken": token},
                                  headers={"Referer": server.url + "/"})
            seen.append(answer.status_code)


def test_other_teams_cannot_slow_bravos_checks_or_delay_its_kill_switch(
        served: Server, workers: list[Worker], users: Any) -> None:
    alpha = team_ensure(slug="alpha")[0]
    bravo = team_ensure(slug="bravo")[0]
    membership_set(team=alpha, user=users["viewer"], role="viewer", actor=None)
    generate(alpha, runs=300)
    bravo_token = agent_key_create(team=bravo, name="bravo-key").token
    receiver = Receiver(secrets={bravo.slug: bravo.webhook_secret}).start()
    Team.objects.filter(pk=bravo.pk).update(webhook_url=f"{receiver.url}/{bravo.slug}")
    new_worker(workers, visibility_timeout=120, concurrency=2)

    bravo_checks(served, bravo_token, 12)  # warm: connections, prepared statements
    alone = bravo_checks(served, bravo_token, CHECKS)

    # The others: long polls and a heavy rate-limit policy (bench/attacks.py, each from a
    # process of its own), alias bombs on an import page, and backtests.
    target = attacks.Target(port=port_of(served))
    polls = attacks.Target(port=target.port, **neighbour_state(served, "long_polls"))
    heavy = attacks.Target(port=target.port, **neighbour_state(served, "heavy_rate_limits"))
    document = Policy.objects.select_related("current").get(
        team=alpha, name="default").current.document
    jobs = [backtest_start(team=alpha, user=None, source="editor",
                           drafts=[{"policy": "default", "document": document}] * 8,
                           since=timedelta(days=30), limit=300).pk
            for _ in range(settings.BACKTEST_MAX_PER_TEAM)]
    stop, bombs = threading.Event(), []
    bomber = threading.Thread(target=import_bombs, daemon=True, args=(
        served, sign_in(served, "viewer", "pw-viewer-123"), stop, bombs))
    try:
        with attacks.running(attacks.long_polls, polls, settle=2.0) as poll_stats, \
                attacks.running(attacks.heavy_rate_limits, heavy, settle=1.0) as heavy_stats:
            bomber.start()
            crowded = bravo_checks(served, bravo_token, CHECKS)
            # Started by now, still running or already through: the backtests competed for
            # the machine during the crowded checks (a run on a loaded machine found none
            # "running" at this moment).
            busy_backtests = Backtest.objects.filter(
                pk__in=jobs, status__in=["running", "done"]).count()
            switch = killswitch_engage(scope="team", team=bravo, reason="fairness",
                                       actor_label="test")
            returned = time.monotonic()
            bravo_runs = list(Run.objects.filter(team=bravo, status="running")
                              .values_list("pk", flat=True))

            def fanned_out() -> bool:
                return (receiver.valid[bravo.slug] >= 1
                        and not Run.objects.filter(pk__in=bravo_runs, status="running").exists()
                        and KillSwitch.objects.get(pk=switch.pk).fanout_done_at is not None)

            wait_for(fanned_out, timeout=60, interval=0.02, what="bravo's fan-out")
            fan_out = time.monotonic() - returned
    finally:
        stop.set()
        bomber.join(30)
        for worker in workers:
            worker.kill()  # the backtests need not finish
        receiver.stop()

    print(f"bravo p99 alone {p99(alone) * 1000:.0f} ms, with the others "
          f"{p99(crowded) * 1000:.0f} ms; fan-out {fan_out:.2f} s; polls open "
          f"{poll_stats.most_open}, heavy answers {sum(heavy_stats.answers.values())}, "
          f"bombs {len(bombs)}, backtests started {busy_backtests}")
    # The others really ran meanwhile, or the test proved nothing.
    assert poll_stats.most_open >= attacks.LONG_POLLS * 0.9, poll_stats
    assert sum(heavy_stats.answers.values()) >= 20, heavy_stats
    assert bombs and set(bombs) <= {422}, bombs
    assert busy_backtests >= 1
    assert p99(crowded) <= max(2 * p99(alone), P99_FLOOR_S), (p99(alone), p99(crowded))
    assert fan_out < FAN_OUT_S, f"bravo's fan-out took {fan_out:.2f} s"
