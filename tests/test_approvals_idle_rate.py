"""How a pending approval (SPEC 11) meets the idle deadline (SPEC 14), the time budget (SPEC
11, 15) and the rate limits (SPEC 12, 15), through the real API on both stacks:

- time pending is not idle: neither the sweep nor a read ends a run that waits for an
  operator, however long it waits; the idle clock starts again at the decision;
- time pending is not active time: it does not count towards max_seconds, the time before and
  after it does;
- a pending answer takes one rate-limit slot when it is answered, and its approval takes none.

Real time is used where the rule is about time passing (the waits are about a second); the
PostgreSQL variant at the end sends simultaneous checks to the multi-process server."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from threading import Barrier
from typing import Any

import httpx
import pytest
from django.test import Client
from django.utils import timezone

from policies.models import Team
from runs.approvals.services import approval_decide
from runs.check.abandon import abandon_idle_runs
from runs.check.tasks import idle_sweep_task
from runs.models import Approval, Decision, RateCount, Run
from tests.conftest import Agent, set_policy

PAY = {"name": "payments.refund", "args": {"order": 42}}


def start(api: Client, agent: str = "support-bot") -> str:
    response = api.post("/api/v1/runs", {"agent": agent}, content_type="application/json")
    assert response.status_code == 201, response.content
    return response.json()["run_id"]


def check(api: Client, run_id: str, action: dict[str, Any] | None = None,
          **body: Any) -> dict[str, Any]:
    response = api.post(f"/api/v1/runs/{run_id}/check",
                        {"action": action or {"name": "search.docs"}, **body},
                        content_type="application/json")
    assert response.status_code == 200, response.content
    return response.json()


def read_run(api: Client, run_id: str) -> dict[str, Any]:
    response = api.get(f"/api/v1/runs/{run_id}")
    assert response.status_code == 200, response.content
    return response.json()


def approve(team: Team, answer: dict[str, Any], user: Any) -> None:
    approval_decide(team=team, approval_id=answer["approval"]["id"], decision="approve",
                    note="", actor=user)


# --- Time pending is not idle (SPEC 14, 15) ---------------------------------------------------

@pytest.mark.django_db
def test_a_run_waiting_for_approval_has_no_idle_deadline_for_the_sweep(api, team):
    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 86_400},
               budgets={"max_idle_seconds": 60})
    waiting, idle = start(api), start(api)
    check(api, waiting)
    assert Run.objects.get(pk=waiting).idle_deadline is not None  # an allow sets it
    answer = check(api, waiting, PAY, check_id="pay-1")
    assert answer["decision"] == "pending"
    assert Run.objects.get(pk=waiting).idle_deadline is None

    # A day later, as far as the sweep can tell: the idle run ends, the waiting one does not.
    ended = abandon_idle_runs(now=timezone.now() + timedelta(hours=23))
    assert ended == [idle]
    assert Run.objects.get(pk=waiting).status == "running"
    # Re-sending the pending check (the client's other way to wait) is no activity that
    # would give the run a deadline while it waits.
    assert check(api, waiting, PAY, check_id="pay-1")["decision"] == "pending"
    assert Run.objects.get(pk=waiting).idle_deadline is None


@pytest.mark.django_db
def test_waiting_longer_than_max_idle_seconds_is_not_abandoned_by_a_sweep_or_a_read(
        api, client, team, users):
    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 600},
               budgets={"max_idle_seconds": 1})
    run_id = start(api)
    answer = check(api, run_id, PAY, check_id="pay-1")
    assert answer["decision"] == "pending"
    time.sleep(1.5)  # longer than max_idle_seconds, pending all along

    assert idle_sweep_task()["abandoned"] == 0
    assert read_run(api, run_id)["status"] == "running"
    listed = api.get("/api/v1/runs?status=running").json()["runs"]
    assert [r["run_id"] for r in listed] == [run_id]
    client.force_login(users["viewer"])
    for page in (f"/teams/{team.slug}/runs/{run_id}/", f"/teams/{team.slug}/runs/",
                 f"/teams/{team.slug}/"):
        assert client.get(page).status_code == 200
    run = Run.objects.get(pk=run_id)
    assert (run.status, run.stop_reason) == ("running", None)
    assert not Decision.objects.filter(run_id=run_id, reason="abandoned").exists()

    # The approval is activity: the idle clock starts again from the decision.
    approve(team, answer, users["operator"])
    decided_at = Approval.objects.get(pk=answer["approval"]["id"]).decided_at
    run = Run.objects.get(pk=run_id)
    assert run.idle_deadline == decided_at + timedelta(seconds=1)
    final = check(api, run_id, PAY, check_id="pay-1")
    assert final["decision"] == "allow"  # the replay of the final answer, not a new check
    # Idle after the decision counts again, from the decision on.
    time.sleep(1.2)
    assert idle_sweep_task()["abandoned"] == 1
    run = Run.objects.get(pk=run_id)
    assert (run.status, run.stop_reason, run.ended_at) == (
        "stopped", "abandoned", decided_at + timedelta(seconds=1))


@pytest.mark.django_db
def test_an_approval_outliving_max_idle_seconds_ends_expired_not_abandoned(api, team):
    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 1},
               budgets={"max_idle_seconds": 0.5})
    run_id = start(api)
    answer = check(api, run_id, PAY, check_id="pay-1")
    time.sleep(1.3)
    assert idle_sweep_task()["abandoned"] == 0
    # Reading the run is a look after the expiry: it settles the expiry (SPEC 11).
    body = read_run(api, run_id)
    assert (body["status"], body["stop_reason"]) == ("stopped", "approval_expired")
    approval = Approval.objects.get(pk=answer["approval"]["id"])
    assert approval.status == "expired"
    run = Run.objects.get(pk=run_id)
    assert run.ended_at == approval.expires_at
    assert not Decision.objects.filter(run_id=run_id, reason="abandoned").exists()


@pytest.mark.django_db
def test_listing_runs_settles_the_expiries_it_would_show_as_running(api, team):
    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 1})
    run_id = start(api)
    check(api, run_id, PAY, check_id="pay-1")
    time.sleep(1.2)
    assert api.get("/api/v1/runs?status=running").json()["runs"] == []
    assert Run.objects.get(pk=run_id).stop_reason == "approval_expired"


# --- Time pending is not active time (SPEC 11, 15) --------------------------------------------

@pytest.mark.django_db
def test_the_clock_stops_while_pending_and_runs_before_and_after(api, team, users):
    budget = 3.0
    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 600},
               budgets={"max_seconds": budget})
    # Upper bounds are the wall time measured here less the time pending, not fixed figures:
    # a loaded CI machine spent over a second on the calls themselves. So the budget is 3 s
    # and the last sleep what is left of it, not fixed figures either.
    began = time.monotonic()
    run_id = start(api)
    time.sleep(0.4)  # active before the wait
    answer = check(api, run_id, PAY, check_id="pay-1")
    before = answer["usage"]["elapsed_s"]
    assert 0.4 <= before <= time.monotonic() - began + 0.01
    time.sleep(budget + 0.1)  # the whole budget, spent waiting
    frozen = read_run(api, run_id)["elapsed_s"]
    assert before <= frozen < before + 0.3  # the clock stood still while pending
    approve(team, answer, users["operator"])
    after = check(api, run_id, check_id="next")
    assert after["decision"] == "allow", after
    assert after["usage"]["elapsed_s"] <= time.monotonic() - began - budget - 0.1 + 0.01
    # Active time after the approval counts again: the budget runs out then.
    time.sleep(budget - after["usage"]["elapsed_s"] + 0.1)
    stop = check(api, run_id, check_id="late")
    assert (stop["decision"], stop["reason"]) == ("stop", "max_seconds")
    run = read_run(api, run_id)
    assert budget <= run["elapsed_s"] <= time.monotonic() - began - budget - 0.1 + 0.01


@pytest.mark.django_db
def test_an_expired_wait_is_not_active_time_up_to_its_expiry(api, team):
    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 1})
    began = time.monotonic()
    run_id = start(api)
    answer = check(api, run_id, PAY, check_id="pay-1")
    time.sleep(1.6)  # settled late: the wait still ends at expires_at
    final = check(api, run_id, PAY, check_id="pay-1")
    assert final["reason"] == "approval_expired"
    run = Run.objects.get(pk=run_id)
    assert run.ended_at == Approval.objects.get(pk=answer["approval"]["id"]).expires_at
    assert run.memory["paused_s"] == pytest.approx(1.0, abs=0.01)
    # Only the start and the first check count: at most the wall time less the 1.6 s slept
    # (the wait and the time after its expiry), however slow the machine.
    assert read_run(api, run_id)["elapsed_s"] <= time.monotonic() - began - 1.6 + 0.01


# --- A pending answer takes one rate-limit slot (SPEC 12, 15) ----------------------------------


def counted(**filters: Any) -> int:
    """How many actions the rate limits counted (one rule per test here)."""
    return sum(RateCount.objects.filter(**filters).values_list("n", flat=True))

@pytest.fixture
def limited(team: Team) -> Team:
    # A time budget the 60 s waits fit in: a wait longer than the time left is a stop
    # (issue 26), and these tests are about the slots.
    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 600},
               rate_limits=[{"match": "payments.*", "per": "agent", "max": 2, "window_s": 60}],
               budgets={"max_seconds": 600})
    return team


@pytest.mark.django_db
def test_a_pending_answer_takes_one_slot_and_its_approval_none(api, limited, users):
    first_run, second_run, third_run = start(api), start(api), start(api)
    first = check(api, first_run, PAY, check_id="a-1")
    assert first["decision"] == "pending"
    assert counted() == 1  # taken when answered pending
    assert check(api, first_run, PAY, check_id="a-1")["decision"] == "pending"  # resumed
    approve(limited, first, users["operator"])
    assert check(api, first_run, PAY, check_id="a-1")["decision"] == "allow"
    assert counted() == 1  # the approval took no second slot

    # One slot is left: the next request may still wait for an operator...
    second = check(api, second_run, PAY, check_id="b-1")
    assert second["decision"] == "pending", second
    assert counted() == 2
    # ...and then the window is full, approved or not.
    third = check(api, third_run, PAY, check_id="c-1")
    assert (third["decision"], third["reason"]) == ("wait", "rate_limited")
    assert 55 < third["retry_after_s"] <= 60  # the first pending answer leaves the window first
    assert Approval.objects.filter(run_id=third_run).count() == 0  # wait comes before approvals
    assert Run.objects.get(pk=third_run).steps == 0


@pytest.mark.django_db
def test_a_denied_or_expired_request_keeps_its_slot(api, limited, users):
    first_run, third_run = start(api), start(api)
    first = check(api, first_run, PAY, check_id="a-1")
    approval_decide(team=limited, approval_id=first["approval"]["id"], decision="deny",
                    note="no", actor=users["operator"])
    set_policy(limited, approvals={"timeout_s": 1})  # the same rule, a quick expiry
    second_run = start(api)
    check(api, second_run, PAY, check_id="b-1")
    time.sleep(1.2)
    assert check(api, second_run, PAY, check_id="b-1")["reason"] == "approval_expired"
    # The window counts requests as they were taken: neither outcome gives a slot back.
    assert check(api, third_run, PAY, check_id="c-1")["decision"] == "wait"
    assert counted() == 2


@pytest.mark.django_db
def test_a_full_window_makes_the_approval_wait_then_asks_once_it_clears(api, team):
    set_policy(team, approvals={"tools": ["payments.refund"], "timeout_s": 600},
               rate_limits=[{"match": "payments.*", "per": "run", "max": 1, "window_s": 1}])
    run_id = start(api)
    assert check(api, run_id, {"name": "payments.lookup"})["decision"] == "allow"  # the slot
    waited = check(api, run_id, PAY, check_id="pay-1")
    assert waited["decision"] == "wait"
    assert not Approval.objects.exists()  # the rate limits come before the approvals
    time.sleep(waited["retry_after_s"] + 0.05)
    again = check(api, run_id, PAY, check_id="pay-1")  # a wait is decided again
    assert again["decision"] == "pending", again
    assert Approval.objects.filter(status="pending").count() == 1
    assert counted() == 2
    assert Run.objects.get(pk=run_id).steps == 2  # the wait counted no step


# --- The same across server processes (PostgreSQL) ---------------------------------------------

@pytest.mark.postgres
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_simultaneous_requests_across_processes_take_exactly_max_slots(server, agent: Agent,
                                                                       team, users):
    """20 checks at once, one per run of one agent, against the two worker processes of the
    production server; max 5: exactly 5 go pending, 15 wait; approving the 5 takes no slot."""
    # A time budget the 60 s waits fit in (a longer wait is a stop, issue 26).
    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 600},
               rate_limits=[{"match": "payments.*", "per": "agent", "max": 5, "window_s": 60}],
               budgets={"max_seconds": 600})
    runs = [agent.start("payer")["run_id"] for _ in range(20)]
    barrier = Barrier(len(runs))

    def one(run_id: str) -> dict[str, Any]:
        with httpx.Client(base_url=agent.http.base_url, timeout=60,
                          headers={"Authorization": f"Bearer {agent.token}"}) as http:
            barrier.wait()
            response = http.post(f"/api/v1/runs/{run_id}/check",
                                 json={"action": PAY, "check_id": "pay"})
            assert response.status_code == 200, response.text
            return response.json()

    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        answers = dict(zip(runs, pool.map(one, runs), strict=True))
    decisions = [a["decision"] for a in answers.values()]
    assert (decisions.count("pending"), decisions.count("wait")) == (5, 15)
    assert counted(scope="payer") == 5
    assert Approval.objects.filter(run_id__in=runs).count() == 5

    for run_id, answer in answers.items():
        if answer["decision"] == "pending":
            approve(team, answer, users["operator"])
            assert agent.check(run_id, action=PAY, check_id="pay")["decision"] == "allow"
    assert counted(scope="payer") == 5
    late = next(r for r, a in answers.items() if a["decision"] == "wait")
    assert agent.check(late, action=PAY, check_id="pay")["decision"] == "wait"
