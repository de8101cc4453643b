"""The client's waiting (governance_client: the sync client and AsyncGovernanceClient) against
the production server, both stacks: a check answered `pending` long-polls the approval and
returns the final answer (approved from the dashboard by a signed-in operator, denied with a
note, expired, or the author's own timeout); a check answered `wait` sleeps `retry_after_s`
and is sent again until it clears, or is returned as `wait` past the wait budget.

The agent runs in a background thread (its check blocks, as in a real agent); this thread
plays the operator."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import pytest

from governance_client import AsyncGovernanceClient, Decision, GovernanceClient
from policies.models import Team
from runs.approvals.services import approval_decide
from runs.killswitch.services import killswitch_engage
from runs.models import Approval, Run
from runs.models import Decision as AuditRecord
from tests.conftest import Server, set_policy
from tests.test_approvals_e2e import signed_in
from tests.workers import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

KINDS = ["sync", "async"]
PAY = ("payments.refund", {"order": 42})
# Generous per-request deadlines: the machine running the suite is shared and loaded, and
# what is tested here is the waiting, not the deadlines (tests/test_client_server.py).
OPTIONS = {"deadline": 10.0}


@dataclass
class Outcome:
    run_id: str
    decisions: list[Decision] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # how long each check took


def agent_checks(kind: str, server: Server, token: str, actions: list[tuple[str, dict]],
                 **options: Any) -> Outcome:
    """One run of an agent checking each action in turn, with the sync or the async client.
    The run is left running: the test reads the server's side of it."""
    options = {**OPTIONS, **options}
    if kind == "sync":
        with GovernanceClient(server.url, token, **options) as client:
            run = client.start_run("support-bot")
            out = Outcome(run.id)
            for name, args in actions:
                started = time.monotonic()
                out.decisions.append(run.check(name, args))
                out.seconds.append(time.monotonic() - started)
            return out

    async def main() -> Outcome:
        async with AsyncGovernanceClient(server.url, token, **options) as client:
            run = await client.start_run("support-bot")
            out = Outcome(run.id)
            for name, args in actions:
                started = time.monotonic()
                out.decisions.append(await run.check(name, args))
                out.seconds.append(time.monotonic() - started)
            return out

    return asyncio.run(main())


def in_background(work: Callable[[], Outcome]) -> Future[Outcome]:
    """The agent's thread. A daemon: if a test fails while its agent still waits for an
    operator, the agent must not keep the test process alive until the approval expires."""
    future: Future[Outcome] = Future()

    def run() -> None:
        try:
            future.set_result(work())
        except BaseException as exc:  # handed to the test through the future
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True).start()
    return future


def waiting_request() -> Approval:
    """The approval the agent is waiting on, once its check has opened it."""
    return wait_for(lambda: Approval.objects.filter(status="pending").first(), timeout=30,
                    what="the agent's approval request")


@pytest.fixture
def approving(team: Team) -> Team:
    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 600})
    return team


# --- pending -------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_an_operator_approving_on_the_dashboard_releases_the_waiting_check(
        kind, server, approving, agent_token, users):
    agent = in_background(lambda: agent_checks(kind, server, agent_token, [PAY]))
    request = waiting_request()
    time.sleep(1.0)  # the agent is in its long poll by now
    assert not agent.done()
    operator = signed_in(server, "operator")
    response = operator.post(f"/teams/{approving.slug}/approvals/{request.pk}/decide",
                             data={"decision": "approve"})
    assert response.status_code == 200, response.text
    decided = time.monotonic()

    out = agent.result(timeout=60)
    # The long poll answered the decision itself, not the end of its 60 s wait.
    assert time.monotonic() - decided < 30
    decision = out.decisions[0]
    assert (decision.decision, decision.reason, decision.step) == ("allow", "step_ok", 1)
    assert decision.allowed
    assert decision.approval == {"id": str(request.pk), "status": "approved",
                                 "expires_at": decision.approval["expires_at"],
                                 "decided_by": "operator"}
    run = Run.objects.get(pk=out.run_id)
    assert (run.status, run.steps, run.tool_calls) == ("running", 1, 1)
    outcomes = list(AuditRecord.objects.filter(run_id=out.run_id).order_by("id")
                    .values_list("outcome", flat=True))
    assert outcomes == ["pending", "allow"]  # sent once, not re-checked as a new step
    operator.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_denial_returns_the_stop_with_the_operators_note(kind, server, approving,
                                                           agent_token, users):
    agent = in_background(lambda: agent_checks(kind, server, agent_token, [PAY]))
    request = waiting_request()
    approval_decide(team=approving, approval_id=request.pk, decision="deny",
                    note="refunds need a ticket", actor=users["operator"])
    decision = agent.result(timeout=60).decisions[0]
    assert (decision.decision, decision.reason) == ("stop", "approval_denied")
    assert not decision.allowed
    assert "refunds need a ticket" in (decision.message or "")
    assert decision.approval is not None and decision.approval["status"] == "denied"
    run = Run.objects.get(pk=request.run_id)
    assert (run.status, run.stop_reason) == ("stopped", "approval_denied")


