"""SPEC 10, "No impossible states": no run is terminal while one of its approvals is pending.

Every path that ends a run (a check under a kill switch, a local stop uploaded, a finish, an
abandonment, the kill switch's fan-out on both of its paths, an expiry) settles the run's
pending approval under the run's lock; a sweep or a page that meets a bad row left by an
older version logs it and goes on; the approval's `decision` on an ended run is the run's
stop, as a replay of its check answers. In process, on both stacks; the same through the
production server is in tests/test_no_impossible_states_e2e.py.
"""

from __future__ import annotations

import logging
import uuid
from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
from django.db import transaction
from django.test import Client
from django.utils import timezone

from governance_client import rules
from policies.models import Team
from runs.approvals.services import ApprovalError, approval_decide, expire_due
from runs.check.abandon import abandon_idle_runs
from runs.killswitch import fanout as killswitch
from runs.killswitch.services import killswitch_engage
from runs.models import Approval, ApprovalStatus, Decision, KillSwitch, Run
from tests.conftest import set_policy

pytestmark = [pytest.mark.django_db, pytest.mark.both_stores]

PAY = {"name": "payments.refund", "args": {"order": 42}}


@pytest.fixture
def approving(team: Team) -> Team:
    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 600},
               tools={"deny": ["shell.*"]})
    return team


