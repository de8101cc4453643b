"""The check's reads and writes: the database side of every agent step (SPEC 4.5).

`run_check` (runs/check/services.py) needs, in one transaction: the agent key, the run locked
against concurrent checks, the engaged kill switch that covers the run, and the earlier
answer to a retried `check_id`; then it writes the run's new state and the audit record.
The decision itself is computed by the pure rules in between, never in SQL.

On PostgreSQL that is two network round trips, each one message with a prepared statement:

1. `BEGIN; EXECUTE lock; EXECUTE keyed`: one SELECT that finds the key by its prefix (not
   revoked; the hash is compared in Python, in constant time), locks the run of the key's
   team `FOR UPDATE`, and reads the covering kill switch and the `check_id` replay in lateral
   subqueries; then, a statement of its own once the run is locked, the check's own entries
   of the run's keyed memory (runs/check/run_memory.py);
2. `EXECUTE write; COMMIT`: one statement that updates the run, upserts the keyed memory's
   changed entries, inserts the decision (data-modifying CTEs) and, for an action counted by
   the rate limits, counts it for every rule of its team it matches, returning the decision's
   id.

The keyed entries a check reads depend on its repeat key, hence on the run's policy: the
caller names them when this process already knows the run's policy version (as for the rate
limits below), else `read_keyed` reads them in one more round trip once the run is locked.

A check whose action matches a rate limit of its policy (SPEC 12) also takes the rules'
advisory locks, waiting for them a bounded time, and reads their windows
(runs/check/rate_limits.py): as more statements of the first message when this process
already knows the run's team, agent and policy version (they never change, `RateRead`), else
in one more round trip between the two.

Why not the ORM here: on the benchmark machine one ORM query cost more Python (about half a
millisecond, mostly building the SQL) than this path's two statements together. And planning
the LOCK statement costs PostgreSQL more than executing it, hence prepared statements, which
Django leaves off by default for the sake of connection poolers (see docs/performance.md
about PgBouncer). Django's connection is used as is: one connection per thread, Django's
lifetime handling, errors translated by `wrap_database_errors` so that the API answers 503
when PostgreSQL is down.

Elsewhere (SQLite, the embedded default, or a caller already inside `transaction.atomic`,
as in tests) `OrmCheck` does the same reads and writes through the ORM inside
`transaction.atomic()`, where SQLite's BEGIN IMMEDIATE serializes the checks.
"""

from __future__ import annotations

import json
import operator
import re
import time
import uuid
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import psycopg
from django.conf import settings
from django.db import (
    DEFAULT_DB_ALIAS,
    DatabaseError,
    IntegrityError,
    InterfaceError,
    OperationalError,
    ProgrammingError,
    connection,
    connections,
    transaction,
)
from django.db.backends.base.base import BaseDatabaseWrapper
from governance_client.rules import RateLimit, RateWindow, RunState

from governance.fastjson import dumps
from policies.models import AgentKey
from runs.check import run_memory
from runs.check.rate_limits import (
    COUNT_SQL,
    count_ctes,
    count_in_python,
    lock_keys,
    lock_statement,
    windows_from_rows,
    windows_in_python,
    windows_params,
    windows_positional,
    windows_prepared,
    windows_sql,
)
from runs.check.records import (
    DECISION_COLUMNS,
    DecisionRow,
    insert,
    row_values,
)
from runs.check.records import (
    ROW_FIELDS as ROW_FIELDS,  # read here by tests/test_check_store_shapes.py
)
from runs.check.states import (
    RUN_COLUMNS,
    STATE_COLUMNS,
    TREE_FIELDS,
    UPDATE_FIELDS,
    columns_of,
    run_state,
    state_of,
)
from runs.killswitch import cover
from runs.models import Decision, Run, RunStatus


@dataclass(slots=True)
class RunRow:
    """The locked run: what never changes about it, and its state as read under the lock.
    `pk` and `team_id` also serve publish_run_event and the approvals' services."""

    id: uuid.UUID
    team_id: int
    agent: str
    policy_version_id: int
    state: RunState
    # SPEC 20: the ancestors' ids, the root first (empty for a root run); they never change.
    ancestors: tuple[str, ...] = ()

    @property
    def pk(self) -> uuid.UUID:
        return self.id


@dataclass(slots=True)
class Locked:
    """What the locking read found. `run` is None when the key's team has no such run."""

    key_id: int
    key_hash: str
    key_last_used_at: datetime | None
    team_id: int
    team_slug: str
    run: RunRow | None
    switch: cover.SwitchFields | None  # the covering switch, as cover.switch_in_words needs it
    earlier_answer: tuple[int, dict[str, Any]] | None  # (decision id, answer) of this check_id
    windows: list[RateWindow] | None = None  # read with the lock (RateRead), else None
    # The counts of the keyed memory's entries named to `lock`, by digest (those the run
    # has); None when none were named.
    keyed: dict[str, int] | None = None


@dataclass(frozen=True, slots=True)
class RateRead:
    """Rate-limit windows to read in the locking round trip, for a run whose team, agent and
    policy version the caller already knows from an earlier check (they never change)."""

    rules: tuple[RateLimit, ...]
    team_id: int
    agent: str


