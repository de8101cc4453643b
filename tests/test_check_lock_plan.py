"""The check's locking read takes each table by the one index that fits, whatever the
statistics say (docs/performance.md "Cost as one run grows").

The statement is prepared once per connection, and PostgreSQL's generic plan for it is made
from the statistics of the moment. Made on tables never analyzed (a new database; a server
without autovacuum), two of its lookups tied with a wrong index and took it: the run by the
team's index (every run of the team read, the id a filter) and the `check_id` replay by
`check_id` alone (every run's decision with that check_id). The statement now names the run
by its id (`$1`) in every lateral read and keeps the team's condition out of the indexes, so
no such plan exists to be chosen.

And the check runs with sequential scans off (`SET LOCAL` in its first message): a plan made
while a table was a page or two (analyzed nearly empty, or truncated) scanned it whole at
every check as it grew, until the next ANALYZE.

The test puts the tables back in the never-analyzed state (the planner's own markers:
no `pg_statistic` rows, `reltuples = -1`), or analyzes them nearly empty, and reads the
generic plan in the check's own transaction (its BEGIN and settings): every lookup takes
its key's index. PostgreSQL only, as the statement.

Analyzed nearly empty, two more lookups tied: the replay by the run's index of its decisions
(one row behind either index starting with the run, the check_id a filter), and the keyed
memory's entries by the run alone (`digest = ANY(...)` left to a filter). Measured in the
benchmark after 30 s of checks: 134 and 116 buffers a check, PostgreSQL's CPU per check
0.73 ms at the start and 1.08 ms on average over the 30 s. The replay now names the unique
index's expression, and each entry is read by its own equality on both key columns.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from policies.models import AgentKey, Policy
from policies.services import agent_key_create, team_ensure
from runs.check import check_store
from runs.models import Run

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

TABLES = ("runs_run", "runs_decision", "runs_runmemory", "runs_killswitch")


def _never_analyzed(cursor: Any) -> None:
    for table in TABLES:
        cursor.execute("DELETE FROM pg_statistic WHERE starelid = %s::regclass", [table])
        cursor.execute("UPDATE pg_class SET reltuples = -1, relpages = 0 WHERE oid = %s::regclass",
                       [table])


def _scans(plan: dict[str, Any]) -> list[tuple[str, str | None, str | None, str]]:
    found = []
    if "Relation Name" in plan:
        index, cond = plan.get("Index Name"), plan.get("Index Cond", "")
        if plan["Node Type"] == "Bitmap Heap Scan":  # the index is its child's
            child = plan["Plans"][0]
            index, cond = child.get("Index Name"), child.get("Index Cond", "")
        found.append((plan["Node Type"], plan["Relation Name"], index, cond))
    for child in plan.get("Plans", []):
        found += _scans(child)
    return found


@pytest.mark.parametrize("stats", ["never analyzed", "analyzed"])
def test_the_lock_reads_the_run_and_its_replay_by_their_own_keys(stats: str) -> None:
    team, _ = team_ensure(slug="plan")
    agent_key_create(team=team, name="k")
    key = AgentKey.objects.get(team=team)
    version = Policy.objects.get(team=team, name="default").current_id
    run = Run.objects.create(team=team, agent="bot", policy_version_id=version,
                             started_at=timezone.now())
    name = f"lock_{uuid.uuid4().hex[:8]}"
    with connection.cursor() as cursor:
        if stats == "analyzed":
            for table in TABLES:
                cursor.execute(f"ANALYZE {table}")
        else:
            _never_analyzed(cursor)
        cursor.execute("SET plan_cache_mode = force_generic_plan")
        cursor.execute(f"PREPARE {name}(uuid, text, text) AS {check_store.LOCK_SQL}")
        cursor.execute(f"PREPARE {name}_keyed(uuid, text[]) AS {check_store.KEYED_SQL}")
        # The check's own transaction: BEGIN and its settings, as the check sends them.
        begin = check_store.EXECUTE_LOCK.split("EXECUTE")[0]
        plans = []
        try:
            cursor.execute(begin)
            cursor.execute(f"EXPLAIN (FORMAT JSON) EXECUTE {name}(%s, %s, %s)",
                           [run.pk, "c-1", key.prefix])
            plans.append(cursor.fetchone()[0])
            cursor.execute(f"EXPLAIN (FORMAT JSON) EXECUTE {name}_keyed(%s, %s)",
                           [run.pk, ["a", "b"]])
            plans.append(cursor.fetchone()[0])
        finally:
            cursor.execute("ROLLBACK")
            cursor.execute(f"DEALLOCATE {name}")
            cursor.execute(f"DEALLOCATE {name}_keyed")
            cursor.execute("RESET plan_cache_mode")
    scans: dict[str, list[tuple[str, str | None, str]]] = {}
    for plan in plans:
        for node, relation, index, cond in _scans(
                (json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"]):
            scans.setdefault(relation, []).append((node, index, cond))
    assert [scan[:2] for scan in scans["runs_run"]] == [("Index Scan", "runs_run_pkey")], scans
    # The replay by the unique index's own expression: no other index can answer it.
    [(_, index, cond)] = scans["runs_decision"]
    assert index == "check_id_per_run" and "$1" in cond and "$2" in cond, scans["runs_decision"]
    # Each entry of the keyed memory by both columns of its key, never the run's whole memory.
    memory = scans["runs_runmemory"]
    assert len(memory) == check_store.KEYED_MAX, memory
    for _, index, cond in memory:
        assert index == "runs_runmemory_pkey" and "run_id = $1" in cond and "digest" in cond, \
            memory
