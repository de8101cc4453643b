"""The switches that cover a run are read by their target keys (runs/killswitch/cover.py), so
no check, start or page reads another team's switches or the history of released ones.

The key is written once (`cover.TARGET_FORMATS`) and rendered twice: in Python
(`target_key`, which the engage's `Target.key` is) and in SQL (`covering_targets_sql`, in
the check's and the start's statements). The first test proves the two agree on both
databases. The others read PostgreSQL's plans of every such read, among many engaged
switches of other teams and a long history of released ones, and count the switch rows
each examines.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.db.models import Q
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from policies.models import AgentKey, Team
from policies.services import agent_key_create
from runs.approvals.services import settle_due_for_team
from runs.approvals.waits import look
from runs.check import check_store
from runs.check.lifecycle import _insert_unless_switched
from runs.dashboard.selectors import switches_covering
from runs.killswitch import cover
from runs.killswitch.fanout import RUN_ENDED
from runs.killswitch.selectors import engaged_for_team, global_page, history_for_team
from runs.killswitch.services import resolve_target
from runs.models import KillSwitch, Run, Scope

pytestmark = pytest.mark.django_db


def make_run(team: Team, agent: str, status: str = "running") -> Run:
    return Run.objects.create(team=team, agent=agent, status=status,
                              policy_version=team.policies.get(name="default").current,
                              started_at=timezone.now())


# --- The key in Python and in SQL -----------------------------------------------------------

def test_the_sql_keys_are_the_engages_keys(team: Team, other_team: Team) -> None:
    for run in (make_run(team, "bot"), make_run(other_team, "a.b-C_9"), make_run(team, "x")):
        engaged = [resolve_target(scope=Scope.GLOBAL).key,
                   resolve_target(scope=Scope.TEAM, team=run.team).key,
                   resolve_target(scope=Scope.AGENT, team=run.team, agent=run.agent).key,
                   resolve_target(scope=Scope.RUN, run=run).key]
        python = cover.covering_targets(team_id=run.team_id, agent=run.agent, run_id=run.pk)
        assert python == engaged
        # A run id in any form names the same run.
        assert cover.covering_targets(team_id=run.team_id, agent=run.agent,
                                      run_id=run.pk.hex) == engaged
        with connection.cursor() as cursor:
            # The check's form: the run's columns.
            keys = cover.covering_targets_sql(team="r.team_id", agent="r.agent", run="r.id")
            cursor.execute(f"SELECT {', '.join(keys)} FROM runs_run r WHERE r.id = %s",
                           [Run._meta.pk.get_db_prep_value(run.pk, connection)])
            assert list(cursor.fetchone()) == engaged
            # The start's form: placeholders, no run yet.
            keys = cover.covering_targets_sql(team="%s", agent="%s", run=None)
            cursor.execute(f"SELECT {', '.join(keys)}", [run.team_id, run.team_id, run.agent])
            assert list(cursor.fetchone()) == engaged[:3]
        assert cover.covering_targets(team_id=run.team_id, agent=run.agent,
                                      run_id=None) == engaged[:3]


# --- The reads, on PostgreSQL ----------------------------------------------------------------

INDEXES = {"one_engaged_per_target", "killswitch_team_engaged"}
TEAMS = 200  # other teams, each with an engaged team switch and two agent switches
RELEASED = 3000  # the history: released switches, some of them this team's
# Rows of runs_killswitch a read may examine: the (at most four) keys, the team's engaged.
BOUND = 10


@pytest.fixture
def crowded(team: Team) -> Iterator[Run]:
    """A running run of `team` among many engaged switches of other teams and a long
    history; the table analyzed, as autovacuum would have."""
    now = timezone.now()
    others = Team.objects.bulk_create(
        [Team(slug=f"crowd-{i}", name=f"crowd {i}") for i in range(TEAMS)])
    run = make_run(team, "bot")
    rows = []
    for other in others:
        rows.append(KillSwitch(scope=Scope.TEAM, team=other, target=f"team:{other.pk}",
                               reason="r", engaged_by_label="ops", engaged_at=now))
        rows += [KillSwitch(scope=Scope.AGENT, team=other, agent=agent,
                            target=f"agent:{other.pk}:{agent}", reason="r",
                            engaged_by_label="ops", engaged_at=now) for agent in ("bot", "x")]
    for i in range(RELEASED):
        owner = team if i % 3 == 0 else others[i % TEAMS]
        rows.append(KillSwitch(scope=Scope.TEAM, team=owner, target=f"team:{owner.pk}",
                               reason="r", engaged_by_label="ops", active=False,
                               engaged_at=now - timedelta(days=1), released_at=now))
    # One engaged switch of the team, for another of its agents: found, covering nothing.
    rows.append(KillSwitch(scope=Scope.AGENT, team=team, agent="other",
                           target=f"agent:{team.pk}:other", reason="r",
                           engaged_by_label="ops", engaged_at=now))
    KillSwitch.objects.bulk_create(rows)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE runs_killswitch")
    yield run


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def switch_reads(plan: dict[str, Any]) -> tuple[list[tuple[str | None, str]], float]:
    """The plan's reads of runs_killswitch, (index, index condition), and the rows they
    examined (returned and filtered out, over all loops; 0 without ANALYZE)."""
    reads, examined = [], 0.0
    for node in _nodes(plan):
        index = node.get("Index Name")
        if node.get("Relation Name") == "runs_killswitch" or index in INDEXES:
            if node["Node Type"] != "Bitmap Heap Scan":  # its index is its child
                reads.append((index, node.get("Index Cond", "")))
            if node["Node Type"] != "Bitmap Index Scan":  # the heap's rows, not twice
                loops = node.get("Actual Loops", 0)
                examined += (node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)
                             + node.get("Rows Removed by Index Recheck", 0)) * loops
    return reads, examined


def explain(sql: str, *, analyze: bool) -> dict[str, Any]:
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN (ANALYZE {str(analyze).upper()}, FORMAT JSON) {sql}")
        plan = cursor.fetchone()[0]
    return (json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"]


def assert_bounded(read: Callable[[], Any]) -> None:
    """Every statement ``read`` makes on runs_killswitch reads it by one of the keys'
    indexes and examines at most BOUND rows (a write's plan is read without running it)."""
    with CaptureQueriesContext(connection) as queries:
        read()
    statements = [q["sql"] for q in queries.captured_queries if "runs_killswitch" in q["sql"]]
    assert statements
    for sql in statements:
        reads, examined = switch_reads(explain(sql, analyze=sql.lstrip().startswith("SELECT")))
        assert reads and all(index in INDEXES and cond for index, cond in reads), (reads, sql)
        assert examined <= BOUND, (examined, sql)


@pytest.mark.postgres
def test_the_check_reads_the_runs_keys_only(crowded: Run) -> None:
    key = AgentKey.objects.get(pk=agent_key_create(team=crowded.team, name="k").key.pk)
    name = f"lock_{uuid.uuid4().hex[:8]}"
    with connection.cursor() as cursor:
        cursor.execute(f"PREPARE {name}(uuid, text, text) AS {check_store.LOCK_SQL}")
        # As the check runs it: sequential scans off (check_store.EXECUTE_LOCK), and the
        # plan PostgreSQL keeps for a prepared statement after its first executions.
        cursor.execute("SET enable_seqscan = off")
        cursor.execute("SET plan_cache_mode = force_generic_plan")
        try:
            cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE {name}(%s, %s, %s)",
                           [crowded.pk, None, key.prefix])
            plan = cursor.fetchone()[0]
        finally:
            cursor.execute("RESET enable_seqscan")
            cursor.execute("RESET plan_cache_mode")
            cursor.execute(f"DEALLOCATE {name}")
    reads, examined = switch_reads((json.loads(plan) if isinstance(plan, str) else plan)[0]
                                   ["Plan"])
    # At most four probes of the keys' index, by keys built from the locked run's columns.
    [(index, cond)] = reads
    assert index == "one_engaged_per_target" and "target" in cond, reads
    assert examined <= BOUND, examined


