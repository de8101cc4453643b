"""An in-process fake of the governance service, for testing agents without a server.

It serves the HTTP surface of SPEC 5 (start, get, check, finish, error bodies, the upload of
local decisions) and decides every check with the server's own rules
(``governance_client.rules.evaluate``): steps, repeats, no progress, budgets, tool allow/deny
lists, repeated errors, shadow mode, ``check_id`` replay, a kill switch. On top of them it
scripts what a person or other agents would do on the real service: approvals (SPEC 11),
decided by an ``operator`` callback or by ``decide``, and rate limits (SPEC 12) on a clock of
its own, which the client's sleeps advance::

    fake = FakeGovernance(max_repeat_action=3, max_usd=1.0, deny=["shell.*"])
    with fake.client() as client, client.run("my-agent") as run:
        ...
    assert fake.runs[run.id].stop_reason == "loop_detected"
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Literal

import httpx

from . import answers, rules
from .aio import AsyncGovernanceClient
from .client import GovernanceClient
from .local import make_check

__all__ = ["FakeApproval", "FakeGovernance", "FakeRun", "RateLimit"]

BASE_URL = "http://governance.test"
AGENT_RE = re.compile(r"[A-Za-z0-9._-]{1,100}")

Verdict = Literal["approve", "deny"] | tuple[Literal["approve", "deny"], str] | None


@dataclass(frozen=True)
class RateLimit:
    """A SPEC 12 rule: at most ``max`` allowed actions matching ``match`` per ``window_s``."""

    match: str
    max: int
    window_s: float
    per: Literal["run", "agent", "team"] = "team"


@dataclass
class FakeApproval:
    id: str
    run_id: str
    check_id: str
    action: dict[str, Any]
    body: dict[str, Any]
    requested_at: float
    expires_at: float
    status: str = "pending"
    note: str | None = None
    decision: dict[str, Any] | None = None


@dataclass
class FakeRun:
    id: str
    agent: str
    state: rules.RunState
    task: str | None = None
    external_id: str | None = None
    output: str | None = None
    finished: bool = False
    answers: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False)
    #: Every check body received (replays included), in order.
    checks: list[dict[str, Any]] = field(default_factory=list, repr=False)
    #: Every decision answered or uploaded (replays excluded), in order.
    decisions: list[dict[str, Any]] = field(default_factory=list, repr=False)
    #: Decisions the client made locally during an outage, as uploaded.
    uploaded: list[dict[str, Any]] = field(default_factory=list, repr=False)

    @property
    def status(self) -> str:
        return self.state.status

    @property
    def stop_reason(self) -> str | None:
        return self.state.stop_reason

    @property
    def steps(self) -> int:
        return self.state.steps

    @property
    def tool_calls(self) -> int:
        return self.state.tool_calls

    @property
    def cost_usd(self) -> float:
        return float(self.state.cost_usd)

    def as_json(self) -> dict[str, Any]:
        return {
            "run_id": self.id,
            "agent": self.agent,
            "status": self.status,
            "stop_reason": self.stop_reason,
            "steps": self.steps,
            "tool_calls": self.tool_calls,
            "cost_usd": self.cost_usd,
            "started_at": self.state.started_at.isoformat(),
            "task": self.task,
            "output": self.output,
        }


@dataclass
class _Failure:
    failure: int | Exception | type[Exception]
    processed: bool


_POLICY_FIELDS = {f.name for f in fields(rules.Policy)}


class FakeGovernance:
    """The fake service; ``client()`` / ``async_client()`` give clients wired to it.

    The policy is ``policy`` (a ``rules.Policy``) with any of its fields given as keywords
    (``max_steps=5``, ``max_usd=0.5``, ``deny=["shell.*"]``, ``mode="shadow"``...); by default
    a new policy's defaults, without ``max_seconds`` or ``max_usd`` (tests should not depend
    on the machine's speed or on costs they did not set).
    """

    def __init__(
        self,
        *,
        api_key: str = "test-key",
        policies: Iterable[str] = ("default",),
        policy: rules.Policy | None = None,
        approvals: Iterable[str] = (),
        approval_timeout_s: float = 900,
        operator: Callable[[FakeApproval], Verdict] | None = None,
        rate_limits: Iterable[RateLimit] = (),
        **policy_fields: Any,
    ) -> None:
        unknown = set(policy_fields) - _POLICY_FIELDS
        if unknown:
            raise TypeError(f"unknown policy fields: {sorted(unknown)}")
        base = policy or rules.Policy(max_seconds=None, max_usd=None)
        for name in ("allow", "deny", "ignore_args", "redact_args"):
            if policy_fields.get(name) is not None:
                policy_fields[name] = tuple(policy_fields[name])
        if policy_fields.get("max_usd") is not None:
            policy_fields["max_usd"] = Decimal(str(policy_fields["max_usd"]))
        self.policy = replace(base, **policy_fields)
        self.api_key = api_key
        self.policies = set(policies)
        self.approval_patterns = tuple(approvals)
        self.approval_timeout_s = approval_timeout_s
        self.operator = operator
        self.rate_limits = tuple(rate_limits)
        self.runs: dict[str, FakeRun] = {}
        self.approvals: dict[str, FakeApproval] = {}
        self.kill_switch: str | None = None
        #: While True, every request fails with a connection error (an outage).
        self.down = False
        self.requests: list[httpx.Request] = []
        #: The journal folder of this fake's clients (governance_client.journal): their own,
        #: so a test never sends what another left; made when first written.
        self.journal = Path(tempfile.gettempdir()) / f"fake-governance-{uuid.uuid4().hex}"
        #: The fake's clock (seconds), advanced by the clients' sleeps and long polls.
        self.clock = 0.0
        self._allowed_at: list[tuple[float, str, str, str]] = []  # (t, run, agent, name)
        self._failures: list[_Failure] = []
        self._decisions = 0

    @classmethod
    def from_policy_file(cls, path: str | os.PathLike[str], *, team: str | None = None,
                         policy: str = "default", **kwargs: Any) -> FakeGovernance:
        """A fake deciding with the team's real policy: ``path`` is the policy document
        (SPEC 3, the YAML file ``apply_policies`` takes, or the same as JSON), ``team`` the
        team's slug (needed when the file has several), ``policy`` the policy's name. Its
        approvals and rate limits become the fake's (``approvals``, ``approval_timeout_s``,
        ``rate_limits``); ``kwargs`` are the other arguments of ``FakeGovernance``. YAML
        needs PyYAML."""
        text = Path(path).read_text(encoding="utf-8")
        if str(path).endswith(".json"):
            document = json.loads(text)
        else:
            try:
                import yaml
            except ImportError:  # pragma: no cover - depends on the environment
                raise ImportError("reading a YAML policy file needs PyYAML "
                                  "(pip install pyyaml)") from None
            document = yaml.safe_load(text)
        found = _policy_in(document, team=team, policy=policy, path=str(path))
        budgets = found.get("budgets") or {}
        if "max_idle_seconds" not in budgets:  # omitted in a file: the default (SPEC 3, 14)
            found = {**found, "budgets": {**budgets,
                                          "max_idle_seconds": rules.Policy().max_idle_seconds}}
        approvals = found.get("approvals") or {}
        kwargs.setdefault("approvals", tuple(approvals.get("tools") or ()))
        kwargs.setdefault("approval_timeout_s", approvals.get("timeout_s", 900))
        kwargs.setdefault("rate_limits", tuple(
            RateLimit(match=r["match"], max=r["max"], window_s=r["window_s"],
                      per=r.get("per", "team"))
            for r in found.get("rate_limits") or ()))
        return cls(policies={policy}, policy=rules.Policy.from_document(found), **kwargs)

    # Kept for tests written against the first version of the fake.
    @property
    def max_steps(self) -> int:
        return self.policy.max_steps

    @property
    def max_repeat_action(self) -> int:
        return self.policy.max_repeat_action

    def fail_next(
        self, *failures: int | Exception | type[Exception], processed: bool = False
    ) -> None:
        """Make the next requests fail with these statuses or exceptions. With ``processed``,
        the request is handled first and only its answer is lost (e.g. a read timeout)."""
        self._failures.extend(_Failure(f, processed) for f in failures)

    def advance(self, seconds: float) -> None:
        self.clock += max(0.0, seconds)

    async def advance_async(self, seconds: float) -> None:
        self.advance(seconds)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def client(self, **kwargs: Any) -> GovernanceClient:
        kwargs.setdefault("sleep", self.advance)
        kwargs.setdefault("journal", self.journal)
        return GovernanceClient(BASE_URL, self.api_key, transport=self.transport(), **kwargs)

    def async_client(self, **kwargs: Any) -> AsyncGovernanceClient:
        kwargs.setdefault("sleep", self.advance_async)
        kwargs.setdefault("journal", self.journal)
        return AsyncGovernanceClient(BASE_URL, self.api_key, transport=self.transport(),
                                     **kwargs)

    def limits(self) -> dict[str, Any]:
        return self.policy.limits()

    def decide(self, approval_id: str, verdict: Literal["approve", "deny"],
               note: str | None = None) -> None:
        """An operator's decision on a pending approval (SPEC 11)."""
        approval = self.approvals[approval_id]
        if approval.status != "pending":
            raise ValueError(f"approval {approval_id} is {approval.status}")
        run = self.runs[approval.run_id]
        if verdict == "approve":
            approval.status = "approved"
            answer = self._decide(run, approval.body, approved=True)
        else:
            approval.status = "denied"
            approval.note = note
            answer = self._stop(run, approval.body, rules.APPROVAL_DENIED,
                                f"An operator denied {approval.action['name']}: {note or ''}")
        approval.decision = answer
        run.answers[approval.check_id] = answer

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
        if parts[:3] == ["api", "v1", "approvals"] and len(parts) == 4:
            return self._approval(parts[3], request)
        if parts[:3] != ["api", "v1", "runs"]:
            return _error(404, "not_found", "No such endpoint.")
        if len(parts) == 3 and request.method == "POST":
            return self._start(body)
        run = self.runs.get(parts[3]) if len(parts) > 3 else None
        if run is None:
            return _error(404, "not_found", "No such run.")
        if len(parts) == 4 and request.method == "GET":
            return httpx.Response(200, json=run.as_json())
        if len(parts) == 5 and request.method == "POST":
            if parts[4] == "check":
                return self._check(run, body)
            if parts[4] == "finish":
                return self._finish(run, body)
            if parts[4] == "local-decisions":
                return self._upload(run, body)
        return _error(405, "method_not_allowed", "Method not allowed.")

    def _start(self, body: dict[str, Any]) -> httpx.Response:
        agent = body.get("agent")
        if not isinstance(agent, str) or not AGENT_RE.fullmatch(agent):
            fields_ = {"agent": "must match [A-Za-z0-9._-]{1,100}"}
            return _error(422, "invalid_request", "Invalid run.", fields_)
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
            id=str(uuid.uuid4()), agent=agent, task=body.get("task"), external_id=external_id,
            state=rules.RunState(started_at=datetime.now(UTC)),
        )
        self.runs[run.id] = run
        return httpx.Response(201, json=self._run_json(run, policy))

    def _run_json(self, run: FakeRun, policy: str) -> dict[str, Any]:
        p = self.policy
        limits = p.limits()
        return run.as_json() | {
            "policy": {
                "name": policy,
                "version": 1,
                "mode": p.mode,
                "step_limits": {k: limits[k] for k in
                                ("max_steps", "max_repeat_action", "no_progress_window")},
                "budgets": {k: limits[k] for k in ("max_seconds", "max_usd", "max_tool_calls")},
                "tools": {"allow": None if p.allow is None else list(p.allow),
                          "deny": list(p.deny)},
                "repeat_key": {"ignore_args": list(p.ignore_args)},
                "on_repeated_error": {"threshold": p.error_threshold,
                                      "action": p.error_action},
                "approvals": {"tools": list(self.approval_patterns),
                              "timeout_s": self.approval_timeout_s},
            }
        }

    def _check(self, run: FakeRun, body: dict[str, Any]) -> httpx.Response:
        run.checks.append(body)
        action = body.get("action")
        if not isinstance(action, dict) or not isinstance(action.get("name"), str):
            return _error(422, "invalid_request", "Invalid check.", {"action.name": "required"})
        check_id = body.get("check_id")
        first = run.answers.get(check_id) if isinstance(check_id, str) else None
        if first is not None and (run.status == rules.RUNNING
                                  or first["decision"] == rules.STOP):
            if first["decision"] == "pending":
                approval = self.approvals[first["approval"]["id"]]
                self._settle(approval)
                if approval.decision is not None:
                    return httpx.Response(200, json=approval.decision)
            return httpx.Response(200, json=first)
        pending = [a for a in self.approvals.values()
                   if a.run_id == run.id and a.status == "pending"]
        for approval in pending:
            self._settle(approval)
        pending = [a for a in pending if a.status == "pending"]
        if pending and self.kill_switch is None and run.status == rules.RUNNING:
            return _error(409, "approval_pending",
                          f"Approval {pending[0].id} is pending for this run.",
                          {"approval": pending[0].id})
        answer = self._decide(run, body)
        if isinstance(check_id, str) and answer["decision"] != "wait":
            run.answers[check_id] = answer
        return httpx.Response(200, json=answer)

    def _decide(self, run: FakeRun, body: dict[str, Any], *, approved: bool = False
                ) -> dict[str, Any]:
        action = body["action"]
        name = action["name"]
        check = make_check(name, action.get("args"), type=action.get("type", "tool"),
                           progress=body.get("progress"), last_result=body.get("last_result"),
                           cost_usd=body.get("cost_usd"))
        now = datetime.now(UTC)
        if approved:
            # The step was counted when the approval was asked for: only the allow remains.
            key = rules.repeat_key(name, check.args, self.policy.ignore_args)
            run.state.repeat_counts[key] = run.state.repeat_counts.get(key, 0) + 1
            if check.type == "tool":
                run.state.tool_calls += 1
            # Its rate-limit slot was taken by the pending answer, not again now (SPEC 12).
            verdict = rules.Decision(outcome=rules.ALLOW, reason=rules.STEP_OK,
                                     step=run.state.steps, repeat_key=key,
                                     repeat_count=run.state.repeat_counts[key])
            return self._answer(run, verdict, now)
        kill = f"the global kill switch: {self.kill_switch}" if self.kill_switch else None
        verdict, new = rules.evaluate(self.policy, run.state, check, now=now, kill=kill)
        if (verdict.answer == rules.ALLOW and run.state.status == rules.RUNNING
                and self.policy.mode != "shadow"):
            # The rate limits come after rules 1 to 9 and before approvals (SPEC 12, 15),
            # as on the service: a check those rules stop is stopped, not made to wait.
            wait = self._rate_limited(run, name)
            past = None if wait is None else rules.wait_past_budget(
                self.policy, run.state, name, wait[0], now)
            if past is not None:
                return self._out_of_time(run, check, past, now)
            if wait is not None:
                return self._answer(run, None, now, {
                    "decision": "wait", "reason": "rate_limited", "step": run.steps + 1,
                    "retry_after_s": wait[0], "message": wait[1],
                    "next_action": rules.NEXT_ACTION[rules.RATE_LIMITED],
                })
        needs_approval = (verdict.answer == rules.ALLOW and run.state.status == rules.RUNNING
                          and any(fnmatchcase(name, p) for p in self.approval_patterns))
        if needs_approval and self.policy.mode != "shadow":
            # SPEC 11: the step is counted, the repeat count and tool_calls move on approval.
            new = run.state.copy()
            new.steps += 1
            rules._register(new, check)  # same registration as evaluate's
            run.state = new
            approval = FakeApproval(
                id=str(uuid.uuid4()), run_id=run.id, check_id=str(body.get("check_id")),
                action={"name": name, "type": check.type, "args": dict(check.args)},
                body=body, requested_at=self.clock,
                expires_at=self.clock + self.approval_timeout_s,
            )
            self.approvals[approval.id] = approval
            # A pending answer takes its rate-limit slot now, whatever comes of it (SPEC 12).
            self._allowed_at.append((self.clock, run.id, run.agent, name))
            return self._answer(run, None, now, {
                "decision": "pending", "reason": "approval_required", "step": new.steps,
                "approval": self._approval_json(approval)["approval"],
                "message": f"{name} needs an operator's approval.",
                "next_action": rules.NEXT_ACTION[rules.APPROVAL_REQUIRED],
            })
        run.state = new
        if verdict.answer == rules.ALLOW:
            self._allowed_at.append((self.clock, run.id, run.agent, name))
        return self._answer(run, verdict, now)

    def _out_of_time(self, run: FakeRun, check: rules.Check, message: str, now: datetime
                     ) -> dict[str, Any]:
        """As the service (issue 26): a rate-limit wait longer than the run's time left is a
        stop now, the step counted and the check registered as for any stop of rule 1 to 9."""
        key = rules.repeat_key(check.name, check.args, self.policy.ignore_args)
        new = run.state.copy()
        new.steps += 1
        rules._register(new, check)  # same registration as evaluate's
        new.status, new.stop_reason, new.ended_at = rules.STOPPED, "max_seconds", now
        run.state = new
        verdict = rules.Decision(outcome=rules.STOP, reason="max_seconds", step=new.steps,
                                 repeat_key=key, repeat_count=new.repeat_counts.get(key, 0),
                                 message=message, next_action=rules.NEXT_ACTION["max_seconds"])
        return self._answer(run, verdict, now)

    def _rate_limited(self, run: FakeRun, name: str) -> tuple[float, str] | None:
        longest: tuple[float, str] | None = None
        for limit in self.rate_limits:
            if not fnmatchcase(name, limit.match):
                continue
            since = self.clock - limit.window_s
            times = sorted(
                t for t, run_id, agent, action in self._allowed_at
                if t > since and fnmatchcase(action, limit.match)
                and (limit.per == "team" or (limit.per == "run" and run_id == run.id)
                     or (limit.per == "agent" and agent == run.agent))
            )
            if len(times) >= limit.max:
                retry = round(times[len(times) - limit.max] + limit.window_s - self.clock, 3)
                retry = max(retry, 0.001)
                message = (f"Rate limit {limit.match!r}: {limit.max} per {limit.window_s} s "
                           f"per {limit.per}.")
                if longest is None or retry > longest[0]:
                    longest = (retry, message)
        return longest

    def _stop(self, run: FakeRun, body: dict[str, Any], reason: str, message: str
              ) -> dict[str, Any]:
        now = datetime.now(UTC)
        state = run.state.copy()
        if state.status == rules.RUNNING:
            state.status, state.stop_reason, state.ended_at = rules.STOPPED, reason, now
        run.state = state
        action = body["action"]
        key = rules.repeat_key(action["name"], action.get("args"), self.policy.ignore_args)
        verdict = rules.Decision(outcome=rules.STOP, reason=reason, step=state.steps,
                                 repeat_key=key, repeat_count=state.repeat_counts.get(key, 0),
                                 message=message, next_action=rules.NEXT_ACTION[reason])
        return self._answer(run, verdict, now)

    def _answer(self, run: FakeRun, verdict: rules.Decision | None, now: datetime,
                answered: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The answer, recorded in ``run.decisions`` as answered (``answered`` replaces
        fields: a wait or a pending answer is recorded as such, never as an allow)."""
        self._decisions += 1
        shown = verdict or rules.Decision(outcome=rules.ALLOW, reason=rules.STEP_OK,
                                          step=run.steps, repeat_key="", repeat_count=0)
        answer: dict[str, Any] = {
            **answers.answer(shown, usage=run.state.usage(now), limits=self.policy.limits()),
            "decision_id": self._decisions,
            # The fake opens approvals and rate-limit waits itself (``answered``), never
            # through the rules' decision.
            "approval": None, "retry_after_s": None,
        }
        if verdict is None:  # a wait or a pending answer names no repeat key
            answer |= {"repeat_key": None, "repeat_count": None}
        answer |= answered or {}
        run.decisions.append(answer)
        return answer

    def _settle(self, approval: FakeApproval) -> None:
        """Ask the scripted operator, then settle an expiry (whoever looks first)."""
        if approval.status != "pending":
            return
        if self.operator is not None:
            verdict = self.operator(approval)
            if verdict is not None:
                kind, note = verdict if isinstance(verdict, tuple) else (verdict, None)
                self.decide(approval.id, kind, note)
                return
        if self.clock >= approval.expires_at:
            approval.status = "expired"
            run = self.runs[approval.run_id]
            approval.decision = self._stop(run, approval.body, rules.APPROVAL_EXPIRED,
                                           "Nobody decided the approval before it expired.")
            run.answers[approval.check_id] = approval.decision

    def _approval_json(self, approval: FakeApproval) -> dict[str, Any]:
        start = datetime(2026, 1, 1, tzinfo=UTC)
        expires = datetime.now(UTC) + timedelta(seconds=approval.expires_at - self.clock)
        data = {
            "id": approval.id,
            "run_id": approval.run_id,
            "status": approval.status,
            "action": approval.action,
            "requested_at": (start + timedelta(seconds=approval.requested_at)).isoformat(),
            "expires_at": expires.isoformat(),
            "decided_at": None,
            "decided_by": None,
            "note": approval.note,
            "decision": approval.decision,
        }
        return data | {"approval": {"id": approval.id, "status": approval.status,
                                    "expires_at": data["expires_at"]}}

    def _approval(self, approval_id: str, request: httpx.Request) -> httpx.Response:
        approval = self.approvals.get(approval_id)
        if approval is None:
            return _error(404, "not_found", "No such approval.")
        try:
            wait = int(request.url.params.get("wait", "0"))
        except ValueError:
            wait = -1
        if not 0 <= wait <= 60:
            return _error(422, "invalid_request", "Invalid wait.", {"wait": "0..60"})
        self._settle(approval)
        if approval.status == "pending" and wait:
            # A long poll that nobody answered: the time passes, then maybe it expired.
            self.advance(wait)
            self._settle(approval)
        data = self._approval_json(approval)
        data.pop("approval")
        return httpx.Response(200, json=data)

    def _upload(self, run: FakeRun, body: dict[str, Any]) -> httpx.Response:
        entries = body.get("decisions")
        if not isinstance(entries, list):
            return _error(422, "invalid_request", "Invalid upload.", {"decisions": "a list"})
        recorded = 0
        for entry in entries:
            check_id = entry.get("check_id")
            if check_id in run.answers:
                continue
            action = entry["action"]
            check = make_check(action["name"], action.get("args"),
                               type=action.get("type", "tool"), progress=entry.get("progress"),
                               last_result=entry.get("last_result"),
                               cost_usd=entry.get("cost_usd"))
            verdict, run.state = rules.record_outcome(
                self.policy, run.state, check, allowed=entry["decision"] == "allow",
                reason=entry.get("reason") or rules.STEP_OK, now=datetime.now(UTC),
                message=entry.get("message"),
            )
            # As on the service: kept, and flagged when it broke the policy (SPEC 10).
            judged = replace(self.policy, approval_tools=self.approval_patterns)
            violation = (rules.policy_violation(judged, check.name)
                         if entry["decision"] == "allow" else None)
            answer = self._answer(run, verdict, datetime.now(UTC)) | {
                "local": True, "policy_violation": violation is not None,
                "violation": violation}
            run.decisions[-1] = answer
            run.answers[check_id] = answer
            run.uploaded.append(entry)
            recorded += 1
        if run.status != rules.RUNNING:
            # A local stop ends the run's wait too: nothing stays pending (SPEC 10).
            for approval in self.approvals.values():
                if approval.run_id == run.id and approval.status == "pending":
                    approval.status = "cancelled"
        return httpx.Response(200, json={"recorded": recorded,
                                         "skipped": len(entries) - recorded,
                                         "run": run.as_json()})

    def _finish(self, run: FakeRun, body: dict[str, Any]) -> httpx.Response:
        status = body.get("status")
        if status not in ("completed", "failed", "stopped"):
            return _error(422, "invalid_request", "Invalid finish.", {"status": "required"})
        if run.finished:
            return _error(409, "run_finished", "The run is already finished.")
        for approval in self.approvals.values():
            if approval.run_id == run.id and approval.status == "pending":
                approval.status = "cancelled"
        run.state = rules.finish(run.state, status, already_finished=False,
                                 now=datetime.now(UTC))
        run.finished = True
        run.output = body.get("output")
        return httpx.Response(200, json=run.as_json())


def _policy_in(document: Any, *, team: str | None, policy: str, path: str) -> dict[str, Any]:
    """One policy of a policy document (SPEC 3), by team slug and policy name."""
    teams = document.get("teams") if isinstance(document, Mapping) else None
    if not isinstance(teams, list) or not teams:
        raise ValueError(f"{path}: not a policy document (no teams list)")
    if team is None and len(teams) > 1:
        raise ValueError(f"{path} has {len(teams)} teams: name one (team=...)")
    chosen = teams[0] if team is None else next(
        (t for t in teams if isinstance(t, Mapping) and t.get("slug") == team), None)
    if not isinstance(chosen, Mapping):
        raise ValueError(f"{path} has no team {team!r}")
    for found in chosen.get("policies") or ():
        if isinstance(found, Mapping) and found.get("name", "default") == policy:
            return dict(found)
    if policy == "default":  # every team has one: a file naming none means the defaults
        return {"name": "default"}
    raise ValueError(f"{path}: team {chosen.get('slug')!r} has no policy {policy!r}")


def _error(
    status: int, code: str, message: str, fields: Mapping[str, Any] | None = None
) -> httpx.Response:
    return httpx.Response(
        status, json={"error": {"code": code, "message": message, "fields": dict(fields or {})}}
    )


def _fail(failure: int | Exception | type[Exception], request: httpx.Request) -> httpx.Response:
    if isinstance(failure, int):
        return _error(failure, "unavailable", "Injected failure.")
    if isinstance(failure, type):
        failure = failure("injected failure", request=request)  # type: ignore[call-arg]
    raise failure
