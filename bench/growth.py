"""Cost as the work grows (issue 17): the real check's throughput with a long audit history
against an empty log, with many running runs against few, and with retention
(`manage.py prune_audit`) pruning that history while the checks run.

The history is generated inside PostgreSQL, set-based (`INSERT ... SELECT FROM
generate_series`, in batches of runs, each run with its decisions in one statement): ended
runs of one team, 20 decisions each, shaped like the rows the check writes (args, last result,
progress, a check_id, the stored answer), their times spread over the last 31 days with the
team's retention at 30 days, so about one run in 31 is old enough for the prune. Generating
through the API would take hours and measure the check instead of the history.

Every load point is the benchmark's start-checks-finish mix (bench/agents.py) on the real
check, 32 agents, with audit rows counted against the decisions returned. What is compared:

- the history's log (10 M rows in full mode) against an empty audit table, in alternating
  slices: an empty twin of the table takes its name for every other slice (`Twin`), so the
  same runs, server and minute of machine load see both; and, for reference, the check
  before anything was generated;
- 100 running runs against 10,000 (idle running runs of the same team, seeded directly, the
  agents' own runs included in the count), in alternating slices;
- the history's points while `prune_audit` runs in its own process, against the history's
  points without it.

Beside the throughput: the sizes of the audit table and its indexes, and EXPLAIN (ANALYZE,
BUFFERS) of the check's two statements (runs/check/check_store.py) and of the prune's batch
read at each size, so what grows can be named. Quick mode (CI) generates a small history and
checks correctness only: the history's row count, audit rows = decisions at every point, the
prune deleting and exporting exactly the runs past the cutoff and nothing else, and every
generated row gone afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

from . import agents as ag
from . import scenarios as sc
from .stack import ROOT, Server, base_env, postgres_cpu_seconds

TEAM = "bench-growth"
AGENTS = 32
STEPS = 20  # decisions per generated run
SPAN_DAYS = 31  # the history's runs ended over this many days, up to an hour ago
RETENTION_DAYS = 30  # the team's retention: runs ended more than 30 days ago go
# twin_rounds: the history's comparison alternates more often than the others, its slices are
# the ones the shared machine's drift disturbed most (pairs of slices 0.78 to 0.97 apart).
FULL = {"history_rows": 10_000_000, "few_runs": 100, "many_runs": 10_000, "batch_runs": 25_000,
        "explain_repeats": 30, "prune_timeout_s": 600, "twin_rounds": 6}
QUICK = {"history_rows": 20_000, "few_runs": 100, "many_runs": 1_000, "batch_runs": 500,
         "explain_repeats": 3, "prune_timeout_s": 120, "twin_rounds": 1}
IDLE_AGENT = "bench-growth-idle"


# --- The generated history ------------------------------------------------------------------

# The decisions' columns as the check writes them; the answer is the check's stored answer
# (governance_client/answers.py `answer`), shaped like a step_ok allow of the benchmark's policy.
HISTORY_SQL = """
WITH g AS (
    SELECT n, gen_random_uuid() AS id,
           %(first_end)s::timestamptz + (n - 1) * %(gap_s)s * interval '1 second'
               - interval '40 seconds' AS started_at
    FROM generate_series(%(first)s, %(last)s) n
), r AS (
    INSERT INTO runs_run (id, team_id, agent, policy_version_id, status, stop_reason, steps,
                          tool_calls, cost_usd, started_at, ended_at, finished_at, task,
                          metadata, external_id, output, memory, idle_deadline)
    SELECT id, %(team)s, 'bench-agent-' || (n %% 16), %(version)s, 'completed', NULL,
           %(steps)s, %(steps)s, 0.024, started_at, started_at + interval '40 seconds',
           started_at + interval '40 seconds', 'Generated history run ' || n,
           jsonb_build_object('ticket', n, 'channel', 'email'), NULL,
           'Refund approved; the customer was told it takes 5 days.', '{}'::jsonb, NULL
    FROM g
), step AS MATERIALIZED (
    -- What varies by step only, built once per batch rather than once per row.
    SELECT s, t.name, t.name || ':' || md5(s::text) AS repeat_key,
           jsonb_build_object('query', 'order status step ' || s || ': refund status',
                              'limit', 10, 'filters', '{"lang": "en", "region": "eu"}'::jsonb)
               AS args,
           to_jsonb('milestone-' || s) AS progress,
           jsonb_build_object('status', 'ok', 'digest', md5('digest' || s),
                              'summary', 'Found 3 articles; the most relevant says refunds '
                              'within 30 days are automatic for orders under 200 EUR.')
               AS last_result,
           %(answer)s::jsonb || jsonb_build_object(
               'step', s, 'repeat_key', t.name || ':' || md5(s::text),
               'usage', jsonb_build_object('steps', s, 'cost_usd', 0.0012 * s,
                                           'elapsed_s', s * 1.5, 'tool_calls', s)) AS answer
    FROM generate_series(1, %(steps)s) s
    CROSS JOIN LATERAL (SELECT (ARRAY['search.docs', 'crm.lookup_order', 'kb.fetch_article',
                                      'billing.refund_quote', 'email.draft_reply'])[1 + s %% 5]
                        AS name) t
)
INSERT INTO runs_decision (run_id, step, outcome, reason, action_name, action_type, args,
                           repeat_key, repeat_count, check_id, progress, last_result, cost_usd,
                           elapsed_s, answer, at)