@pytest.mark.postgres
def test_a_start_reads_the_runs_keys_only(crowded: Run) -> None:
    team = crowded.team
    assert_bounded(lambda: _insert_unless_switched(Run(
        team=team, agent="bot", policy_version=crowded.policy_version,
        started_at=timezone.now())))
    assert_bounded(lambda: cover.covering_switch(team_id=team.pk, agent="bot", run_id=None))
    assert_bounded(lambda: cover.covering_switch(team_id=team.pk, agent="bot",
                                                 run_id=crowded.pk))


@pytest.mark.postgres
def test_the_teams_reads_skip_other_teams_and_the_history(crowded: Run) -> None:
    team = crowded.team
    assert_bounded(lambda: engaged_for_team(team))
    assert_bounded(lambda: switches_covering(team))
    assert_bounded(lambda: settle_due_for_team(team))
    # The long poll's look reads the switches only for a pending approval.
    from runs.models import Approval

    approval = Approval.objects.create(
        team=team, run=crowded, check_id="c", step=1, action_name="refund",
        action_type="tool", requested_at=timezone.now(),
        expires_at=timezone.now() + timedelta(hours=1))
    assert_bounded(lambda: look(team.pk, [str(approval.pk)]))


@pytest.mark.postgres
def test_the_history_pages_read_a_page_of_the_history(crowded: Run) -> None:
    """The team's history (its switches and the global ones) and the global page's: a range
    of an index each, newest first, never a sort of the whole history."""
    team = crowded.team
    now = timezone.now()
    KillSwitch.objects.bulk_create(
        [KillSwitch(scope=Scope.GLOBAL, target="global", reason="r", engaged_by_label="ops",
                    active=False, engaged_at=now - timedelta(hours=i), released_at=now)
         for i in range(300)])
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE runs_killswitch")
    limit = 20
    for read in (lambda: history_for_team(team, limit=limit),
                 lambda: global_page(limit=limit)["history"]):
        with CaptureQueriesContext(connection) as queries:
            read()
        statements = [q["sql"] for q in queries.captured_queries
                      if "runs_killswitch" in q["sql"] and "engaged_at" in q["sql"]
                      and "DESC" in q["sql"]]
        assert statements
        for sql in statements:
            plan = explain(sql, analyze=True)
            assert not any(node["Node Type"] == "Sort" for node in _nodes(plan)), sql
            _reads, examined = switch_reads(plan)
            assert examined <= limit + 1, (examined, sql)
    # Merged, the page is what one sort of the whole history would give.
    whole = sorted(KillSwitch.objects.filter(Q(scope=Scope.GLOBAL) | Q(team=team)),
                   key=lambda s: (s.engaged_at, s.pk), reverse=True)
    assert [s.pk for s in history_for_team(team, limit=limit)] == [s.pk for s in whole[:limit]]
    assert {s.scope for s in whole[:limit]} == {Scope.AGENT, Scope.GLOBAL}  # both kinds