def start(api: Client) -> str:
    response = api.post("/api/v1/runs", {"agent": "support-bot"},
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


def pending(api: Client) -> tuple[str, str]:
    run_id = start(api)
    check(api, run_id, check_id="first")
    answer = check(api, run_id, PAY, check_id="pay-1")
    assert answer["decision"] == "pending", answer
    return run_id, answer["approval"]["id"]


def upload(api: Client, run_id: str, *entries: dict[str, Any]) -> dict[str, Any]:
    response = api.post(f"/api/v1/runs/{run_id}/local-decisions", {"decisions": list(entries)},
                        content_type="application/json")
    assert response.status_code == 200, response.content
    return response.json()


def local(check_id: str, name: str = "search.docs", decision: str = "allow",
          reason: str = "step_ok") -> dict[str, Any]:
    return {"check_id": check_id, "action": {"name": name, "args": {"q": check_id}},
            "decision": decision, "reason": reason}


def assert_no_impossible_states() -> None:
    """Nothing pending on an ended run: neither an approval row nor the run's own memory."""
    stale = Approval.objects.filter(status=ApprovalStatus.PENDING).exclude(
        run__status=rules.RUNNING)
    assert not stale.exists(), list(stale.values("id", "run__status", "run__stop_reason"))
    for run in Run.objects.exclude(status=rules.RUNNING):
        assert not (run.memory or {}).get("pending"), (run.pk, run.status, run.memory)


def get_approval(api: Client, approval_id: str) -> dict[str, Any]:
    response = api.get(f"/api/v1/approvals/{approval_id}")
    assert response.status_code == 200, response.content
    return response.json()


# --- Every path that ends a run settles its approval ---------------------------------------

def test_a_local_stop_uploaded_while_waiting_cancels_the_approval(api, approving, users):
    run_id, approval_id = pending(api)

    body = upload(api, run_id, local("l-1", decision="stop", reason="loop_detected"))

    assert (body["run"]["status"], body["run"]["stop_reason"]) == ("stopped", "loop_detected")
    approval = Approval.objects.get(pk=approval_id)
    assert approval.status == "cancelled"
    assert_no_impossible_states()
    # Its final answer is the run's stop, a second audit record at the request's step.
    got = get_approval(api, approval_id)
    assert (got["status"], got["decision"]["decision"], got["decision"]["reason"]) == (
        "cancelled", "stop", "loop_detected")
    final = Decision.objects.get(pk=got["decision"]["decision_id"])
    assert (final.step, final.outcome, final.action_name) == (2, "stop", "payments.refund")
    # The re-sent check answers the same.
    resent = check(api, run_id, PAY, check_id="pay-1")
    assert (resent["decision"], resent["reason"]) == ("stop", "loop_detected")
    # Deciding it now is a clear 409, never a 500.
    with pytest.raises(ApprovalError) as caught:
        approval_decide(team=approving, approval_id=approval_id, decision="approve", note="",
                        actor=users["operator"])
    assert caught.value.status == 409


def test_local_allows_while_waiting_leave_the_request_waiting(api, approving):
    run_id, approval_id = pending(api)
    body = upload(api, run_id, local("l-1"))
    assert body["run"]["status"] == "running"
    assert Approval.objects.get(pk=approval_id).status == "pending"
    assert_no_impossible_states()


def test_finishing_a_waiting_run_cancels_the_approval(api, approving):
    run_id, approval_id = pending(api)
    response = api.post(f"/api/v1/runs/{run_id}/finish", {"status": "failed"},
                        content_type="application/json")
    assert response.status_code == 200, response.content
    assert Approval.objects.get(pk=approval_id).status == "cancelled"
    assert_no_impossible_states()


def test_an_abandoned_waiting_run_cancels_the_approval(api, approving):
    """Waiting is not idle, so a waiting run has no idle deadline; a run recorded by an older
    version could have one all the same."""
    run_id, approval_id = pending(api)
    Run.objects.filter(pk=run_id).update(idle_deadline=timezone.now() - timedelta(seconds=1))

    assert abandon_idle_runs() == [run_id]

    run = Run.objects.get(pk=run_id)
    assert (run.status, run.stop_reason) == ("stopped", "abandoned")
    approval = Approval.objects.get(pk=approval_id)
    assert approval.status == "cancelled"
    assert (approval.decision["decision"], approval.decision["reason"]) == ("stop", "abandoned")
    assert_no_impossible_states()


def test_a_check_finding_a_waiting_run_abandoned_cancels_the_approval(api, approving):
    run_id, approval_id = pending(api)
    Run.objects.filter(pk=run_id).update(idle_deadline=timezone.now() - timedelta(seconds=1))

    answer = check(api, run_id, check_id="late")

    assert (answer["decision"], answer["reason"]) == ("stop", "abandoned")
    assert Approval.objects.get(pk=approval_id).status == "cancelled"
    assert_no_impossible_states()


@pytest.mark.parametrize("path", ["fan-out", "fan-out orm", "check", "poll"])
def test_a_kill_switch_cancels_the_approval_whoever_gets_there_first(api, approving, users,
                                                                     path):
    run_id, approval_id = pending(api)
    with mock.patch("runs.killswitch.services._enqueue_fanout"):
        switch = killswitch_engage(scope="team", team=approving, reason="enough",
                                   actor=users["operator"])
    if path == "fan-out":
        killswitch.killswitch_fanout(switch_id=switch.pk)
    elif path == "fan-out orm":
        # The portable batch, which SQLite always takes and PostgreSQL never does by itself.
        with transaction.atomic():
            killswitch._kill_batch_orm(switch, Run.objects.filter(
                killswitch.cover.runs_covered_by(switch), status=rules.RUNNING))
    elif path == "check":
        assert check(api, run_id, check_id="other")["reason"] == "killed"
    else:
        assert get_approval(api, approval_id)["decision"]["reason"] == "killed"

    assert Run.objects.get(pk=run_id).status == "killed"
    assert Approval.objects.get(pk=approval_id).status == "cancelled"
    assert_no_impossible_states()


def test_an_expiry_found_by_the_sweep_stops_the_run(api, approving):
    run_id, approval_id = pending(api)
    assert expire_due(now=timezone.now() + timedelta(seconds=601)) == 1
    run = Run.objects.get(pk=run_id)
    assert (run.status, run.stop_reason) == ("stopped", "approval_expired")
    assert Approval.objects.get(pk=approval_id).status == "expired"
    assert_no_impossible_states()


def test_a_local_upload_after_the_expiry_settles_the_expiry_first(api, approving):
    run_id, approval_id = pending(api)
    later = timezone.now() + timedelta(seconds=601)
    with mock.patch("django.utils.timezone.now", return_value=later):
        body = upload(api, run_id, local("l-1", decision="stop", reason="max_steps"))
    # Nobody decided before the expiry: the run was over then, and the upload finds it so.
    assert (body["run"]["status"], body["run"]["stop_reason"]) == ("stopped",
                                                                    "approval_expired")
    assert Approval.objects.get(pk=approval_id).status == "expired"
    assert_no_impossible_states()


# --- The approval's decision on an ended run is the run's stop -----------------------------

def same_but_the_id(got: dict[str, Any], replay: dict[str, Any]) -> None:
    assert {k: v for k, v in got.items() if k != "decision_id"} == {
        k: v for k, v in replay.items() if k != "decision_id"}


@pytest.mark.parametrize("fanout", [True, False])
def test_after_a_kill_an_approved_request_answers_stop_killed(api, approving, users, fanout):
    """The approval was approved, then a kill switch covered the run: the agent polling the
    request must not read an allow after the engage returned (SPEC 4.5), fanned out or not."""
    run_id, approval_id = pending(api)
    approval_decide(team=approving, approval_id=approval_id, decision="approve", note="",
                    actor=users["operator"])
    assert get_approval(api, approval_id)["decision"]["decision"] == "allow"
    if fanout:
        killswitch_engage(scope="team", team=approving, reason="enough", actor=users["operator"])
    else:
        with mock.patch("runs.killswitch.services._enqueue_fanout"):
            killswitch_engage(scope="team", team=approving, reason="enough",
                              actor=users["operator"])

    got = get_approval(api, approval_id)

    assert got["status"] == "approved"  # what happened to the request stays said
    assert (got["decision"]["decision"], got["decision"]["reason"]) == ("stop", "killed")
    assert "enough" in got["decision"]["message"]
    resent = check(api, run_id, PAY, check_id="pay-1")
    same_but_the_id(got["decision"], resent)
    assert Run.objects.get(pk=run_id).status == "killed"


def test_a_replayed_allow_under_a_switch_not_yet_fanned_out_answers_stop_killed(
        api, approving, users):
    """SPEC 4.5: no allow leaks, retries included, from the engage's commit on."""
    run_id = start(api)
    assert check(api, run_id, check_id="c-1")["decision"] == "allow"
    with mock.patch("runs.killswitch.services._enqueue_fanout"):
        killswitch_engage(scope="team", team=approving, reason="enough", actor=users["operator"])

    again = check(api, run_id, check_id="c-1")

    assert (again["decision"], again["reason"]) == ("stop", "killed")
    assert Run.objects.get(pk=run_id).status == "killed"


def test_after_a_finish_an_approved_request_answers_the_runs_stop(api, approving, users):
    run_id, approval_id = pending(api)
    approval_decide(team=approving, approval_id=approval_id, decision="approve", note="",
                    actor=users["operator"])
    api.post(f"/api/v1/runs/{run_id}/finish", {"status": "completed"},
             content_type="application/json")
    got = get_approval(api, approval_id)
    assert (got["decision"]["decision"], got["decision"]["reason"]) == ("stop", "run_finished")
    same_but_the_id(got["decision"], check(api, run_id, PAY, check_id="pay-1"))


# --- Rows left by an older version ---------------------------------------------------------

def legacy_bad_row(api: Client, *, expired: bool = True) -> tuple[str, str]:
    """What the defect left: a run ended by a local stop, its approval still pending (and,
    with ``expired``, past its expiry), its memory still naming it."""
    run_id, approval_id = pending(api)
    past = timezone.now() - timedelta(seconds=5)
    run = Run.objects.get(pk=run_id)
    memory = dict(run.memory)
    if expired:
        memory["pending"] = {**memory["pending"], "expires_at": past.isoformat()}
        Approval.objects.filter(pk=approval_id).update(expires_at=past)
    Run.objects.filter(pk=run_id).update(status="stopped", stop_reason="loop_detected",
                                         ended_at=timezone.now(), memory=memory)
    return run_id, approval_id


def test_pages_and_the_runs_api_answer_200_with_a_legacy_bad_row(api, approving, users):
    bad_run, bad = legacy_bad_row(api)
    killswitch_engage(scope="agent", team=approving, agent="other-bot", reason="unrelated",
                      actor=users["operator"])  # a kill switch engaged makes pages look more
    viewer = Client()
    viewer.force_login(users["viewer"])

    for path in ["/", "/runs/", "/approvals/", f"/runs/{bad_run}/"]:
        response = viewer.get(f"/teams/{approving.slug}{path}")
        assert response.status_code == 200, (path, response.status_code)
    listed = api.get("/api/v1/runs")
    assert listed.status_code == 200
    assert bad_run in [r["run_id"] for r in listed.json()["runs"]]
    assert get_approval(api, bad)["status"] == "cancelled"
    assert_no_impossible_states()


def test_deciding_a_legacy_bad_row_answers_409_on_the_page(api, approving, users):
    _, bad = legacy_bad_row(api, expired=False)
    operator = Client()
    operator.force_login(users["operator"])
    response = operator.post(f"/teams/{approving.slug}/approvals/{bad}/decide",
                             {"decision": "approve"})
    assert response.status_code == 409
    assert b"over" in response.content
    assert_no_impossible_states()


def test_a_legacy_bad_row_answers_its_runs_stop_to_the_poll_and_the_check(api, approving):
    run_id, bad = legacy_bad_row(api, expired=False)
    got = get_approval(api, bad)
    assert got["status"] == "cancelled"
    assert (got["decision"]["decision"], got["decision"]["reason"]) == ("stop", "loop_detected")
    same_but_the_id(got["decision"], check(api, run_id, PAY, check_id="pay-1"))


def test_finishing_a_run_with_a_legacy_bad_row_clears_it(api, approving):
    run_id, bad = legacy_bad_row(api, expired=False)
    response = api.post(f"/api/v1/runs/{run_id}/finish", {"status": "stopped"},
                        content_type="application/json")
    assert response.status_code == 200, response.content
    assert Approval.objects.get(pk=bad).status == "cancelled"
    assert_no_impossible_states()


def test_the_expiry_sweep_goes_on_past_a_bad_row(api, approving, caplog):
    """One row the sweep cannot settle (here a run's memory that names its request with
    half its fields) is logged and left; the other teams' and runs' expiries go on."""
    broken_run, broken = pending(api)
    _, good = pending(api)
    _, legacy = legacy_bad_row(api)
    Run.objects.filter(pk=broken_run).update(memory={"pending": {"approval_id": broken}})
    later = timezone.now() + timedelta(seconds=601)

    with caplog.at_level(logging.ERROR):
        settled = expire_due(now=later)

    assert settled == 2
    assert Approval.objects.get(pk=good).status == "expired"
    assert Approval.objects.get(pk=legacy).status == "cancelled"
    assert Approval.objects.get(pk=broken).status == "pending"
    assert broken in caplog.text


def test_the_abandon_sweep_goes_on_past_a_bad_row(api, approving, caplog):
    broken, good = start(api), start(api)
    past = timezone.now() - timedelta(seconds=1)
    Run.objects.filter(pk__in=[broken, good]).update(idle_deadline=past)
    Run.objects.filter(pk=broken).update(memory={"pending": {"since": "not a time"}})

    with caplog.at_level(logging.ERROR):
        ended = abandon_idle_runs()

    assert ended == [good]
    assert broken in caplog.text


def test_every_page_answers_200_past_a_bad_row(api, approving, users):
    broken, _ = pending(api)
    Run.objects.filter(pk=broken).update(memory={"pending": {"since": "not a time"}})
    Approval.objects.filter(run_id=broken).update(
        expires_at=timezone.now() - timedelta(seconds=1))
    viewer = Client()
    viewer.force_login(users["viewer"])
    for path in ["/", "/runs/", "/approvals/"]:
        assert viewer.get(f"/teams/{approving.slug}{path}").status_code == 200, path
    assert api.get("/api/v1/runs").status_code == 200


def test_a_decision_on_an_unknown_approval_is_still_404(api, approving, users):
    with pytest.raises(ApprovalError) as caught:
        approval_decide(team=approving, approval_id=uuid.uuid4(), decision="approve", note="",
                        actor=users["operator"])
    assert caught.value.status == 404
    assert not KillSwitch.objects.exists()


# --- No step after the end ------------------------------------------------------------------


@pytest.mark.parametrize("checks_between", [1, 2])
def test_a_step_taken_while_the_run_finishes_is_never_after_its_end(api, team, checks_between):
    """Found by an attacker racing 40 checks with a finish: an allow whose audit time was
    3.7 ms after its run's `ended_at`, because the finish read its time before a check
    committed and its update did not notice the step. The interleaving, made to happen: the
    agent's checks commit between the finish's read and its write, once (the finish then
    reads again) or on every read (it then finishes under the run's lock)."""
    from runs.check import lifecycle

    run_id = start(api)
    real = lifecycle.abandon_if_idle
    reads = []

    def a_check_commits_meanwhile(run: Run, *, now: Any = None) -> Run:
        reads.append(now)
        if len(reads) <= checks_between:
            assert check(api, run_id, {"name": "search.docs", "args": {"n": len(reads)}}
                         )["decision"] == "allow"
        return real(run, now=now)

    with mock.patch.object(lifecycle, "abandon_if_idle", a_check_commits_meanwhile):
        response = api.post(f"/api/v1/runs/{run_id}/finish", {"status": "completed"},
                            content_type="application/json")
    assert response.status_code == 200, response.content
    run = Run.objects.get(pk=run_id)
    assert run.status == "completed"
    last = Decision.objects.filter(run_id=run_id, outcome="allow").order_by("-at").first()
    assert last is not None and last.at <= run.ended_at, (last.at, run.ended_at)
    assert run.steps == checks_between