SELECT g.id, step.s, 'allow', 'step_ok', step.name, 'tool', step.args, step.repeat_key, 1,
       md5(g.id::text || step.s), step.progress, step.last_result, 0.0012, step.s * 1.5,
       step.answer, g.started_at + step.s * interval '1.5 seconds'
FROM g CROSS JOIN step
ORDER BY g.n, step.s
"""
ANSWER = {"reason": "step_ok", "shadow": None, "message": None, "approval": None,
          "decision": "allow", "directive": None, "next_action": None, "repeat_count": 1,
          "retry_after_s": None,
          "limits": {"max_usd": 50.0, "max_steps": 30, "max_seconds": 3600,
                     "max_tool_calls": None, "max_repeat_action": 3, "no_progress_window": 4}}


def generate_history(team: sc.Team, *, rows: int, batch_runs: int) -> dict[str, Any]:
    """`rows` decisions in rows // STEPS ended runs of the team, one committed statement per
    batch of runs; then VACUUM ANALYZE, the state autovacuum leaves a table this old in (and
    so that autovacuum does not start on it in the middle of a measurement)."""
    from django.db import connection, transaction
    from django.utils import timezone

    from policies.models import Policy

    version = Policy.objects.get(team_id=team.team_id, name="default").current_id
    runs = rows // STEPS
    span_s = SPAN_DAYS * 86400 - 3600
    # The last run ends an hour ago, the first SPAN_DAYS days ago.
    first_end = timezone.now() - timedelta(seconds=3600 + span_s)
    started = time.monotonic()
    for first in range(1, runs + 1, batch_runs):
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET LOCAL work_mem = '64MB'")  # the batch's sort stays in memory
            cursor.execute(HISTORY_SQL, {
                "first": first, "last": min(runs, first + batch_runs - 1), "team": team.team_id,
                "version": version, "steps": STEPS, "first_end": first_end,
                "gap_s": span_s / max(1, runs - 1), "answer": json.dumps(ANSWER)})
        if (first - 1) // batch_runs % 40 == 39:
            print(f"  growth: {first + batch_runs - 1} of {runs} runs generated, "
                  f"{time.monotonic() - started:.0f} s", flush=True)
    insert_s = time.monotonic() - started
    with connection.cursor() as cursor:
        cursor.execute("VACUUM (ANALYZE) runs_run, runs_decision")
    return {"runs": runs, "rows": runs * STEPS, "insert_s": round(insert_s, 1),
            "vacuum_s": round(time.monotonic() - started - insert_s, 1)}


def history_rows(team: sc.Team) -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM runs_decision d JOIN runs_run r ON r.id = d.run_id "
                       "WHERE r.team_id = %s AND r.task LIKE 'Generated history run %%'",
                       [team.team_id])
        return int(cursor.fetchone()[0])


# --- Running runs ---------------------------------------------------------------------------

def set_running(team: sc.Team, total: int) -> int:
    """Make the team hold `total` running runs while the agents run: the runs the agents left
    open at the end of an earlier slice are ended, and idle running runs (never checked) are
    added or removed so that with the agents' own AGENTS runs there are `total`."""
    from django.db import connection

    idle = max(0, total - AGENTS)
    with connection.cursor() as cursor:
        cursor.execute("UPDATE runs_run SET status = 'completed', ended_at = now() "
                       "WHERE team_id = %s AND status = 'running' AND agent <> %s",
                       [team.team_id, IDLE_AGENT])
        cursor.execute("SELECT count(*) FROM runs_run WHERE team_id = %s AND agent = %s",
                       [team.team_id, IDLE_AGENT])
        have = int(cursor.fetchone()[0])
        if have < idle:
            cursor.execute(
                "INSERT INTO runs_run (id, team_id, agent, policy_version_id, status, steps, "
                "tool_calls, cost_usd, started_at, task, metadata, output, memory) "
                "SELECT gen_random_uuid(), %s, %s, p.current_id, 'running', 0, 0, 0, now(), "
                "'idle run ' || n, '{}'::jsonb, '', '{}'::jsonb "
                "FROM generate_series(1, %s) n, policies_policy p "
                "WHERE p.team_id = %s AND p.name = 'default'",
                [team.team_id, IDLE_AGENT, idle - have, team.team_id])
        elif have > idle:
            # Never checked, so without decisions: a plain DELETE, no audit record touched.
            cursor.execute("DELETE FROM runs_run WHERE id IN (SELECT id FROM runs_run "
                           "WHERE team_id = %s AND agent = %s LIMIT %s)",
                           [team.team_id, IDLE_AGENT, have - idle])
        cursor.execute("SELECT count(*) FROM runs_run WHERE team_id = %s AND status = 'running'",
                       [team.team_id])
        return int(cursor.fetchone()[0]) + AGENTS


