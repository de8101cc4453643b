"""The client against the real server: deadlines that travel with the check and are audited
`expired`, fail-open decisions uploaded after an outage, the kill's reason reaching the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from django.db import connection, transaction
from django.db.models import F

from governance_client import AsyncGovernanceClient, GovernanceClient
from policies.models import Team
from runs.killswitch.services import killswitch_engage
from runs.models import Approval, Decision, Run
from tests.conftest import Agent, Server, server_env, set_policy, start_server


def decisions(agent: Agent, run_id: str) -> list[dict[str, Any]]:
    response = agent.http.get(f"/api/v1/runs/{run_id}/decisions")
    assert response.status_code == 200, response.text
    return response.json()["decisions"]


def wait_for(predicate: Any, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


class Outage(httpx.BaseTransport):
    """The network between the agent and the service, which a test can cut."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.down = False

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("network unreachable (test outage)", request=request)
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


class RunLock:
    """Holds the lock every check of the run takes (PostgreSQL: the row; SQLite: the
    database's write lock) from a thread of its own, so a check waits behind it: taken
    when `__enter__` returns, released when the block ends. Events, not sleeps: on a loaded
    machine the thread's new connection took longer than a fixed 0.3 s to lock the row, and
    a fixed hold could end before a late check arrived."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.locked, self.release = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self.hold)

    def hold(self) -> None:
        try:
            with transaction.atomic():
                if connection.vendor == "postgresql":
                    list(Run.objects.select_for_update().filter(pk=self.run_id))
                else:
                    Run.objects.filter(pk=self.run_id).update(steps=F("steps"))
                self.locked.set()
                self.release.wait(30)
        finally:
            connection.close()

    def __enter__(self) -> RunLock:
        self.thread.start()
        assert self.locked.wait(30), "the run's lock was never taken"
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.thread.join()


def test_a_check_answered_after_its_deadline_is_audited_expired_and_counts_nothing(
    agent: Agent, server: Server
) -> None:
    # A server whose checks wait for their run's lock longer than the agent's deadline
    # (CHECK_LOCK_WAIT_MS), so the check is still waiting when the deadline passes.
    patient = start_server(workers=1, env=server_env(CHECK_LOCK_WAIT_MS="5000"))
    try:
        with GovernanceClient(patient.url, agent.token, deadline=0.6) as client:
            run = client.start_run("support-bot")
            run_id = run.id
            with RunLock(run_id):
                started = time.monotonic()
                decision = run.check("refund.issue", {"order": 1})
                elapsed = time.monotonic() - started
                # Held on after the client gave up, past every attempt's deadline_at and the
                # server's allowance for clock skew (CHECK_CLOCK_SKEW_MS, 0.5 s): released at
                # once, CI saw an attempt decided within that allowance, an allow.
                time.sleep(2.0)
    finally:
        patient.stop()

    assert decision.reason == "governance_unavailable" and not decision.allowed
    assert elapsed < 4.0  # its deadline (0.6 s), not the server's lock wait (5 s) or more
    wait_for(lambda: any(d["outcome"] == "expired" for d in decisions(agent, run_id)))
    audited = decisions(agent, run_id)
    assert {d["outcome"] for d in audited} == {"expired"}
    assert all(d["reason"] == "deadline_expired" for d in audited)
    stored = agent.http.get(f"/api/v1/runs/{run_id}").json()
    assert (stored["steps"], stored["tool_calls"], stored["status"]) == (0, 0, "running")

    # The run goes on: the next check is decided and counted as usual.
    answer = agent.check(run_id, "refund.issue", {"order": 1}, deadline_ms=5000)
    assert (answer["decision"], answer["step"]) == ("allow", 1)


@pytest.mark.postgres
def test_a_check_waits_for_its_runs_lock_a_bounded_time_then_answers_503(
    agent: Agent, server: Server
) -> None:
    """SPEC 10: a lock wait on the check's path is bounded. Found by an attacker: uploads of
    local decisions held a run's lock for seconds, and the checks of the run waiting behind
    them held the API pool's threads, so another team's checks waited 3 to 5 s. Past
    CHECK_LOCK_WAIT_MS (1 s) the check answers 503 with Retry-After, nothing decided."""
    run_id = agent.start()["run_id"]
    body = {"action": {"name": "refund.issue", "args": {"order": 1}}, "check_id": "c-1",
            "deadline_ms": 10_000}
    with RunLock(run_id):  # held until the answer, at most 30 s
        started = time.monotonic()
        busy = agent.http.post(f"/api/v1/runs/{run_id}/check", json=body)
        waited = time.monotonic() - started
    assert busy.status_code == 503 and busy.headers["Retry-After"] == "1", busy.text
    assert busy.json()["error"]["code"] == "unavailable"
    assert "busy" in busy.json()["error"]["message"]
    assert waited < 5  # 1 s of lock wait, on a loaded machine; not the lock's hold
    assert decisions(agent, run_id) == []
    # Sent again once the run is free, the same check is decided and counted once.
    answer = agent.check(run_id, "refund.issue", {"order": 1}, check_id="c-1")
    assert (answer["decision"], answer["step"]) == ("allow", 1)


@pytest.mark.slow
def test_a_check_left_queued_in_a_frozen_server_is_audited_expired_never_allowed(
    agent: Agent, settings: Any
) -> None:
    """The server is frozen (SIGSTOP) when the check arrives: the request waits in the
    socket's queue, where deadline_ms does not run yet. The client gives up at its deadline;
    when the server resumes, it reads the queued attempts past the check's deadline_at and
    decides none of them: no allow of an action that never ran, nothing counted."""
    frozen = start_server(workers=1)
    try:
        with GovernanceClient(frozen.url, agent.token, deadline=2.0) as client:
            run = client.start_run("support-bot")
            os.killpg(frozen.process.pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                decision = run.check("refund.issue", {"order": 1})
                elapsed = time.monotonic() - started
                # Frozen past the deadline and the clock-skew allowance.
                time.sleep(2.5 + settings.CHECK_CLOCK_SKEW_MS / 1000)
            finally:
                os.killpg(frozen.process.pid, signal.SIGCONT)
            assert decision.reason == "governance_unavailable" and not decision.allowed
            assert elapsed < 3.0
            # The resumed server reads the queued attempts: one whose body it reads is
            # audited expired; one whose client's departure it sees first is not decided at
            # all (governance/asgi.py `read_body`), which a CI run once saw for the only
            # attempt. Either way, no allow and nothing counted.
            wait_for(lambda: httpx.get(f"{frozen.url}/readyz", timeout=5).status_code == 200)
            time.sleep(2.0)  # the queued attempts are read meanwhile
            audited = decisions(agent, run.id)
            assert {d["outcome"] for d in audited} <= {"expired"}, audited
            stored = agent.http.get(f"/api/v1/runs/{run.id}").json()
            assert (stored["steps"], stored["tool_calls"]) == (0, 0)
    finally:
        frozen.stop()


def test_a_check_read_after_its_deadline_at_expires_and_so_does_its_retry(agent: Agent) -> None:
    """deadline_at bounds the check even when deadline_ms, counted from when the server read
    it, has time left; the same body sent again gets the same answer, counting nothing."""
    run_id = agent.start()["run_id"]
    past = (datetime.now(UTC) - timedelta(seconds=5)).isoformat()
    body = {"check_id": "late-1", "deadline_ms": 10_000, "deadline_at": past}

    first = agent.check(run_id, "refund.issue", {"order": 1}, **body)
    again = agent.check(run_id, "refund.issue", {"order": 1}, **body)

    for answer in (first, again):
        assert (answer["decision"], answer["reason"], answer["step"]) == (
            "stop", "deadline_expired", 0)
    assert [d["outcome"] for d in decisions(agent, run_id)] == ["expired", "expired"]
    assert agent.http.get(f"/api/v1/runs/{run_id}").json()["steps"] == 0
    # A moment still ahead (with or without an offset: UTC) is decided as usual.
    soon = (datetime.now(UTC) + timedelta(seconds=30)).replace(tzinfo=None).isoformat()
    answer = agent.check(run_id, "refund.issue", {"order": 1}, deadline_at=soon)
    assert (answer["decision"], answer["step"]) == ("allow", 1)


def test_an_expired_checks_answer_is_what_its_audit_row_says(agent: Agent, team: Team) -> None:
    """SPEC 4.5: the answer is the audited decision. Found by an attacker: an expired check's
    answer kept what the rules had decided before it expired, a repeat count its audit row
    did not have and an approval id that answered 404."""
    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 600})
    run_id = agent.start()["run_id"]
    assert agent.check(run_id, "search.docs", {"q": 1})["decision"] == "allow"
    past = (datetime.now(UTC) - timedelta(seconds=5)).isoformat()
    repeat = agent.check(run_id, "search.docs", {"q": 1}, deadline_at=past)
    pay = agent.check(run_id, "payments.refund", {"order": 1}, deadline_at=past, check_id="p1")
    audited = decisions(agent, run_id)
    assert [(d["outcome"], d["repeat_count"]) for d in audited] == [
        ("allow", 1), ("expired", 1), ("expired", 0)]
    assert (repeat["reason"], repeat["repeat_count"]) == ("deadline_expired", 1)
    assert (pay["decision"], pay["reason"], pay["approval"], pay["retry_after_s"]) == (
        "stop", "deadline_expired", None, None)
    assert "deadline_at" in pay["message"]
    assert not Approval.objects.filter(run_id=run_id).exists()


@pytest.mark.parametrize("value", ["soon", True, {}, [1], "2026-13-01T00:00:00Z"])
def test_a_bad_deadline_at_is_refused_naming_the_field(agent: Agent, value: Any) -> None:
    run_id = agent.start()["run_id"]
    response = agent.http.post(f"/api/v1/runs/{run_id}/check",
                               json={"action": {"name": "x"}, "deadline_at": value})
    assert response.status_code == 422, response.text
    assert list(response.json()["error"]["fields"]) == ["deadline_at"]


def test_a_check_within_its_deadline_is_decided_as_usual(agent: Agent) -> None:
    run_id = agent.start()["run_id"]
    answer = agent.check(run_id, deadline_ms=10_000)
    assert (answer["decision"], answer["step"]) == ("allow", 1)


@pytest.mark.parametrize("value", [0, -1, 600_001, "soon", True, 0.5, 600_000.5, {}, "5"])
def test_a_bad_deadline_is_refused_naming_the_field(agent: Agent, value: Any) -> None:
    run_id = agent.start()["run_id"]
    response = agent.http.post(f"/api/v1/runs/{run_id}/check",
                               json={"action": {"name": "x"}, "deadline_ms": value})
    assert response.status_code == 422
    assert response.json()["error"]["fields"] == {
        "deadline_ms": "Input should be a number of milliseconds from 1 to 600000"}


def test_fail_open_decisions_made_during_an_outage_are_uploaded_marked_local(
    agent: Agent, server: Server
) -> None:
    network = Outage()
    with GovernanceClient(server.url, agent.token, fail_mode="open", deadline=10,
                          transport=network) as client, client.run("support-bot") as run:
        assert run.check("search.docs", {"q": "refunds"}, cost_usd=0.1).allowed
        run.report("page 1")
        network.down = True
        local = [run.check("search.docs", {"q": q}, cost_usd=0.1) for q in ("a", "b")]
        run.report("page b")
        assert all(d.allowed and d.local for d in local)
        network.down = False
        after = run.check("search.docs", {"q": "c"}, cost_usd=0.1)
        assert after.step == 4 and not after.local

    stored = agent.http.get(f"/api/v1/runs/{run.id}").json()
    assert (stored["steps"], stored["tool_calls"], stored["status"]) == (4, 4, "completed")
    assert stored["cost_usd"] == pytest.approx(0.4)
    audited = decisions(agent, run.id)
    assert [(d["step"], d["outcome"], d["local"]) for d in audited] == [
        (1, "allow", False), (2, "allow", True), (3, "allow", True), (4, "allow", False)]
    assert [d["action"]["args"]["q"] for d in audited] == ["refunds", "a", "b", "c"]


def test_a_local_stop_uploaded_at_finish_ends_the_run_with_its_reason(
    agent: Agent, server: Server, team: Team
) -> None:
    set_policy(team, step_limits={"max_repeat_action": 2})
    network = Outage()
    with GovernanceClient(server.url, agent.token, fail_mode="open", deadline=10,
                          transport=network) as client, client.run("support-bot") as run:
        run.check("edit_file", {"path": "a"})
        network.down = True
        run.check("edit_file", {"path": "a"})
        stop = run.check("edit_file", {"path": "a"})
        network.down = False
        run.output = stop.user_notice("partial")

    assert stop.local and stop.reason == "loop_detected"
    stored = agent.http.get(f"/api/v1/runs/{run.id}").json()
    assert (stored["status"], stored["stop_reason"], stored["steps"]) == (
        "stopped", "loop_detected", 3)
    assert stored["output"].startswith("partial")
    assert [d["outcome"] for d in decisions(agent, run.id)] == ["allow", "allow", "stop"]


def test_a_local_decision_warns_as_the_server_would(agent: Agent, server: Server,
                                                     team: Team) -> None:
    """SPEC 16 during an outage: the run's policy as the start answers it carries the
    warnings, so the client's own decisions warn before a stop as the server's do (found by
    an attacker: the policy had no warnings block, and local allows never warned)."""
    set_policy(team, step_limits={"max_repeat_action": 3})
    network = Outage()
    with GovernanceClient(server.url, agent.token, fail_mode="open", deadline=10,
                          transport=network) as client, client.run("support-bot") as run:
        online = run.check("edit_file", {"path": "a"})
        network.down = True
        local = run.check("edit_file", {"path": "a"})
        network.down = False
    assert online.directive is None and local.local
    # The second of three identical calls: one more may run (the default warning, at 2).
    assert local.directive is not None and local.directive["code"] == "repeat_action", local
    audited = decisions(agent, run.id)
    assert [d["local"] for d in audited] == [False, True]
    # The audit records what the agent was told with the local allow.
    assert audited[1]["rule"]["name"] == "repeat_action"
    assert audited[1]["rule"]["observed"] == {"repeat_count": 2}
    why = agent.http.get(f"/api/v1/decisions/{audited[1]['id']}").json()
    assert why["directive"] == local.directive, why


def test_an_action_that_needs_an_approval_is_not_allowed_during_an_outage(
    agent: Agent, server: Server, team: Team
) -> None:
    """The run's policy tells the client which actions need an operator (SPEC 11): during
    an outage they are refused locally and nothing of them is uploaded."""
    set_policy(team, approvals={"tools": ["refund.*"], "timeout_s": 60})
    network = Outage()
    with GovernanceClient(server.url, agent.token, fail_mode="open", deadline=10,
                          transport=network) as client, client.run("support-bot") as run:
        network.down = True
        refund = run.check("refund.issue", {"amount": 120})
        search = run.check("search.docs", {"q": "refunds"})
        network.down = False

    assert not refund.allowed and refund.reason == "governance_unavailable"
    assert search.allowed and search.local
    audited = decisions(agent, run.id)
    assert [(d["action"]["name"], d["outcome"], d["local"]) for d in audited] == [
        ("search.docs", "allow", True)]


def test_a_budget_is_warned_once_across_an_outage(agent: Agent, server: Server,
                                                  team: Team) -> None:
    """SPEC 16: a budget's warning once per run, whoever sent it. The service's warning
    given before an outage is not given again by the client's own decisions, and the
    client's given during one is not given again by the service after it."""
    network = Outage()

    def warned(fraction: float) -> tuple[list[Any], str]:
        """The warnings' codes of 3 checks, then 2 during an outage and 2 after it."""
        set_policy(team, step_limits={"max_steps": 20, "max_repeat_action": 10},
                   warnings={"budget_fraction": fraction, "repeat_action": None,
                             "no_progress": None})
        with GovernanceClient(server.url, agent.token, fail_mode="open", deadline=10,
                              transport=network) as client, client.run("support-bot") as run:
            online = [run.check("edit_file", {"path": str(i)}, progress=str(i))
                      for i in range(3)]
            network.down = True
            local = [run.check("edit_file", {"path": f"l{i}"}, progress=f"l{i}")
                     for i in range(2)]
            network.down = False
            after = [run.check("edit_file", {"path": f"a{i}"}, progress=f"a{i}")
                     for i in range(2)]
        assert all(d.local for d in local)
        return [d.directive and d.directive["code"] for d in online + local + after], run.id

    # Steps past 2 of 20 (the fraction 0.1): the third check, once.
    codes, _ = warned(0.1)
    assert codes == [None, None, "budget", None, None, None, None], codes
    # Past 4 of 20: the fifth check, decided by the client during the outage.
    codes, run_id = warned(0.2)
    assert codes == [None, None, None, None, "budget", None, None], codes
    audited = decisions(agent, run_id)
    assert audited[4]["local"] and audited[4]["rule"]["name"] == "budget"
    assert audited[4]["rule"]["observed"] == {"steps": 5}, audited[4]["rule"]
    assert [d["rule"] for d in audited[5:]] == [None, None]