@dataclass(slots=True)
class HitRow:
    """An action counted by the rate limits (runs/check/rate_limits.py); stamped by the store."""

    team_id: int
    agent: str
    action_name: str


@dataclass(slots=True, frozen=True)
class SwitchSeen:
    """The covering switch as the lock statement reads it (cover.SwitchFields)."""

    scope: str
    agent: str
    reason: str
    engaged_by_label: str
    run_id: Any  # a run switch's run: the checked run or one of its ancestors (SPEC 20)


def _rate_rows(cursor: Any, *, locking: bool) -> tuple[bool, list[Any]]:
    """The rate-limit part of a multi-statement message, the cursor being on the result before
    it: whether the rules' locks were granted in time (`locking`: the message took some),
    then the windows' rows."""
    locked = True
    if locking:
        cursor.nextset()
        locked = bool(cursor.fetchone()[0])
    cursor.nextset()
    return locked, cursor.fetchall()


def _update_values(state: RunState) -> dict[str, Any]:
    """The run's new columns: everything a check may change."""
    return columns_of(state, UPDATE_FIELDS)


class DuplicateCheck(Exception):
    """A concurrent retry of the same check_id committed first; the caller starts over and
    then finds that first answer (PostgreSQL only, see PostgresCheck.write)."""


class StaleConnection(Exception):
    """The connection broke before anything was written (e.g. PostgreSQL restarted while it
    sat in Django's pool): the caller may retry once on a new connection."""


class CheckTransaction(Protocol):
    db_seconds: float

    def lock(self, *, prefix: str, run_id: uuid.UUID, check_id: str | None,
             rate: RateRead | None = None, keyed: Sequence[str] | None = None
             ) -> Locked | None:
        ...

    def read_keyed(self, *, run_id: uuid.UUID, keyed: Sequence[str]) -> dict[str, int]:
        ...

    def lock_ancestors(self, *, team_id: int, ids: Sequence[str]) -> list[RunRow]:
        """Lock a child run's ancestors, the root first, before `lock` locks the run
        (SPEC 20; the lock order is docs/reliability.md's), and read them."""
        ...

    def write_ancestors(self, rows: Sequence[tuple[uuid.UUID, dict[str, Any]]]) -> None:
        """The ancestors' changed columns (states.TREE_FIELDS), before `write` commits."""
        ...

    def rate_windows(self, *, run: RunRow, rules: Sequence[RateLimit], now: datetime
                     ) -> list[RateWindow]:
        ...

    def write(self, *, run_id: uuid.UUID, state: RunState | None, rows: list[DecisionRow],
              hit: HitRow | None = None, keyed: Sequence[dict[str, Any]] = ()) -> int:
        """Store the audit records, the run's new state (None: unchanged), the hit and the
        keyed memory's changed entries."""
        ...


# Which store a check's transaction uses, the one choice of the check's path:
#
# | database    | inside a caller's transaction | the check touches approvals | store         |
# | ----------- | ----------------------------- | --------------------------- | ------------- |
# | PostgreSQL  | no                            | no                          | PostgresCheck |
# | PostgreSQL  | yes (tests, scripts)          | either                      | OrmCheck      |
# | PostgreSQL  | either                        | yes (``portable``)          | OrmCheck      |
# | SQLite      | either                        | either                      | OrmCheck      |
#
# A check that finds approvals involved on PostgresCheck starts again as ``portable``
# (runs/check/services.py `run_check`).
def uses_prepared_statements(*, vendor: str, in_atomic_block: bool, portable: bool) -> bool:
    """Whether the check runs on PostgresCheck (the table above), else on OrmCheck."""
    return vendor == "postgresql" and not in_atomic_block and not portable


@contextmanager
def check_transaction(*, portable: bool = False) -> Iterator[CheckTransaction]:
    """One check's transaction: committed by `write`, rolled back on any other way out.
    ``portable``: the ORM path on every database, for checks that touch approvals (SPEC 11),
    which read and write more than the two prepared statements do."""
    db = connections[DEFAULT_DB_ALIAS]
    if uses_prepared_statements(vendor=db.vendor, in_atomic_block=db.in_atomic_block,
                                portable=portable):
        tx = PostgresCheck(db)
        try:
            yield tx
        finally:
            tx.end()
    else:
        with transaction.atomic():
            yield OrmCheck()


# --- PostgreSQL: two round trips ------------------------------------------------------------

# The expression of the unique index `check_id_per_run` (runs/models.py Decision, as Django
# writes it for PostgreSQL): the earlier answer of a check_id is found by it alone, so the
# run's index of its decisions cannot be chosen instead (tests/test_check_lock_plan.py).
REPLAY_KEY = "(COALESCE((run_id)::text, '') || COALESCE(check_id, ''))"