# --- Run switches of ended runs, in existing databases ----------------------------------------

@pytest.mark.django_db(transaction=True)
def test_the_migration_retires_the_switches_of_ended_runs(team: Team) -> None:
    executor = MigrationExecutor(connection)
    try:
        executor.migrate([("runs", "0011_rate_counters")])
        # The models as they were then: today's have columns added by later migrations.
        old = executor.loader.project_state(("runs", "0011_rate_counters")).apps
        old_run, old_switch = old.get_model("runs", "Run"), old.get_model("runs", "KillSwitch")
        version_id = team.policies.get(name="default").current_id
        ended, running = (old_run.objects.create(
            team_id=team.pk, agent=agent, status=status, policy_version_id=version_id,
            started_at=timezone.now()) for agent, status in (("a", "killed"), ("b", "running")))
        for run in (ended, running):
            old_switch.objects.create(scope=Scope.RUN, team_id=team.pk, run_id=run.pk,
                                      target=resolve_target(scope=Scope.RUN, run=run).key,
                                      reason="r", engaged_by_label="ops",
                                      engaged_at=timezone.now())
    finally:
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())
    retired = KillSwitch.objects.get(run_id=ended.pk)
    assert not retired.active and retired.release_reason == RUN_ENDED
    assert retired.released_at is not None
    assert KillSwitch.objects.get(run_id=running.pk).active