@pytest.mark.parametrize("kind", KINDS)
def test_an_approval_nobody_decides_returns_the_expired_stop(kind, server, team, agent_token):
    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 2})
    out = agent_checks(kind, server, agent_token, [PAY])
    decision = out.decisions[0]
    assert (decision.decision, decision.reason) == ("stop", "approval_expired")
    assert decision.approval is not None and decision.approval["status"] == "expired"
    assert 1.5 < out.seconds[0] < 30  # it waited for the expiry, and no longer than needed
    run = Run.objects.get(pk=out.run_id)
    assert (run.status, run.stop_reason) == ("stopped", "approval_expired")


@pytest.mark.parametrize("kind", KINDS)
def test_the_authors_approval_timeout_returns_the_pending_decision(kind, server, approving,
                                                                   agent_token):
    # A poll's attempt must last as long as the service holds it, past the check's deadline
    # (5 s, not the default 2 s: the check that opens the request once took more than 2 s in
    # CI, and the client then answered governance_unavailable).
    out = agent_checks(kind, server, agent_token, [PAY], approval_timeout=8, deadline=5.0)
    decision = out.decisions[0]
    # Documented (governance_client/README.md): the pending decision, not a stop and not
    # "governance unavailable": the service answered every poll, nobody decided yet.
    assert (decision.decision, decision.reason) == ("pending", "approval_required"), decision
    assert not decision.allowed and not decision.local
    assert 7.5 < out.seconds[0] < 30
    approval = Approval.objects.get(run_id=out.run_id)
    assert approval.status == "pending"  # still there for an operator; the agent moved on
    assert decision.approval is not None and decision.approval["id"] == str(approval.pk)


@pytest.mark.parametrize("kind", KINDS)
def test_a_kill_switch_reaches_the_waiting_check_without_the_fan_out(
        kind, server, approving, agent_token, users):
    """The fan-out never runs here (as with a broker down): the client's own poll settles the
    cancellation, and an operator approving afterwards is refused, never an allow."""
    agent = in_background(lambda: agent_checks(kind, server, agent_token, [PAY]))
    request = waiting_request()
    with mock.patch("runs.killswitch.services._enqueue_fanout"):
        killswitch_engage(scope="agent", team=approving, agent="support-bot",
                          reason="refund storm", actor=users["admin"])
    decision = agent.result(timeout=60).decisions[0]
    assert (decision.decision, decision.reason) == ("stop", "killed")
    assert "refund storm" in (decision.message or "")
    operator = signed_in(server, "operator")
    response = operator.post(f"/teams/{approving.slug}/approvals/{request.pk}/decide",
                             data={"decision": "approve"})
    assert response.status_code == 409
    operator.close()
    assert Approval.objects.get(pk=request.pk).status == "cancelled"
    assert Run.objects.get(pk=request.run_id).status == "killed"
    assert not AuditRecord.objects.filter(run_id=request.run_id, outcome="allow").exists()