# A check names at most four entries of its keyed memory (`rules.keyed_reads`: its repeat
# key, progress token, result signature and error text), each read by its own equality on
# both columns of the primary key, which no plan can turn into a read of the run's whole
# memory. Written as `digest = ANY($4)`, a plan made while the table was nearly empty read
# every entry of the run and filtered the digests (116 buffers a check after 400 steps;
# docs/performance.md "Two more ties").
KEYED_MAX = 4
KEYED_READS = "\n    UNION ALL ".join(
    f"SELECT digest, count FROM runs_runmemory WHERE run_id = $1 AND digest = $2[{i}]"
    for i in range(1, KEYED_MAX + 1))
# A statement of its own, after the run's lock in the same message (SPEC 4.5). PostgreSQL
# reads every table of a statement with the snapshot taken when the statement started, except
# the row it locks, which it reads again once the lock is granted. Read in a lateral subquery
# of the locking statement, the entries of a check that had waited for another check of the
# same run were the counts from before that check's write, while the run's row was the new
# one: both checks allowed the same repeat (4 or 5 allows of one repeat key under
# `max_repeat_action: 3`, and likewise `repeated_error` and `no_progress`, found by a tester
# with 24 concurrent checks; tests/test_concurrency.py). Under READ COMMITTED each statement
# takes a new snapshot, so this one, started once the lock is held, sees every committed write
# of the run's memory. It reads whatever run it is given: its counts are used only when the
# locking statement found the run for the key.
KEYED_SQL = f"""
SELECT jsonb_object_agg(m.digest, m.count) FROM (
    {KEYED_READS}
) m
"""

# The switch subquery is the cover rule's SQL form (runs/killswitch/cover.py). It reads with
# the statement's snapshot, taken when the statement started, so a switch whose engage
# committed before this check began is always seen (SPEC 4.5).
#
# The select list is named once, here: each value of the lock's row is read by the position
# its name has in this list (LOCK_AT), so a column added or moved shifts no other reading.
# The run's team is the key's (the run is joined on it), hence not read twice.
LOCK_SELECT: tuple[tuple[str, str], ...] = (
    ("key_id", "k.id"), ("key_hash", "k.key_hash"), ("key_last_used_at", "k.last_used_at"),
    ("team_id", "k.team_id"), ("team_slug", "t.slug"),
    *((f"run_{name}", f"r.{name}") for name in RUN_COLUMNS if name != "team_id"),
    ("switch_scope", "s.scope"), ("switch_agent", "s.agent"), ("switch_reason", "s.reason"),
    ("switch_engaged_by_label", "s.engaged_by_label"), ("switch_run_id", "s.run_id"),
    ("earlier_id", "d.id"), ("earlier_answer", "d.answer"),
)
LOCK_AT = {name: i for i, (name, _) in enumerate(LOCK_SELECT)}
# The run's state columns as they sit in the row, in STATE_COLUMNS order (one C call a check).
_STATE_OF_ROW = operator.itemgetter(*(LOCK_AT[f"run_{name}"] for name in STATE_COLUMNS))
LOCK_SQL = f"""
SELECT {", ".join(expression for _, expression in LOCK_SELECT)}
FROM policies_agentkey k
JOIN policies_team t ON t.id = k.team_id
LEFT JOIN LATERAL (
    SELECT {", ".join(RUN_COLUMNS)}
    FROM runs_run WHERE id = $1 AND team_id + 0 = k.team_id
        AND (k.agent = '' OR runs_run.agent = k.agent)  -- an agent-bound key (SPEC 10)
    FOR UPDATE
) r ON true
LEFT JOIN LATERAL (
    SELECT ks.scope, ks.agent, ks.reason, ks.engaged_by_label, ks.run_id
    FROM runs_killswitch ks
    WHERE ks.active AND r.status = '{RunStatus.RUNNING.value}' AND (
        {cover.covers_sql(switch="ks", team="r.team_id", agent="r.agent", run="$1")})
    ORDER BY ks.engaged_at
    LIMIT 1
) s ON true
LEFT JOIN LATERAL (
    SELECT id, answer FROM runs_decision
    WHERE r.id IS NOT NULL AND check_id IS NOT NULL AND {REPLAY_KEY} = ($1::text || $2)
) d ON true
WHERE k.prefix = $3 AND k.revoked_at IS NULL
"""
READ_KEYED_SQL = "SELECT digest, count FROM runs_runmemory WHERE run_id = %s AND digest = ANY(%s)"

