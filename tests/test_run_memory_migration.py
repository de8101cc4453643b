"""Migration 0007 moves the keyed memory (repeat counts, progress values, result signatures,
error counts) out of each run's `memory` document into `RunMemory` rows, and back when it is
reversed: a run recorded before the change goes on exactly as it would have."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from governance_client import rules
from policies.models import Team
from runs.check import run_memory, services
from runs.models import Run
from tests.conftest import set_policy
from tests.test_check_long_run import body_of, check_of, compared, expected

pytestmark = pytest.mark.django_db(transaction=True)

BEFORE = [("runs", "0006_idle_deadline_rate_hits")]
AFTER = [("runs", "0007_run_memory")]


def migrate(target: list[tuple[str, str]]) -> Any:
    """Migrate the test database to ``target``; the models as they were there."""
    executor = MigrationExecutor(connection)
    executor.migrate(target)
    return executor.loader.project_state(target).apps


@pytest.fixture
def at_the_end() -> Iterator[None]:
    """Whatever happens, the database ends at the latest migration for the next test."""
    yield
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())


def check(api: Any, run_id: str, body: dict[str, Any]) -> dict[str, Any]:
    response = api.post(f"/api/v1/runs/{run_id}/check", json.dumps(body),
                        content_type="application/json")
    assert response.status_code == 200, response.content
    return response.json()


def test_a_run_recorded_before_goes_on_as_it_would_have(api: Any, team: Team,
                                                         at_the_end: None) -> None:
    set_policy(team, step_limits={"max_steps": 1000, "max_repeat_action": 3,
                                  "no_progress_window": 4},
               budgets={"max_seconds": None, "max_usd": None, "max_tool_calls": None},
               on_repeated_error={"threshold": 3, "action": "nudge"},
               repeat_key={"ignore_args": ["request_id"]}, mode="shadow")
    run_id = api.post("/api/v1/runs", {"agent": "old-bot"},
                      content_type="application/json").json()["run_id"]
    idle_id = api.post("/api/v1/runs", {"agent": "idle-bot"},
                       content_type="application/json").json()["run_id"]
    policy = services.rules_for_version(Run.objects.get(pk=run_id).policy_version_id)
    state = rules.RunState(started_at=Run.objects.get(pk=run_id).started_at)
    rng = random.Random(11)
    bodies = [body_of(rng, i, pool=8) for i in range(120)]

    def go_on(body: dict[str, Any]) -> None:
        nonlocal state
        answer = check(api, run_id, body)
        decision, state = rules.evaluate(policy, state, check_of(body), now=datetime.now(UTC))
        assert compared(answer) == expected(decision, state)

    for body in bodies[:60]:
        go_on(body)

    # Back to the document: exactly what the check stored before the change.
    old = migrate(BEFORE).get_model("runs", "Run")
    assert old.objects.get(pk=run_id).memory == json.loads(json.dumps(state.memory()))
    # A document of an older shape: some parts missing, counts only.
    old.objects.filter(pk=idle_id).update(memory={"repeat_counts": {"search.docs:ab": 2},
                                                  "no_progress_streak": 1})

    then = migrate(AFTER).get_model("runs", "Run")  # today's has later columns
    assert run_memory.entries(run_id) == state.keyed()
    assert then.objects.get(pk=run_id).memory == json.loads(json.dumps(state.fixed_memory()))
    assert run_memory.entries(idle_id) == {(rules.REPEAT, "search.docs:ab"): 2}
    assert then.objects.get(pk=idle_id).memory == {"no_progress_streak": 1}

    # The same run goes on: repeats, progress values and errors first seen before the change
    # count as seen (the pools are small, so the next 60 checks come back to them). On the
    # latest schema, which today's check writes to (runs/migrations/0011: the rate limits).
    migrate(MigrationExecutor(connection).loader.graph.leaf_nodes())
    services._RUN_FACTS.clear()
    for body in bodies[60:]:
        go_on(body)
    assert max(state.repeat_counts.values()) >= 3  # keys from before came back
    assert run_memory.entries(run_id) == state.keyed()


def test_the_migration_looks_entries_up_by_the_digest_the_check_uses() -> None:
    from importlib import import_module

    migration = import_module("runs.migrations.0007_run_memory")
    for entry in [(rules.REPEAT, "search.docs:9f2c"), (rules.PROGRESS, '"milestone é"'),
                  (rules.SIGNATURE, "error:boom"), (rules.ERROR, "boom")]:
        assert migration.digest(*entry) == run_memory.digest(entry)
    assert set(migration.KEYED.values()) == set(rules.KEYED_KINDS)
