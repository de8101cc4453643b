"""Model-based test of the check API: a hypothesis state machine drives runs through the real
API (Django's test client, real database) and compares every answer with a small model of
SPEC section 4 written here, independently of governance_client/rules.py.

The model knows nothing of hashes or canonical JSON: actions, args, progress values and error
texts are drawn from equivalence classes (spellings the SPEC says are the same thing), and the
model keys its state by class. So it checks the SPEC's sentences (equivalent args share a
repeat key, ``1 == 1.0`` but ``"1" != 1``, whitespace and ignored args do not matter, case
does...) as well as the order of the rules, the counters, terminal runs, check_id replays
and finish.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import pytest
from django.test import Client
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    precondition,
    rule,
    run_state_machine_as_test,
)

from policies.document import parse_policy
from policies.models import Team
from policies.services import agent_key_create, policy_save, team_ensure

# Transactional: outside a test transaction the check takes its production path on
# PostgreSQL (runs/check/check_store.py), not the ORM fallback used inside an atomic block.
pytestmark = pytest.mark.django_db(transaction=True)

# --- The model ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelPolicy:
    name: str
    mode: str
    error_action: str
    allow: tuple[str, ...] | None
    max_steps: int = 8
    max_repeat_action: int = 2
    no_progress_window: int = 2
    max_usd: Decimal | None = Decimal("0.05")
    max_tool_calls: int | None = 5
    deny_prefix: str = "shell."
    error_threshold: int = 2

    def document(self) -> dict[str, Any]:
        return parse_policy({
            "name": self.name, "mode": self.mode,
            "step_limits": {"max_steps": self.max_steps,
                            "max_repeat_action": self.max_repeat_action,
                            "no_progress_window": self.no_progress_window},
            "budgets": {"max_seconds": None,
                        "max_usd": None if self.max_usd is None else float(self.max_usd),
                        "max_tool_calls": self.max_tool_calls},
            "tools": {"allow": list(self.allow) if self.allow is not None else None,
                      "deny": [self.deny_prefix + "*"]},
            "repeat_key": {"ignore_args": ["request_id"]},
            "on_repeated_error": {"threshold": self.error_threshold,
                                  "action": self.error_action},
            # This model is of SPEC 4's rules; the warnings of SPEC 16 have their own
            # (tests/test_rules_warnings.py, tests/test_fake_parity.py).
            "warnings": None,
        })

    def denied(self, name: str) -> bool:
        if name.startswith(self.deny_prefix):
            return True
        # The allow lists below are exact names or "prefix.*" patterns.
        return self.allow is not None and not any(
            name == p or (p.endswith(".*") and name.startswith(p[:-1])) for p in self.allow)


# Small limits, so that short random runs reach every rule.
POLICIES = {
    p.name: p for p in [
        ModelPolicy(name="default", mode="enforce", error_action="stop", allow=None,
                    max_steps=6, max_tool_calls=3, max_usd=Decimal("0.02")),
        # Only the progress and error rules are near: long runs that circle.
        ModelPolicy(name="patient", mode="enforce", error_action="stop", allow=None,
                    max_steps=20, max_repeat_action=5, no_progress_window=2,
                    max_tool_calls=None, max_usd=None, error_threshold=3,
                    deny_prefix="never."),
        ModelPolicy(name="nudger", mode="enforce", error_action="nudge",
                    allow=("search.*", "fetch"), max_steps=5, max_repeat_action=3,
                    no_progress_window=3, max_tool_calls=None, max_usd=None),
        ModelPolicy(name="shadowy", mode="shadow", error_action="nudge", allow=None,
                    max_steps=5, max_tool_calls=3, max_usd=Decimal("0.03")),
    ]
}

# (class, spelling): spellings of one class are equivalent by SPEC 4.2.
ARGS: list[tuple[str, dict[str, Any] | None]] = [
    ("empty", None), ("empty", {}), ("empty", {"request_id": "r-1"}),
    ("refund", {"q": "refund policy"}), ("refund", {"q": "  refund\tpolicy "}),
    ("refund", {"q": "refund  policy", "request_id": "r-2"}),
    ("Refund", {"q": "Refund policy"}),
    ("n1", {"n": 1}), ("n1", {"n": 1.0}), ("true", {"n": True}), ("n1s", {"n": "1"}),
    ("nested", {"a": {"y": [1, "x"], "x": None}}), ("nested", {"a": {"x": None, "y": [1.0, " x"]}}),
]
# Repeated entries weigh the draw: mostly allowed tools, so runs live long enough to loop.
NAMES = ["search.docs"] * 5 + ["fetch"] * 3 + ["search.web", "crm.lookup", "shell.exec"]
# (class or None, value)
PROGRESS: list[tuple[str | None, Any]] = [
    (None, None), (None, None), (None, None), (None, None),
    ("s:a", "a"), ("s:a", "  a "), ("s:b", "b"),
    ("n:1", 1), ("n:1", 1.0), ("s:1", "1"), ("n:2", 2.5),
]
# (error class or None, signature class or None, body)
RESULTS: list[tuple[str | None, str | None, dict[str, Any] | None]] = [
    (None, None, None), (None, None, None), (None, None, None),
    (None, None, {"status": "ok"}), (None, None, {"status": "ok"}),
    (None, None, {"status": "ok", "digest": ""}),
    (None, "d1", {"status": "ok", "digest": "d1"}), (None, "d1", {"status": "ok", "digest": "d1"}),
    (None, "d2", {"status": "ok", "digest": "d2"}),
    ("timeout", "error:Time out", {"status": "error", "error": "Time out"}),
    ("timeout", "error:Time out", {"status": "error", "error": " Time \n out "}),
    ("TIMEOUT", "error:TIME OUT", {"status": "error", "error": "TIME OUT"}),
    ("", "error:", {"status": "error"}),
    ("timeout", "d1", {"status": "error", "error": "Time out", "digest": "d1"}),
]
COSTS: list[Any] = [None, None, 0, 0.01, 0.02, 0.005]
NUDGE = "The error '{}' occurred {} times. Change approach radically or abandon this subtask."
ERROR_TEXT = {"timeout": "Time out", "TIMEOUT": "TIME OUT", "": ""}


@dataclass
class ModelRun:
    policy: ModelPolicy
    status: str = "running"
    stop_reason: str | None = None
    finished: bool = False
    steps: int = 0
    tool_calls: int = 0
    cost: Decimal = Decimal(0)
    allowed: Counter[tuple[str, str]] = field(default_factory=Counter)
    progress_seen: set[str] = field(default_factory=set)
    signatures_seen: set[str] = field(default_factory=set)
    streak: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    first_answers: dict[str, dict[str, Any]] = field(default_factory=dict)
    audited: int = 0
    last_action: tuple[str, tuple[str, Any]] | None = None  # what the test last sent

    def check(self, *, name: str, kind: str, args_class: str, progress: str | None,
              error: str | None, signature: str | None, cost: Decimal
              ) -> dict[str, Any]:
        """The expected answer of SPEC 4.4 (decision, reason, step, repeat_count...)."""
        key = (name, args_class)
        p = self.policy
        if self.status != "running":
            reason = (self.stop_reason or self.status) if self.status in ("stopped", "killed") \
                else "run_finished"
            return {"decision": "stop", "reason": reason, "step": self.steps,
                    "repeat_count": self.allowed[key], "shadow": None, "directive": None}
        self.steps += 1
        self.cost += cost
        if progress is not None or signature is not None:
            new = False
            if progress is not None:
                new = progress not in self.progress_seen
                self.progress_seen.add(progress)
            if signature is not None:
                new = new or signature not in self.signatures_seen
                self.signatures_seen.add(signature)
            self.streak = 0 if new else self.streak + 1
        if error is not None:
            self.errors[error] += 1
        stop = None
        if self.steps > p.max_steps:
            stop = "max_steps"
        elif p.denied(name):
            stop = "tool_denied"
        elif p.max_usd is not None and self.cost >= p.max_usd:
            stop = "max_usd"
        elif (p.max_tool_calls is not None and kind == "tool"
              and self.tool_calls >= p.max_tool_calls):
            stop = "max_tool_calls"
        elif self.allowed[key] >= p.max_repeat_action:
            stop = "loop_detected"
        elif self.streak >= p.no_progress_window:
            stop = "no_progress"
        elif (p.error_action == "stop" and error is not None
              and self.errors[error] >= p.error_threshold):
            stop = "repeated_error"
        if stop is not None and p.mode == "enforce":
            self.status, self.stop_reason = "stopped", stop
            return {"decision": "stop", "reason": stop, "step": self.steps,
                    "repeat_count": self.allowed[key], "shadow": None, "directive": None}
        self.allowed[key] += 1
        if kind == "tool":
            self.tool_calls += 1
        directive = None
        if error is not None and p.error_action == "nudge" and \
                self.errors[error] >= p.error_threshold:
            directive = NUDGE.format(ERROR_TEXT[error], self.errors[error])
        return {"decision": "allow", "reason": "step_ok", "step": self.steps,
                "repeat_count": self.allowed[key], "shadow": stop, "directive": directive}

    def finish(self, status: str) -> tuple[int, str | None]:
        if self.finished:
            return 409, None
        self.finished = True
        if self.status == "running":
            self.status = status
            self.stop_reason = "agent_stopped" if status == "stopped" else None
        return 200, self.status


# --- The machine -----------------------------------------------------------------------------


RUNS = Bundle("runs")
DRAW = dict(
    name=st.sampled_from(NAMES), kind=st.sampled_from(["tool", "tool", "llm"]),
    args=st.sampled_from(ARGS), progress=st.sampled_from(PROGRESS),
    result=st.sampled_from(RESULTS), cost=st.sampled_from(COSTS),
    check_id=st.sampled_from([None, None, None, "c1", "c2"]),
    # An agent stuck in a loop repeats its last action (possibly spelled another way).
    again=st.sampled_from([False, False, True]),
)
# A run is left for a new one after this many checks: random runs then reach every limit
# instead of one shadow-mode run (which never stops) taking all the steps.
LONG_RUN = 12


class CheckApi(RuleBasedStateMachine):
    runs = RUNS

    def __init__(self, client: Client) -> None:
        super().__init__()
        self.client = client
        self.models: dict[str, ModelRun] = {}
        self.current: str | None = None
        self.key_of: dict[tuple[str, str], str] = {}  # model key -> the API's repeat_key

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return self.client.post(path, json.dumps(body), content_type="application/json")

    def _needs_a_run(self) -> bool:
        model = self.models.get(self.current or "")
        return model is None or model.status != "running" or model.steps >= LONG_RUN

    @precondition(_needs_a_run)
    @rule(target=runs, policy=st.sampled_from(sorted(POLICIES)))
    def start(self, policy: str) -> str:
        response = self.post("/api/v1/runs", {"agent": "model-bot", "policy": policy})
        assert response.status_code == 201, response.content
        run_id = response.json()["run_id"]
        self.models[run_id] = ModelRun(policy=POLICIES[policy])
        self.current = run_id
        return run_id

    # Hypothesis picks among enabled rules evenly: two rules check the current run, one
    # any run (old and terminal ones included), one finishes a run.
    @precondition(lambda self: self.current is not None)
    @rule(**DRAW)
    def check(self, **draw: Any) -> None:
        assert self.current is not None
        self._check(self.current, **draw)

    @precondition(lambda self: self.current is not None)
    @rule(**DRAW)
    def check_again(self, **draw: Any) -> None:
        assert self.current is not None
        self._check(self.current, **draw)

    @rule(run=RUNS, **DRAW)
    def check_any_run(self, run: str, **draw: Any) -> None:
        self._check(run, **draw)

    def _check(self, run: str, name: str, kind: str, args: tuple[str, Any],
              progress: tuple[str | None, Any], result: tuple[Any, Any, Any], cost: Any,
              check_id: str | None, again: bool) -> None:
        model = self.models[run]
        if again and model.last_action is not None:
            name, last_args = model.last_action
            if args[0] != last_args[0]:
                args = last_args
        model.last_action = (name, args)
        body: dict[str, Any] = {"action": {"name": name, "type": kind}}
        if args[1] is not None:
            body["action"]["args"] = args[1]
        if progress[1] is not None:
            body["progress"] = progress[1]
        if result[2] is not None:
            body["last_result"] = result[2]
        if cost is not None:
            body["cost_usd"] = cost
        if check_id is not None:
            body["check_id"] = check_id
        response = self.post(f"/api/v1/runs/{run}/check", body)
        assert response.status_code == 200, response.content
        got = response.json()

        first = model.first_answers.get(check_id) if check_id else None
        if first is not None and (model.status == "running" or first["decision"] == "stop"):
            # A replay: the first answer, nothing counted, nothing audited.
            assert got == first
            return
        expected = model.check(name=name, kind=kind, args_class=args[0], progress=progress[0],
                               error=result[0], signature=result[1],
                               cost=Decimal(str(cost or 0)))
        model.audited += 1
        if check_id is not None and first is None:
            model.first_answers[check_id] = got

        assert {k: got[k] for k in ("decision", "reason", "step", "repeat_count")} == {
            k: expected[k] for k in ("decision", "reason", "step", "repeat_count")}, (body, got)
        assert (got["shadow"] or {}).get("reason") == expected["shadow"]
        assert (got["directive"] or {}).get("content") == expected["directive"]
        if got["decision"] == "stop":
            assert got["message"] and got["next_action"]
        else:
            assert got["message"] is None and got["next_action"] is None
        assert (got["usage"]["steps"], got["usage"]["tool_calls"]) == (model.steps,
                                                                       model.tool_calls)
        assert Decimal(str(got["usage"]["cost_usd"])) == model.cost
        # One repeat key per equivalence class, different classes never share one.
        key = (name, args[0])
        assert self.key_of.setdefault(key, got["repeat_key"]) == got["repeat_key"]
        assert list(self.key_of.values()).count(got["repeat_key"]) == 1

    @rule(run=runs, status=st.sampled_from(["completed", "failed", "stopped"]))
    def finish(self, run: str, status: str) -> None:
        model = self.models[run]
        code, expected_status = model.finish(status)
        response = self.post(f"/api/v1/runs/{run}/finish", {"status": status, "output": "done"})
        assert response.status_code == code, response.content
        if code == 409:
            assert response.json()["error"]["code"] == "run_finished"
            return
        body = response.json()
        assert (body["status"], body["stop_reason"]) == (expected_status, model.stop_reason)
        assert (body["steps"], body["tool_calls"]) == (model.steps, model.tool_calls)
        assert body["output"] == "done"

    def teardown(self) -> None:
        for run in self.models:
            self.audit_log_matches(run)

    def audit_log_matches(self, run: str) -> None:
        response = self.client.get(f"/api/v1/runs/{run}/decisions?limit=1000")
        decisions = response.json()["decisions"]
        model = self.models[run]
        assert len(decisions) == model.audited
        # Every counted step once; checks of a terminal run repeat its last step (0 if none).
        counted = {d["step"] for d in decisions} - {0}
        assert counted == set(range(1, model.steps + 1))
        allowed = sum(d["outcome"] in ("allow", "would_stop") for d in decisions)
        assert allowed == sum(model.allowed.values())


@pytest.fixture
def client_with_policies() -> Client:
    team: Team = team_ensure(slug="model")[0]
    for policy in POLICIES.values():
        policy_save(team=team, document=policy.document(), actor=None, source="test")
    token = agent_key_create(team=team, name="model").token
    return Client(HTTP_AUTHORIZATION=f"Bearer {token}")


def test_the_check_api_behaves_like_the_model_of_spec_section_4(
        client_with_policies: Client) -> None:
    run_state_machine_as_test(
        lambda: CheckApi(client_with_policies),
        settings=settings(max_examples=50, stateful_step_count=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.filter_too_much]),
    )