# The write takes the decisions (one, or two when the check found the run abandoned), the
# run's new state, the rate-limit hit and the keyed memory's changed entries as one JSON
# document each, unpacked by jsonb_populate_recordset: one literal to quote instead of
# twenty-two, one JSON encoding. An empty array writes nothing. The data-modifying CTEs run even
# though the INSERT does not read them: one statement for the state change and its audit
# record. The hit is counted for the rules of its team it matches (rate_limits.count_ctes),
# stamped with the database's clock, the clock every rate-limit window is read with. An
# entry's count is its new value, not an increment: the run's lock is held.
# The run's update reads its one row with jsonb_populate_record: from a recordset the plan
# (generic, the statement is prepared) expects 100 rows and joined them by a hash over a
# sequential scan of the whole runs table, every version of every run's row included, on
# every check (2 ms at 10,000 runs, docs/performance.md "Cost as the work grows"), so a
# check's cost grew with the table instead of being one index lookup. An empty array makes
# the record NULL: nothing updated.
_COLUMNS = ", ".join(DECISION_COLUMNS)
INSERT_SQL = f"""
INSERT INTO runs_decision ({_COLUMNS})
SELECT {_COLUMNS} FROM jsonb_populate_recordset(NULL::runs_decision, $1)
RETURNING id
"""
WRITE_SQL = """
WITH run AS (
    UPDATE runs_run r SET """ + ", ".join(f"{name} = n.{name}" for name in UPDATE_FIELDS) + """
    FROM jsonb_populate_record(NULL::runs_run, $2 -> 0) n
    WHERE r.id = n.id
), """ + count_ctes("$3") + """, keyed AS (
    INSERT INTO runs_runmemory (run_id, digest, kind, text, count)
    SELECT run_id, digest, kind, text, count
    FROM jsonb_populate_recordset(NULL::runs_runmemory, $4)
    ON CONFLICT (run_id, digest) DO UPDATE SET count = EXCLUDED.count
)""" + INSERT_SQL

# Prepared once per connection with SQL PREPARE, then run with EXECUTE in the same simple-query
# message as BEGIN (and COMMIT): two round trips, and PostgreSQL plans the LOCK statement
# once per connection instead of on every check (planning it costs more than running it).
# Protocol-level prepared statements would need pipeline mode to keep two round trips, and
# psycopg's pipeline costs more Python per check than the query strings this builds.
PREPARE_SQL = (
    f"PREPARE governance_check_lock(uuid, text, text) AS {LOCK_SQL};"
    f"PREPARE governance_check_keyed(uuid, text[]) AS {KEYED_SQL};"
    f"PREPARE governance_check_write(jsonb, jsonb, jsonb, jsonb) AS {WRITE_SQL};"
)
# Sequential scans off for the check's transaction (a local setting: it ends with the
# transaction): every table the check reads it reads by a key, and a plan made when a table
# was a page or two (a new database, a truncated table, statistics from then) would
# otherwise keep scanning it whole as it grows, until an ANALYZE replans: measured in one
# benchmark run, 17,257 sequential scans of runs_runmemory reading 43.7 M rows,
# PostgreSQL's CPU per check 1.18 ms instead of 0.7 to 0.9 (docs/performance.md "A plan that
# grew too"). The setting is read whenever PostgreSQL plans the statements (the first
# executions, and every replan), so their plans take the keys' indexes at any size and with
# any statistics.
#
# And a bound on every lock wait of the check's transaction (SPEC 10): a run held by another
# request longer than CHECK_LOCK_WAIT_MS answers 503 (runs/check/api.py), instead of holding
# the API pool's thread while it waits (found by an attacker: uploads of local decisions
# holding a run's lock for seconds, and 32 checks of it waiting, put another team's checks
# 3 to 5 s behind). One statement for both settings: the transaction's first message keeps
# one result before the lock's.
BEGIN_CHECK = ("BEGIN; SELECT set_config('enable_seqscan', 'off', true), "
               f"set_config('lock_timeout', '{int(settings.CHECK_LOCK_WAIT_MS)}ms', true)")
EXECUTE_LOCK = BEGIN_CHECK + "; EXECUTE governance_check_lock(%s, %s, %s)"
EXECUTE_KEYED = "EXECUTE governance_check_keyed(%s, %s)"
EXECUTE_WRITE = "EXECUTE governance_check_write(%s, %s, %s, %s); COMMIT"
# SPEC 20: a child run's ancestors, locked the root first, one statement each in the order
# given, in the message that begins the transaction; `lock` then goes on without BEGIN.
BEGIN_TREE = BEGIN_CHECK
ANCESTOR_LOCK_SQL = (f"SELECT {', '.join(RUN_COLUMNS)} FROM runs_run "
                     "WHERE id = %s AND team_id = %s FOR UPDATE")
ANCESTOR_WRITE_SQL = ("UPDATE runs_run SET " + ", ".join(f"{name} = %s" for name in TREE_FIELDS)
                      + " WHERE id = %s")


# --- Behind a pooler in transaction mode ------------------------------------------------------
# PgBouncer in transaction mode (DATABASE_POOLER=transaction, docs/deploy.md) gives each
# transaction whichever server connection is free: a statement PREPAREd in one transaction is
# unknown to the next one's server connection (it answered "prepared statement does not exist",
# then 503 "The store refused the write", for most checks), or already exists there. So there
# the same statements are sent whole, in the same two messages: each $n becomes a typed
# client-side literal. PostgreSQL then plans them on every check (docs/deploy.md, "PgBouncer",
# for what that costs).
_PLACEHOLDER = re.compile(r"\$(\d+)")


