"""SPEC 14: runs with no activity for budgets.max_idle_seconds end stopped / abandoned, by the
sweep, on read, on a check or a finish after the deadline, also in shadow mode; a check that
takes the run's lock first wins against the sweep. Deadlines are moved into the past in the
database rather than waited for."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import httpx
import pytest
from django.db import connection, transaction
from django.utils import timezone

from runs.check import abandon
from runs.check.abandon import abandon_idle_runs, sweep_idle_runs
from runs.check.tasks import idle_sweep_task
from runs.models import Decision, Run
from tests.conftest import Agent, set_policy
from tests.test_bounded_looks import overdue_runs

# Plain django_db tests of these run on both check stores (tests/conftest.py).
pytestmark = pytest.mark.both_stores


def start(api: Any, **body: Any) -> str:
    response = api.post("/api/v1/runs", {"agent": "bot", **body},
                        content_type="application/json")
    assert response.status_code == 201, response.content
    return response.json()["run_id"]


def check(api: Any, rid: str, name: str = "search.docs", **body: Any) -> dict[str, Any]:
    response = api.post(f"/api/v1/runs/{rid}/check", {"action": {"name": name}, **body},
                        content_type="application/json")
    assert response.status_code == 200, response.content
    return response.json()


def overdue(rid: str, seconds: float = 1) -> Any:
    """Put the run's deadline in the past; returns the deadline."""
    deadline = timezone.now() - timedelta(seconds=seconds)
    Run.objects.filter(pk=rid).update(idle_deadline=deadline)
    return deadline


def assert_abandoned(rid: str, deadline: Any, steps: int) -> None:
    run = Run.objects.get(pk=rid)
    assert (run.status, run.stop_reason, run.ended_at, run.steps) == (
        "stopped", "abandoned", deadline, steps)
    records = list(Decision.objects.filter(run_id=rid, reason="abandoned", action_name=""))
    assert len(records) == 1
    assert (records[0].outcome, records[0].step) == ("stop", steps)
    assert "max_idle_seconds=" in records[0].answer["message"]


@pytest.mark.django_db
def test_start_and_checks_set_the_deadline_from_max_idle_seconds(api: Any, team: Any) -> None:
    set_policy(team, budgets={"max_idle_seconds": 120, "max_seconds": 600})
    before = timezone.now()
    rid = start(api)
    run = Run.objects.get(pk=rid)
    assert run.idle_deadline == run.started_at + timedelta(seconds=120)
    check(api, rid)
    moved = Run.objects.get(pk=rid).idle_deadline
    assert moved is not None and moved >= before + timedelta(seconds=120)


@pytest.mark.django_db
def test_null_max_idle_seconds_never_abandons(api: Any, team: Any) -> None:
    # Without a time budget either: else the run's deadline is its budget's (issue 26).
    set_policy(team, budgets={"max_idle_seconds": None, "max_seconds": None})
    rid = start(api)
    assert Run.objects.get(pk=rid).idle_deadline is None
    assert abandon_idle_runs(now=timezone.now() + timedelta(days=365)) == []


@pytest.mark.django_db
def test_the_sweep_ends_overdue_runs_only(api: Any, team: Any) -> None:
    idle, busy = start(api), start(api)
    check(api, idle)
    deadline = overdue(idle)
    assert idle_sweep_task()["abandoned"] == 1
    assert_abandoned(idle, deadline, steps=1)
    assert Run.objects.get(pk=busy).status == "running"
    assert abandon_idle_runs() == []  # idempotent


@pytest.mark.django_db
def test_a_sweep_pass_ends_batch_after_batch_while_its_time_lasts(team: Any,
                                                                   monkeypatch: Any) -> None:
    """A backlog bigger than a batch drains in one pass (every minute), not one batch a
    minute; a pass whose time is spent stops after its batch, the rest for the next."""
    monkeypatch.setattr(abandon, "SWEEP_BATCH", 50)
    overdue_runs(team, 130)
    assert idle_sweep_task()["abandoned"] == 130
    assert not Run.objects.filter(status="running").exists()
    overdue_runs(team, 130)
    assert len(sweep_idle_runs(seconds=0)) == 50
    assert len(sweep_idle_runs()) == 80


