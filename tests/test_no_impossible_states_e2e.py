"""SPEC 10, "No impossible states", through the production server (granian, several worker
processes) on both stacks: the defect as reported (a local stop uploaded while a run waits for
an approval), an approved request whose run is then killed, and a bad row left by an older
version, each read by agents and operators over HTTP. The paths one by one are in
tests/test_no_impossible_states.py."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from policies.models import Team
from runs.approvals.services import approval_decide
from runs.killswitch.services import killswitch_engage
from runs.models import Approval, Run
from tests.conftest import Agent, set_policy
from tests.test_approvals_e2e import signed_in

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

PAY = {"name": "payments.refund", "args": {"order": 42}}


@pytest.fixture
def approving(team: Team) -> Team:
    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 600},
               budgets={"max_seconds": None})
    return team


def pending(agent: Agent) -> tuple[str, str]:
    run_id = agent.start()["run_id"]
    answer = agent.check(run_id, action=PAY, check_id="pay-1")
    assert answer["decision"] == "pending", answer
    return run_id, answer["approval"]["id"]


def pages_answer(operator: Any, team: Team, run_id: str) -> None:
    for path in ["", "runs/", "approvals/", f"runs/{run_id}/"]:
        response = operator.get(f"/teams/{team.slug}/{path}", headers={"HX-Request": ""})
        assert response.status_code == 200, (path, response.status_code)


def test_a_local_stop_while_waiting_leaves_nothing_pending_and_nothing_broken(
        server, agent, approving, users):
    run_id, approval_id = pending(agent)

    upload = agent.http.post(f"/api/v1/runs/{run_id}/local-decisions", json={"decisions": [
        {"check_id": "l-1", "action": {"name": "search.docs"}, "decision": "stop",
         "reason": "loop_detected"}]})

    assert upload.status_code == 200, upload.text
    assert Approval.objects.get(pk=approval_id).status == "cancelled"
    operator = signed_in(server, "operator")
    decided = operator.post(f"/teams/{approving.slug}/approvals/{approval_id}/decide",
                            data={"decision": "approve"})
    assert decided.status_code == 409, decided.text
    pages_answer(operator, approving, run_id)
    assert agent.http.get("/api/v1/runs").status_code == 200
    got = agent.http.get(f"/api/v1/approvals/{approval_id}").json()
    assert (got["status"], got["decision"]["decision"], got["decision"]["reason"]) == (
        "cancelled", "stop", "loop_detected")
    assert agent.check(run_id, action=PAY, check_id="pay-1") == got["decision"]


def test_an_approved_request_whose_run_is_killed_answers_stop_killed(
        server, agent, approving, users):
    run_id, approval_id = pending(agent)
    approval_decide(team=approving, approval_id=approval_id, decision="approve", note="",
                    actor=users["operator"])
    killswitch_engage(scope="team", team=approving, reason="refunds are looping",
                      actor=users["operator"])

    got = agent.http.get(f"/api/v1/approvals/{approval_id}", params={"wait": 5}).json()

    assert got["status"] == "approved"
    assert (got["decision"]["decision"], got["decision"]["reason"]) == ("stop", "killed")
    assert "refunds are looping" in got["decision"]["message"]
    resent = agent.check(run_id, action=PAY, check_id="pay-1")
    assert {k: v for k, v in resent.items() if k != "decision_id"} == {
        k: v for k, v in got["decision"].items() if k != "decision_id"}
    assert Run.objects.get(pk=run_id).status == "killed"


def test_a_bad_row_left_by_an_older_version_breaks_no_page_and_no_sweep(
        server, agent, approving, users):
    run_id, approval_id = pending(agent)
    other_run, other = pending(agent)
    past = timezone.now() - timedelta(seconds=5)
    for waiting, request in [(run_id, approval_id), (other_run, other)]:
        memory = Run.objects.get(pk=waiting).memory
        memory["pending"]["expires_at"] = past.isoformat()
        Run.objects.filter(pk=waiting).update(memory=memory)
        Approval.objects.filter(pk=request).update(expires_at=past)
    # What the defect left: the run ended, its request pending (and now past its expiry).
    Run.objects.filter(pk=run_id).update(status="stopped", stop_reason="loop_detected",
                                         ended_at=timezone.now())

    pages_answer(signed_in(server, "viewer"), approving, run_id)
    assert agent.http.get("/api/v1/runs").status_code == 200

    assert Approval.objects.get(pk=approval_id).status == "cancelled"
    assert Approval.objects.get(pk=other).status == "expired"  # the look went on past it
    assert not (Run.objects.get(pk=run_id).memory or {}).get("pending")