def inlined(body: str, types: Sequence[str]) -> tuple[str, list[int]]:
    """A statement written for PREPARE (placeholders $1, $2, ...) as one to send whole with
    client-side binding: each placeholder a typed ``%s``, and the index of the parameter each
    ``%s`` takes, in order (a placeholder may appear more than once)."""
    order: list[int] = []

    def placeholder(match: re.Match[str]) -> str:
        index = int(match.group(1)) - 1
        order.append(index)
        return f"(%s::{types[index]})"

    return _PLACEHOLDER.sub(placeholder, body.replace("%", "%%")), order


_LOCK_INLINE, _LOCK_ORDER = inlined(LOCK_SQL, ["uuid", "text", "text"])
_KEYED_INLINE, _KEYED_ORDER = inlined(KEYED_SQL, ["uuid", "text[]"])
_WRITE_INLINE, _WRITE_ORDER = inlined(WRITE_SQL, ["jsonb"] * 4)
SEND_LOCK = BEGIN_CHECK + "; " + _LOCK_INLINE
SEND_WRITE = _WRITE_INLINE + "\n; COMMIT"
# The window read sent whole, by number of rules.
_windows_inline: dict[int, tuple[str, list[int]]] = {}


def statements_prepared() -> bool:
    """Whether the check PREPAREs its statements once per connection (PostgreSQL itself, or a
    pooler in session mode), else sends them whole (a pooler in transaction mode)."""
    return settings.DATABASE_POOLER != "transaction"


# The connections (Django's, one per thread) on which the statements are prepared.
_prepared: weakref.WeakSet[Any] = weakref.WeakSet()
# The rate-limit window statements prepared on each connection, by name.
_prepared_windows: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


def _text_array(digests: Sequence[str]) -> str:
    """The digests (hexadecimal, nothing to quote) as a text[] literal: psycopg's list
    adaptation cost 11 us of Python per check more than a string."""
    return "{" + ",".join(digests) + "}"


def _loaded(value: Any) -> Any:
    # Django registers a text loader for jsonb on its connections (JSONField decodes itself).
    return json.loads(value) if isinstance(value, str) else value


def _locked_of(row: Sequence[Any], *, windows: list[RateWindow] | None,
               keyed: dict[str, int] | None) -> Locked:
    """The lock's row (LOCK_SELECT) as what the locking read found, with the counts of the
    keyed memory's entries read after it (None: none were named)."""
    at = LOCK_AT
    run = None
    if row[at["run_id"]] is not None:
        state = dict(zip(STATE_COLUMNS, _STATE_OF_ROW(row), strict=True))
        state["memory"] = _loaded(state["memory"])
        run = RunRow(id=row[at["run_id"]], team_id=row[at["team_id"]],
                     agent=row[at["run_agent"]],
                     policy_version_id=row[at["run_policy_version_id"]],
                     state=run_state(**state),
                     ancestors=tuple(_loaded(row[at["run_ancestors"]]) or ()))
    switch = None
    if row[at["switch_scope"]] is not None:
        switch = SwitchSeen(scope=row[at["switch_scope"]], agent=row[at["switch_agent"]],
                            reason=row[at["switch_reason"]],
                            engaged_by_label=row[at["switch_engaged_by_label"]],
                            run_id=row[at["switch_run_id"]])
    earlier_id = row[at["earlier_id"]]
    earlier = (int(earlier_id), _loaded(row[at["earlier_answer"]])) \
        if earlier_id is not None else None
    return Locked(key_id=row[at["key_id"]], key_hash=row[at["key_hash"]],
                  key_last_used_at=row[at["key_last_used_at"]], team_id=row[at["team_id"]],
                  team_slug=row[at["team_slug"]], run=run, switch=switch,
                  earlier_answer=earlier, windows=windows, keyed=keyed)


def _run_row(values: dict[str, Any]) -> RunRow:
    """A run read by its RUN_COLUMNS (an ancestor locked by `lock_ancestors`)."""
    state = {name: values[name] for name in STATE_COLUMNS}
    state["memory"] = _loaded(state["memory"])
    return RunRow(id=values["id"], team_id=values["team_id"], agent=values["agent"],
                  policy_version_id=values["policy_version_id"], state=run_state(**state),
                  ancestors=tuple(_loaded(values["ancestors"]) or ()))