@pytest.mark.django_db
def test_a_run_read_after_its_deadline_is_abandoned(api: Any, team: Any) -> None:
    rid = start(api)
    deadline = overdue(rid)
    body = api.get(f"/api/v1/runs/{rid}").json()
    assert (body["status"], body["stop_reason"]) == ("stopped", "abandoned")
    assert_abandoned(rid, deadline, steps=0)


@pytest.mark.django_db
def test_listing_runs_ends_the_overdue_ones(api: Any, team: Any) -> None:
    rid = start(api)
    overdue(rid)
    listed = api.get("/api/v1/runs?status=running").json()["runs"]
    assert listed == []
    assert Run.objects.get(pk=rid).stop_reason == "abandoned"


@pytest.mark.django_db
@pytest.mark.parametrize("mode", ["enforce", "shadow"])
def test_a_check_after_the_deadline_answers_stop_abandoned(api: Any, team: Any,
                                                          mode: str) -> None:
    set_policy(team, mode=mode)
    rid = start(api)
    check(api, rid)
    deadline = overdue(rid)
    answer = check(api, rid, check_id="late")
    assert (answer["decision"], answer["reason"], answer["step"]) == ("stop", "abandoned", 1)
    assert_abandoned(rid, deadline, steps=1)
    # The check itself is audited too, with its action, after the abandonment.
    last = Decision.objects.filter(run_id=rid).order_by("id").last()
    assert last is not None and (last.pk, last.action_name) == (answer["decision_id"],
                                                                "search.docs")


@pytest.mark.django_db
def test_the_check_that_finds_the_run_abandoned_names_the_limit(api: Any, team: Any) -> None:
    # SPEC 4.4 and 16: every stop names the limit and its value. The check that ends the run
    # answered "The run is already stopped (reason: abandoned)." with the rule
    # {"status": "running"}, while every later check named max_idle_seconds.
    set_policy(team, budgets={"max_idle_seconds": 120, "max_seconds": 600})
    rid = start(api)
    check(api, rid)
    overdue(rid)
    first = check(api, rid, "other.tool")
    later = check(api, rid, "third.tool")
    assert "max_idle_seconds=120" in first["message"]
    assert first["rule"]["name"] == "abandoned"
    assert first["rule"]["limit"] == {"max_idle_seconds": 120}
    assert (first["message"], first["rule"]) == (later["message"], later["rule"])


@pytest.mark.django_db
def test_a_finish_after_the_deadline_finds_the_run_abandoned(api: Any, team: Any) -> None:
    rid = start(api)
    deadline = overdue(rid)
    response = api.post(f"/api/v1/runs/{rid}/finish",
                        {"status": "completed", "output": "partial"},
                        content_type="application/json")
    assert response.status_code == 200
    body = response.json()
    assert (body["status"], body["stop_reason"], body["output"]) == (
        "stopped", "abandoned", "partial")
    assert_abandoned(rid, deadline, steps=0)


@pytest.mark.django_db
def test_a_rate_limit_wait_is_activity(api: Any, team: Any) -> None:
    # A time budget the 60 s wait fits in, and that ends after the idle deadline: a wait
    # longer than the time left is a stop (issue 26).
    set_policy(team, rate_limits=[{"match": "*", "per": "run", "max": 1, "window_s": 60}],
               budgets={"max_seconds": 7200})
    rid = start(api)
    check(api, rid)
    overdue(rid, seconds=-5)  # due in 5 s
    assert check(api, rid, name="x")["decision"] == "wait"
    deadline = Run.objects.get(pk=rid).idle_deadline
    assert deadline is not None and deadline > timezone.now() + timedelta(seconds=3000)


@pytest.mark.django_db
def test_the_dashboard_shows_an_abandoned_run(client: Any, api: Any, team: Any,
                                              users: dict[str, Any]) -> None:
    rid = start(api)
    overdue(rid)
    client.force_login(users["viewer"])
    page = client.get(f"/teams/{team.slug}/runs/{rid}/")
    assert page.status_code == 200
    text = page.content.decode()
    assert "abandoned" in text
    assert "max_idle_seconds=" in text


@pytest.mark.django_db
def test_the_migration_gives_older_versions_no_idle_limit_and_no_rate_limits() -> None:
    import importlib

    from django.apps import apps

    from policies.models import Policy, PolicyVersion, Team

    fill = importlib.import_module("policies.migrations.0004_idle_and_rate_limits").fill
    team = Team.objects.create(slug="old", name="old")
    policy = Policy.objects.create(team=team, name="default")
    old = {"name": "default", "budgets": {"max_seconds": 45, "max_usd": 1.0,
                                          "max_tool_calls": None}}
    version = PolicyVersion.objects.create(policy=policy, version=1, document=old)
    fill(apps, None)
    document = PolicyVersion.objects.get(pk=version.pk).document
    assert document["budgets"]["max_idle_seconds"] is None
    assert document["rate_limits"] == []


