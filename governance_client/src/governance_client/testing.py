"""An in-process fake of the governance service, for testing agents without a server.

It serves the HTTP surface of SPEC 5 (start, get, check, finish, error bodies, the upload of
local decisions, the approval poll) and decides as the service does, through the same pure
functions: ``rules.evaluate`` for every check (the stop rules, shadow mode, the rate limits
from ``rules.window_of`` over the actions it counted, the approvals it opens),
``rules.settle`` for an approval's final answer (approved, denied, expired as of its
``expires_at``, cancelled by the kill switch), ``rules.record_outcome`` for uploaded local
decisions, ``rules.finish``, and ``answers`` for every answer. What is its own is the
routing, a clock (`now`: it moves only with the clients' sleeps and long polls and with
``advance``) and a scripted operator (``operator`` or ``decide``) standing in for the people
and other agents of the real service. tests/test_fake_parity.py runs one table of scenarios
through the fake and the server and compares the answers::

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
    #: On the fake's clock; an expiry is decided at its ``expires_at``.
    decided_at: float | None = None


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
    #: SPEC 20: the ancestors' ids, the root first (empty for a root run), and the children.
    ancestors: tuple[str, ...] = ()
    children: list[str] = field(default_factory=list, repr=False)

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
            "parent_run_id": self.ancestors[-1] if self.ancestors else None,
            "root_run_id": self.ancestors[0] if self.ancestors else None,
            "children": list(self.children),
            "children_more": False,
            "tree_usage": {"steps": self.steps, "tool_calls": self.tool_calls,
                           "cost_usd": self.cost_usd},
        }


@dataclass
class _Failure:
    failure: int | Exception | type[Exception]
    processed: bool


_POLICY_FIELDS = {f.name for f in fields(rules.Policy) if f.init}


class FakeGovernance:
    """The fake service; ``client()`` / ``async_client()`` give clients wired to it.

    The policy is ``policy`` (a ``rules.Policy``) with any of its fields given as keywords
    (``max_steps=5``, ``max_usd=0.5``, ``deny=["shell.*"]``, ``mode="shadow"``...); by default
    a new policy's defaults, without ``max_seconds`` or ``max_usd`` (tests should not depend
    on costs they did not set). ``start_time``: the moment the fake's clock starts from
    (default: when the fake is made).
    """

    def __init__(
        self,
        *,
        api_key: str = "test-key",
        policies: Iterable[str] = ("default",),
        policy: rules.Policy | None = None,
        approvals: Iterable[str] = (),
        approval_timeout_s: float | None = None,
        operator: Callable[[FakeApproval], Verdict] | None = None,
        rate_limits: Iterable[RateLimit] = (),
        start_time: datetime | None = None,
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
        chosen = replace(base, **policy_fields)
        self.api_key = api_key
        self.policies = set(policies)
        # The approvals and rate limits are the policy's, as on the service (rules.evaluate
        # applies them); the keywords, when given, replace the policy's own.
        self.approval_patterns = tuple(approvals) or chosen.approval_tools
        self.approval_timeout_s = (chosen.approval_timeout_s if approval_timeout_s is None
                                   else approval_timeout_s)
        self.rate_limits = tuple(rate_limits) or tuple(
            RateLimit(match=r.match, max=r.max, window_s=r.window_s, per=r.per)  # type: ignore[arg-type]
            for r in chosen.rate_limits)
        self.policy = replace(
            chosen, approval_tools=self.approval_patterns,
            approval_timeout_s=self.approval_timeout_s,  # type: ignore[arg-type]
            rate_limits=tuple(rules.RateLimit(match=r.match, per=r.per, max=r.max,
                                              window_s=r.window_s)  # type: ignore[arg-type]
                              for r in self.rate_limits))
        self.operator = operator
        self.runs: dict[str, FakeRun] = {}
        self.approvals: dict[str, FakeApproval] = {}
        self.kill_switch: str | None = None
        #: While True, every request fails with a connection error (an outage).
        self.down = False
        self.requests: list[httpx.Request] = []
        #: The journal folder of this fake's clients (governance_client.journal): their own,
        #: so a test never sends what another left; made when first written.
        self.journal = Path(tempfile.gettempdir()) / f"fake-governance-{uuid.uuid4().hex}"
        #: The fake's clock (seconds), advanced by the clients' sleeps and long polls and by
        #: `advance`: the only time the fake knows (`now`), so no test depends on the
        #: machine's speed.
        self.clock = 0.0
        self._origin = start_time or datetime.now(UTC)  # the clock's zero
        #: Who engaged ``kill_switch``, as the agent is told (the switch's words, SPEC 6).
        self.kill_switch_by = "an operator"
        # The actions a rate limit counts (rules.RATE_COUNTED): (when, run, agent, name).
        self._counted: list[tuple[datetime, str, str, str]] = []
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
        if "warnings" not in found or isinstance(found["warnings"], dict):
            # Each one omitted in a file, or the whole block: a new policy's (SPEC 3, 16), as
            # the server saves it (found by an attacker: a block naming only budget_fraction
            # turned the other two off here, and the server warned).
            steps = found.get("step_limits") or {}
            found = {**found, "warnings": {
                "repeat_action": rules.default_warning(
                    "repeat_action", steps.get("max_repeat_action") or 3),
                "no_progress": rules.default_warning(
                    "no_progress", steps.get("no_progress_window") or 4),
                "budget_fraction": rules.DEFAULT_WARNINGS["budget_fraction"],
                **(found.get("warnings") or {})}}
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

    def now(self) -> datetime:
        """The fake's time: the moment it was made, plus its clock."""
        return self._origin + timedelta(seconds=self.clock)

    def decide(self, approval_id: str, verdict: Literal["approve", "deny"],
               note: str | None = None) -> None:
        """An operator's decision on a pending approval (SPEC 11). Under the kill switch the
        request is cancelled instead and the decision refused, as on the service."""
        approval = self.approvals[approval_id]
        if approval.status != "pending":
            raise ValueError(f"approval {approval_id} is {approval.status}")
        if self.kill_switch is not None:
            self._settle(approval, rules.CANCELLED)
            raise ValueError(f"approval {approval_id} was cancelled by the kill switch")
        self._settle(approval, rules.APPROVED if verdict == "approve" else rules.DENIED,
                     note=note)

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
            # A read after the deadline finds it ended (SPEC 14).
            self._abandon_if_idle(run, out_of_time=True)
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
                named = body.get("parent_run_id")
                if named is not None and run.ancestors[-1:] != (str(named),):
                    # As the service: a child's start is never handed a run outside its
                    # parent (runs/check/lifecycle.py, `_same_start`).
                    return _error(409, "external_id_conflict", "This external_id belongs "
                                  "to a run that is not a child of this parent_run_id.",
                                  {"external_id": "already used by a run outside this parent"})
                return httpx.Response(200, json=self._run_json(run, policy))
        kill = self._kill_words()
        if kill is not None:
            return _error(409, "kill_switch_engaged", f"No new run may start: {kill}.")
        ancestors: tuple[str, ...] = ()
        parent_id = body.get("parent_run_id")
        if parent_id is not None:  # SPEC 20, as the service (runs/check/lifecycle.py)
            parent = self.runs.get(str(parent_id))
            if parent is None:
                return _error(404, "not_found", "No such parent run.",
                              {"parent_run_id": "no run of this key's team with this id"})
            self._settle_due(parent, ask=False)
            if parent.status != rules.RUNNING:
                return _error(409, "parent_finished", f"The parent run is {parent.status}.",
                              {"parent_run_id": f"that run is {parent.status}"})
            if len(parent.ancestors) + 1 > rules.MAX_DEPTH:
                return _error(422, "invalid_request", "The request is not valid.",
                              {"parent_run_id": "the tree is at its deepest"})
            ancestors = (*parent.ancestors, parent.id)
        now = self.now()
        run = FakeRun(
            id=str(uuid.uuid4()), agent=agent, task=body.get("task"), external_id=external_id,
            state=rules.RunState(started_at=now, idle_deadline=rules.next_deadline(
                self.policy, rules.RunState(started_at=now), now)),
            ancestors=ancestors,
        )
        if ancestors:
            self.runs[ancestors[-1]].children.append(run.id)
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
                "budgets": {**{k: limits[k] for k in ("max_seconds", "max_usd",
                                                      "max_tool_calls")},
                            "max_idle_seconds": p.max_idle_seconds},
                "tools": {"allow": None if p.allow is None else list(p.allow),
                          "deny": list(p.deny)},
                "repeat_key": {"ignore_args": list(p.ignore_args)},
                "on_repeated_error": {"threshold": p.error_threshold,
                                      "action": p.error_action},
                "approvals": {"tools": list(self.approval_patterns),
                              "timeout_s": self.approval_timeout_s},
            }
        }

    def _kill_rule(self) -> dict[str, Any] | None:
        """The switch as a killed stop's rule names it (SPEC 16): the fake's is global."""
        if self.kill_switch is None:
            return None
        return answers.kill_rule("global", team=None, by=self.kill_switch_by,
                                 reason=self.kill_switch)

    def _kill_words(self) -> str | None:
        """The engaged switch as the agent reads it (the service's words for a global one)."""
        if self.kill_switch is None:
            return None
        return answers.switch_in_words("global", by=self.kill_switch_by,
                                       reason=self.kill_switch)

    def _check(self, run: FakeRun, body: dict[str, Any]) -> httpx.Response:
        """A check, in the service's order (runs/check/services.py, SPEC 15): what is due on a
        waiting run is settled, then a replay, then the 409 of a run waiting for an approval,
        then the rules (rules 1 to 9, rate limits, approvals, allow) in `rules.evaluate`."""
        run.checks.append(body)
        action = body.get("action")
        if not isinstance(action, dict) or not isinstance(action.get("name"), str):
            return _error(422, "invalid_request", "Invalid check.", {"action.name": "required"})
        check_id = body.get("check_id") if isinstance(body.get("check_id"), str) else None
        check = make_check(action["name"], action.get("args"),
                                 type=action.get("type", "tool"), progress=body.get("progress"),
                                 last_result=body.get("last_result"),
                                 cost_usd=body.get("cost_usd"), check_id=check_id)
        kill = self._kill_words()
        self._settle_due(run)
        abandoned = self._abandon_if_idle(run)
        tree = self._tree(run)
        first = run.answers.get(check_id) if check_id is not None else None
        retry = False
        if first is not None and not abandoned:
            if first["decision"] == rules.PENDING:
                # What a resent pending check answers: its final answer once there is one.
                first = self.approvals[first["approval"]["id"]].decision or first
            ends_now = rules.ends_at_this_check(tree, self.now(), covered=kill is not None)
            if rules.replay_allowed(run.state, first["decision"], ends_now=ends_now):
                return httpx.Response(200, json=first)
            # The first answer was an allow and the run is over: its stop is decided anew,
            # counting nothing again.
            check, retry = replace(check, check_id=None), True
        pending = run.state.pending
        if run.state.status == rules.RUNNING and pending is not None:
            message, fields_ = rules.approval_pending(pending)
            return _error(409, "approval_pending", message, fields_)
        missing = rules.check_id_missing(self.policy, run.state, check, kill=kill)
        if missing is not None:
            return _error(422, "invalid_request", "The request is not valid.",
                          {"check_id": missing})
        now = self.now()
        windows = (self._windows(run, check.name, now)
                   if run.state.status == rules.RUNNING and kill is None else [])
        _explain_stop(run)
        before = run.state
        decision, run.state = rules.evaluate(self.policy, run.state, check, now=now, kill=kill,
                                             rate=windows, approval_id=str(uuid.uuid4()),
                                             kill_rule=self._kill_rule(), tree=tree,
                                             retry=retry)
        if run.state.steps > before.steps:  # counted on every ancestor too (SPEC 20)
            for ancestor, state in zip(tree, rules.count_in_tree(tree, decision, check,
                                                                 now=now), strict=True):
                self.runs[ancestor.run_id].state = state
        if decision.outcome in rules.RATE_COUNTED:
            # A pending answer takes its slot now, not again once approved (SPEC 12, 15).
            self._counted.append((now, run.id, run.agent, check.name))
        if decision.outcome == rules.PENDING:
            opened = run.state.pending
            assert opened is not None
            approval = FakeApproval(
                id=opened.approval_id, run_id=run.id, check_id=opened.check_id,
                action={"name": check.name, "type": check.type, "args": dict(check.args)},
                body=body, requested_at=self.clock,
                expires_at=self.clock + self.approval_timeout_s,
            )
            self.approvals[approval.id] = approval
        answer = self._answer(run, decision, now)
        # A wait keeps no check_id: the same check is decided again when sent again.
        if check.check_id is not None and decision.outcome != rules.WAIT:
            run.answers[check.check_id] = answer
        return httpx.Response(200, json=answer)

    def _abandon_if_idle(self, run: FakeRun, *, out_of_time: bool = False) -> bool:
        """As the service (SPEC 14): a run past its idle deadline is ended `abandoned` by
        the check, finish or read that finds it so, its record first, whose words and rule
        that check and every later one answer. A finish or a read (``out_of_time``) also
        ends a run whose time budget ran out with no check, `max_seconds` (`rules.overdue`,
        as the service's `abandon_if_idle`); a check's rule 4 stops that one itself."""
        now = self.now()
        ended = (rules.overdue(run.state, self.policy, now=now) if out_of_time
                 else rules.abandon(run.state, now=now, policy=self.policy))
        if ended is None:
            return False
        run.state = ended
        self._record(run, answers.abandon_answer(ended, self.policy, now))
        return True

    def _tree(self, run: FakeRun) -> list[rules.Ancestor]:
        """The run's ancestors as the rules read them, the root first (SPEC 20)."""
        return [rules.Ancestor(run_id=a, policy=self.policy, state=self.runs[a].state)
                for a in run.ancestors]

    def _record(self, run: FakeRun, answer: dict[str, Any]) -> None:
        """An audit record no check answered (an abandonment, a finish's tree stop)."""
        self._decisions += 1
        run.decisions.append({**answer, "decision_id": self._decisions})

    def _windows(self, run: FakeRun, name: str, now: datetime) -> list[rules.RateWindow]:
        """The rate-limit windows of the action (SPEC 12), from the actions counted in each
        rule's scope: what the service's store reads."""
        windows = []
        for rule in rules.rate_limits_matching(self.policy, name):
            stamps = [at for at, run_id, agent, action in self._counted
                      if rule.matches(action) and (
                          rule.per == "team" or (rule.per == "run" and run_id == run.id)
                          or (rule.per == "agent" and agent == run.agent))]
            windows.append(rules.window_of(rule, stamps, now))
        return windows

    def _answer(self, run: FakeRun, decision: rules.Decision, now: datetime
                ) -> dict[str, Any]:
        """The answer (answers.answer_of, as the service builds it), recorded in
        ``run.decisions`` as answered."""
        self._decisions += 1
        answer = {**answers.answer_of(decision, run.state, self.policy, now),
                  "decision_id": self._decisions}
        run.decisions.append(answer)
        return answer

    def _pending_approval(self, run: FakeRun) -> FakeApproval | None:
        pending = run.state.pending
        return self.approvals.get(pending.approval_id) if pending is not None else None

    def _settle_due(self, run: FakeRun, *, ask: bool = True) -> None:
        """What is due on a waiting run (whoever looks first settles, SPEC 11): the scripted
        operator's verdict (``ask``), else the expiry once past ``expires_at``, else the
        cancellation under the kill switch."""
        approval = self._pending_approval(run)
        if approval is None or approval.status != rules.PENDING:
            return
        if ask and self.operator is not None:
            verdict = self.operator(approval)
            if verdict is not None:
                kind, note = verdict if isinstance(verdict, tuple) else (verdict, None)
                if self.kill_switch is None:
                    self._settle(approval, rules.APPROVED if kind == "approve"
                                 else rules.DENIED, note=note)
                    return
        pending = run.state.pending
        assert pending is not None
        if self.now() >= pending.expires_at:
            self._settle(approval, rules.EXPIRED)
        elif self.kill_switch is not None:
            self._settle(approval, rules.CANCELLED)

    def _settle(self, approval: FakeApproval, status: str, note: str | None = None) -> None:
        """Settle the run's pending approval with `rules.settle` (an expiry ends the run as
        of ``expires_at``), its final answer the one a resent check gets (SPEC 11)."""
        run = self.runs[approval.run_id]
        now = self.now()
        pending = run.state.pending
        decision, run.state = rules.settle(run.state, status, now=now, note=note or "",
                                           kill=self._kill_words(), policy=self.policy,
                                           kill_rule=self._kill_rule())
        if status == rules.APPROVED and pending is not None:  # the tool call, up the tree too
            tree = self._tree(run)
            for ancestor, state in zip(tree, rules.approved_in_tree(tree, pending),
                                       strict=True):
                self.runs[ancestor.run_id].state = state
        approval.status, approval.note = status, note
        approval.decided_at = approval.expires_at if status == rules.EXPIRED else self.clock
        answer = self._answer(run, decision, now)
        # The approver is named in the answer, as on the service: nobody, for the fake.
        answer["approval"] = {**(decision.approval or {}), "decided_by": None}
        approval.decision = answer
        run.answers[approval.check_id] = answer

    def _cancel_on_end(self, run: FakeRun, pending: rules.Pending | None) -> None:
        """The run ended while it waited (a finish, a local stop): its request is cancelled,
        its final answer the ended run's stop at the request's step (SPEC 10, 11), as the
        service's `settle_on_end` answers it."""
        approval = self.approvals.get(pending.approval_id) if pending is not None else None
        if pending is None or approval is None or approval.status != rules.PENDING \
                or run.state.status not in rules.TERMINAL:
            return
        approval.status, approval.decided_at = rules.CANCELLED, self.clock
        decision = replace(rules.terminal_decision(run.state, pending.repeat_key),
                           step=pending.step, approval=pending.summary(rules.CANCELLED))
        answer = self._answer(run, decision, self.now())
        answer["approval"] = {**pending.summary(rules.CANCELLED), "decided_by": None}
        approval.decision = answer
        run.answers[approval.check_id] = answer

    def _approval_json(self, approval: FakeApproval) -> dict[str, Any]:
        def at(seconds: float) -> str:  # as the service writes its times: UTC, with a Z
            return (self._origin + timedelta(seconds=seconds)).isoformat().replace(
                "+00:00", "Z")

        return {
            "id": approval.id,
            "run_id": approval.run_id,
            "status": approval.status,
            "action": approval.action,
            "requested_at": at(approval.requested_at),
            "expires_at": at(approval.expires_at),
            "decided_at": None if approval.decided_at is None else at(approval.decided_at),
            "decided_by": None,
            "note": approval.note,
            "decision": approval.decision,
        }

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
        run = self.runs[approval.run_id]
        self._settle_due(run)
        if approval.status == rules.PENDING and wait:
            # A long poll that nobody answered: the time passes, then maybe it expired.
            self.advance(wait)
            self._settle_due(run)
        return httpx.Response(200, json=self._approval_json(approval))

    def _upload(self, run: FakeRun, body: dict[str, Any]) -> httpx.Response:
        entries = body.get("decisions")
        if not isinstance(entries, list):
            return _error(422, "invalid_request", "Invalid upload.", {"decisions": "a list"})
        # What is due first (an expiry comes before the upload that finds it), as on the service.
        self._settle_due(run, ask=False)
        waiting = run.state.pending
        recorded = 0
        for entry in entries:
            check_id = entry.get("check_id")
            if check_id in run.answers:
                continue
            action = entry["action"]
            check = make_check(action["name"], action.get("args"),
                                     type=action.get("type", "tool"),
                                     progress=entry.get("progress"),
                                     last_result=entry.get("last_result"),
                                     cost_usd=entry.get("cost_usd"))
            now = self.now()
            allowed = entry["decision"] == rules.ALLOW
            before = run.state
            verdict, run.state = rules.record_outcome(
                self.policy, run.state, check, allowed=allowed,
                reason=entry.get("reason") or rules.STEP_OK, now=now,
                message=entry.get("message"),
            )
            # As on the service: kept, and flagged when it broke the policy (SPEC 10).
            violation = rules.local_violation(self.policy, before, check,
                                              now=now) if allowed else None
            directive = entry.get("directive") if allowed else None
            # As on the service: the warning's rule, and a budget's remembered.
            warning = rules.remember_warning(self.policy, run.state, check, directive, now) \
                if directive is not None and run.state.steps > before.steps else None
            self._decisions += 1
            answer = {**answers.local_answer(verdict, run.state, self.policy, now,
                                             decided_at=entry.get("at") or now.isoformat(),
                                             violation=violation,
                                             after_end=before.status in rules.TERMINAL,
                                             directive=directive, warning=warning),
                      "decision_id": self._decisions}
            run.decisions.append(answer)
            run.answers[check_id] = answer
            run.uploaded.append(entry)
            recorded += 1
        # A local stop ends the run's wait too: nothing stays pending (SPEC 10).
        self._cancel_on_end(run, waiting)
        return httpx.Response(200, json={"recorded": recorded,
                                         "skipped": len(entries) - recorded,
                                         "run": run.as_json()})

    def _finish(self, run: FakeRun, body: dict[str, Any]) -> httpx.Response:
        status = body.get("status")
        if status not in ("completed", "failed", "stopped"):
            return _error(422, "invalid_request", "Invalid finish.", {"status": "required"})
        if run.finished:
            return _error(409, "run_finished", "The run is already finished.")
        self._settle_due(run, ask=False)  # an expiry that is due comes first (SPEC 11)
        self._abandon_if_idle(run, out_of_time=True)  # then a deadline passed (SPEC 14)
        now = self.now()
        stopped = rules.stopped_by_tree(run.state, self._tree(run), now)
        waiting = run.state.pending
        if stopped is not None:  # SPEC 20: its tree is over, it ends stopped with it
            decision, run.state = stopped
            self._record(run, answers.answer_of(decision, run.state, self.policy, now))
        run.state = rules.finish(run.state, status, already_finished=False, now=now)
        self._cancel_on_end(run, waiting)
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


def _explain_stop(run: FakeRun) -> None:
    """As the service (runs/check/records.py, `explain_stop`): a later check of a stopped or
    killed run answers with the words of the stop that ended it (its first stop), and its
    rule."""
    state = run.state
    if state.status not in (rules.STOPPED, rules.KILLED) or state.stop_detail is not None:
        return
    reason = state.stop_reason or state.status
    first = next((d for d in run.decisions if d.get("decision") == rules.STOP), None)
    if first is None or first.get("reason") != reason:
        return
    fired = first.get("rule")
    run.state = replace(state, stop_detail=first.get("message") or None,
                        stop_rule=fired if isinstance(fired, dict) else None)
