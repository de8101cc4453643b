"""Long runs through the check's real path (the API, the services, the check's transaction:
two prepared statements on PostgreSQL, the ORM on SQLite): thousands of checks of one run,
every answer compared with `governance_client.rules` evaluated in memory on the whole state,
and the stored state compared with that whole state at the end.

The server keeps the run's keyed memory (repeat counts, progress values, result signatures,
error counts) as rows and reads only the check's own entries (runs/check/run_memory.py): these
tests prove that changes no answer however long the run, that the entries stored are exactly
the in-memory state's, and that what the run's row carries stays the same size.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from django.db import connection

from governance_client import rules
from policies.models import Team
from runs.check import check_store, run_memory, services
from runs.models import Run, RunMemory
from tests.conftest import set_policy

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

TOOLS = ("search.docs", "crm.lookup", "kb.fetch", "billing.quote", "email.draft", "llm.plan")
ERRORS = ("timeout talking to crm", "Rate limit exceeded", "  no  such order ", "HTTP 500")


def body_of(rng: random.Random, i: int, *, pool: int) -> dict[str, Any]:
    """A check drawn from small pools, so repeat keys, progress values, signatures and error
    texts come back now and then over the whole run (some from thousands of steps before)."""
    body: dict[str, Any] = {
        "action": {"name": rng.choice(TOOLS), "type": "llm" if rng.random() < 0.2 else "tool",
                   "args": {"q": rng.randrange(pool), "request_id": i}},
        "check_id": f"c{i}",
    }
    if rng.random() < 0.6:
        body["progress"] = rng.choice([rng.randrange(pool * 3), f"m{rng.randrange(pool)}"])
    roll = rng.random()
    if roll < 0.35:
        body["last_result"] = {"status": "ok", "digest": f"d{rng.randrange(pool * 2)}"}
    elif roll < 0.6:
        body["last_result"] = {"status": "error", "error": rng.choice(ERRORS)}
    return body


def check_of(body: dict[str, Any]) -> rules.Check:
    action, last = body["action"], body.get("last_result")
    return rules.Check(
        name=action["name"], type=action["type"], args=action["args"],
        progress=body.get("progress"),
        last_result=rules.LastResult(status=last["status"], digest=last.get("digest"),
                                     error=last.get("error")) if last else None,
        cost_usd=Decimal(0), check_id=body["check_id"])


def compared(answer: dict[str, Any]) -> tuple[Any, ...]:
    """The fields of an answer that the rules decide (not the clock's elapsed_s)."""
    return (answer["decision"], answer["reason"], answer["step"], answer["repeat_key"],
            answer["repeat_count"], answer["message"], answer["shadow"], answer["directive"],
            answer["usage"]["steps"], answer["usage"]["tool_calls"])


def expected(decision: rules.Decision, state: rules.RunState) -> tuple[Any, ...]:
    """The same fields as the in-memory rules decide them."""
    return (decision.answer, decision.reason, decision.step, decision.repeat_key,
            decision.repeat_count, decision.message, decision.shadow, decision.directive,
            state.steps, state.tool_calls)


def long_run(api: Any, team: Team, *, checks: int, pool: int, seed: int
             ) -> tuple[str, rules.RunState, list[dict[str, Any]]]:
    """Start a run and send it `checks` checks; every answer must be the in-memory rules'.
    Returns the run id, the in-memory state and the answers."""
    started = api.post("/api/v1/runs", {"agent": "long-bot"}, content_type="application/json")
    assert started.status_code == 201, started.content
    run_id = started.json()["run_id"]
    run = Run.objects.get(pk=run_id)
    policy = services.rules_for_version(run.policy_version_id)
    state = rules.RunState(started_at=run.started_at)
    rng = random.Random(seed)
    answers = []
    for i in range(checks):
        body = body_of(rng, i, pool=pool)
        response = api.post(f"/api/v1/runs/{run_id}/check", json.dumps(body),
                            content_type="application/json")
        assert response.status_code == 200, response.content
        answer = response.json()
        decision, state = rules.evaluate(policy, state, check_of(body),
                                         now=datetime.now(UTC))
        assert compared(answer) == expected(decision, state), (i, answer)
        answers.append(answer)
    return run_id, state, answers


def assert_stored_as_in_memory(run_id: str, state: rules.RunState) -> None:
    run = Run.objects.get(pk=run_id)
    assert (run.status, run.stop_reason, run.steps, run.tool_calls) == (
        state.status, state.stop_reason, state.steps, state.tool_calls)
    # Every entry of the whole memory is a row, with its count, and nothing else is.
    assert run_memory.entries(run.pk) == state.keyed()
    # The row's own memory is the fixed part only: its size does not depend on the run's
    # length (a number, a float and a null).
    assert run.memory == state.fixed_memory()
    assert len(json.dumps(run.memory)) < 100


def test_a_long_shadow_run_answers_as_the_rules_on_the_whole_memory(api: Any,
                                                                     team: Team) -> None:
    # Shadow mode: every rule's stop becomes a would-stop, so the run goes on and every rule
    # (loops, no progress, repeated errors) keeps firing over thousands of steps.
    set_policy(team, mode="shadow",
               step_limits={"max_steps": 10000, "max_repeat_action": 3,
                            "no_progress_window": 4},
               budgets={"max_seconds": None, "max_usd": None, "max_tool_calls": None,
                        "max_idle_seconds": None},
               on_repeated_error={"threshold": 3, "action": "stop"},
               repeat_key={"ignore_args": ["request_id"]})
    run_id, state, answers = long_run(api, team, checks=2000, pool=60, seed=17)

    shadowed = {a["shadow"]["reason"] for a in answers if a["shadow"]}
    assert {"loop_detected", "no_progress", "repeated_error"} <= shadowed
    assert len(state.repeat_counts) > 300 and len(state.progress_seen) > 150
    assert_stored_as_in_memory(run_id, state)


def test_a_long_run_stops_for_a_repeat_first_seen_thousands_of_steps_before(
        api: Any, team: Team) -> None:
    set_policy(team, step_limits={"max_steps": 10000, "max_repeat_action": 3,
                                  "no_progress_window": 1000},
               budgets={"max_seconds": None, "max_usd": None, "max_tool_calls": None,
                        "max_idle_seconds": None},
               on_repeated_error={"threshold": 1000, "action": "nudge"})
    # A large pool: repeats are rare, so the run goes on (nudges included) for 1,200 checks.
    run_id, state, _ = long_run(api, team, checks=1200, pool=100_000, seed=5)
    assert state.status == rules.RUNNING
    first = json.loads(json.dumps(body_of(random.Random(5), 0, pool=100_000)))
    policy = services.rules_for_version(Run.objects.get(pk=run_id).policy_version_id)
    # The first check's action, twice more, is allowed (counts 2, 3); the next is a loop.
    for i, outcome in enumerate(["allow", "allow", "stop"]):
        body = {**first, "check_id": f"again{i}"}
        answer = api.post(f"/api/v1/runs/{run_id}/check", json.dumps(body),
                          content_type="application/json").json()
        decision, state = rules.evaluate(policy, state, check_of(body), now=datetime.now(UTC))
        assert compared(answer) == expected(decision, state)
        assert answer["decision"] == outcome
    assert (answer["reason"], answer["repeat_count"]) == ("loop_detected", 3)
    assert_stored_as_in_memory(run_id, state)


@pytest.fixture
def executes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The statements the PostgreSQL check sends on its own cursor (one per round trip)."""
    if connection.vendor != "postgresql":
        pytest.skip("the check's prepared statements are PostgreSQL's")
    sent: list[str] = []
    original = psycopg.ClientCursor.execute

    def execute(self: Any, query: Any, params: Any = None, **kwargs: Any) -> Any:
        sent.append(str(query).split("(")[0])
        return original(self, query, params, **kwargs)

    monkeypatch.setattr(psycopg.ClientCursor, "execute", execute)
    yield sent


def test_a_check_costs_two_round_trips_at_any_length_of_the_run(
        api: Any, team: Team, executes: list[str]) -> None:
    set_policy(team, step_limits={"max_steps": 10000, "max_repeat_action": 1000,
                                  "no_progress_window": 1000},
               budgets={"max_seconds": None, "max_usd": None, "max_tool_calls": None})
    run_id, _, _ = long_run(api, team, checks=300, pool=50, seed=3)
    rng = random.Random(99)

    def one_check(i: int) -> list[str]:
        executes.clear()
        body = body_of(rng, 10_000 + i, pool=50)
        assert api.post(f"/api/v1/runs/{run_id}/check", json.dumps(body),
                        content_type="application/json").status_code == 200
        return list(executes)

    both = [check_store.EXECUTE_LOCK.split("(")[0], "EXECUTE governance_check_write"]
    assert one_check(0) == both
    # A process that did not start the run and never checked it does not know its policy
    # version: it reads the check's entries in one more round trip, once.
    services._RUN_FACTS.clear()
    assert one_check(1) == [both[0], "SELECT digest, count FROM runs_runmemory WHERE run_id = %s "
                            "AND digest = ANY", both[1]]
    assert one_check(2) == both
    assert RunMemory.objects.filter(run_id=run_id).count() > 200