# --- Real concurrency on PostgreSQL -----------------------------------------------------------

@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_check_holding_the_lock_first_wins_against_the_sweep(agent: Agent, team: Any) -> None:
    """The sweep reads the run as overdue, then waits for the run's lock, held by a check
    that moves the deadline: once it gets the lock it tests again and leaves the run be."""
    rid = agent.start()["run_id"]
    overdue(rid)
    locked, release = threading.Event(), threading.Event()

    def check_holding_the_lock() -> None:
        with transaction.atomic():
            Run.objects.select_for_update().filter(pk=rid).first()
            locked.set()
            release.wait(10)
            Run.objects.filter(pk=rid).update(
                idle_deadline=timezone.now() + timedelta(hours=1))
        connection.close()

    def sweep() -> list[str]:
        try:
            return abandon_idle_runs()
        finally:
            connection.close()

    with ThreadPoolExecutor(2) as pool:
        holder = pool.submit(check_holding_the_lock)
        assert locked.wait(10)
        swept = pool.submit(sweep)
        # The sweep is blocked on the lock: its candidate read saw the run overdue.
        with connection.cursor() as cursor:
            for _ in range(100):
                cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = "
                               "current_database() AND wait_event_type = 'Lock'")
                if cursor.fetchone()[0]:
                    break
                threading.Event().wait(0.05)
        release.set()
        holder.result()
        assert swept.result() == []
    assert Run.objects.get(pk=rid).status == "running"
    assert not Decision.objects.filter(run_id=rid, reason="abandoned").exists()


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_checks_racing_the_sweep_abandon_each_run_once(server: Any, agent: Agent,
                                                       team: Any) -> None:
    runs = [agent.start()["run_id"] for _ in range(8)]
    for rid in runs:
        agent.check(rid)
    deadlines = {rid: overdue(rid) for rid in runs}
    barrier = threading.Barrier(len(runs) * 3 + 2)

    def one_check(rid: str) -> dict[str, Any]:
        with httpx.Client(base_url=server.url, timeout=60,
                          headers={"Authorization": f"Bearer {agent.token}"}) as http:
            barrier.wait()
            return http.post(f"/api/v1/runs/{rid}/check",
                             json={"action": {"name": "x"}}).json()

    def one_sweep() -> list[str]:
        try:
            barrier.wait()
            return abandon_idle_runs()
        finally:
            connection.close()

    with ThreadPoolExecutor(len(runs) * 3 + 2) as pool:
        sweeps = [pool.submit(one_sweep) for _ in range(2)]
        answers = [pool.submit(one_check, rid) for rid in runs for _ in range(3)]
        results = [a.result() for a in answers]
        swept = [rid for s in sweeps for rid in s.result()]
    assert all((a["decision"], a["reason"]) == ("stop", "abandoned") for a in results)
    assert len(swept) == len(set(swept))
    for rid in runs:
        assert_abandoned(rid, deadlines[rid], steps=1)


@pytest.mark.django_db
def test_a_run_tells_its_agent_how_long_it_may_stay_silent(api: Any, team: Any) -> None:
    # SPEC 3 and 14: max_idle_seconds is one of the policy's budgets, and the run's policy in
    # the start and the run's answers shows them all (the answer's schema left it out).
    set_policy(team, budgets={"max_idle_seconds": 2})
    response = api.post("/api/v1/runs", {"agent": "bot"}, content_type="application/json")
    budgets = response.json()["policy"]["budgets"]
    assert budgets == {"max_seconds": 45.0, "max_usd": 1.0, "max_tool_calls": None,
                       "max_idle_seconds": 2}
    rid = response.json()["run_id"]
    assert api.get(f"/api/v1/runs/{rid}").json()["policy"]["budgets"]["max_idle_seconds"] == 2
    set_policy(team, budgets={"max_idle_seconds": None})
    assert api.post("/api/v1/runs", {"agent": "bot"}, content_type="application/json"
                    ).json()["policy"]["budgets"]["max_idle_seconds"] is None
