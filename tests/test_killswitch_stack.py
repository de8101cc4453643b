"""The kill switch on the production stack: the multi-process server, and, with REDIS_URL, a
real Celery worker (tests/workers.py) that does the fan-out. SPEC 4.5 and 6.

Without Redis the first test still runs (the fan-out then happens at the engage's commit,
in this process); the worker tests need Redis.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from policies.models import Team
from policies.services import agent_key_create, team_ensure
from runs.check.lifecycle import run_start
from runs.killswitch.services import killswitch_engage
from runs.models import Decision, KillSwitch, Run, WebhookDelivery
from runs.webhooks import delivery as webhooks
from tests.conftest import HAS_REDIS, set_policy
from tests.workers import Receiver, Worker, wait_for, workers_fixture  # noqa: F401 (fixture)
from tests.workers import new_worker as start_worker_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

VISIBILITY_S = 5  # the worker's broker visibility timeout: how soon a lost task comes back

UNLIMITED = {
    "step_limits": {"max_steps": 10000, "max_repeat_action": 1000, "no_progress_window": 1000},
    "budgets": {"max_seconds": None, "max_usd": None, "max_tool_calls": None},
}


def new_worker(workers: list[Worker]) -> Worker:
    return start_worker_for(workers, visibility_timeout=VISIBILITY_S)


def fanout_rows(run_id: Any) -> int:
    """Audit records written by the fan-out (a check's kill carries its action)."""
    return Decision.objects.filter(run_id=run_id, outcome="stop", reason="killed",
                                   action_name="").count()


@dataclass
class Call:
    started: float
    ended: float
    decision: str
    reason: str


def hammer(url: str, token: str, run_id: str, calls: list[Call], done: threading.Event) -> None:
    with httpx.Client(base_url=url, timeout=30,
                      headers={"Authorization": f"Bearer {token}"}) as http:
        n = 0
        while not done.is_set():
            n += 1
            started = time.monotonic()
            response = http.post(f"/api/v1/runs/{run_id}/check",
                                 json={"action": {"name": "fetch.page", "args": {"n": n}}})
            ended = time.monotonic()
            assert response.status_code == 200, response.text
            body = response.json()
            calls.append(Call(started, ended, body["decision"], body["reason"]))


def test_no_check_that_started_after_the_engage_returned_is_allowed(server, team, workers):
    """12 agents hammer the check API of a 2-process server from 12 threads; the team switch
    is engaged from this process. Every check that started after the engage call returned
    answers stop / killed, and every covered run ends killed."""
    if HAS_REDIS:
        new_worker(workers)
    set_policy(team, **UNLIMITED)
    agents = []
    for i in range(12):
        token = agent_key_create(team=team, name=f"agent-{i}").token
        response = httpx.post(f"{server.url}/api/v1/runs", json={"agent": f"bot-{i}"},
                              headers={"Authorization": f"Bearer {token}"}, timeout=30)
        assert response.status_code == 201, response.text
        agents.append((token, response.json()["run_id"]))
    idle_key = agent_key_create(team=team, name="idle").key
    idle = [run_start(key=idle_key, agent="idle-bot", policy=None, task=None, metadata=None,
                      external_id=None)[0].pk for _ in range(4)]

    calls: list[list[Call]] = [[] for _ in agents]
    done = threading.Event()
    threads = [threading.Thread(target=hammer, args=(server.url, token, run_id, calls[i], done))
               for i, (token, run_id) in enumerate(agents)]
    for thread in threads:
        thread.start()
    wait_for(lambda: all(len(c) >= 3 for c in calls), timeout=30, what="every agent checking")
    killswitch_engage(scope="team", team=team, reason="hammer test", actor_label="test")
    returned = time.monotonic()
    time.sleep(1.5)
    done.set()
    for thread in threads:
        thread.join(timeout=60)

    everything = [c for per_agent in calls for c in per_agent]
    after = [c for c in everything if c.started >= returned]
    assert len(after) >= 12, "every agent should have checked after the engage"
    leaks = [c for c in after if (c.decision, c.reason) != ("stop", "killed")]
    assert leaks == [], f"{len(leaks)} checks started after the engage were not killed"
    assert sum(c.decision == "allow" for c in everything) > 12  # they did run before
    # Each agent saw allows, then only stops: a killed run never allows again.
    for per_agent in calls:
        outcomes = [c.decision for c in per_agent]
        first_stop = outcomes.index("stop")
        assert set(outcomes[first_stop:]) == {"stop"}

    all_runs = [run_id for _, run_id in agents] + idle
    wait_for(lambda: Run.objects.filter(pk__in=all_runs, status="killed").count()
             == len(all_runs), timeout=30, what="the fan-out to kill every run")
    assert Run.objects.filter(pk__in=all_runs).exclude(stop_reason="killed").count() == 0
    assert all(fanout_rows(run_id) == 1 for run_id in idle)
    switch = KillSwitch.objects.get(active=True)
    wait_for(lambda: KillSwitch.objects.get(pk=switch.pk).fanout_done_at, timeout=10)


@pytest.mark.redis
def test_with_no_worker_the_kill_still_stops_checks_and_a_late_worker_fans_out(
        server, agent, team, workers):
    runs = [agent.start()["run_id"] for _ in range(6)]
    checked, idle = runs[:3], runs[3:]
    switch = killswitch_engage(scope="team", team=team, reason="no worker yet",
                               actor_label="test")
    for run_id in checked:
        answer = agent.check(run_id, args={"q": run_id})
        assert (answer["decision"], answer["reason"]) == ("stop", "killed")
    response = agent.http.post("/api/v1/runs", json={"agent": "support-bot"})
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "kill_switch_engaged"
    time.sleep(0.5)
    # Nothing has fanned out: the idle runs are still running, the switch's fan-out pending.
    assert set(Run.objects.filter(pk__in=idle).values_list("status", flat=True)) == {"running"}
    assert KillSwitch.objects.get(pk=switch.pk).fanout_done_at is None

    new_worker(workers)
    wait_for(lambda: KillSwitch.objects.get(pk=switch.pk).fanout_done_at, timeout=30,
             what="the fan-out")
    assert set(Run.objects.filter(pk__in=runs).values_list("status", flat=True)) == {"killed"}
    assert [fanout_rows(r) for r in idle] == [1, 1, 1]
    assert [fanout_rows(r) for r in checked] == [0, 0, 0]  # their checks killed them first
    for run_id in runs:
        answer = agent.check(run_id, args={"again": True})
        assert (answer["decision"], answer["reason"]) == ("stop", "killed")


@pytest.mark.redis
def test_a_worker_killed_mid_fanout_is_replaced_and_nothing_is_lost_or_doubled(
        workers):
    """SIGKILL the worker while it kills runs, and again while it waits on a slow webhook
    receiver. After each restart the broker delivers the lost task again: every run ends
    killed with exactly one audit record, every team is notified with a valid signature."""
    teams = [team_ensure(slug=slug)[0] for slug in ("alpha", "bravo", "charlie")]
    receiver = Receiver(secrets={t.slug: t.webhook_secret for t in teams}, delay=2.0).start()
    try:
        for t in teams:
            Team.objects.filter(pk=t.pk).update(webhook_url=f"{receiver.url}/{t.slug}")
        per_team = 40
        runs = []
        for t in teams:
            key = agent_key_create(team=t, name="k").key
            runs += [run_start(key=key, agent="bot", policy=None, task=None, metadata=None,
                               external_id=None)[0].pk for _ in range(per_team)]
        total = len(runs)

        worker = new_worker(workers)
        switch = killswitch_engage(scope="global", reason="sigkill test", actor_label="root")

        # 1. Kill the worker in the middle of marking runs killed.
        def some_killed() -> bool:
            return Run.objects.filter(status="killed").count() > 0

        wait_for(some_killed, timeout=30, interval=0.005, what="the fan-out to start")
        worker.kill()
        lost_at = time.monotonic()
        killed_before = Run.objects.filter(status="killed").count()
        # Redis gives an unacked task back once it is older than the visibility timeout.
        time.sleep(max(0.0, lost_at + VISIBILITY_S + 1 - time.monotonic()))

        # 2. Restart; kill it again while it waits on the slow receiver.
        worker = new_worker(workers)
        assert receiver.first_request.wait(timeout=60), "no webhook delivery started"
        worker.kill()
        lost_at = time.monotonic()
        assert Run.objects.filter(status="killed").count() == total
        time.sleep(max(0.0, lost_at + VISIBILITY_S + 1 - time.monotonic()))

        # 3. Restart: everything finishes.
        new_worker(workers)
        wait_for(lambda: WebhookDelivery.objects.filter(status="delivered").count()
                 == len(teams), timeout=90, interval=0.5, what="every webhook delivered")
    finally:
        receiver.stop()

    print(f"killed before the first SIGKILL: {killed_before}/{total}")
    assert set(Run.objects.values_list("status", "stop_reason")) == {("killed", "killed")}
    assert [fanout_rows(run_id) for run_id in runs] == [1] * total
    assert Decision.objects.filter(reason="killed").count() == total
    assert all(receiver.valid[t.slug] >= 1 for t in teams)
    assert not receiver.invalid
    for body in receiver.bodies:
        assert body["id"] == switch.pk and body["scope"] == "global"
        assert len(body["killed_runs"]) == per_team
    for delivery in WebhookDelivery.objects.all():
        tries = list(delivery.tries.all())
        assert [t.number for t in tries] == list(range(1, delivery.attempts + 1))
        assert tries[-1].status_code == 200
        assert all(t.error != webhooks.IN_FLIGHT for t in tries)
    # The attempt cut by the second SIGKILL is on record as such, and was made again.
    assert any(t.error == webhooks.INTERRUPTED
               for d in WebhookDelivery.objects.all() for t in d.tries.all())
    assert KillSwitch.objects.get(pk=switch.pk).fanout_done_at is not None
