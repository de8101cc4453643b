"""Reads of one run, and of one agent's runs, examine a number of rows bounded by the page
they answer, whatever the run's length or the team's history (SPEC 10, "Bounded work per
request"; docs/reliability.md "Reads bounded by an index").

On PostgreSQL each statement a read makes is run again under EXPLAIN ANALYZE, and the rows
its scans of the table examined (returned and filtered out, over all loops) are counted. The
run is long and its decisions are interleaved with other runs' (a busy installation), so a
read that walked the run's every decision, sorted them, or walked the table's id order
filtering for the run, examines thousands of rows. On SQLite the plans of the same reads
search the same indexes, and sort nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from governance_client import rules
from policies.models import Team
from policies.services import agent_key_create
from runs.audit.selectors import decisions_of, runs_page
from runs.check.records import stop_detail
from runs.dashboard import presenters
from runs.dashboard.selectors import (
    TIMELINE_PAGE,
    latest_decision_id,
    timeline,
    timeline_page,
)
from runs.models import Decision, Run

pytestmark = pytest.mark.django_db

ALLOWED = 2000  # the long run's allowed steps, then its kill, then checks of the killed run
AFTER_END = 400
OTHERS = 6  # other runs, each with as many decisions as the long run, interleaved


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def examined(sql: str, table: str) -> float:
    """Rows of ``table`` the statement's scans examined, under EXPLAIN ANALYZE."""
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}")
        plan = cursor.fetchone()[0]
    total = 0.0
    for node in _nodes((json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"]):
        if node.get("Relation Name") == table:
            total += (node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)
                      + node.get("Rows Removed by Index Recheck", 0)) * node["Actual Loops"]
    return total


def most_examined(read: Callable[[], Any], table: str, marker: str = "") -> float:
    """The most rows of ``table`` any SELECT of ``read`` (containing ``marker``) examined."""
    with CaptureQueriesContext(connection) as queries:
        read()
    statements = [q["sql"] for q in queries.captured_queries
                  if q["sql"].startswith("SELECT") and f'"{table}"' in q["sql"]
                  and marker in q["sql"]]
    assert statements
    return max(examined(sql, table) for sql in statements)


def _decision(run: Run, step: int, outcome: str, reason: str, at: Any) -> Decision:
    answer = {"decision": outcome, "message": f"{reason} at {step}"}
    if outcome == rules.WOULD_STOP:
        answer["shadow"] = {"reason": reason, "message": "would stop"}
    return Decision(run=run, step=step, outcome=outcome, reason=reason, action_name="t",
                    action_type="tool", answer=answer, at=at)


@pytest.fixture
def history(team: Team) -> dict[str, Run]:
    """A killed run of ALLOWED steps checked AFTER_END more times after its kill, a shadow
    run whose second half would have stopped, and OTHERS runs as long, decisions
    interleaved in id order; the tables analyzed, as autovacuum would have."""
    version = team.policies.get(name="default").current
    now = timezone.now()
    long = Run.objects.create(team=team, agent="bot", policy_version=version, started_at=now,
                              status=rules.KILLED, stop_reason="killed", ended_at=now)
    shadow = Run.objects.create(team=team, agent="bot", policy_version=version,
                                started_at=now)
    others = Run.objects.bulk_create([Run(team=team, agent="other", policy_version=version,
                                          started_at=now) for _ in range(OTHERS)])
    rows: list[Decision] = []
    for step in range(1, ALLOWED + AFTER_END + 2):
        if step <= ALLOWED:
            rows.append(_decision(long, step, rules.ALLOW, "ok", now))
        else:  # the kill, then the stops answered to every later check
            rows.append(_decision(long, ALLOWED, rules.STOP, "killed", now))
        shadowed = step > (ALLOWED + AFTER_END) // 2
        rows.append(_decision(shadow, step, rules.WOULD_STOP if shadowed else rules.ALLOW,
                              "max_steps" if shadowed else "ok", now))
        rows += [_decision(other, step, rules.ALLOW, "ok", now) for other in others]
        if len(rows) >= 5000:
            # Written as they are built: building them all first left the test's
            # transaction idle past the server's 10 s limit on a loaded machine.
            Decision.objects.bulk_create(rows)
            rows = []
    Decision.objects.bulk_create(rows)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE runs_decision")
        cursor.execute("ANALYZE runs_run")
    return {"long": long, "shadow": shadow}


@pytest.mark.postgres
def test_a_runs_pages_read_a_page_of_its_decisions(history: dict[str, Run]) -> None:
    run = history["long"]
    middle = Decision.objects.filter(run=run, step=ALLOWED // 2).values_list("id", flat=True)[0]
    page = 100
    # The decisions API: the first page, and one from the middle of the run.
    assert most_examined(lambda: list(decisions_of(run, limit=page)), "runs_decision") <= page
    assert most_examined(lambda: list(decisions_of(run, after=middle, limit=page)),
                         "runs_decision") <= page
    # The timeline: its last page, an earlier one, the stream's new rows; each row's
    # previous decision (its step's duration) one more row.
    bound = 2 * (TIMELINE_PAGE + 1)
    assert most_examined(lambda: timeline_page(run), "runs_decision") <= bound
    assert most_examined(lambda: timeline_page(run, before=middle), "runs_decision") <= bound
    last = Decision.objects.filter(run=run).order_by("-id").values_list("id", flat=True)[0]
    assert most_examined(lambda: timeline(run, after=last - 1), "runs_decision") <= 4
    # Stops and warnings only: a page of them, not the run's allows between them (the first
    # half of the run has none: a walk of its allows would examine a thousand rows).
    assert most_examined(lambda: timeline_page(run, flagged=True), "runs_decision") <= bound
    assert most_examined(lambda: timeline_page(run, before=middle, flagged=True),
                         "runs_decision") <= bound
    assert timeline_page(run, before=middle, flagged=True) == ([], False)


@pytest.mark.postgres
def test_the_run_page_and_its_api_read_no_more(history: dict[str, Run], client: Any,
                                               users: Any, team: Team) -> None:
    run = history["long"]
    client.force_login(users["viewer"])
    url = reverse("runs:run", kwargs={"slug": team.slug, "run_id": run.pk})
    # Its timeline page, the stream's starting point (the run's latest id), its banner.
    assert most_examined(lambda: client.get(url), "runs_decision") <= 2 * (TIMELINE_PAGE + 1)
    token = agent_key_create(team=team, name="reader").token
    assert most_examined(lambda: client.get(f"/api/v1/runs/{run.pk}/decisions?limit=50",
                                            HTTP_AUTHORIZATION=f"Bearer {token}"),
                         "runs_decision") <= 50


@pytest.mark.postgres
def test_the_end_of_a_run_is_found_at_once(history: dict[str, Run]) -> None:
    run, shadow = history["long"], history["shadow"]
    # Every later check of a killed run names its kill; the run's page shows its end.
    assert most_examined(lambda: stop_detail(run.pk, "killed"), "runs_decision") <= 1
    assert most_examined(lambda: presenters.banner(run), "runs_decision") <= 1
    assert presenters.banner(run).message == f"killed at {ALLOWED}"
    # Where a shadow policy would have stopped, and how often (counted up to a cap).
    summary = presenters.shadow_summary(shadow)
    assert summary is not None and summary.capped
    assert summary.count == presenters.SHADOW_COUNT_CAP
    assert most_examined(lambda: presenters.shadow_summary(shadow),
                         "runs_decision") <= presenters.SHADOW_COUNT_CAP + 1


@pytest.mark.postgres
def test_an_agents_runs_are_read_newest_first_from_the_index(team: Team) -> None:
    """GET /api/v1/runs for one agent, or with a key bound to it (SPEC 10)."""
    version = team.policies.get(name="default").current
    now = timezone.now()
    # The agent's runs are the team's oldest: a read of the team's newest runs filtered by
    # agent, or of all the agent's runs sorted, would examine thousands.
    Run.objects.bulk_create(
        [Run(team=team, agent="old-bot", policy_version=version, status=rules.COMPLETED,
             started_at=now - timedelta(days=2, seconds=i)) for i in range(2000)]
        + [Run(team=team, agent="new-bot", policy_version=version, status=rules.COMPLETED,
               started_at=now - timedelta(seconds=i)) for i in range(2000)])
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE runs_run")
    listing = 'ORDER BY "runs_run"."started_at" DESC'
    # A page of 50 reads 51 to know whether more follow, and one more to know the last
    # one's start is not shared (the order is (started, id), the index's (started)).
    assert most_examined(lambda: runs_page(team, agent="old-bot", limit=50),
                         "runs_run", listing) <= 52
    assert most_examined(lambda: runs_page(team, key_agent="old-bot", limit=50),
                         "runs_run", listing) <= 52


@pytest.mark.skipif(connection.vendor != "sqlite", reason="SQLite's plans")
def test_sqlite_searches_the_same_indexes(team: Team) -> None:
    version = team.policies.get(name="default").current
    run = Run.objects.create(team=team, agent="bot", policy_version=version,
                             started_at=timezone.now(), status=rules.KILLED, stop_reason="killed")
    with CaptureQueriesContext(connection) as queries:
        list(decisions_of(run, after=10))
        timeline(run, after=10)
        timeline_page(run, before=10)
        timeline_page(run, before=10, flagged=True)
        latest_decision_id(run)
        stop_detail(run.pk, "killed")
        presenters.banner(run)
        presenters.shadow_summary(run)
        runs_page(team, agent="bot")
    plans = []
    for query in queries.captured_queries:
        if '"runs_decision"' in query["sql"] or '"runs_run"."agent" =' in query["sql"]:
            with connection.cursor() as cursor:
                cursor.execute(f"EXPLAIN QUERY PLAN {query['sql']}")
                plans.append([row[3] for row in cursor.fetchall()])
    assert len(plans) >= 8
    for plan in plans:
        # The runs list's order is (started, id), the index's (started): only runs that
        # started in the same microsecond are sorted, a page's worth at most.
        assert not any(("TEMP B-TREE" in step and "RIGHT PART" not in step)
                       or step.startswith("SCAN") for step in plan), plan
        searches = [step for step in plan if step.startswith("SEARCH")]
        assert all(" INDEX decision_run" in step or " INDEX run_team_agent_recent" in step
                   or "PRIMARY KEY" in step for step in searches), plan
    # Each row's previous decision: a range of the run's index, not the run's every entry.
    previous = [step for plan in plans for step in plan if step.startswith("SEARCH U0")]
    assert previous and all("<expr><?" in step for step in previous), previous


def _decision_indexes() -> dict[str, list[str | None]]:
    with connection.cursor() as cursor:
        found = connection.introspection.get_constraints(cursor, "runs_decision")
    return {name: info["columns"] for name, info in found.items()
            if info["index"] and not info["primary_key"] and not info["unique"]}


@pytest.mark.django_db(transaction=True)
def test_the_migration_replaces_the_foreign_keys_index_both_ways() -> None:
    def run_id_only() -> list[str]:
        return [name for name, columns in _decision_indexes().items() if columns == ["run_id"]]

    names = {"decision_run", "decision_run_stop", "decision_run_would_stop"}
    assert names <= set(_decision_indexes()) and run_id_only() == []
    executor = MigrationExecutor(connection)
    try:
        executor.migrate([("runs", "0011_rate_counters")])
        assert not names & set(_decision_indexes()) and len(run_id_only()) == 1
    finally:
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())
    assert names <= set(_decision_indexes()) and run_id_only() == []
