"""SPEC 11 and 15 through the agent API, in process (both stacks): the pending answer, its
resumption by check_id, approval, denial, expiry, cancellation by a kill switch or a finish,
the 409 of another check while pending, shadow mode, RBAC of the API, bad input."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from django.core.management import call_command
from django.test import Client

from policies.models import OperatorEvent, Team
from policies.services import agent_key_create
from runs.approvals.services import ApprovalError, approval_decide, expire_due
from runs.killswitch.services import killswitch_engage
from runs.models import Approval, Decision, Run
from tests.conftest import set_policy

pytestmark = pytest.mark.django_db

PAY = {"name": "payments.refund", "args": {"order": 42, "token": "s3cret"}}


@pytest.fixture
def approving(team: Team) -> Team:
    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 600})
    return team


def start(api: Client, **body: Any) -> str:
    response = api.post("/api/v1/runs", {"agent": "support-bot", **body},
                        content_type="application/json")
    assert response.status_code == 201, response.content
    return response.json()["run_id"]


def check(api: Client, run_id: str, action: dict[str, Any] | None = None, *,
          status: int = 200, **body: Any) -> dict[str, Any]:
    response = api.post(f"/api/v1/runs/{run_id}/check",
                        {"action": action or {"name": "search.docs"}, **body},
                        content_type="application/json")
    assert response.status_code == status, response.content
    return response.json()


def get_approval(api: Client, approval_id: str, query: str = "", *, status: int = 200
                 ) -> dict[str, Any]:
    response = api.get(f"/api/v1/approvals/{approval_id}{query}")
    assert response.status_code == status, response.content
    return response.json()


def pending(api: Client, **body: Any) -> tuple[str, dict[str, Any]]:
    run_id = start(api)
    answer = check(api, run_id, PAY, check_id="pay-1", **body)
    assert answer["decision"] == "pending", answer
    return run_id, answer


# --- The pending answer -------------------------------------------------------------------

def test_a_matching_action_answers_pending_and_counts_the_step(api, approving):
    run_id = start(api)
    check(api, run_id, check_id="s1")
    answer = check(api, run_id, PAY, check_id="pay-1", cost_usd=0.25, progress="p")

    assert (answer["decision"], answer["reason"], answer["step"]) == (
        "pending", "approval_required", 2)
    assert answer["approval"]["status"] == "pending"
    assert uuid.UUID(answer["approval"]["id"])
    assert "payments.*" in answer["message"] and answer["next_action"]
    assert answer["retry_after_s"] is None
    assert answer["usage"]["steps"] == 2 and answer["usage"]["tool_calls"] == 1
    run = Run.objects.get(pk=run_id)
    assert (run.steps, run.tool_calls, float(run.cost_usd)) == (2, 1, 0.25)
    row = Decision.objects.get(run_id=run_id, check_id="pay-1")
    assert (row.outcome, row.reason, row.step) == ("pending", "approval_required", 2)
    assert row.args == {"order": 42, "token": "[redacted]"}
    approval = Approval.objects.get(pk=answer["approval"]["id"])
    assert (approval.status, approval.step, approval.check_id) == ("pending", 2, "pay-1")
    decisions = api.get(f"/api/v1/runs/{run_id}/decisions").json()["decisions"]
    assert [d["outcome"] for d in decisions] == ["allow", "pending"]


def test_every_check_answer_carries_the_new_fields_as_null(api, team):
    run_id = start(api)
    answer = check(api, run_id)
    assert answer["approval"] is None and answer["retry_after_s"] is None


def test_resending_the_check_id_answers_pending_then_the_final_answer(api, approving, users):
    run_id, first = pending(api)
    again = check(api, run_id, PAY, check_id="pay-1")
    assert again == first
    assert Run.objects.get(pk=run_id).steps == 1  # not counted again

    body = get_approval(api, first["approval"]["id"])
    assert body["status"] == "pending" and body["decision"] is None
    assert body["action"] == {"name": "payments.refund", "type": "tool",
                              "args": {"order": 42, "token": "[redacted]"}}
    assert body["run_id"] == run_id and body["decided_by"] is None

    approval_decide(team=approving, approval_id=first["approval"]["id"], decision="approve",
                    note="ok", actor=users["operator"])
    final = check(api, run_id, PAY, check_id="pay-1")
    assert (final["decision"], final["reason"], final["step"]) == ("allow", "step_ok", 1)
    assert final["approval"]["status"] == "approved"
    assert final["approval"]["decided_by"] == "operator"
    assert get_approval(api, first["approval"]["id"])["decision"] == final


# --- Approve ------------------------------------------------------------------------------

def test_approval_moves_the_repeat_count_and_tool_calls_then(api, approving, users):
    run_id, first = pending(api)
    assert first["repeat_count"] == 0 and first["usage"]["tool_calls"] == 0

    approval = approval_decide(team=approving, approval_id=first["approval"]["id"],
                               decision="approve", note="", actor=users["operator"])

    assert approval.status == "approved" and approval.decided_by_label == "operator"
    run = Run.objects.get(pk=run_id)
    assert (run.status, run.steps, run.tool_calls) == ("running", 1, 1)
    rows = list(Decision.objects.filter(run_id=run_id).order_by("id"))
    assert [(d.step, d.outcome, d.reason) for d in rows] == [
        (1, "pending", "approval_required"), (1, "allow", "step_ok")]
    assert rows[1].answer["approval"]["decided_by"] == "operator"
    assert rows[1].repeat_count == 1 and rows[1].check_id is None
    body = get_approval(api, first["approval"]["id"])
    assert (body["status"], body["decided_by"]) == ("approved", "operator")
    assert body["decision"]["decision_id"] == rows[1].pk
    event = OperatorEvent.objects.get(action="approval.approve")
    assert event.actor_label == "operator" and event.detail["approval"] == str(approval.pk)
    # The run goes on; the same action again is a new request.
    nxt = check(api, run_id, PAY, check_id="pay-2")
    assert nxt["decision"] == "pending" and nxt["step"] == 2


def test_an_approved_check_whose_error_reached_its_threshold_carries_the_nudge(
        api, approving, users):
    # SPEC 4.4: an allow of a check whose reported error reached on_repeated_error.threshold
    # (3, nudge) carries the directive; an approved check's allow is that check's allow.
    run_id = start(api)
    boom = {"status": "error", "error": "Gateway  timeout"}
    for i in range(2):
        assert check(api, run_id, {"name": f"lookup.{i}"}, last_result=boom)["directive"] is None
    first = check(api, run_id, PAY, check_id="pay-1", last_result=boom)
    assert first["decision"] == "pending"

    approval_decide(team=approving, approval_id=first["approval"]["id"], decision="approve",
                    note="", actor=users["operator"])

    final = get_approval(api, first["approval"]["id"])["decision"]
    assert final["decision"] == "allow"
    assert final["directive"] == {
        "type": "inject_message", "role": "user", "code": "repeated_error",
        "content": "The error 'Gateway timeout' occurred 3 times. Change approach radically "
                   "or abandon this subtask."}
    assert final["rule"]["name"] == "repeated_error"
    assert final["rule"]["observed"] == {"error_count": 3}
    assert check(api, run_id, PAY, check_id="pay-1") == final


# --- Deny ---------------------------------------------------------------------------------

def test_a_denial_needs_a_note_and_changes_nothing_without_one(api, approving, users):
    _, first = pending(api)
    for note in ("", "   ", None):
        with pytest.raises(ApprovalError) as caught:
            approval_decide(team=approving, approval_id=first["approval"]["id"],
                            decision="deny", note=note, actor=users["operator"])
        assert (caught.value.status, caught.value.fields) == (422, {"note": "required to deny"})
    assert Approval.objects.get(pk=first["approval"]["id"]).status == "pending"


def test_an_unknown_decision_is_refused(api, approving, users):
    _, first = pending(api)
    with pytest.raises(ApprovalError) as caught:
        approval_decide(team=approving, approval_id=first["approval"]["id"],
                        decision="maybe", note="x", actor=users["operator"])
    assert caught.value.status == 422 and "decision" in caught.value.fields


def test_denial_stops_the_run_with_the_note(api, approving, users):
    run_id, first = pending(api)
    approval_decide(team=approving, approval_id=first["approval"]["id"], decision="deny",
                    note="refunds are frozen today", actor=users["operator"])

    run = Run.objects.get(pk=run_id)
    assert (run.status, run.stop_reason, run.tool_calls) == ("stopped", "approval_denied", 0)
    final = check(api, run_id, PAY, check_id="pay-1")
    assert (final["decision"], final["reason"], final["step"]) == ("stop", "approval_denied", 1)
    assert "refunds are frozen today" in final["message"]
    body = get_approval(api, first["approval"]["id"])
    assert (body["status"], body["note"]) == ("denied", "refunds are frozen today")
    assert OperatorEvent.objects.filter(action="approval.deny").count() == 1
    # Any other check answers the run's stop.
    assert check(api, run_id, check_id="later")["reason"] == "approval_denied"


# --- One decision -------------------------------------------------------------------------

def test_a_second_decision_answers_approval_decided(api, approving, users):
    _, first = pending(api)
    approval_decide(team=approving, approval_id=first["approval"]["id"], decision="approve",
                    note="", actor=users["operator"])
    with pytest.raises(ApprovalError) as caught:
        approval_decide(team=approving, approval_id=first["approval"]["id"], decision="deny",
                        note="too late", actor=users["admin"])
    assert (caught.value.status, caught.value.code) == (409, "approval_decided")
    assert Approval.objects.get(pk=first["approval"]["id"]).status == "approved"
    assert OperatorEvent.objects.filter(action__startswith="approval.").count() == 1


def test_another_check_id_while_pending_answers_409_naming_it(api, approving):
    run_id, first = pending(api)
    response = api.post(f"/api/v1/runs/{run_id}/check",
                        {"action": {"name": "search.docs"}, "check_id": "other"},
                        content_type="application/json")
    assert response.status_code == 409
    error = response.json()["error"]
    assert error["code"] == "approval_pending"
    assert error["fields"] == {"approval_id": first["approval"]["id"], "check_id": "pay-1"}
    assert first["approval"]["id"] in error["message"]
    # Nothing counted, nothing audited; a check without check_id is refused the same way.
    assert Run.objects.get(pk=run_id).steps == 1
    assert Decision.objects.filter(run_id=run_id).count() == 1
    check(api, run_id, status=409)


def test_a_kill_switch_covering_the_run_cancels_the_approval(api, approving, users):
    from unittest import mock

    from runs.killswitch.fanout import killswitch_fanout

    run_id, first = pending(api)
    run = Run.objects.get(pk=run_id)
    with mock.patch("runs.killswitch.services._enqueue_fanout"):
        switch = killswitch_engage(scope="run", run=run, reason="runaway refunds",
                                   actor=users["operator"])
    result = killswitch_fanout(switch_id=switch.pk)  # what the Celery task runs
    assert result is not None and result.killed == [run_id]
    assert killswitch_fanout(switch_id=switch.pk).killed == []  # idempotent

    approval = Approval.objects.get(pk=first["approval"]["id"])
    assert approval.status == "cancelled" and approval.decided_by_label == ""
    run.refresh_from_db()
    assert (run.status, run.stop_reason) == ("killed", "killed")
    final = check(api, run_id, PAY, check_id="pay-1")
    assert (final["decision"], final["reason"]) == ("stop", "killed")
    assert "runaway refunds" in final["message"]
    body = get_approval(api, first["approval"]["id"])
    assert body["status"] == "cancelled" and body["decision"]["reason"] == "killed"
    assert body["decided_by"] is None
    with pytest.raises(ApprovalError) as caught:
        approval_decide(team=approving, approval_id=first["approval"]["id"],
                        decision="approve", note="", actor=users["operator"])
    assert caught.value.code == "approval_decided"
    # The operator's act is the engage, audited as such; the cancellation it caused is in
    # the run's audit log, not a second operator event (docs/approvals.md).
    events = list(OperatorEvent.objects.values_list("action", "actor__username"))
    assert ("killswitch.engage", "operator") in events
    assert not [action for action, _ in events if action.startswith("approval.")]
    assert Decision.objects.filter(run_id=run_id, reason="killed", step=1).exists()


def test_a_check_under_a_kill_switch_while_pending_answers_stop_killed(api, approving, users):
    from unittest import mock

    run_id, first = pending(api)
    # A switch engaged with the fan-out not run yet: the check sees it first.
    with mock.patch("runs.killswitch.services._enqueue_fanout"):
        killswitch_engage(scope="team", team=approving, reason="stop all", actor=users["admin"])
    assert Approval.objects.get(pk=first["approval"]["id"]).status == "pending"

    answer = check(api, run_id, check_id="other")
    assert (answer["decision"], answer["reason"]) == ("stop", "killed")
    assert Approval.objects.get(pk=first["approval"]["id"]).status == "cancelled"
    assert Run.objects.get(pk=run_id).status == "killed"


@pytest.mark.parametrize("decision", ["approve", "deny"])
def test_a_decision_after_a_kill_switch_covers_the_run_cancels_instead(api, approving, users,
                                                                       decision):
    """The fan-out has not reached the run yet (a busy or unreachable broker): an operator
    deciding then must not let the action run. From the switch's commit on, the run's
    answer is stop / killed (SPEC 4.5, 6), whoever settles the request."""
    from unittest import mock

    run_id, first = pending(api)
    with mock.patch("runs.killswitch.services._enqueue_fanout"):
        killswitch_engage(scope="agent", team=approving, agent="support-bot",
                          reason="refund storm", actor=users["admin"])
    with pytest.raises(ApprovalError) as caught:
        approval_decide(team=approving, approval_id=first["approval"]["id"],
                        decision=decision, note="fine", actor=users["operator"])
    assert (caught.value.status, caught.value.code) == (409, "kill_switch_engaged")
    assert "refund storm" in caught.value.message

    approval = Approval.objects.get(pk=first["approval"]["id"])
    assert approval.status == "cancelled" and approval.decided_by_label == ""
    run = Run.objects.get(pk=run_id)
    assert (run.status, run.stop_reason, run.tool_calls) == ("killed", "killed", 0)
    final = check(api, run_id, PAY, check_id="pay-1")
    assert (final["decision"], final["reason"]) == ("stop", "killed")
    assert not Decision.objects.filter(run_id=run_id, outcome="allow").exists()
    assert not OperatorEvent.objects.filter(action__startswith="approval.").exists()


@pytest.mark.parametrize("looker", ["poll", "approvals page", "run page", "runs list"])
def test_whoever_looks_first_settles_the_cancellation_of_a_covered_run(api, approving, users,
                                                                       looker):
    """The fan-out has not run: the waiting agent's poll, or a screen, cancels the request
    as a check would, so nobody is shown (or waits for) a request the switch has ended."""
    from unittest import mock

    run_id, first = pending(api)
    with mock.patch("runs.killswitch.services._enqueue_fanout"):
        killswitch_engage(scope="run", run=Run.objects.get(pk=run_id), reason="enough",
                          actor=users["operator"])
    viewer = Client()
    viewer.force_login(users["viewer"])
    if looker == "approvals page":
        assert viewer.get(f"/teams/{approving.slug}/approvals/").status_code == 200
    elif looker == "run page":
        assert viewer.get(f"/teams/{approving.slug}/runs/{run_id}/").status_code == 200
    elif looker == "runs list":
        assert viewer.get(f"/teams/{approving.slug}/runs/").status_code == 200
    if looker != "poll":
        assert Approval.objects.get(pk=first["approval"]["id"]).status == "cancelled"
    body = get_approval(api, first["approval"]["id"])
    assert body["status"] == "cancelled"
    assert (body["decision"]["decision"], body["decision"]["reason"]) == ("stop", "killed")
    assert "enough" in body["decision"]["message"]
    assert Run.objects.get(pk=run_id).status == "killed"


def test_finishing_the_run_cancels_its_approval(api, approving):
    run_id, first = pending(api)
    response = api.post(f"/api/v1/runs/{run_id}/finish",
                        {"status": "completed", "output": "gave up waiting"},
                        content_type="application/json")
    assert response.status_code == 200, response.content
    assert response.json()["status"] == "completed"
    approval = Approval.objects.get(pk=first["approval"]["id"])
    assert approval.status == "cancelled"
    assert approval.decision["decision"] == "stop"
    assert approval.decision["reason"] == "run_finished"
    final = check(api, run_id, PAY, check_id="pay-1")
    assert final["decision"] == "stop"
    assert Run.objects.get(pk=run_id).memory["pending"] is None


# --- Expiry -------------------------------------------------------------------------------

@pytest.fixture
def quick(team: Team) -> Team:
    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 1})
    return team


def test_an_expired_approval_stops_the_run_and_refuses_a_late_decision(api, quick, users):
    run_id, first = pending(api)
    time.sleep(1.2)
    with pytest.raises(ApprovalError) as caught:
        approval_decide(team=quick, approval_id=first["approval"]["id"], decision="approve",
                        note="", actor=users["operator"])
    assert (caught.value.status, caught.value.code) == (409, "approval_expired")

    run = Run.objects.get(pk=run_id)
    assert (run.status, run.stop_reason) == ("stopped", "approval_expired")
    approval = Approval.objects.get(pk=first["approval"]["id"])
    assert approval.status == "expired" and approval.decided_at == approval.expires_at
    assert run.ended_at == approval.expires_at
    final = check(api, run_id, PAY, check_id="pay-1")
    assert (final["decision"], final["reason"], final["step"]) == ("stop", "approval_expired", 1)
    assert not OperatorEvent.objects.filter(action__startswith="approval.").exists()


@pytest.mark.parametrize("looker", ["get", "check", "sweep", "command", "resend"])
def test_whoever_looks_first_after_the_expiry_settles_it(api, quick, looker):
    run_id, first = pending(api)
    approval_id = first["approval"]["id"]
    time.sleep(1.2)
    assert Approval.objects.get(pk=approval_id).status == "pending"  # nobody looked yet
    if looker == "get":
        assert get_approval(api, approval_id)["status"] == "expired"
    elif looker == "check":
        assert check(api, run_id, check_id="next")["reason"] == "approval_expired"
    elif looker == "resend":
        assert check(api, run_id, PAY, check_id="pay-1")["reason"] == "approval_expired"
    elif looker == "sweep":
        assert expire_due() == 1
        assert expire_due() == 0
    else:
        call_command("approvals", "list", "--team", quick.slug)
    assert Approval.objects.get(pk=approval_id).status == "expired"
    finals = Decision.objects.filter(run_id=run_id, reason="approval_expired")
    assert finals.count() == 1 + (looker in ("check",))  # a new check is audited too


def test_time_pending_does_not_count_as_active_time(api, team, users):
    # A pending wait longer than the whole budget; the budget is roomy enough for a loaded
    # machine's start and checks, which count.
    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 600},
               budgets={"max_seconds": 2})
    began = time.monotonic()
    run_id, first = pending(api)
    time.sleep(2.3)
    approval_decide(team=team, approval_id=first["approval"]["id"], decision="approve",
                    note="", actor=users["operator"])
    answer = check(api, run_id, check_id="after")
    assert answer["decision"] == "allow", answer
    assert answer["usage"]["elapsed_s"] < 2
    run = api.get(f"/api/v1/runs/{run_id}").json()
    # The 2.3 s pending never counts; the rest does, however slow the machine (a loaded CI
    # machine took over a second for the start, the checks and this read).
    assert run["elapsed_s"] <= time.monotonic() - began - 2.3 + 0.01, run


# --- Shadow mode and the check_id requirement ---------------------------------------------

def test_shadow_mode_makes_no_request(api, team):
    set_policy(team, mode="shadow", approvals={"tools": ["payments.*"], "timeout_s": 60})
    run_id = start(api)
    answer = check(api, run_id, PAY)  # no check_id needed either
    assert (answer["decision"], answer["reason"]) == ("allow", "step_ok")
    assert answer["shadow"]["reason"] == "approval_required"
    assert answer["approval"] is None
    row = Decision.objects.get(run_id=run_id)
    assert row.outcome == "would_stop"
    assert not Approval.objects.exists()
    assert Run.objects.get(pk=run_id).tool_calls == 1


def test_a_check_needing_approval_without_check_id_is_refused_before_counting(api, approving):
    run_id = start(api)
    response = api.post(f"/api/v1/runs/{run_id}/check", {"action": PAY},
                        content_type="application/json")
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "invalid_request" and "check_id" in error["fields"]
    assert Run.objects.get(pk=run_id).steps == 0
    assert not Decision.objects.filter(run_id=run_id).exists()


# --- The API's RBAC and bad input ---------------------------------------------------------

def test_another_teams_approval_answers_404(api, approving, other_team):
    _, first = pending(api)
    other = Client(HTTP_AUTHORIZATION=f"Bearer {agent_key_create(team=other_team, name='o').token}")
    body = get_approval(other, first["approval"]["id"], status=404)
    assert body["error"]["code"] == "not_found"
    get_approval(api, str(uuid.uuid4()), status=404)
    get_approval(api, "not-a-uuid", status=404)


def test_an_agent_bound_key_sees_only_its_agents_approvals(api, approving):
    _, first = pending(api)
    bound = agent_key_create(team=approving, name="bound", agent="other-bot").token
    other = Client(HTTP_AUTHORIZATION=f"Bearer {bound}")
    get_approval(other, first["approval"]["id"], status=404)
    mine = agent_key_create(team=approving, name="mine", agent="support-bot").token
    get_approval(Client(HTTP_AUTHORIZATION=f"Bearer {mine}"), first["approval"]["id"])


def test_the_get_needs_a_key(approving, api):
    _, first = pending(api)
    assert Client().get(f"/api/v1/approvals/{first['approval']['id']}").status_code == 401


@pytest.mark.parametrize("query", ["?wait=61", "?wait=-1", "?wait=abc", "?wait=1.5"])
def test_a_wait_outside_0_to_60_answers_422(api, approving, query):
    _, first = pending(api)
    body = get_approval(api, first["approval"]["id"], query, status=422)
    assert body["error"]["code"] == "invalid_request" and "wait" in body["error"]["fields"]


def test_a_decided_approval_answers_at_once_whatever_the_wait(api, approving, users):
    _, first = pending(api)
    approval_decide(team=approving, approval_id=first["approval"]["id"], decision="approve",
                    note="", actor=users["operator"])
    started = time.monotonic()
    assert get_approval(api, first["approval"]["id"], "?wait=30")["status"] == "approved"
    assert time.monotonic() - started < 5


def test_the_command_lists_and_decides(api, approving, users, capsys):
    _, first = pending(api)
    call_command("approvals", "list", "--team", approving.slug)
    out = capsys.readouterr().out
    assert first["approval"]["id"] in out and "payments.refund" in out and "pending" in out

    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match=r"required to deny|needs a note"):
        call_command("approvals", "decide", first["approval"]["id"], "deny")
    call_command("approvals", "decide", first["approval"]["id"], "deny", "--note", "no")
    approval = Approval.objects.get(pk=first["approval"]["id"])
    assert (approval.status, approval.decided_by_label, approval.decided_by) == ("denied", "",
                                                                                None)
    event = OperatorEvent.objects.get(action="approval.deny")
    assert event.actor_label.startswith("manage.py approvals")
    with pytest.raises(CommandError, match="approval_decided"):
        call_command("approvals", "decide", first["approval"]["id"], "approve")


def test_the_command_names_the_user(api, approving, users):
    _, first = pending(api)
    call_command("approvals", "decide", first["approval"]["id"], "approve", "--user", "operator")
    approval = Approval.objects.get(pk=first["approval"]["id"])
    assert (approval.decided_by_label, approval.decided_by) == ("operator", users["operator"])
    assert get_approval(api, first["approval"]["id"])["decided_by"] == "operator"


@pytest.mark.parametrize("who", ["viewer", "outsider"])
def test_the_command_refuses_a_user_who_may_not_decide(api, approving, users, who):
    """SPEC 11: operators and above decide. The named user is the recorded approver."""
    from django.core.management.base import CommandError

    _, first = pending(api)
    with pytest.raises(CommandError, match="may not decide"):
        call_command("approvals", "decide", first["approval"]["id"], "approve", "--user", who)
    assert Approval.objects.get(pk=first["approval"]["id"]).status == "pending"


def test_the_expiry_sweep_is_a_celery_beat_task(api, quick):
    from django.conf import settings

    from governance.celery import app

    schedule = settings.CELERY_BEAT_SCHEDULE["approvals-expire"]
    assert schedule["task"] == "runs.tasks.approvals_expire" and schedule["schedule"] <= 60
    app.loader.import_default_modules()  # what a worker does at start: autodiscovery
    task = app.tasks["runs.tasks.approvals_expire"]
    _, first = pending(api)
    time.sleep(1.2)
    assert task.run() == 1  # what the worker runs
    assert Approval.objects.get(pk=first["approval"]["id"]).status == "expired"
    assert task.run() == 0
