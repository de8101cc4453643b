"""An in-process fake of the governance service, for testing agents without a server.

It implements the HTTP surface of SPEC 5 (start, get, check, finish, error bodies) and the part
of the SPEC 4 rules that agent tests usually need: ``max_steps``, ``max_repeat_action`` (with the
server's repeat key), the repeated-error nudge, ``check_id`` replay and a global kill switch.
Budgets, tool lists, progress and shadow mode are left to the real service::

    fake = FakeGovernance(max_repeat_action=3)
    with fake.client() as client, client.run("my-agent") as run:
        ...
    assert fake.runs[run.id].stop_reason == "loop_detected"
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx

from .client import GovernanceClient
from .keys import normalize_text, repeat_key

__all__ = ["FakeGovernance", "FakeRun"]

BASE_URL = "http://governance.test"
AGENT_RE = re.compile(r"[A-Za-z0-9._-]{1,100}")
TERMINAL = frozenset({"stopped", "killed", "completed", "failed"})
NEXT_ACTION = {
    "killed": "Stop now and return the partial response: an operator engaged the kill switch.",
    "max_steps": "Return the partial response, then split the task or relaunch with a narrower "
    "scope.",
    "loop_detected": "Return the partial response, then reformulate the request or relaunch with "
    "a narrower scope.",
    "run_finished": "The run is over: do not execute the action; start a new run for new work.",
}


@dataclass
class FakeRun:
    id: str
    agent: str
    task: str | None = None
    external_id: str | None = None
    status: str = "running"
    stop_reason: str | None = None
    steps: int = 0
    tool_calls: int = 0
    output: str | None = None
    finished: bool = False
    repeat_counts: dict[str, int] = field(default_factory=dict)
    error_counts: dict[str, int] = field(default_factory=dict)
    answers: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False)
    #: Every check body received (replays included), in order.
    checks: list[dict[str, Any]] = field(default_factory=list, repr=False)
    #: Every decision answered (replays excluded), in order.
    decisions: list[dict[str, Any]] = field(default_factory=list, repr=False)
    started_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat())

    def as_json(self) -> dict[str, Any]:
        return {
            "run_id": self.id,
            "agent": self.agent,
            "status": self.status,
            "stop_reason": self.stop_reason,
            "steps": self.steps,
            "tool_calls": self.tool_calls,
            "started_at": self.started_at,
            "task": self.task,
            "output": self.output,
        }


@dataclass
class _Failure:
    failure: int | Exception | type[Exception]
    processed: bool


class FakeGovernance:
    """The fake service; ``client()`` gives a ``GovernanceClient`` wired to it (no sleeping)."""

    def __init__(
        self,
        *,
        api_key: str = "test-key",
        max_steps: int = 18,
        max_repeat_action: int = 3,
        error_threshold: int = 3,
        ignore_args: Iterable[str] = (),
        policies: Iterable[str] = ("default",),
    ) -> None:
        self.api_key = api_key
        self.max_steps = max_steps
        self.max_repeat_action = max_repeat_action
        self.error_threshold = error_threshold
        self.ignore_args = tuple(ignore_args)
        self.policies = set(policies)
        self.runs: dict[str, FakeRun] = {}
        self.kill_switch: str | None = None
        #: While True, every request fails with a connection error (an outage).
        self.down = False
        self.requests: list[httpx.Request] = []
        self._failures: list[_Failure] = []

    def fail_next(
        self, *failures: int | Exception | type[Exception], processed: bool = False
    ) -> None:
        """Make the next requests fail with these statuses or exceptions. With ``processed``,
        the request is handled first and only its answer is lost (e.g. a read timeout)."""
        self._failures.extend(_Failure(f, processed) for f in failures)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def client(self, **kwargs: Any) -> GovernanceClient:
        kwargs.setdefault("sleep", lambda _seconds: None)
        return GovernanceClient(BASE_URL, self.api_key, transport=self.transport(), **kwargs)

    def limits(self) -> dict[str, Any]:
        return {
            "max_steps": self.max_steps,
            "max_repeat_action": self.max_repeat_action,
            "no_progress_window": 4,
            "max_seconds": None,
            "max_usd": None,
            "max_tool_calls": None,
        }

    # -- HTTP -----------------------------------------------------------------------------------

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if self.down:
            raise httpx.ConnectError("connection refused (fake outage)", request=request)
        failure = self._failures.pop(0) if self._failures else None
        if failure is not None and not failure.processed:
            return _fail(failure.failure, request)
        response = self._route(request)
        if failure is not None:
            return _fail(failure.failure, request)
        return response

    def _route(self, request: httpx.Request) -> httpx.Response:
        if request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return _error(401, "unauthorized", "Missing, unknown or revoked agent key.")
        try:
            body = json.loads(request.content or b"{}")
        except ValueError:
            return _error(400, "invalid_json", "The body is not JSON.")
        parts = request.url.path.strip("/").split("/")
        if parts[:3] != ["api", "v1", "runs"]:
            return _error(404, "not_found", "No such endpoint.")
        if len(parts) == 3 and request.method == "POST":
            return self._start(body)
        run = self.runs.get(parts[3]) if len(parts) > 3 else None
        if run is None:
            return _error(404, "not_found", "No such run.")
        if len(parts) == 4 and request.method == "GET":
            return httpx.Response(200, json=run.as_json())
        if len(parts) == 5 and parts[4] == "check" and request.method == "POST":
            return self._check(run, body)
        if len(parts) == 5 and parts[4] == "finish" and request.method == "POST":
            return self._finish(run, body)
        return _error(405, "method_not_allowed", "Method not allowed.")

    def _start(self, body: dict[str, Any]) -> httpx.Response:
        agent = body.get("agent")
        if not isinstance(agent, str) or not AGENT_RE.fullmatch(agent):
            fields = {"agent": "must match [A-Za-z0-9._-]{1,100}"}
            return _error(422, "invalid_request", "Invalid run.", fields)
        policy = body.get("policy") or "default"
        if policy not in self.policies:
            return _error(422, "invalid_request", "Invalid run.", {"policy": "unknown policy"})
        external_id = body.get("external_id")
        for run in self.runs.values():
            if external_id is not None and run.external_id == external_id:
                return httpx.Response(200, json=self._run_json(run, policy))
        if self.kill_switch is not None:
            return _error(409, "kill_switch_engaged", f"Kill switch engaged: {self.kill_switch}")
        run = FakeRun(
            id=str(uuid.uuid4()), agent=agent, task=body.get("task"), external_id=external_id
        )
        self.runs[run.id] = run
        return httpx.Response(201, json=self._run_json(run, policy))

    def _run_json(self, run: FakeRun, policy: str) -> dict[str, Any]:
        step_limits = {
            "max_steps": self.max_steps,
            "max_repeat_action": self.max_repeat_action,
            "no_progress_window": 4,
        }
        return run.as_json() | {
            "policy": {
                "name": policy,
                "version": 1,
                "mode": "enforce",
                "step_limits": step_limits,
                "budgets": {"max_seconds": None, "max_usd": None, "max_tool_calls": None},
            }
        }

    def _check(self, run: FakeRun, body: dict[str, Any]) -> httpx.Response:
        run.checks.append(body)
        action = body.get("action")
        if not isinstance(action, dict) or not isinstance(action.get("name"), str):
            return _error(422, "invalid_request", "Invalid check.", {"action.name": "required"})
        check_id = body.get("check_id")
        if run.status == "running" and check_id in run.answers:
            return httpx.Response(200, json=run.answers[check_id])
        name, args = action["name"], action.get("args") or {}
        key = repeat_key(name, args, self.ignore_args)
        if run.status in TERMINAL:
            reason = run.stop_reason or "run_finished"
            answer = self._answer(run, "stop", reason, key, f"The run is already {run.status}.")
            run.decisions.append(answer)
            return httpx.Response(200, json=answer)

        run.steps += 1
        result = body.get("last_result") or {}
        error = result.get("error") if result.get("status") == "error" else None
        error = normalize_text(error) if isinstance(error, str) else None
        if error:
            run.error_counts[error] = run.error_counts.get(error, 0) + 1
        count = run.repeat_counts.get(key, 0)
        stop: tuple[str, str] | None = None
        if self.kill_switch is not None:
            stop = "killed", f"Stopped by a kill switch: {self.kill_switch}."
        elif run.steps > self.max_steps:
            stop = "max_steps", f"Step {run.steps} exceeds max_steps={self.max_steps}."
        elif count >= self.max_repeat_action:
            stop = (
                "loop_detected",
                (
                    f"{name} was called {count} times with the same arguments "
                    f"(max_repeat_action={self.max_repeat_action})."
                ),
            )
        if stop is not None:
            run.status = "killed" if stop[0] == "killed" else "stopped"
            run.stop_reason = stop[0]
            answer = self._answer(run, "stop", stop[0], key, stop[1])
        else:
            run.repeat_counts[key] = count + 1
            if action.get("type", "tool") == "tool":
                run.tool_calls += 1
            answer = self._answer(run, "allow", "step_ok", key, None)
            seen = run.error_counts.get(error, 0) if error else 0
            if error and seen >= self.error_threshold:
                answer["directive"] = {
                    "type": "inject_message",
                    "role": "user",
                    "content": f"The error '{error}' occurred {seen} times. "
                    "Change approach radically or abandon this subtask.",
                }
        if isinstance(check_id, str):
            run.answers[check_id] = answer
        run.decisions.append(answer)
        return httpx.Response(200, json=answer)

    def _answer(
        self, run: FakeRun, decision: str, reason: str, key: str, message: str | None
    ) -> dict[str, Any]:
        return {
            "decision": decision,
            "reason": reason,
            "decision_id": sum(len(r.decisions) for r in self.runs.values()) + 1,
            "step": run.steps,
            "repeat_key": key,
            "repeat_count": run.repeat_counts.get(key, 0),
            "message": message,
            "next_action": NEXT_ACTION.get(reason) if decision == "stop" else None,
            "usage": {"steps": run.steps, "tool_calls": run.tool_calls, "cost_usd": 0.0},
            "limits": self.limits(),
            "directive": None,
            "shadow": None,
        }

    def _finish(self, run: FakeRun, body: dict[str, Any]) -> httpx.Response:
        status = body.get("status")
        if status not in ("completed", "failed", "stopped"):
            return _error(422, "invalid_request", "Invalid finish.", {"status": "required"})
        if run.finished:
            return _error(409, "run_finished", "The run is already finished.")
        if run.status == "running":
            run.status = status
            run.stop_reason = "agent_stopped" if status == "stopped" else None
        run.finished = True
        run.output = body.get("output")
        return httpx.Response(200, json=run.as_json())


def _error(
    status: int, code: str, message: str, fields: dict[str, Any] | None = None
) -> httpx.Response:
    return httpx.Response(
        status, json={"error": {"code": code, "message": message, "fields": fields or {}}}
    )


def _fail(failure: int | Exception | type[Exception], request: httpx.Request) -> httpx.Response:
    if isinstance(failure, int):
        return _error(failure, "unavailable", "Injected failure.")
    if isinstance(failure, type):
        failure = failure("injected failure", request=request)  # type: ignore[call-arg]
    raise failure