@pytest.mark.parametrize("kind", KINDS)
def test_a_run_that_stopped_waiting_for_an_operator_ends_stopped_with_the_users_words(
        kind, server, approving, agent_token):
    """The author's approval timeout ends the run's block: the run is stopped, not
    completed, and its output tells the user what was not run, with no API step in it."""
    if kind == "sync":
        # A check's own deadline above CI's load (a check that opens the request once took
        # more than the default 2 s there): the author's approval_timeout is what is tested.
        with GovernanceClient(server.url, agent_token, approval_timeout=2,
                              deadline=10) as client, client.run("support-bot") as run:
            decision = run.check(*PAY)
    else:
        async def main() -> tuple[Any, Decision]:
            async with AsyncGovernanceClient(server.url, agent_token, approval_timeout=2,
                                             deadline=10) as client, \
                    client.run("support-bot") as run:
                return run, await run.check(*PAY)
        run, decision = asyncio.run(main())

    assert decision.decision == "pending"
    stored = Run.objects.get(pk=run.id)
    assert (stored.status, stored.stop_reason) == ("stopped", "agent_stopped")
    assert stored.output == decision.user_notice()
    assert "payments.refund needs an operator's approval" in stored.output
    assert "/api/v1/" not in stored.output and "check_id" not in stored.output
    assert f"/api/v1/approvals/{decision.approval['id']}" not in stored.output
    assert Approval.objects.get(run_id=run.id).status == "cancelled"


# --- wait ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_a_rate_limited_check_sleeps_until_the_window_clears_then_allows(kind, server, team,
                                                                         agent_token):
    set_policy(team, rate_limits=[{"match": "http.*", "per": "run", "max": 1, "window_s": 2}])
    out = agent_checks(kind, server, agent_token, [("http.get", {"n": 1}),
                                                   ("http.get", {"n": 2})])
    first, second = out.decisions
    assert first.allowed and second.allowed
    assert (second.decision, second.step) == ("allow", 2)
    assert out.seconds[1] > 1.0  # it slept out the window rather than being let through
    outcomes = list(AuditRecord.objects.filter(run_id=out.run_id).order_by("id")
                    .values_list("outcome", flat=True))
    assert outcomes[0] == "allow" and outcomes[-1] == "allow"
    assert set(outcomes[1:-1]) == {"wait"}  # the waits the server answered in between
    assert Run.objects.get(pk=out.run_id).steps == 2


@pytest.mark.parametrize("kind", KINDS)
def test_a_wait_longer_than_the_budget_is_returned_as_wait(kind, server, team, agent_token):
    # The client's wait budget (5 s), not the run's time: that one covers the 60 s wait (a
    # wait longer than the run's time left is a stop, issue 26).
    set_policy(team, rate_limits=[{"match": "http.*", "per": "run", "max": 1, "window_s": 60}],
               budgets={"max_seconds": 600})
    out = agent_checks(kind, server, agent_token, [("http.get", {"n": 1}),
                                                   ("http.get", {"n": 2})], wait_budget=5)
    decision = out.decisions[1]
    assert (decision.decision, decision.reason) == ("wait", "rate_limited")
    assert not decision.allowed
    assert decision.retry_after_s is not None and 55 < decision.retry_after_s <= 60
    assert out.seconds[1] < 5  # no sleep it knew could not be enough
    assert AuditRecord.objects.filter(run_id=out.run_id, outcome="wait").count() == 1
    run = Run.objects.get(pk=out.run_id)
    assert (run.status, run.steps) == ("running", 1)  # a wait stops nothing, counts nothing


@pytest.mark.parametrize("kind", KINDS)
def test_a_rate_limited_action_needing_approval_waits_then_asks_the_operator(
        kind, server, team, agent_token, users):
    set_policy(team, approvals={"tools": ["payments.refund"], "timeout_s": 600},
               rate_limits=[{"match": "payments.*", "per": "run", "max": 1, "window_s": 2}])
    agent = in_background(lambda: agent_checks(
        kind, server, agent_token, [("payments.lookup", {"order": 42}), PAY]))
    request = waiting_request()  # only once the window cleared
    approval_decide(team=team, approval_id=request.pk, decision="approve", note="",
                    actor=users["operator"])
    out = agent.result(timeout=60)
    assert [d.decision for d in out.decisions] == ["allow", "allow"]
    outcomes = list(AuditRecord.objects.filter(run_id=out.run_id).order_by("id")
                    .values_list("outcome", flat=True))
    assert outcomes[0] == "allow" and outcomes[-2:] == ["pending", "allow"]
    assert "wait" in outcomes