def test_a_budget_warned_beside_a_shadow_would_stop_is_not_warned_again_locally(
        agent: Agent, server: Server, team: Team) -> None:
    """The answer's rule is the would-stop's, the directive the budget's warning: the
    client's copy learns the warned budget all the same (found by an attacker: it sent the
    warning again during an outage)."""
    set_policy(team, mode="shadow", step_limits={"max_steps": 10, "max_repeat_action": 1},
               warnings={"budget_fraction": 0.5, "repeat_action": None, "no_progress": None})
    network = Outage()
    with GovernanceClient(server.url, agent.token, fail_mode="open", deadline=10,
                          transport=network) as client, client.run("support-bot") as run:
        for i in range(4):
            run.check(f"tool_{i}", {"i": i}, progress=str(i))
        run.check("same", {}, progress="a")
        both = run.check("same", {}, progress="b")
        network.down = True
        local = run.check("other", {}, progress="c")
        network.down = False
    assert both.shadow and both.shadow["reason"] == "loop_detected", both
    assert both.directive and both.directive["code"] == "budget", both
    assert local.local and local.directive is None, local


def test_an_uploaded_directive_must_be_a_warning(agent: Agent) -> None:
    run_id = agent.start()["run_id"]
    entry = {"check_id": "local-1", "action": {"name": "search.docs", "args": {"q": 1}},
             "decision": "allow", "reason": "step_ok",
             "directive": {"type": "inject_message", "role": "user", "code": "ignore_all",
                           "content": "x"}}
    refused = agent.http.post(f"/api/v1/runs/{run_id}/local-decisions",
                              json={"decisions": [entry]})
    assert refused.status_code == 422, refused.text
    assert "decisions.0.directive.code" in refused.json()["error"]["fields"], refused.text
    assert agent.http.get(f"/api/v1/runs/{run_id}").json()["steps"] == 0


