"""A hypothesis state machine for SPEC 10's "No impossible states": agents start, check,
upload local decisions and finish runs through the API; operators approve and deny on the
dashboard and engage and release kill switches; the fan-out, the expiry sweep and the
abandoned-run sweep run whenever they like (the sweeps possibly much later, as if time had
passed). After every step no run that is over has an approval pending (neither a request's
row nor the run's memory), and no read answers 500: the API's lists and the approval's poll,
the overview, runs, approvals and run pages. An approval read after its run ended never
answers an allow.

In process (Django's test client), on whichever stack the suite runs on."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from governance_client import rules
from policies.models import Team
from policies.services import agent_key_create
from runs.approvals.services import expire_due
from runs.check.abandon import abandon_idle_runs
from runs.killswitch.fanout import killswitch_fanout
from runs.killswitch.services import KillSwitchError, killswitch_engage, killswitch_release
from runs.models import Approval, ApprovalStatus, KillSwitch, Run
from tests.conftest import set_policy

# Transactional: on PostgreSQL the check then takes its production path.
pytestmark = pytest.mark.django_db(transaction=True)

# Weighted towards the action that waits for an operator: the states worth exploring.
ACTIONS = ["search.docs", "payments.refund", "payments.refund", "shell.exec"]
CHECK_IDS = ["c1", "c2", "c3", "pay-1", "pay-2"]
LOCAL_STOPS = ["loop_detected", "max_steps", "tool_denied"]
PAGES = ["", "runs/", "approvals/"]

class Governed(RuleBasedStateMachine):
    def __init__(self, team: Team, agent: Client, operator: Client) -> None:
        super().__init__()
        self.team, self.agent, self.operator = team, agent, operator
        self.started: list[str] = []

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return self.agent.post(path, json.dumps(body), content_type="application/json")

    # --- Agents -------------------------------------------------------------------------

    def current(self) -> str | None:
        """The agent's run: the last one started while it runs, else a new one (None while
        a kill switch refuses new runs). Agents act on a run that goes on, so that the
        states worth exploring (a run waiting for an operator) come often."""
        if self.started and Run.objects.filter(pk=self.started[-1],
                                               status=rules.RUNNING).exists():
            return self.started[-1]
        response = self.post("/api/v1/runs", {"agent": "model-bot"})
        assert response.status_code in (201, 409), response.content
        if response.status_code == 409:
            assert response.json()["error"]["code"] == "kill_switch_engaged"
            return None
        self.started.append(response.json()["run_id"])
        return self.started[-1]

    @rule(name=st.sampled_from(ACTIONS), check_id=st.sampled_from(CHECK_IDS))
    def check(self, name: str, check_id: str) -> None:
        run = self.current()
        if run is None:
            return
        response = self.post(f"/api/v1/runs/{run}/check",
                             {"action": {"name": name}, "check_id": check_id})
        assert response.status_code in (200, 409), response.content
        if response.status_code == 409:
            assert response.json()["error"]["code"] == "approval_pending"

    @rule(name=st.sampled_from(ACTIONS), check_id=st.sampled_from(CHECK_IDS),
          stop=st.sampled_from([None, *LOCAL_STOPS]))
    def upload(self, name: str, check_id: str, stop: str | None) -> None:
        run = self.current()
        if run is None:
            return
        entry = {"check_id": f"local-{check_id}", "action": {"name": name},
                 "decision": "stop" if stop else "allow", "reason": stop or "step_ok"}
        response = self.post(f"/api/v1/runs/{run}/local-decisions", {"decisions": [entry]})
        assert response.status_code == 200, response.content

    @precondition(lambda self: self.started)
    @rule(which=st.integers(0, 10), status=st.sampled_from(["completed", "failed", "stopped"]))
    def finish(self, which: int, status: str) -> None:
        run = self.started[-1 - which % len(self.started)]  # the current run mostly
        response = self.post(f"/api/v1/runs/{run}/finish", {"status": status})
        assert response.status_code in (200, 409), response.content

    # --- Operators ----------------------------------------------------------------------

    @precondition(lambda self: self.started)
    @rule(decision=st.sampled_from(["approve", "deny"]), which=st.integers(0, 10))
    def decide(self, decision: str, which: int) -> None:
        approvals = list(Approval.objects.filter(run_id__in=self.started).order_by("requested_at"))
        if not approvals:
            return
        approval = approvals[which % len(approvals)]
        response = self.operator.post(
            f"/teams/{self.team.slug}/approvals/{approval.pk}/decide",
            {"decision": decision, "note": "no"})
        assert response.status_code in (302, 409), (response.status_code, approval.status)

    @precondition(lambda self: self.started)
    @rule(scope=st.sampled_from(["run", "run", "team"]))
    def engage(self, scope: str) -> None:
        target = Run.objects.get(pk=self.started[-1]) if scope == "run" else None
        try:
            killswitch_engage(scope=scope, team=self.team if scope == "team" else None,
                              run=target, reason="model")
        except KillSwitchError:
            # A run that is over, and never had a switch: nothing to kill.
            assert target is not None and Run.objects.get(pk=target.pk).status != "running"

    @rule(release=st.booleans())
    def fan_out_or_release(self, release: bool) -> None:
        if release:
            killswitch_release(scope="team", team=self.team, reason="model")
            return
        for switch in KillSwitch.objects.filter(fanout_done_at__isnull=True):
            killswitch_fanout(switch_id=switch.pk)

    # --- Sweeps, now or much later --------------------------------------------------------

    @rule(sweep=st.sampled_from(["expiry", "idle"]), later=st.booleans())
    def sweep(self, sweep: str, later: bool) -> None:
        if sweep == "expiry":
            expire_due(now=timezone.now() + timedelta(seconds=601 if later else 0))
        else:
            abandon_idle_runs(now=timezone.now() + timedelta(seconds=3601 if later else 0))

    # --- Reads ----------------------------------------------------------------------------

    @precondition(lambda self: self.started)
    @rule()
    def look(self) -> None:
        """Every screen and every read of the API, as anyone might at any moment."""
        for page in PAGES:
            response = self.operator.get(f"/teams/{self.team.slug}/{page}")
            assert response.status_code == 200, page
        assert self.agent.get("/api/v1/runs?limit=500").status_code == 200
        run = self.started[-1]
        assert self.operator.get(f"/teams/{self.team.slug}/runs/{run}/").status_code == 200
        assert self.agent.get(f"/api/v1/runs/{run}").status_code == 200
        assert self.agent.get(f"/api/v1/runs/{run}/decisions").status_code == 200
        for approval in Approval.objects.filter(run_id__in=self.started):
            response = self.agent.get(f"/api/v1/approvals/{approval.pk}")
            assert response.status_code == 200, response.content
            body = response.json()
            if Run.objects.get(pk=approval.run_id).status != rules.RUNNING:
                # Never an allow for a run that is over: its stop, as a replay answers.
                assert body["status"] != "pending"
                assert body["decision"]["decision"] == "stop", body

    # --- What must always hold --------------------------------------------------------------

    @invariant()
    def no_run_is_over_while_an_approval_is_pending(self) -> None:
        # This example's runs: the database outlives examples (what one left must not
        # fail the next, or shrinking could not replay it).
        stale = Approval.objects.filter(run_id__in=self.started,
                                        status=ApprovalStatus.PENDING).exclude(
            run__status=rules.RUNNING)
        assert not stale.exists(), list(stale.values("run__status", "run__stop_reason"))
        for run in Run.objects.filter(pk__in=self.started).exclude(status=rules.RUNNING):
            assert not (run.memory or {}).get("pending"), (run.status, run.stop_reason)

    def teardown(self) -> None:
        # Switches would outlive this example and refuse the next one's starts.
        for switch in KillSwitch.objects.filter(active=True):
            killswitch_release(scope=switch.scope, team=switch.team, run=switch.run,
                               reason="teardown")


@pytest.fixture
def clients(team: Team, users: dict[str, User]) -> Iterator[tuple[Client, Client]]:
    set_policy(team, tools={"deny": ["shell.*"]},
               approvals={"tools": ["payments.*"], "timeout_s": 600},
               budgets={"max_idle_seconds": 3600})
    token = agent_key_create(team=team, name="model").token
    operator = Client()
    operator.force_login(users["operator"])
    # The fan-out runs when the machine says so (its own rule), as a busy broker would have
    # it, so that every look can come first.
    with mock.patch("runs.killswitch.services._enqueue_fanout"):
        yield Client(HTTP_AUTHORIZATION=f"Bearer {token}"), operator


def test_no_run_is_ever_over_with_an_approval_pending(team: Team,
                                                     clients: tuple[Client, Client]) -> None:
    agent, operator = clients
    run_state_machine_as_test(
        lambda: Governed(team, agent, operator),
        # Sized for CI (two suites side by side on 2 cores): it found the defect within
        # seconds; more examples cost minutes on PostgreSQL.
        settings=settings(max_examples=20, stateful_step_count=30, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.filter_too_much]),
    )
