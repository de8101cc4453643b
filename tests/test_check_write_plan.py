"""The check's write finds its run by the primary key however many runs there are
(docs/performance.md "Cost as the work grows"). It used to join the runs table with the
JSON-unpacked new state (a recordset, now one record) by a hash over a sequential scan of
the whole table once it held a few thousand runs: 2 ms of PostgreSQL per check at 10,000
running runs, growing with them.

PostgreSQL only: the two-round-trip path (runs/check/check_store.py) is PostgreSQL's; SQLite
updates the run through the ORM by its primary key.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.utils import timezone

from policies.models import Policy
from policies.services import agent_key_create, team_ensure
from runs.check import check_store
from runs.models import Decision, Run

# Transactional: outside a test transaction the check takes its production path.
pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

RUNS = 3000


@pytest.fixture
def many_runs() -> dict[str, Any]:
    team, _ = team_ensure(slug="many")
    token = agent_key_create(team=team, name="k").token
    version = Policy.objects.get(team=team, name="default").current_id
    now = timezone.now()
    Run.objects.bulk_create([Run(team=team, agent="bot", policy_version_id=version,
                                 started_at=now, task=f"run {i}") for i in range(RUNS)],
                            batch_size=1000)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE runs_run")  # the statistics a live table has
    return {"team": team, "token": token, "run": Run.objects.filter(team=team).first()}


def _plan_nodes(plan: dict[str, Any]) -> list[tuple[str, str | None]]:
    nodes = [(plan["Node Type"], plan.get("Relation Name"))]
    for child in plan.get("Plans", []):
        nodes += _plan_nodes(child)
    return nodes


@pytest.mark.parametrize("mode", ["force_custom_plan", "force_generic_plan"])
def test_the_write_reads_the_run_by_its_primary_key(many_runs: dict[str, Any], mode: str
                                                    ) -> None:
    """Both plans a prepared statement may run with: the first executions' custom plans and
    the generic one PostgreSQL may keep after them."""
    run = many_runs["run"]
    name = f"plan_{uuid.uuid4().hex[:8]}"
    state = {"id": str(run.pk), "status": "running", "stop_reason": None, "ended_at": None,
             "steps": 1, "tool_calls": 1, "cost_usd": "0", "memory": {}, "idle_deadline": None}
    with connection.cursor() as cursor:
        cursor.execute(f"SET plan_cache_mode = {mode}")
        # The decisions, the run's new state, the rate-limit hit, the keyed memory's entries.
        cursor.execute(f"PREPARE {name}(jsonb, jsonb, jsonb, jsonb) AS {check_store.WRITE_SQL}")
        try:
            cursor.execute(f"EXPLAIN (FORMAT JSON) EXECUTE {name}(%s, %s, %s, %s)",
                           ["[]", json.dumps([state]), "[]", "[]"])
            plan = cursor.fetchone()[0]
        finally:
            cursor.execute(f"DEALLOCATE {name}")
            cursor.execute("RESET plan_cache_mode")
    nodes = _plan_nodes((json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"])
    assert ("Seq Scan", "runs_run") not in nodes
    assert ("Index Scan", "runs_run") in nodes


def test_a_check_among_many_runs_changes_its_run_only(many_runs: dict[str, Any]) -> None:
    run = many_runs["run"]
    client = Client(HTTP_AUTHORIZATION=f"Bearer {many_runs['token']}")
    response = client.post(f"/api/v1/runs/{run.pk}/check", {"action": {"name": "search"}},
                           content_type="application/json")
    assert response.status_code == 200, response.content
    assert response.json()["decision"] == "allow"
    assert Run.objects.get(pk=run.pk).steps == 1
    assert Run.objects.filter(team=many_runs["team"], steps=0).count() == RUNS - 1
    assert list(Decision.objects.values_list("run_id", flat=True)) == [run.pk]