class PostgresCheck:
    def __init__(self, db: BaseDatabaseWrapper) -> None:
        db.ensure_connection()
        self.raw: psycopg.Connection[Any] = db.connection
        # The wrapper's error translation, looked up once: every `connection.` goes through
        # asgiref's context-local storage (several microseconds each, seven per check).
        self.errors = db.wrap_database_errors
        # Client-side binding (what Django's own cursors do): the parameters become literals
        # of the EXECUTE, which is what lets BEGIN and COMMIT share its message. One cursor
        # per connection, kept on Django's (per-thread) wrapper: every check used to make one.
        cursor = getattr(db, "_governance_check_cursor", None)
        if cursor is None or cursor.connection is not self.raw:
            cursor = psycopg.ClientCursor(self.raw)
            db._governance_check_cursor = cursor  # type: ignore[attr-defined]
        self.cursor: psycopg.ClientCursor[Any] = cursor
        self.open = False
        self.begun = False  # BEGIN sent already (a child run's ancestors locked first)
        self.db_seconds = 0.0
        self.prepared = statements_prepared()

    def lock_ancestors(self, *, team_id: int, ids: Sequence[str]) -> list[RunRow]:
        if not ids:
            return []
        sql = "; ".join([BEGIN_TREE, *[ANCESTOR_LOCK_SQL] * len(ids)])
        params: list[Any] = []
        for run_id in ids:
            params += [run_id, team_id]
        found: list[RunRow] = []
        started = time.perf_counter()
        try:
            with self.errors:
                self.open = self.begun = True
                self.cursor.execute(sql, params)
                self.cursor.nextset()  # past BEGIN's and SET's results
                for _ in ids:
                    self.cursor.nextset()
                    row = self.cursor.fetchone()
                    if row is not None:
                        found.append(_run_row(dict(zip(RUN_COLUMNS, row, strict=True))))
        except (OperationalError, InterfaceError) as exc:
            if self.raw.broken or self.raw.closed:
                raise StaleConnection() from exc
            raise
        finally:
            self.db_seconds += time.perf_counter() - started
        return found

    def write_ancestors(self, rows: Sequence[tuple[uuid.UUID, dict[str, Any]]]) -> None:
        if not rows:
            return
        params: list[Any] = []
        for run_id, columns in rows:
            params += [*(columns[name] for name in TREE_FIELDS), run_id]
        started = time.perf_counter()
        try:
            with self.errors:
                self.cursor.execute("; ".join([ANCESTOR_WRITE_SQL] * len(rows)), params)
        finally:
            self.db_seconds += time.perf_counter() - started

    def _prepare(self) -> None:
        if self.prepared and self.raw not in _prepared:
            self.cursor.execute(PREPARE_SQL)
            _prepared.add(self.raw)
            _prepared_windows[self.raw] = set()

    def _windows_statement(self, rules: Sequence[RateLimit], *, team_id: int, agent: str,
                           run_id: uuid.UUID) -> tuple[str, list[Any]]:
        """`EXECUTE` of the prepared window read, preparing it first on this connection (or
        the read itself, behind a pooler in transaction mode)."""
        if not self.prepared:
            count = len(rules)
            if count not in _windows_inline:
                _, types, body = windows_positional(count)
                _windows_inline[count] = inlined(body, types)
            sql, order = _windows_inline[count]
            values = windows_params(rules, team_id=team_id, agent=agent, run_id=run_id)
            return sql, [values[i] for i in order]
        name, prepare = windows_prepared(rules)
        done = _prepared_windows.setdefault(self.raw, set())
        if name not in done:
            self.cursor.execute(prepare)  # not transactional: kept if the check rolls back
            done.add(name)
        params = windows_params(rules, team_id=team_id, agent=agent, run_id=run_id)
        return f"EXECUTE {name}({', '.join(['%s'] * len(params))})", params

    def lock(self, *, prefix: str, run_id: uuid.UUID, check_id: str | None,
             rate: RateRead | None = None, keyed: Sequence[str] | None = None
             ) -> Locked | None:
        if keyed and len(keyed) > KEYED_MAX:  # the statement reads KEYED_MAX entries at most
            raise ValueError(f"{len(keyed)} keyed entries named, at most {KEYED_MAX} are read")
        cursor = self.cursor
        started = time.perf_counter()
        sql = EXECUTE_LOCK
        params: list[Any] = [run_id, check_id, prefix]
        if not self.prepared:
            sql, params = SEND_LOCK, [params[i] for i in _LOCK_ORDER]
        if self.begun:
            # After a child run's ancestors (`lock_ancestors`) the transaction is open already:
            # without its BEGIN and SET, prepared or sent whole (the first result read is then
            # the lock's, not BEGIN's empty one).
            sql = sql.split("; ", 2)[2]
        if keyed:
            # Once the run is locked, with a snapshot of its own (KEYED_SQL).
            entries = [run_id, _text_array(keyed)]
            if self.prepared:
                sql += "; " + EXECUTE_KEYED
                params += entries
            else:
                sql += "; " + _KEYED_INLINE
                params += [entries[i] for i in _KEYED_ORDER]
        keys: list[int] = []
        if rate is not None:
            # After the run's lock, in the same message: the rules' locks (a bounded wait),
            # then the windows, each a statement of its own so the read's snapshot follows the
            # locks. Should the key or the run be refused, the rollback releases these locks
            # at once.
            keys = lock_keys(rate.rules, team_id=rate.team_id, agent=rate.agent, run_id=run_id)
            if keys:
                sql += "; " + lock_statement(keys)
        windows_rows: list[Any] = []
        rate_locked = True
        counts: dict[str, int] | None = None
        try:
            with self.errors:
                self._prepare()
                if rate is not None:
                    windows, more = self._windows_statement(
                        rate.rules, team_id=rate.team_id, agent=rate.agent, run_id=run_id)
                    sql += "; " + windows
                    params += more
                self.open = True
                cursor.execute(sql, params)
                if not self.begun:
                    cursor.nextset()  # past BEGIN's and SET's results, to the SELECT's
                    cursor.nextset()
                row = cursor.fetchone()
                if keyed:
                    cursor.nextset()
                    counts = _loaded(cursor.fetchone()[0]) or {}
                if rate is not None:
                    rate_locked, windows_rows = _rate_rows(cursor, locking=bool(keys))
        except (OperationalError, InterfaceError, ProgrammingError) as exc:
            missing = isinstance(exc.__cause__, psycopg.errors.InvalidSqlStatementName)
            if missing or self.raw.broken or self.raw.closed:
                # The connection died while idle, or its session lost the prepared statements
                # (DISCARD ALL): nothing was read or written, a new connection may retry.
                _prepared.discard(self.raw)
                _prepared_windows.pop(self.raw, None)
                raise StaleConnection() from exc
            raise
        finally:
            self.db_seconds += time.perf_counter() - started
        if row is None:
            return None
        return _locked_of(row, windows=windows_from_rows(
            rate.rules, windows_rows, locked=rate_locked) if rate is not None else None,
            keyed=counts)

    def read_keyed(self, *, run_id: uuid.UUID, keyed: Sequence[str]) -> dict[str, int]:
        """The counts of these entries of the run's keyed memory, by digest: one round trip,
        for a check whose entries `lock` could not name."""
        if not keyed:
            return {}
        started = time.perf_counter()
        try:
            with self.errors:
                self.cursor.execute(READ_KEYED_SQL, [run_id, list(keyed)])
                return dict(self.cursor.fetchall())
        finally:
            self.db_seconds += time.perf_counter() - started

    def rate_windows(self, *, run: RunRow, rules: Sequence[RateLimit], now: datetime
                     ) -> list[RateWindow]:
        """Take the rules' advisory locks (a bounded wait), then read their windows with the
        database's clock: one round trip (the locks and the read are separate statements of
        one message, so the read's snapshot is taken once the locks are held)."""
        keys = lock_keys(rules, team_id=run.team_id, agent=run.agent, run_id=run.id)
        started = time.perf_counter()
        try:
            with self.errors:
                sql, params = self._windows_statement(rules, team_id=run.team_id,
                                                      agent=run.agent, run_id=run.id)
                if keys:
                    self.cursor.execute(lock_statement(keys) + "; " + sql, params)
                    locked = bool(self.cursor.fetchone()[0])
                    self.cursor.nextset()
                else:
                    self.cursor.execute(sql, params)
                    locked = True
                rows = self.cursor.fetchall()
        finally:
            self.db_seconds += time.perf_counter() - started
        return windows_from_rows(rules, rows, locked=locked)

    def write(self, *, run_id: uuid.UUID, state: RunState | None, rows: list[DecisionRow],
              hit: HitRow | None = None, keyed: Sequence[dict[str, Any]] = ()) -> int:
        decisions = dumps([{"run_id": run_id, **row_values(row)} for row in rows])
        runs = dumps([{"id": run_id, **_update_values(state)}] if state is not None else [])
        hits = dumps([{"team_id": hit.team_id, "agent": hit.agent, "run_id": run_id,
                        "action_name": hit.action_name}] if hit is not None else [])
        entries = dumps([{"run_id": run_id, **entry} for entry in keyed])
        sql, params = EXECUTE_WRITE, (decisions, runs, hits, entries)
        if not self.prepared:
            sql, params = SEND_WRITE, tuple(params[i] for i in _WRITE_ORDER)
        cursor = self.cursor
        started = time.perf_counter()
        try:
            with self.errors:
                cursor.execute(sql, params)
                written = cursor.fetchall()
        except IntegrityError as exc:
            cause = getattr(exc.__cause__, "diag", None)
            if cause is not None and cause.constraint_name == "check_id_per_run":
                # Both retries read "no earlier answer" with snapshots taken before the
                # other committed; the unique index refuses the second audit record.
                raise DuplicateCheck() from exc
            raise
        finally:
            self.db_seconds += time.perf_counter() - started
        # An error in the INSERT skips the COMMIT of the same message; past this point the
        # COMMIT ran (psycopg raises for an error in any statement of the message).
        self.open = False
        assert written
        return max(int(r[0]) for r in written)  # the check's own record is the last one

    def end(self) -> None:
        """Roll back whatever is still open (a refusal, a replay, an error)."""
        if not self.open:
            return
        self.open = False
        started = time.perf_counter()
        # A connection that broke is closed by Django at the end of the request
        # (wrap_database_errors marks it); nothing more to do for it here.
        with suppress(DatabaseError), self.errors:
            self.cursor.execute("ROLLBACK")
        self.db_seconds += time.perf_counter() - started