# --- Load ------------------------------------------------------------------------------------

def load_slice(server: Server, team: sc.Team, *, seconds: float, warmup: float) -> sc.Slice:
    """The mix at AGENTS agents on the real check, over whatever the tables hold (unlike
    scenarios.run_slice, which empties them first); its audit rows are the rows past the
    largest id before it."""
    before = sc.max_decision_id()
    opts = ag.AgentOptions(host="127.0.0.1", port=server.port, token=team.token)
    cpu_server0, cpu_client0, cpu_pg0 = server.cpu(), time.process_time(), postgres_cpu_seconds()
    stats = asyncio.run(ag.run_load(opts, AGENTS, seconds, warmup))
    return sc.Slice(stats=stats, rows=sc.decision_rows(after_id=before),
                    cpu_server=server.cpu() - cpu_server0,
                    cpu_client=time.process_time() - cpu_client0,
                    cpu_postgres=postgres_cpu_seconds() - cpu_pg0)


POINT_KEYS = ("checks_per_s", "p50_ms", "p99_ms", "server_cpu_ms_per_check",
              "postgres_cpu_ms_per_check", "checks", "errors", "error_kinds", "audit_rows",
              "decisions_returned", "audit_ok", "slices")


def point(slices: list[sc.Slice], label: str, **extra: Any) -> dict[str, Any]:
    summary = sc.summarize(slices, scenario=sc.REAL, agents=AGENTS)
    return {"label": label, **{k: summary[k] for k in POINT_KEYS}, **extra,
            "slice_checks_per_s": [round(x.stats.checks_in_window / max(
                1e-9, x.stats.window_end - x.stats.window_start), 1) for x in slices]}


# --- What grows: sizes and plans -------------------------------------------------------------

def sizes() -> dict[str, Any]:
    """Bytes of the audit and runs tables and of each of their indexes, and their rows."""
    from django.db import connection

    out: dict[str, Any] = {}
    with connection.cursor() as cursor:
        for table in ("runs_decision", "runs_run"):
            cursor.execute(f"SELECT pg_relation_size('{table}'), "
                           f"pg_total_relation_size('{table}'), (SELECT count(*) FROM {table})")
            heap, total, rows = cursor.fetchone()
            cursor.execute("SELECT c.relname, pg_relation_size(c.oid) FROM pg_index i "
                           "JOIN pg_class c ON c.oid = i.indexrelid "
                           "WHERE i.indrelid = %s::regclass ORDER BY c.relname", [table])
            out[table] = {"rows": int(rows), "heap_mib": _mib(heap), "total_mib": _mib(total),
                          "indexes_mib": {name: _mib(n) for name, n in cursor.fetchall()}}
    return out


