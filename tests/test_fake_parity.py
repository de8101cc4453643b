"""FakeGovernance answers as the server does: one table of scenarios, run through the fake and
through the real API (in process, over WSGI), and the answers compared field by field.

Both sides get the same policy (the server's stored version, `rules_for_version`) and the same
clock, started at the same moment: the fake's own, and the server's `timezone.now` patched to
move only when a scenario waits. What cannot be the same is normalised: ids, and the
rate-limit waits on PostgreSQL, whose windows are stamped by the database's clock (rounded to
the second; a scenario that needs the windows to move with the scenario's clock runs on
SQLite only).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from django.db import connection
from governance_client.testing import BASE_URL, FakeGovernance

from governance_client import rules
from policies.document import parse_policy
from policies.models import Team
from policies.services import policy_save
from runs.approvals.services import approval_decide
from runs.check.policy_cache import rules_for_version
from runs.killswitch.services import resolve_target
from runs.models import KillSwitch
from tests.conftest import set_policy
from tests.on_this_thread import keeps_the_test_connection

RATE = {"rate_limits": [{"match": "http.*", "per": "run", "max": 1, "window_s": 60}]}
APPROVALS = {"approvals": {"tools": ["refund.*"], "timeout_s": 900}}
NO_TIME_BUDGET = {"budgets": {"max_seconds": None, "max_usd": 1.0}}


def check(name: str = "search.docs", args: dict[str, Any] | None = None, *,
          check_id: str | None = None, **extra: Any) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"action": {"name": name, "type": "tool", "args": args or {}},
                            **extra}
    if check_id is not None:
        body["check_id"] = check_id
    return ("check", body)


def wait(seconds: float) -> tuple[str, float]:
    return ("wait", seconds)


# name: (the policy's changes, the steps). A step: a check, a wait (both clocks move), an
# operator's approve / deny of the run's pending request, the agent's poll of it (GET
# /api/v1/approvals/{id}), a kill switch engaged, a second start, a finish.
SCENARIOS: dict[str, tuple[dict[str, Any], list[tuple[str, Any]]]] = {
    "allow": ({}, [check(), check("files.read", {"path": "a"}, progress=1),
                   ("finish", "completed")]),
    "max_steps": ({"step_limits": {"max_steps": 2}}, [
        check(args={"q": 1}), check(args={"q": 2}), check(args={"q": 3}),
        check(args={"q": 4}), ("finish", "completed")]),
    "loop_detected": ({"step_limits": {"max_repeat_action": 2}}, [
        check(args={"q": 1}), check(args={"q": 1}), check(args={"q": 1})]),
    "tool_denied": ({"tools": {"allow": None, "deny": ["shell.*"]}}, [
        check("shell.exec", {"cmd": "ls"}), check()]),
    "max_usd": ({"budgets": {"max_usd": 0.5}}, [
        check(args={"q": 1}, cost_usd=0.3), check(args={"q": 2}, cost_usd=0.3),
        check(args={"q": 3})]),
    "max_seconds": ({}, [check(args={"q": 1}), wait(30), check(args={"q": 2}), wait(20),
                         check(args={"q": 3})]),
    "max_tool_calls": ({"budgets": {"max_tool_calls": 1}}, [
        check(args={"q": 1}), check(args={"q": 2})]),
    "repeated_error_nudge": ({}, [
        check(args={"q": n}, last_result={"status": "error", "error": "boom"})
        for n in range(4)]),
    "shadow": ({"mode": "shadow", "tools": {"allow": None, "deny": ["shell.*"]}}, [
        check("shell.exec", {"cmd": "ls"}), check()]),
    "rate_limit_wait": ({**RATE, **NO_TIME_BUDGET}, [
        check("http.get", {"n": 1}, check_id="h1"), check("http.get", {"n": 2}, check_id="h2"),
        check("search.docs"), check("http.get", {"n": 2}, check_id="h2")]),
    # Room again once the counted action leaves the window (exactly window_s later).
    "rate_limit_room_again": ({**RATE, **NO_TIME_BUDGET}, [
        check("http.get", {"n": 1}, check_id="h1"), wait(30),
        check("http.get", {"n": 2}, check_id="h2"), wait(30),
        check("http.get", {"n": 2}, check_id="h2")]),
    "rate_limit_past_the_time_budget": (RATE, [
        check("http.get", {"n": 1}), check("http.get", {"n": 2}), check()]),
    "approval_approved": (APPROVALS, [
        check("refund.issue", {"order": 7}, check_id="r1"), check(),
        check("refund.issue", {"order": 7}, check_id="r1"), wait(5), ("poll", None),
        ("approve", None), ("poll", None),
        check("refund.issue", {"order": 7}, check_id="r1"), check(),
        ("finish", "completed")]),
    "approval_denied": (APPROVALS, [
        check("refund.issue", {"order": 7}, check_id="r1"), wait(3),
        ("deny", "not over 100 EUR"), ("poll", None),
        check("refund.issue", {"order": 7}, check_id="r1"),
        check(), ("finish", "completed")]),
    "approval_expired": (APPROVALS, [
        check(args={"q": 1}), check("refund.issue", {"order": 7}, check_id="r1"), wait(901),
        ("poll", None), check("refund.issue", {"order": 7}, check_id="r1"), check(),
        ("finish", "failed")]),
    "approval_cancelled_by_a_finish": (APPROVALS, [
        check("refund.issue", {"order": 7}, check_id="r1"), wait(10), ("finish", "stopped"),
        ("poll", None), check("refund.issue", {"order": 7}, check_id="r1"), check()]),
    "approval_needs_a_check_id": (APPROVALS, [check("refund.issue", {"order": 7})]),
    "approval_cancelled_by_a_kill_switch": (APPROVALS, [
        check("refund.issue", {"order": 7}, check_id="r1"), ("kill", "incident 12"),
        check("refund.issue", {"order": 7}, check_id="r1")]),
    "kill_switch": ({}, [check(args={"q": 1}), ("kill", "incident 12"),
                         check(args={"q": 2}), ("start", None)]),
    # SPEC 16 warnings: the repeat warning at 2 of 3, the no-progress one at 3 of 4, the
    # budget's once (steps 15 of 18), the nearest of several, a model that changes course.
    "warning_repeat_action": ({}, [check(args={"q": 1}), check(args={"q": 1}),
                                   check(args={"q": 1}), check(args={"q": 1})]),
    "warning_no_progress": ({}, [check(args={"q": n}, progress="same") for n in range(5)]),
    "warning_budget_once": ({**NO_TIME_BUDGET, "step_limits": {"max_steps": 6}}, [
        check(args={"q": n}) for n in range(7)]),
    "warning_then_a_change_of_action": ({}, [
        check(args={"q": 1}), check(args={"q": 1}), check("files.read", {"path": "a"}),
        ("finish", "completed")]),
    "warnings_off": ({"warnings": None}, [check(args={"q": 1}), check(args={"q": 1})]),
    # SPEC 14: the check that finds the run idle ends it `abandoned` and names the limit,
    # as every later one does; a finish after the deadline finds it so.
    "abandoned": ({"budgets": {"max_seconds": None, "max_idle_seconds": 60}}, [
        check(args={"q": 1}, check_id="a"), wait(61), check(args={"q": 1}, check_id="a"),
        check(args={"q": 2}), ("finish", "completed")]),
    "abandoned_then_finished": ({"budgets": {"max_seconds": None, "max_idle_seconds": 60}}, [
        check(args={"q": 1}), wait(61), ("finish", "completed"), check(args={"q": 2})]),
    # A finish after the time budget ran out with no check finds it stopped max_seconds.
    "out_of_time_then_finished": ({"budgets": {"max_seconds": 10}}, [
        check(args={"q": 1}), wait(20), ("finish", "completed"), check(args={"q": 2})]),
    "replay": ({"step_limits": {"max_steps": 1}}, [
        check(args={"q": 1}, check_id="a"), check(args={"q": 1}, check_id="a"),
        check(args={"q": 2}, check_id="b"), check(args={"q": 1}, check_id="a")]),
}

# Scenarios whose rate-limit windows must move with the scenario's clock.
MOVES_RATE_WINDOWS = {"rate_limit_room_again"}

UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
WAITED = re.compile(r"(\d+\.\d{3}) s")


def normal(value: Any) -> Any:
    """An answer with what cannot match replaced: ids by a placeholder, a wait in seconds
    rounded to the second (PostgreSQL's stamps are its own clock's). Times are compared as
    written: both sides start their clocks at the same moment."""
    if isinstance(value, dict):
        return {k: round(v) if k == "retry_after_s" and v is not None else normal(v)
                for k, v in value.items() if k not in ("decision_id", "run_id", "started_at")}
    if isinstance(value, list):
        return [normal(v) for v in value]
    if isinstance(value, str):
        value = UUID.sub("<id>", value)
        return WAITED.sub(lambda m: f"{round(float(m.group(1)))} s", value)
    return value


class Side:
    """One of the two services the scenario runs through."""

    http: httpx.Client

    def __init__(self, http: httpx.Client) -> None:
        self.http = http
        self.run_id = ""
        self.approval_id = ""

    def advance(self, seconds: float) -> None:
        raise NotImplementedError

    def decide(self, verdict: str, note: str | None) -> None:
        raise NotImplementedError

    def kill(self, reason: str) -> None:
        raise NotImplementedError

    def play(self, steps: list[tuple[str, Any]]) -> list[Any]:
        answers = [self.start()]
        for kind, arg in steps:
            if kind == "check":
                answers.append(self.send(f"/api/v1/runs/{self.run_id}/check", arg))
            elif kind == "finish":
                answers.append(self.send(f"/api/v1/runs/{self.run_id}/finish",
                                         {"status": arg}))
            elif kind == "poll":
                response = self.http.get(f"/api/v1/approvals/{self.approval_id}")
                answers.append({"status": response.status_code,
                                "body": normal(response.json())})
            elif kind == "start":
                answers.append(self.start())
            elif kind == "wait":
                self.advance(arg)
            elif kind in ("approve", "deny"):
                self.decide(kind, arg)
            elif kind == "kill":
                self.kill(arg)
        return answers

    def start(self) -> Any:
        response = self.http.post("/api/v1/runs", json={"agent": "support-bot"})
        if response.status_code == 201:
            self.run_id = response.json()["run_id"]
            # The server's start answers fewer of the run's fields than the fake's.
            return {"status": 201, "run": {k: response.json()[k] for k in ("agent", "status")}}
        return {"status": response.status_code, "body": normal(response.json())}

    def send(self, path: str, body: dict[str, Any]) -> Any:
        response = self.http.post(path, json=body)
        data = response.json()
        if response.status_code == 200 and data.get("decision") == rules.PENDING:
            self.approval_id = data["approval"]["id"]
        if "run_id" in data and "decision" not in data:  # a finish: the run as it ended
            data = {k: data[k] for k in ("status", "stop_reason", "steps", "tool_calls",
                                         "cost_usd")}
        return {"status": response.status_code, "body": normal(data)}


class FakeSide(Side):
    def __init__(self, fake: FakeGovernance) -> None:
        super().__init__(httpx.Client(transport=fake.transport(), base_url=BASE_URL,
                                      headers={"Authorization": f"Bearer {fake.api_key}"}))
        self.fake = fake

    def advance(self, seconds: float) -> None:
        self.fake.advance(seconds)

    def decide(self, verdict: str, note: str | None) -> None:
        self.fake.decide(self.approval_id, verdict, note)  # type: ignore[arg-type]

    def kill(self, reason: str) -> None:
        self.fake.kill_switch_by, self.fake.kill_switch = "ops", reason


class ServerSide(Side):
    def __init__(self, http: httpx.Client, clock: list[datetime], team: Team) -> None:
        super().__init__(http)
        self.clock, self.team = clock, team

    def advance(self, seconds: float) -> None:
        self.clock[0] += timedelta(seconds=seconds)

    def decide(self, verdict: str, note: str | None) -> None:
        approval_decide(team=self.team, approval_id=self.approval_id, decision=verdict,
                        note=note)

    def kill(self, reason: str) -> None:
        # Engaged and committed, its fan-out not yet run: every check from now on is
        # covered (SPEC 4.5), which is what the fake's switch is.
        target = resolve_target(scope="global")
        KillSwitch.objects.create(scope=target.scope, target=target.key, reason=reason,
                                  engaged_by_label="ops", engaged_at=self.clock[0])


@pytest.fixture
def wsgi(agent_token: str) -> Iterator[httpx.Client]:
    from governance.wsgi import application

    with keeps_the_test_connection(), httpx.Client(
            transport=httpx.WSGITransport(app=application), base_url="http://127.0.0.1",
            headers={"Authorization": f"Bearer {agent_token}"}) as http:
        yield http


@pytest.mark.django_db
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_fake_answers_each_scenario_as_the_server_does(
        name: str, team: Team, wsgi: httpx.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    changes, steps = SCENARIOS[name]
    if name in MOVES_RATE_WINDOWS and connection.vendor == "postgresql":
        pytest.skip("PostgreSQL stamps rate-limit windows with its own clock, which a "
                    "test cannot move")
    if changes:
        set_policy(team, **changes)
    clock = [datetime.now(UTC).replace(microsecond=0)]
    monkeypatch.setattr("django.utils.timezone.now", lambda: clock[0])
    policy = rules_for_version(team.policies.get(name="default").current_id)

    start = clock[0]
    served = ServerSide(wsgi, clock, team).play(steps)
    faked = FakeSide(FakeGovernance(policy=policy, start_time=start)).play(steps)

    assert len(faked) == len(served)
    for n, (fake_answer, server_answer) in enumerate(zip(faked, served, strict=True)):
        if connection.vendor == "postgresql":
            # Its windows are stamped by the database's clock, which runs on while the
            # scenario's stands still: the waits agree within 2 s (CI's load once moved
            # one across a rounding boundary), and everything else exactly.
            fake_waits, server_waits = waits(fake_answer), waits(server_answer)
            assert len(fake_waits) == len(server_waits), f"{name}, answer {n}"
            assert all(abs(f - s) <= 2 for f, s in zip(fake_waits, server_waits,
                                                       strict=True)), f"{name}, answer {n}"
            fake_answer, server_answer = unwaited(fake_answer), unwaited(server_answer)
        assert fake_answer == server_answer, f"{name}, answer {n}"


SECONDS = re.compile(r"\b(\d+) s\b")


def waits(value: Any) -> list[int]:
    """Every wait an answer names, in order: its retry_after_s, and the seconds its
    messages give (as `normal` wrote them)."""
    if isinstance(value, dict):
        return [w for k, v in value.items()
                for w in ([round(v)] if k == "retry_after_s" and v is not None else waits(v))]
    if isinstance(value, list):
        return [w for v in value for w in waits(v)]
    if isinstance(value, str):
        return [int(m) for m in SECONDS.findall(value)]
    return []


def unwaited(value: Any) -> Any:
    """The answer with each wait `waits` names replaced by a placeholder."""
    if isinstance(value, dict):
        return {k: "<wait>" if k == "retry_after_s" and v is not None else unwaited(v)
                for k, v in value.items()}
    if isinstance(value, list):
        return [unwaited(v) for v in value]
    if isinstance(value, str):
        return SECONDS.sub("<wait> s", value)
    return value


@pytest.mark.django_db
@pytest.mark.parametrize("warnings", [
    None, {}, {"budget_fraction": 0.5}, {"repeat_action": 1}, {"no_progress": None}])
def test_a_fake_from_a_policy_file_warns_as_the_server_saves_that_file(
        warnings: dict[str, Any] | None, team: Team, tmp_path: Any) -> None:
    """SPEC 3, 16: what a file omits takes the default, the warnings block's keys one by one
    too. Found by an attacker: a block naming only budget_fraction turned the two other
    warnings off in the fake, while the server warned."""
    policy: dict[str, Any] = {
        "name": "default", "step_limits": {"max_steps": 10, "max_repeat_action": 3,
                                           "no_progress_window": 4},
        "budgets": {"max_seconds": None, "max_usd": None}}
    if warnings is not None:
        policy["warnings"] = warnings
    path = tmp_path / "policies.json"
    path.write_text(json.dumps({"teams": [{"slug": team.slug, "policies": [policy]}]}))
    # As the API's PUT and `govctl policies apply` save it: normalised first.
    version = policy_save(team=team, document=parse_policy(policy), actor=None, source="test")
    assert version is not None
    served = rules_for_version(version.pk)
    faked = FakeGovernance.from_policy_file(path, team=team.slug).policy
    fields = ("warn_repeat_action", "warn_no_progress", "warn_budget_fraction")
    assert [getattr(faked, f) for f in fields] == [getattr(served, f) for f in fields]