# --- Elsewhere: the ORM inside transaction.atomic() ------------------------------------------

class OrmCheck:
    """The portable path: the same reads and writes as PostgresCheck, statement by statement.
    On SQLite the surrounding BEGIN IMMEDIATE is the lock."""

    def __init__(self) -> None:
        self.db_seconds = 0.0

    def lock(self, *, prefix: str, run_id: uuid.UUID, check_id: str | None,
             rate: RateRead | None = None, keyed: Sequence[str] | None = None
             ) -> Locked | None:
        """`rate` is ignored here: the windows are read by `rate_windows`."""
        started = time.perf_counter()
        try:
            key = (AgentKey.objects.select_related("team")
                   .filter(prefix=prefix, revoked_at__isnull=True).first())
            if key is None:
                return None
            runs = Run.objects.select_for_update().filter(team_id=key.team_id, pk=run_id)
            if key.agent:  # an agent-bound key: other agents' runs are not there (SPEC 10)
                runs = runs.filter(agent=key.agent)
            run_row = runs.only(*RUN_COLUMNS).first()
            run = switch = earlier = counts = None
            if run_row is not None:
                run = RunRow(id=run_row.pk, team_id=run_row.team_id, agent=run_row.agent,
                             policy_version_id=run_row.policy_version_id,
                             state=state_of(run_row),
                             ancestors=tuple(run_row.ancestors or ()))
                if run.state.status == RunStatus.RUNNING:
                    switch = cover.covering_switch(team_id=run.team_id, agent=run.agent,
                                                  run_id=run.id)
                if check_id is not None:
                    found = (Decision.objects.filter(run_id=run.id, check_id=check_id)
                             .values_list("id", "answer").first())
                    earlier = (found[0], found[1]) if found is not None else None
                if keyed:
                    counts = run_memory.counts(run.id, keyed)
            return Locked(key_id=key.pk, key_hash=key.key_hash,
                          key_last_used_at=key.last_used_at, team_id=key.team_id,
                          team_slug=key.team.slug, run=run, switch=switch,
                          earlier_answer=earlier, keyed=counts)
        finally:
            self.db_seconds += time.perf_counter() - started

    def lock_ancestors(self, *, team_id: int, ids: Sequence[str]) -> list[RunRow]:
        """One locking read each, in the order given (the root first); on SQLite the
        transaction's BEGIN IMMEDIATE holds every lock already."""
        found: list[RunRow] = []
        started = time.perf_counter()
        try:
            for run_id in ids:
                row = (Run.objects.select_for_update().filter(pk=run_id, team_id=team_id)
                       .only(*RUN_COLUMNS).first())
                if row is not None:
                    found.append(_run_row({name: getattr(row, name)
                                           for name in RUN_COLUMNS}))
        finally:
            self.db_seconds += time.perf_counter() - started
        return found

    def write_ancestors(self, rows: Sequence[tuple[uuid.UUID, dict[str, Any]]]) -> None:
        started = time.perf_counter()
        try:
            for run_id, columns in rows:
                Run.objects.filter(pk=run_id).update(**columns)
        finally:
            self.db_seconds += time.perf_counter() - started

    def read_keyed(self, *, run_id: uuid.UUID, keyed: Sequence[str]) -> dict[str, int]:
        if not keyed:
            return {}
        started = time.perf_counter()
        try:
            return run_memory.counts(run_id, keyed)
        finally:
            self.db_seconds += time.perf_counter() - started

    def rate_windows(self, *, run: RunRow, rules: Sequence[RateLimit], now: datetime
                     ) -> list[RateWindow]:
        """On SQLite the transaction's BEGIN IMMEDIATE already serializes every check, and
        the server's clock is the database's host clock. On PostgreSQL inside a caller's
        transaction (tests) the same locks and SQL as PostgresCheck."""
        started = time.perf_counter()
        try:
            if connection.vendor != "postgresql":
                return windows_in_python(rules, team_id=run.team_id, agent=run.agent,
                                         run_id=run.id, now=now)
            locked = True
            with connection.cursor() as cursor:
                keys = lock_keys(rules, team_id=run.team_id, agent=run.agent, run_id=run.id)
                if keys:
                    cursor.execute(lock_statement(keys))
                    locked = bool(cursor.fetchone()[0])
                sql, params = windows_sql(rules, team_id=run.team_id, agent=run.agent,
                                          run_id=run.id)
                cursor.execute(sql, params)
                rows = cursor.fetchall()
            return windows_from_rows(rules, rows, locked=locked)
        finally:
            self.db_seconds += time.perf_counter() - started

    def write(self, *, run_id: uuid.UUID, state: RunState | None, rows: list[DecisionRow],
              hit: HitRow | None = None, keyed: Sequence[dict[str, Any]] = ()) -> int:
        started = time.perf_counter()
        try:
            if state is not None:
                Run.objects.filter(pk=run_id).update(**_update_values(state))
            run_memory.upsert(run_id, list(keyed))
            if hit is not None and connection.vendor == "postgresql":
                # The same statement as PostgresCheck's write: stamps taken under the counts'
                # row locks, by the database's clock.
                with connection.cursor() as cursor:
                    cursor.execute(COUNT_SQL, [dumps([{
                        "team_id": hit.team_id, "agent": hit.agent, "run_id": run_id,
                        "action_name": hit.action_name}])])
            elif hit is not None:
                count_in_python(team_id=hit.team_id, agent=hit.agent, run_id=run_id,
                                action_name=hit.action_name, at=rows[-1].at)
            return insert(run_id, rows)
        finally:
            self.db_seconds += time.perf_counter() - started