def _mib(size: int) -> float:
    return round(size / 2**20, 1)


def _plan_nodes(plan: dict[str, Any]) -> list[str]:
    """The plan's nodes, depth first, each with the index or relation it reads."""
    name = plan["Node Type"]
    on = plan.get("Index Name") or plan.get("Relation Name")
    nodes = [f"{name} ({on})" if on else name]
    for child in plan.get("Plans", []):
        nodes += _plan_nodes(child)
    return nodes


def _explained(cursor: Any, statement: str, params: list[Any], repeats: int
               ) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, BUFFERS) of one statement `repeats` times, each in a transaction
    rolled back: the median execution time, the buffers of the median run, the plan's
    nodes and the time spent in triggers (the foreign key's check among them)."""
    runs = []
    for _ in range(repeats):
        cursor.execute("BEGIN")
        try:
            cursor.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statement, params)
            runs.append(_loaded(cursor.fetchone()[0])[0])
        finally:
            cursor.execute("ROLLBACK")
    runs.sort(key=lambda r: r["Execution Time"])
    median = runs[len(runs) // 2]
    top = median["Plan"]
    return {
        "execution_ms": round(median["Execution Time"], 3),
        "execution_ms_min": round(runs[0]["Execution Time"], 3),
        "planning_ms": round(median.get("Planning Time", 0.0), 3),
        "shared_hit": top.get("Shared Hit Blocks", 0) + sum(
            t.get("Shared Hit Blocks", 0) for t in median.get("Triggers", [])),
        "shared_read": top.get("Shared Read Blocks", 0),
        "shared_dirtied": top.get("Shared Dirtied Blocks", 0),
        "triggers_ms": {t["Trigger Name"]: round(t["Time"], 3)
                        for t in median.get("Triggers", [])},
        "nodes": _plan_nodes(top),
    }


def _loaded(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def explain_check(team: sc.Team, *, repeats: int) -> dict[str, Any]:
    """The check's two prepared statements (the run's lock with the switch and check_id
    reads; the run's update with the audit INSERT), as a check of an idle running run of the
    team would run them, with a check_id never seen (the common case)."""
    import uuid

    from django.db import connection

    from runs.check import check_store

    prefix = team.token.split("_", 2)[1]
    with connection.cursor() as cursor:
        cursor.execute("SELECT id FROM runs_run WHERE team_id = %s AND agent = %s LIMIT 1",
                       [team.team_id, IDLE_AGENT])
        found = cursor.fetchone()
    if found is None:
        set_running(team, AGENTS + 1)
        with connection.cursor() as cursor:
            cursor.execute("SELECT id FROM runs_run WHERE team_id = %s AND agent = %s LIMIT 1",
                           [team.team_id, IDLE_AGENT])
            found = cursor.fetchone()
    run_id = found[0]
    now = time.time()
    with connection.cursor() as cursor:
        raw = cursor.connection
        with raw.cursor() as pg:
            # Names of their own: the check's own statements are left as they are.
            name = f"growth_{uuid.uuid4().hex[:8]}"
            # As the check prepares them: after the lock, the check's keyed-memory entries
            # (by digest); the write also takes their new counts.
            pg.execute(f"PREPARE {name}_lock(uuid, text, text) AS {check_store.LOCK_SQL}")
            pg.execute(f"PREPARE {name}_keyed(uuid, text[]) AS {check_store.KEYED_SQL}")
            pg.execute(f"PREPARE {name}_write(jsonb, jsonb, jsonb, jsonb) AS "
                       f"{check_store.WRITE_SQL}")
            pg.execute("SELECT jsonb_agg(to_jsonb(r)) FROM runs_run r WHERE id = %s", [run_id])
            run_json = _loaded(pg.fetchone()[0])
            lock = _explained(pg, f"EXECUTE {name}_lock(%s, %s, %s)",
                              [run_id, uuid.uuid4().hex, prefix], repeats)
            keyed = _explained(pg, f"EXECUTE {name}_keyed(%s, %s)",
                               [run_id, [uuid.uuid4().hex]], repeats)
            decision = {
                "run_id": str(run_id), "step": 1, "outcome": "allow", "reason": "step_ok",
                "action_name": "search.docs", "action_type": "tool",
                "args": {"query": "order status step 1: refund status", "limit": 10},
                "repeat_key": "search.docs:" + uuid.uuid4().hex, "repeat_count": 1,
                "check_id": None, "progress": "milestone-1",
                "last_result": {"status": "ok", "digest": uuid.uuid4().hex},
                "cost_usd": "0.0012", "elapsed_s": 1.5, "answer": {**ANSWER, "step": 1},
                "at": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(now))}
            writes = []
            for _ in range(repeats):
                decision["check_id"] = uuid.uuid4().hex
                writes.append(_explained(pg, f"EXECUTE {name}_write(%s, %s, %s, %s)", [
                    json.dumps([decision]), json.dumps(run_json), "[]", "[]"], 1))
            writes.sort(key=lambda w: w["execution_ms"])
            write = writes[len(writes) // 2]
            write["execution_ms_min"] = writes[0]["execution_ms"]
            pg.execute(f"DEALLOCATE {name}_lock")
            pg.execute(f"DEALLOCATE {name}_keyed")
            pg.execute(f"DEALLOCATE {name}_write")
    return {"lock": lock, "keyed": keyed, "write": write}


def explain_prune_read(team: sc.Team) -> dict[str, Any]:
    """The prune's batch read (runs/audit/retention.py prune_team): the oldest prunable runs
    of the team, locked, one batch."""
    from django.db import transaction
    from django.utils import timezone

    from policies.models import Team
    from runs.audit.retention import BATCH, prunable_runs

    team_row = Team.objects.get(pk=team.team_id)
    cutoff = timezone.now() - timedelta(days=RETENTION_DAYS)
    with transaction.atomic():
        text = (prunable_runs(team_row, cutoff).select_for_update()
                .order_by("ended_at", "id")[:BATCH].explain(analyze=True, buffers=True))
        transaction.set_rollback(True)
    lines = text.splitlines()
    ms = next((float(line.split(":")[1].split()[0]) for line in lines
               if line.startswith("Execution Time")), None)
    return {"execution_ms": ms, "plan": lines}


# --- An empty twin of the audit table ------------------------------------------------------

class Twin:
    """An empty copy of runs_decision (columns, defaults and the id sequence, indexes, the
    foreign key to the runs) that `swapped()` puts under the audit table's name for a while,
    so that the same server, the same runs and the same minute of machine load can be
    measured against a long log and an empty one. The check's prepared statements follow
    the name: PostgreSQL analyses a cached statement again when a table it reads is renamed,
    and the audit count of every slice (read by name) proves where the rows went.

    Bench-only and never left behind: the twin is dropped on the way out, and a twin found
    under the audit table's name at the start (a killed benchmark) is swapped back first.
    """

    NAME = "bench_growth_decision_twin"
    MARK = "bench growth twin"

    def __enter__(self) -> Twin:
        restore_audit_table()
        with connection_cursor() as cursor:
            cursor.execute(f"DROP TABLE IF EXISTS {self.NAME}")
            cursor.execute(f"CREATE TABLE {self.NAME} (LIKE runs_decision INCLUDING ALL)")
            cursor.execute(f"ALTER TABLE {self.NAME} ADD FOREIGN KEY (run_id) REFERENCES "
                           "runs_run (id) DEFERRABLE INITIALLY DEFERRED")
            cursor.execute(f"COMMENT ON TABLE {self.NAME} IS '{self.MARK}'")
        return self

    def __exit__(self, *exc: Any) -> None:
        restore_audit_table()
        with connection_cursor() as cursor:
            cursor.execute(f"DROP TABLE IF EXISTS {self.NAME}")

    @staticmethod
    def swap() -> None:
        from django.db import transaction

        with transaction.atomic(), connection_cursor() as cursor:
            cursor.execute("ALTER TABLE runs_decision RENAME TO bench_growth_decision_swap")
            cursor.execute(f"ALTER TABLE {Twin.NAME} RENAME TO runs_decision")
            cursor.execute(f"ALTER TABLE bench_growth_decision_swap RENAME TO {Twin.NAME}")

    @contextmanager
    def swapped(self) -> Iterator[None]:
        self.swap()
        try:
            yield
        finally:
            self.swap()


def restore_audit_table() -> None:
    """Put the real audit table back under its name if the twin holds it."""
    with connection_cursor() as cursor:
        cursor.execute("SELECT obj_description('runs_decision'::regclass, 'pg_class')")
        if cursor.fetchone()[0] == Twin.MARK:
            Twin.swap()


def connection_cursor() -> Any:
    from django.db import connection

    return connection.cursor()


# --- Retention under load --------------------------------------------------------------------

class LockWatch:
    """Samples, every 0.2 s, which of the database's backends wait for a lock and on what
    (`relation`, `tuple`, `transactionid`: a check behind the prune's rows or table;
    `extend`: inserters taking turns at growing a table)."""

    def __init__(self) -> None:
        self.samples = 0
        self.waiting_max = 0
        self.waiting_samples = 0
        self.events: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        import psycopg

        from .stack import database_url

        with psycopg.connect(database_url().replace("postgres://", "postgresql://", 1),
                             autocommit=True) as conn:
            while not self._stop.wait(0.2):
                rows = conn.execute("SELECT wait_event, count(*) FROM pg_stat_activity WHERE "
                                    "datname = current_database() AND wait_event_type = 'Lock' "
                                    "GROUP BY wait_event").fetchall()
                waiting = sum(int(n) for _, n in rows)
                self.samples += 1
                self.waiting_max = max(self.waiting_max, waiting)
                self.waiting_samples += waiting > 0
                for event, n in rows:
                    self.events[event] = self.events.get(event, 0) + int(n)

    def __enter__(self) -> LockWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def as_dict(self) -> dict[str, Any]:
        return {"samples": self.samples, "samples_with_a_lock_wait": self.waiting_samples,
                "max_backends_waiting": self.waiting_max, "waits_by_event": self.events}


def prune_under_load(server: Server, team: sc.Team, *, seconds: float, warmup: float,
                     timeout_s: float) -> dict[str, Any]:
    """`manage.py prune_audit --team` in its own process, as beat's worker would run it,
    while the agents run slice after slice; then whether it pruned exactly what it had to."""
    from django.db import connection
    from django.utils import timezone

    from policies.models import Team

    Team.objects.filter(pk=team.team_id).update(retention_days=RETENTION_DAYS)
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM runs_run WHERE team_id = %s AND ended_at < %s",
                       [team.team_id, timezone.now() - timedelta(days=RETENTION_DAYS)])
        expected_at_least = int(cursor.fetchone()[0])
    total_before = history_rows(team)
    export_dir = Path(tempfile.mkdtemp(prefix="governance-bench-prune-"))
    slices: list[sc.Slice] = []
    tail: list[sc.Slice] = []
    # Every run that ended before this minus the retention is past the prune's own cutoff
    # (taken when its process starts, after this).
    surely_past = timezone.now() - timedelta(days=RETENTION_DAYS)
    try:
        started = time.monotonic()
        prune = subprocess.Popen(
            [sys.executable, "manage.py", "prune_audit", "--team", TEAM, "--export-dir",
             str(export_dir)], cwd=ROOT, env=base_env(), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        with LockWatch() as locks:
            while prune.poll() is None and time.monotonic() - started < timeout_s:
                x = load_slice(server, team, seconds=seconds, warmup=warmup)
                # Only a slice that ended with the prune still running measured it throughout.
                (slices if prune.poll() is None else tail).append(x)
        try:
            out, err = prune.communicate(timeout=max(1.0, timeout_s - (time.monotonic()
                                                                          - started)))
        except subprocess.TimeoutExpired:
            prune.kill()
            out, err = prune.communicate()
        prune_s = time.monotonic() - started
        exported: dict[str, int] = {}
        for path in export_dir.rglob("*.jsonl"):
            with path.open(encoding="utf-8") as f:
                for line in f:
                    kind = json.loads(line)["kind"]
                    exported[kind] = exported.get(kind, 0) + 1
    finally:
        shutil.rmtree(export_dir, ignore_errors=True)
    pruned_runs, pruned_decisions = _pruned(out)
    total_after = history_rows(team)
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM runs_run WHERE team_id = %s AND status <> 'running' "
                       "AND ended_at < %s", [team.team_id, surely_past])
        left_behind = int(cursor.fetchone()[0])
    ok = (prune.returncode == 0 and pruned_runs is not None and pruned_runs >= expected_at_least
          and pruned_decisions == pruned_runs * STEPS
          and exported.get("run", 0) == pruned_runs
          and exported.get("decision", 0) == pruned_decisions
          and total_after == total_before - pruned_decisions and left_behind == 0)
    return {
        "prune_s": round(prune_s, 1), "returncode": prune.returncode,
        "stderr_tail": err.strip().splitlines()[-3:] if prune.returncode else [],
        "runs_pruned": pruned_runs, "decisions_pruned": pruned_decisions,
        "runs_past_cutoff_before": expected_at_least, "exported": exported,
        "history_rows_before": total_before, "history_rows_after": total_after,
        "runs_left_past_cutoff": left_behind, "ok": ok, "locks": locks.as_dict(),
        "during": point(slices, "prune running") if slices else None,
        "tail": point(tail, "prune ended during the slice") if tail else None,
    }


def _pruned(out: str) -> tuple[int | None, int | None]:
    # "bench-growth: pruned 16123 runs, 322460 decisions, 0 operator events older than ..."
    for line in out.splitlines():
        if line.startswith(f"{TEAM}: pruned "):
            words = line.split()
            return int(words[2]), int(words[4])
    return None, None


# --- The phase -------------------------------------------------------------------------------

def measure(server: Server, *, quick: bool) -> dict[str, Any]:
    size = QUICK if quick else FULL
    seconds, warmup, rounds = (1.5, 0.5, 1) if quick else (7.0, 1.0, 3)
    sc.reset_runs()
    team = sc.seed_team(TEAM)
    from policies.models import Team

    # No prune may find the history before the measured one does.
    Team.objects.filter(pk=team.team_id).update(retention_days=90)
    out: dict[str, Any] = {"agents": AGENTS, "slice_s": seconds, "rounds": rounds,
                           "history_rows_target": size["history_rows"],
                           "load_average": [round(x, 2) for x in os.getloadavg()]}
    load_slice(server, team, seconds=1.5, warmup=0.5)  # connections, statements, caches warm

    # Running runs: few against many, alternating, over an empty log.
    slices: dict[str, list[sc.Slice]] = {"few": [], "many": []}
    counted: dict[str, int] = {}
    for _ in range(rounds):
        for label in ("few", "many"):
            counted[label] = set_running(team, size[f"{label}_runs"])
            slices[label].append(load_slice(server, team, seconds=seconds, warmup=warmup))
    out["running"] = {label: point(xs, f"{size[f'{label}_runs']} running runs",
                                   running_runs=counted[label]) for label, xs in slices.items()}
    set_running(team, 0)

    # Nothing generated yet: both tables as on an installation's first day.
    sc.reset_runs()
    out["explain_empty"] = explain_check(team, repeats=size["explain_repeats"])
    set_running(team, 0)
    out["sizes_empty"] = sizes()
    fresh = [load_slice(server, team, seconds=seconds, warmup=warmup) for _ in range(rounds)]
    print(f"  growth: generating {size['history_rows']:,} audit rows", flush=True)
    out["generated"] = generate_history(team, rows=size["history_rows"],
                                        batch_runs=size["batch_runs"])
    out["generated"]["counted"] = history_rows(team)
    out["sizes_history"] = sizes()
    out["explain_history"] = explain_check(team, repeats=size["explain_repeats"])
    out["explain_prune_read"] = explain_prune_read(team)
    # The history's log against an empty one, in alternating slices (an empty twin of the
    # audit table takes its name for every other slice), so that both see the same drift of
    # the shared machine's load: a measurement before and one after the ten minutes of
    # generating would compare two machines.
    history, empty = [], []
    with Twin() as twin:
        for _ in range(size["twin_rounds"]):
            set_running(team, 0)
            history.append(load_slice(server, team, seconds=seconds, warmup=warmup))
            with twin.swapped():
                set_running(team, 0)
                empty.append(load_slice(server, team, seconds=seconds, warmup=warmup))
    set_running(team, 0)
    out["prune"] = prune_under_load(server, team, seconds=seconds, warmup=warmup,
                                    timeout_s=size["prune_timeout_s"])
    # Cleanup: every generated row goes, by the benchmark's own maintenance truncate.
    sc.reset_runs()
    Team.objects.filter(pk=team.team_id).update(retention_days=90)
    out["rows_left_after_cleanup"] = sc.max_decision_id()
    out["fresh"] = point(fresh, "nothing generated yet")
    out["history"] = point(history, f"{out['generated']['rows']:,} audit rows")
    out["empty"] = point(empty, "empty audit table, the same runs")
    base = out["empty"]["checks_per_s"]
    out["history_over_empty"] = round(out["history"]["checks_per_s"] / base, 2) if base else None
    few = out["running"]["few"]["checks_per_s"]
    out["many_over_few"] = round(out["running"]["many"]["checks_per_s"] / few, 2) if few \
        else None
    during = (out["prune"]["during"] or out["prune"]["tail"] or {}).get("checks_per_s")
    out["prune_over_history"] = round(during / out["history"]["checks_per_s"], 2) \
        if during and out["history"]["checks_per_s"] else None
    out["failures"] = failures(out)
    return out


def failures(out: dict[str, Any]) -> list[str]:
    """Every correctness check that failed, in words (never a timing)."""
    failed = []
    points = [out["fresh"], out["empty"], out["history"], *out["running"].values()]
    points += [p for p in (out["prune"]["during"], out["prune"]["tail"]) if p]
    for p in points:
        if p["errors"] or not p["audit_ok"]:
            failed.append(f"{p['label']}: errors {p['error_kinds']}, audit rows "
                          f"{p['audit_rows']} for {p['decisions_returned']} decisions")
    if out["generated"]["counted"] != out["history_rows_target"]:
        failed.append(f"history: {out['generated']['counted']} rows generated, "
                      f"{out['history_rows_target']} asked")
    if not out["prune"]["ok"]:
        pr = out["prune"]
        failed.append(f"prune under load: exit {pr['returncode']} {pr['stderr_tail']}, pruned "
                      f"{pr['runs_pruned']} runs / {pr['decisions_pruned']} decisions (at least "
                      f"{pr['runs_past_cutoff_before']} runs), exported {pr['exported']}, history "
                      f"{pr['history_rows_before']} -> {pr['history_rows_after']}, "
                      f"{pr['runs_left_past_cutoff']} runs left past the cutoff")
    if out["rows_left_after_cleanup"]:
        failed.append(f"cleanup: {out['rows_left_after_cleanup']} audit rows left")
    return failed


def line(g: dict[str, Any]) -> str:
    r = g["running"]
    pr = g["prune"]
    during = pr["during"] or pr["tail"] or {}
    return (f"  growth at {g['agents']} agents: empty audit table {g['empty']['checks_per_s']} "
            f"checks/s, {g['generated']['rows']:,} audit rows "
            f"{g['history']['checks_per_s']} ({g['history_over_empty']}x; p99 "
            f"{g['empty']['p99_ms']} / {g['history']['p99_ms']} ms); running runs "
            f"{r['few']['running_runs']} {r['few']['checks_per_s']} vs {r['many']['running_runs']} "
            f"{r['many']['checks_per_s']} ({g['many_over_few']}x); prune of "
            f"{pr['decisions_pruned']} decisions in {pr['prune_s']} s under load "
            f"{during.get('checks_per_s')} checks/s ({g['prune_over_history']}x, p99 "
            f"{during.get('p99_ms')} ms, lock waits seen {pr['locks']['samples_with_a_lock_wait']}"
            f"/{pr['locks']['samples']}); history generated in {g['generated']['insert_s']} s "
            f"+ vacuum {g['generated']['vacuum_s']} s; failures {len(g['failures'])}")


def phase(results: dict[str, Any], server: Server, *, quick: bool) -> None:
    """The phase as bench/__main__.py runs it: measured, stored, one line printed."""
    results["growth"] = measure(server, quick=quick)
    print(line(results["growth"]), flush=True)
