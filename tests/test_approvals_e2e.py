"""Approvals (SPEC 11) through the production server (granian, several worker processes) on
both stacks: the long poll answers as soon as the status changes, a re-sent check resumes,
two operators deciding at once from different server processes leave exactly one winner,
the dashboard's RBAC, and the signed webhook through the delivery machinery."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from policies.models import OperatorEvent, Team
from runs.approvals.services import approval_decide
from runs.models import Approval, Decision, Run, WebhookDelivery
from tests.conftest import HAS_REDIS, Agent, Server, server_env, set_policy, start_server
from tests.workers import Receiver, Worker, new_worker, wait_for, workers_fixture  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

PAY = {"name": "payments.refund", "args": {"order": 42}}


@pytest.fixture
def approving(team: Team) -> Team:
    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 600},
               budgets={"max_seconds": None})
    return team


def pending(agent: Agent, check_id: str = "pay-1") -> tuple[str, dict[str, Any]]:
    run_id = agent.start()["run_id"]
    answer = agent.check(run_id, action=PAY, check_id=check_id)
    assert answer["decision"] == "pending", answer
    return run_id, answer


def long_poll(agent: Agent, approval_id: str, wait: int, out: dict[str, Any]) -> None:
    started = time.monotonic()
    response = agent.http.get(f"/api/v1/approvals/{approval_id}", params={"wait": wait},
                              timeout=wait + 30)
    out.update(status_code=response.status_code, body=response.json(),
               seconds=time.monotonic() - started)


def signed_in(server: Server, username: str) -> httpx.Client:
    client = httpx.Client(base_url=server.url, timeout=30, follow_redirects=False)
    page = client.get("/accounts/login/")
    token = page.text.split('name="csrfmiddlewaretoken" value="')[1].split('"')[0]
    response = client.post("/accounts/login/", data={
        "username": username, "password": f"pw-{username}-123", "csrfmiddlewaretoken": token})
    assert response.status_code == 302, response.text
    client.headers["X-CSRFToken"] = client.cookies["csrftoken"]
    client.headers["HX-Request"] = "true"
    return client


def test_the_long_poll_answers_as_soon_as_the_approval_is_decided(server, agent, approving,
                                                                   users):
    run_id, first = pending(agent)
    approval_id = first["approval"]["id"]
    out: dict[str, Any] = {}
    poller = threading.Thread(target=long_poll, args=(agent, approval_id, 40, out))
    poller.start()
    time.sleep(1.0)  # the poll is waiting
    assert poller.is_alive()
    approval_decide(team=approving, approval_id=approval_id, decision="approve", note="",
                    actor=users["operator"])
    poller.join(35)

    assert out["status_code"] == 200 and out["body"]["status"] == "approved"
    assert out["seconds"] < 30  # woken by the decision, not by the end of its wait
    decision = out["body"]["decision"]
    assert (decision["decision"], decision["reason"], decision["step"]) == ("allow", "step_ok", 1)
    # The re-sent check answers the same final answer (on PostgreSQL: through the ORM path).
    assert agent.check(run_id, action=PAY, check_id="pay-1") == decision
    assert Run.objects.get(pk=run_id).tool_calls == 1


def test_a_long_poll_with_nothing_decided_answers_pending_after_its_wait(server, agent,
                                                                          approving):
    _, first = pending(agent)
    out: dict[str, Any] = {}
    long_poll(agent, first["approval"]["id"], 2, out)
    assert out["status_code"] == 200 and out["body"]["status"] == "pending"
    assert out["body"]["decision"] is None
    assert out["seconds"] >= 1.5


def test_the_long_poll_settles_the_expiry_it_waits_for(server, agent, team):
    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 2})
    run_id, first = pending(agent)
    out: dict[str, Any] = {}
    long_poll(agent, first["approval"]["id"], 30, out)
    assert out["body"]["status"] == "expired", out
    assert out["body"]["decision"]["reason"] == "approval_expired"
    assert out["seconds"] < 25
    run = agent.http.get(f"/api/v1/runs/{run_id}").json()
    assert (run["status"], run["stop_reason"]) == ("stopped", "approval_expired")


def test_a_denial_reaches_the_waiting_agent_with_the_note(server, agent, approving, users):
    run_id, first = pending(agent)
    out: dict[str, Any] = {}
    poller = threading.Thread(target=long_poll, args=(agent, first["approval"]["id"], 40, out))
    poller.start()
    time.sleep(0.5)
    approval_decide(team=approving, approval_id=first["approval"]["id"], decision="deny",
                    note="not on a Friday", actor=users["operator"])
    poller.join(35)
    decision = out["body"]["decision"]
    assert (decision["decision"], decision["reason"]) == ("stop", "approval_denied")
    assert "not on a Friday" in decision["message"]
    assert agent.check(run_id, check_id="x")["reason"] == "approval_denied"


def test_while_pending_another_check_id_answers_409_over_http(server, agent, approving):
    run_id, first = pending(agent)
    response = agent.http.post(f"/api/v1/runs/{run_id}/check",
                               json={"action": {"name": "search"}, "check_id": "other"})
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "approval_pending"
    assert response.json()["error"]["fields"]["approval_id"] == first["approval"]["id"]


# --- Two operators, two server processes ----------------------------------------------------

@pytest.fixture
def two_servers(transactional_db: Any) -> Iterator[tuple[Server, Server]]:
    a, b = start_server(workers=1), start_server(workers=1)
    yield a, b
    a.stop()
    b.stop()


def _decide(barrier: threading.Barrier, results: dict[str, httpx.Response], url: str,
            name: str, client: httpx.Client, data: dict[str, str]) -> None:
    barrier.wait(10)
    results[name] = client.post(url, data=data)


def test_two_operators_deciding_at_once_from_two_processes_leave_one_winner(
        two_servers, agent, approving, users):
    a, b = two_servers
    operator, admin = signed_in(a, "operator"), signed_in(b, "admin")
    rounds = 6
    for n in range(rounds):
        _, first = pending(agent, check_id=f"pay-{n}")
        approval_id = first["approval"]["id"]
        url = f"/teams/{approving.slug}/approvals/{approval_id}/decide"
        barrier = threading.Barrier(2)
        results: dict[str, httpx.Response] = {}
        threads = [
            threading.Thread(target=_decide, args=(barrier, results, url, "approve", operator,
                                                   {"decision": "approve"})),
            threading.Thread(target=_decide, args=(barrier, results, url, "deny", admin,
                                                   {"decision": "deny", "note": "no"})),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        codes = sorted(r.status_code for r in results.values())
        assert codes == [200, 409], {k: (r.status_code, r.text[:300]) for k, r in results.items()}
        winner = next(k for k, r in results.items() if r.status_code == 200)
        loser = results["deny" if winner == "approve" else "approve"]
        assert "already" in loser.text
        approval = Approval.objects.get(pk=approval_id)
        assert approval.status == {"approve": "approved", "deny": "denied"}[winner]
        finals = Decision.objects.filter(run_id=approval.run_id, check_id__isnull=True)
        assert finals.count() == 1
        assert OperatorEvent.objects.filter(detail__approval=approval_id).count() == 1
    operator.close()
    admin.close()


def test_a_viewers_forged_decision_is_403_and_changes_nothing(server, agent, approving, users):
    _, first = pending(agent)
    viewer = signed_in(server, "viewer")
    page = viewer.get(f"/teams/{approving.slug}/approvals/")
    assert page.status_code == 200 and "payments.refund" in page.text
    assert 'value="approve"' not in page.text  # no controls for a viewer
    response = viewer.post(f"/teams/{approving.slug}/approvals/{first['approval']['id']}/decide",
                           data={"decision": "approve"})
    assert response.status_code == 403
    assert Approval.objects.get(pk=first["approval"]["id"]).status == "pending"
    assert not OperatorEvent.objects.filter(action__startswith="approval.").exists()


def test_the_dashboard_refuses_bad_input_with_422(server, agent, approving, users):
    _, first = pending(agent)
    operator = signed_in(server, "operator")
    url = f"/teams/{approving.slug}/approvals/{first['approval']['id']}/decide"
    no_note = operator.post(url, data={"decision": "deny", "note": "  "})
    assert no_note.status_code == 422 and "note" in no_note.text
    unknown = operator.post(url, data={"decision": "maybe"})
    assert unknown.status_code == 422
    assert Approval.objects.get(pk=first["approval"]["id"]).status == "pending"
    ok = operator.post(url, data={"decision": "approve"})
    assert ok.status_code == 200 and 'data-status="approved"' in ok.text


# --- Webhooks -----------------------------------------------------------------------------

def test_requests_and_decisions_are_posted_signed_to_the_webhook(
        server, agent, approving, users, workers: list[Worker], settings: Any):
    # The decision is made in this process, which delivers its webhook when no Celery runs:
    # the receiver on loopback must be allowed here as in the server's environment.
    settings.WEBHOOK_ALLOWED_HOSTS = ["127.0.0.1"]
    if HAS_REDIS:
        new_worker(workers)  # deliveries run on Celery
    receiver = Receiver(secrets={approving.slug: ""}).start()
    try:
        approving.webhook_url = f"{receiver.url}/{approving.slug}"
        approving.webhook_secret = "whsec-test"
        approving.save(update_fields=["webhook_url", "webhook_secret"])
        receiver.secrets[approving.slug] = "whsec-test"
        _, first = pending(agent)
        wait_for(lambda: receiver.valid[approving.slug] >= 1, timeout=30, what="requested")
        requested = receiver.bodies[0]
        assert requested["event"] == "approval.requested"
        assert requested["id"] == first["approval"]["id"]
        assert requested["action"]["name"] == "payments.refund"
        approval_decide(team=approving, approval_id=first["approval"]["id"], decision="deny",
                        note="no", actor=users["operator"])
        wait_for(lambda: receiver.valid[approving.slug] >= 2, timeout=30, what="decided")
        decided = receiver.bodies[1]
        assert (decided["event"], decided["status"], decided["decided_by"]) == (
            "approval.decided", "denied", "operator")
        assert receiver.invalid[approving.slug] == 0
        deliveries = WebhookDelivery.objects.filter(approval_id=first["approval"]["id"])
        wait_for(lambda: all(d.status == "delivered" for d in deliveries.all()), timeout=15)
        assert sorted(deliveries.values_list("event", flat=True)) == [
            "approval.decided", "approval.requested"]
    finally:
        receiver.stop()


# --- The long poll holds no thread -----------------------------------------------------------

@pytest.fixture
def asgi_server(transactional_db: Any) -> Iterator[Server]:
    srv = start_server(workers=1, env=server_env())
    yield srv
    srv.stop()


def test_under_asgi_many_waiting_polls_hold_no_thread(asgi_server, approving, agent_token,
                                                       users):
    polls = 40  # more than the threads of the worker's API pool
    with httpx.Client(base_url=asgi_server.url, timeout=60,
                      headers={"Authorization": f"Bearer {agent_token}"}) as http:
        agent = Agent(token=agent_token, http=http)
        _, first = pending(agent)
        outs = [dict[str, Any]() for _ in range(polls)]
        threads = [threading.Thread(target=long_poll, args=(agent, first["approval"]["id"], 30,
                                                           out)) for out in outs]
        for t in threads:
            t.start()
        time.sleep(2.0)
        # Every poll is waiting, and the server still answers checks at once.
        other = agent.start(agent="other-bot")["run_id"]
        started = time.monotonic()
        assert agent.check(other, check_id="q")["decision"] == "allow"
        assert time.monotonic() - started < 5  # a generous deadline: no poll holds it
        approval_decide(team=approving, approval_id=first["approval"]["id"],
                        decision="approve", note="", actor=users["operator"])
        for t in threads:
            t.join(40)
    assert all(out.get("body", {}).get("status") == "approved" for out in outs)
    assert max(out["seconds"] for out in outs) < 28