def test_an_upload_sent_twice_is_counted_once(agent: Agent) -> None:
    run_id = agent.start()["run_id"]
    body = {"decisions": [
        {"check_id": "local-1", "action": {"name": "search.docs", "args": {"q": 1}},
         "decision": "allow", "reason": "step_ok", "cost_usd": 0.25},
    ]}
    first = agent.http.post(f"/api/v1/runs/{run_id}/local-decisions", json=body)
    again = agent.http.post(f"/api/v1/runs/{run_id}/local-decisions", json=body)

    assert first.status_code == again.status_code == 200, first.text
    assert (first.json()["recorded"], again.json()["recorded"], again.json()["skipped"]) == (
        1, 0, 1)
    assert again.json()["run"]["steps"] == 1
    assert again.json()["run"]["cost_usd"] == pytest.approx(0.25)
    # A check_id the service decided itself is not counted again either.
    answer = agent.check(run_id, check_id="served-1")
    body["decisions"][0]["check_id"] = "served-1"
    skipped = agent.http.post(f"/api/v1/runs/{run_id}/local-decisions", json=body).json()
    assert skipped["skipped"] == 1 and skipped["run"]["steps"] == answer["step"] == 2


@pytest.mark.parametrize("body", [
    {}, {"decisions": []}, {"decisions": [{"check_id": "x", "action": {"name": "t"},
                                           "decision": "maybe", "reason": "r"}]},
    {"decisions": [{"action": {"name": "t"}, "decision": "allow", "reason": "step_ok"}]},
])
def test_a_bad_upload_is_refused_and_changes_nothing(agent: Agent, body: Any) -> None:
    run_id = agent.start()["run_id"]
    response = agent.http.post(f"/api/v1/runs/{run_id}/local-decisions", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == "invalid_request"
    assert Decision.objects.filter(run_id=run_id).count() == 0


@pytest.mark.parametrize("decision", ["maybe", None, 1])
def test_an_upload_with_a_bad_decision_names_that_field(agent: Agent, decision: Any) -> None:
    run_id = agent.start()["run_id"]
    entry = {"check_id": "x", "action": {"name": "t"}, "decision": decision, "reason": "r"}
    response = agent.http.post(f"/api/v1/runs/{run_id}/local-decisions",
                               json={"decisions": [entry]})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["fields"] == {
        "decisions.0.decision": "decision should be 'allow' or 'stop'"}


@pytest.mark.parametrize(("decision", "reason", "says"), [
    ("stop", "made_up", "'loop_detected'"),
    ("stop", "step_ok", "'loop_detected'"),
    ("stop", "approval_required", "'loop_detected'"),
    ("stop", "killed", "'loop_detected'"),  # an operator's kill is not the agent's to claim
    ("allow", "loop_detected", "'step_ok'"),
])
def test_a_local_decision_gives_a_reason_the_local_rules_can_give(
        agent: Agent, decision: str, reason: str, says: str) -> None:
    """A local stop's reason becomes the run's stop reason: only the rules' own are taken."""
    run_id = agent.start()["run_id"]
    body = {"decisions": [{"check_id": "l-1", "action": {"name": "t"}, "decision": decision,
                           "reason": reason}]}
    response = agent.http.post(f"/api/v1/runs/{run_id}/local-decisions", json=body)
    assert response.status_code == 422, response.text
    assert says in response.json()["error"]["fields"]["decisions.0.reason"]
    run = agent.http.get(f"/api/v1/runs/{run_id}").json()
    assert (run["status"], run["steps"]) == ("running", 0)


def test_an_upload_to_another_teams_run_answers_404(agent: Agent, other_team: Team) -> None:
    from policies.services import agent_key_create

    other = agent_key_create(team=other_team, name="other").token
    run_id = agent.start()["run_id"]
    response = agent.http.post(
        f"/api/v1/runs/{run_id}/local-decisions",
        headers={"Authorization": f"Bearer {other}"},
        json={"decisions": [{"check_id": "x", "action": {"name": "t"}, "decision": "allow",
                             "reason": "step_ok"}]},
    )
    assert response.status_code == 404


def test_the_stop_after_a_kill_carries_the_operators_reason(agent: Agent, team: Team) -> None:
    run_id = agent.start()["run_id"]
    assert agent.check(run_id)["decision"] == "allow"
    killswitch_engage(scope="team", team=team, reason="refunds are looping, INC-42")
    try:
        first = agent.check(run_id, "search.docs", {"q": 2})
        later = agent.check(run_id, "search.docs", {"q": 3})
    finally:
        from runs.killswitch.services import killswitch_release

        killswitch_release(scope="team", team=team, reason="test over")
    assert (first["decision"], first["reason"]) == ("stop", "killed")
    assert "INC-42" in first["message"]
    assert (later["decision"], later["reason"]) == ("stop", "killed")
    assert "INC-42" in later["message"]


def _uploaded_in_parts(agent: Agent, server: Server, checks: list[dict[str, Any]]) -> Any:
    """A fail-open run: one check online, then `checks` decided locally during an outage,
    uploaded when the service answers again (at the run's finish). A deadline of 10 s: an
    upload of a megabyte takes its turn within the bulk calls' share of the server's time
    (SPEC 10), and on a busy CI machine its second body waited past 1 s."""
    network = Outage()
    with GovernanceClient(server.url, agent.token, fail_mode="open", deadline=10,
                          transport=network) as client, client.run("support-bot") as run:
        assert run.check("search.docs", {"q": "online"}).allowed
        network.down = True
        local = [run.check("files.write", **check) for check in checks]
        network.down = False
        assert all(d.allowed and d.local for d in local)
    assert not run.unsynced
    return agent.http.get(f"/api/v1/runs/{run.id}").json()


def test_local_decisions_over_one_body_are_uploaded_in_several(
        agent: Agent, server: Server, team: Team, monkeypatch: pytest.MonkeyPatch) -> None:
    """The service takes 1,000 entries and 1 MiB per upload: the client sends as many
    bodies as it takes (here, its byte bound made 200 KB, 17 writes of 12.6 KB: two bodies;
    and 7 entries, 3 a body). Not a megabyte a body: each takes its turn within the bulk
    calls' share of the server's time (SPEC 10), and on a busy CI machine the second one
    waited past the client's deadline."""
    from governance_client import _core

    set_policy(team, step_limits={"max_steps": 100, "max_repeat_action": 100})
    monkeypatch.setattr(_core, "UPLOAD_MAX_BYTES", 200_000)
    blob = "x" * 12_600
    stored = _uploaded_in_parts(agent, server, [
        {"args": {"i": i, "blob": blob}} for i in range(17)])
    assert stored["steps"] == 18
    monkeypatch.setattr(_core, "UPLOAD_MAX_ENTRIES", 3)
    stored = _uploaded_in_parts(agent, server, [{"args": {"i": i}} for i in range(7)])
    assert stored["steps"] == 8


def test_an_upload_over_the_body_limit_is_sent_again_in_halves(
        agent: Agent, server: Server, team: Team, monkeypatch: pytest.MonkeyPatch) -> None:
    from governance_client import _core

    set_policy(team, step_limits={"max_steps": 100, "max_repeat_action": 100})
    monkeypatch.setattr(_core, "UPLOAD_MAX_BYTES", 10 * 1024 * 1024)  # as if measured wrong
    stored = _uploaded_in_parts(agent, server, [
        {"args": {"i": i, "blob": "x" * 63_000}} for i in range(17)])
    assert stored["steps"] == 18


def test_a_local_decision_the_service_refuses_costs_only_itself(
        agent: Agent, server: Server, caplog: pytest.LogCaptureFixture) -> None:
    """An action the client allowed locally whose body the service would have refused (NUL
    in its args): that entry is dropped and logged, the others are counted."""
    stored = _uploaded_in_parts(agent, server, [
        {"args": {"q": "before"}}, {"args": {"q": "nul\x00inside"}}, {"args": {"q": "after"}}])
    assert stored["steps"] == 3
    names = [d["action"]["args"].get("q") for d in decisions(agent, stored["run_id"])]
    assert names == ["online", "before", "after"]
    assert any("refused, dropped" in r.getMessage() and "decisions.1" in r.getMessage()
               for r in caplog.records)


def test_the_clients_upload_limits_fit_the_services(settings: Any) -> None:
    import annotated_types

    from governance_client import _core
    from runs.check.schemas import LocalDecisionsIn

    bounds = LocalDecisionsIn.model_fields["decisions"].metadata
    assert annotated_types.MaxLen(_core.UPLOAD_MAX_ENTRIES) in bounds
    assert _core.UPLOAD_MAX_BYTES < settings.DATA_UPLOAD_MAX_MEMORY_SIZE


class SlowFirstConnection:
    """A loopback proxy in front of the server that holds the first connection's bytes for
    ``hold`` seconds before passing them on (a swamped server that reads a request late);
    every later connection passes at once."""

    def __init__(self, target: str, hold: float) -> None:
        host, port = target.removeprefix("http://").split(":")
        self.target = (host, int(port))
        self.hold = hold
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            delay = self.hold if self.accepted == 1 else 0.0
            threading.Thread(target=self._serve, args=(conn, delay), daemon=True).start()

    def _serve(self, conn: socket.socket, delay: float) -> None:
        time.sleep(delay)
        upstream = socket.create_connection(self.target)

        def pipe(src: socket.socket, dst: socket.socket) -> None:
            try:
                while data := src.recv(65536):
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    with contextlib.suppress(OSError):
                        s.shutdown(socket.SHUT_RDWR)

        threading.Thread(target=pipe, args=(upstream, conn), daemon=True).start()
        pipe(conn, upstream)

    def close(self) -> None:
        self.listener.close()


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_start_read_late_is_sent_again_and_makes_one_run(
    agent: Agent, server: Server, team: Team, kind: str
) -> None:
    """A start whose first attempt the server reads late (past the attempt's share of the
    deadline) is sent again at once, without the author's external_id: the client's own id
    makes it safe, the start gets its whole deadline, and the late attempt finds the run."""
    proxy = SlowFirstConnection(server.url, hold=1.5)
    try:
        if kind == "sync":
            with GovernanceClient(proxy.url, agent.token, deadline=4.0) as client:
                run_id = client.start_run("late-bot").id
        else:
            async def start() -> str:
                async with AsyncGovernanceClient(proxy.url, agent.token,
                                                 deadline=4.0) as client:
                    return (await client.start_run("late-bot")).id
            run_id = asyncio.run(start())
        time.sleep(2.0)  # the held attempt reaches the server too
    finally:
        proxy.close()

    assert proxy.accepted >= 2
    assert list(Run.objects.filter(team=team, agent="late-bot").values_list("pk", flat=True)) \
        == [uuid.UUID(run_id)]


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_fail_open_decisions_of_a_run_that_ended_in_the_outage_reach_the_service_later(
    agent: Agent, server: Server, tmp_path: Any, kind: str
) -> None:
    """The run's block ends while the service is unreachable: its local decisions and its
    finish are kept in the journal and sent by the next start, instead of the run staying
    `running` at step 1."""
    network = Outage()
    options: dict[str, Any] = {"fail_mode": "open", "deadline": 1, "journal": tmp_path}
    if kind == "sync":
        with GovernanceClient(server.url, agent.token, transport=network, **options) as client:
            with client.run("support-bot") as run:
                assert run.check("search.docs", {"q": "refunds"}).allowed
                network.down = True
                assert all(run.check("search.docs", {"q": q}).local for q in ("a", "b"))
                run.output = "Read two more pages offline."
            run_id = run.id
            assert agent.http.get(f"/api/v1/runs/{run_id}").json()["steps"] == 1
            network.down = False
            client.start_run("support-bot")
    else:
        async def scenario() -> str:
            async with AsyncGovernanceClient(server.url, agent.token,
                                             transport=AsyncOutage(network),
                                             **options) as client:
                async with client.run("support-bot") as run:
                    assert (await run.check("search.docs", {"q": "refunds"})).allowed
                    network.down = True
                    for q in ("a", "b"):
                        assert (await run.check("search.docs", {"q": q})).local
                    run.output = "Read two more pages offline."
                network.down = False
                await client.start_run("support-bot")
                return run.id
        run_id = asyncio.run(scenario())

    stored = agent.http.get(f"/api/v1/runs/{run_id}").json()
    assert (stored["status"], stored["steps"], stored["output"]) == (
        "completed", 3, "Read two more pages offline.")
    assert [(d["outcome"], d["local"]) for d in decisions(agent, run_id)] == [
        ("allow", False), ("allow", True), ("allow", True)]
    assert list(tmp_path.glob("*.json")) == []


class AsyncOutage(httpx.AsyncBaseTransport):
    """Outage for the async client: the same switch."""

    def __init__(self, outage: Outage) -> None:
        self.outage = outage
        self.inner = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.outage.down:
            raise httpx.ConnectError("network unreachable (test outage)", request=request)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()
