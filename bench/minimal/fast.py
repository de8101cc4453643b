"""The minimal durable check done the fastest way this stack allows (issue 33): one statement,
one round trip, a protocol-level prepared statement, orjson.

Every rung of the ladder (bench/ladder.py) runs this same function, from a raw WSGI
application (bench/minimal/wsgi_raw.py) up to the product's own server (bench/views.py), so
that the difference between two rungs is what the layer added, not the SQL.

The statement: the run's `UPDATE ... RETURNING` (which locks the row, as the real check's
lock does), the repeat-count upsert of the action's key and the audit `INSERT`, as
data-modifying CTEs of one statement in autocommit: one round trip, atomic.
"""

from __future__ import annotations

import hashlib
import os
import threading
from typing import Any

import orjson

from bench.views import ANSWER
from governance.fastjson import dumps

DURABLE_ONE = """
WITH r AS (
    UPDATE runs_run SET steps = steps + 1 WHERE id = %(run)s RETURNING id, steps
), c AS (
    INSERT INTO bench_repeat_count (run_id, repeat_key, count)
    SELECT id, %(key)s, 1 FROM r
    ON CONFLICT (run_id, repeat_key) DO UPDATE SET count = bench_repeat_count.count + 1
    RETURNING count
), d AS (
    INSERT INTO runs_decision (run_id, step, outcome, reason, action_name, action_type, args,
        repeat_key, repeat_count, check_id, progress, last_result, cost_usd, answer, at)
    SELECT r.id, r.steps, 'allow', 'step_ok', %(name)s, %(type)s, %(args)s::jsonb, %(key)s,
        c.count, %(check_id)s, %(progress)s::jsonb, %(last)s::jsonb, %(cost)s,
        %(answer)s::jsonb || jsonb_build_object('step', r.steps, 'repeat_count', c.count),
        now()
    FROM r, c
    RETURNING id, step, repeat_count
)
SELECT id, step, repeat_count FROM d
"""

# The same, found through the bearer key: the key's row (by its prefix, not revoked, with the
# token's hash) joined to the run of its team. What authentication adds to the statement.
DURABLE_ONE_KEYED = DURABLE_ONE.replace(
    "UPDATE runs_run SET steps = steps + 1 WHERE id = %(run)s RETURNING id, steps",
    "UPDATE runs_run SET steps = runs_run.steps + 1 FROM policies_agentkey k "
    "WHERE runs_run.id = %(run)s AND k.prefix = %(prefix)s AND k.revoked_at IS NULL "
    "AND k.key_hash = %(digest)s AND runs_run.team_id = k.team_id "
    "RETURNING runs_run.id, runs_run.steps")

_ANSWER_JSON = orjson.dumps(ANSWER).decode()
NOT_FOUND = b'{"error":{"code":"not_found"}}'
UNAUTHORIZED = b'{"error":{"code":"unauthorized"}}'


def params(run_id: str, body: dict[str, Any]) -> dict[str, Any]:
    action = body.get("action") or {}
    args = orjson.dumps(action.get("args"), option=orjson.OPT_SORT_KEYS)
    key = f"{action.get('name', '')}:{hashlib.sha256(args).hexdigest()[:32]}"
    return {
        "run": run_id, "key": key, "name": action.get("name", ""),
        "type": action.get("type", "tool"), "args": args.decode(),
        "check_id": body.get("check_id"), "progress": orjson.dumps(body.get("progress")).decode(),
        "last": orjson.dumps(body.get("last_result")).decode(),
        "cost": body.get("cost_usd") or 0, "answer": _ANSWER_JSON,
    }


def durable(conn: Any, run_id: str, body: bytes, *, claim: Any = None,
            parsed: dict[str, Any] | None = None) -> tuple[int, bytes]:
    """(status, answer bytes) of one minimal durable check on `conn` (a psycopg connection in
    autocommit). `claim` (a KeyClaim) looks the run up through the key; `parsed`, a body
    already parsed (and validated) by the caller."""
    values = params(run_id, parsed if parsed is not None else orjson.loads(body))
    sql = DURABLE_ONE
    if claim is not None:
        sql = DURABLE_ONE_KEYED
        values["prefix"], values["digest"] = claim.prefix, claim.digest
    import psycopg

    # A plain (server-side binding) cursor: Django's connections default to client-side
    # binding, which cannot prepare; every rung prepares the same way.
    row = psycopg.Cursor(conn).execute(sql, values, prepare=True).fetchone()
    if row is None:
        return (401, UNAUTHORIZED) if claim is not None else (404, NOT_FOUND)
    decision_id, step, count = row
    return 200, orjson.dumps({**ANSWER, "step": step, "repeat_key": values["key"],
                              "repeat_count": count, "decision_id": decision_id})


# The same work in two round trips, as the real check makes it (runs/check/check_store.py):
# `BEGIN` and a locking read of the run, then (the real check decides in Python here) the
# write and `COMMIT`. The ladder's `wsgi-2trips` rung: what the second round trip alone costs
# at the floor, served the fastest way.
LOCK_ONE = "SELECT id, steps FROM runs_run WHERE id = %(run)s FOR UPDATE"


def durable_two_trips(conn: Any, run_id: str, body: bytes) -> tuple[int, bytes]:
    """`durable` in two round trips on `conn` (autocommit): each one pipelined message,
    prepared statements, the transaction opened and committed in those messages."""
    import psycopg

    values = params(run_id, orjson.loads(body))
    cursor = psycopg.Cursor(conn)
    with conn.pipeline():
        conn.execute("BEGIN")
        cursor.execute(LOCK_ONE, values, prepare=True)
        if cursor.fetchone() is None:  # the first round trip
            conn.execute("ROLLBACK")
            return 404, NOT_FOUND
        cursor.execute(DURABLE_ONE, values, prepare=True)
        conn.execute("COMMIT")
        row = cursor.fetchone()  # the second
    decision_id, step, count = row
    return 200, orjson.dumps({**ANSWER, "step": step, "repeat_key": values["key"],
                              "repeat_count": count, "decision_id": decision_id})


# The one-round-trip check at its best (the ladder's `wsgi-rules` rung): what a check that
# decides by the product's own rules costs at the floor, if nothing else of the real check
# came with them. The rules (governance_client.rules: the pure functions the server, the
# client and the backtests share) decide from the run's state this process keeps from its
# own last check of the run, as a one-round-trip design would (docs/performance.md), then the
# floor's one statement stores the decision and the answer made as the server makes it.
# Left out, so that this is an upper bound of such a check's throughput: the body's
# validation, the key, the statement's guards (the run's version, a switch, a replay), the
# run's state in the row, the live events, the metrics, Django.
DECIDED_ONE = DURABLE_ONE.replace("'allow', 'step_ok'", "%(outcome)s, %(reason)s").replace(
    "%(answer)s::jsonb || jsonb_build_object('step', r.steps, 'repeat_count', c.count)",
    "%(answer)s::jsonb")
_states: dict[str, Any] = {}
_policy: Any = None


def durable_decided(conn: Any, run_id: str, body: bytes) -> tuple[int, bytes]:
    """`durable`, decided first by the rules from this process's own state of the run.
    A run's checks come one at a time (an agent waits for each answer), so the state of one
    run is never decided on by two threads at once."""
    global _policy
    from datetime import UTC, datetime

    import psycopg

    from bench.scenarios import LONG_POLICY
    from governance_client import answers, rules

    if _policy is None:
        _policy = rules.Policy.from_document(LONG_POLICY)
    parsed = orjson.loads(body)
    action = parsed.get("action") or {}
    check = rules.make_check(action.get("name", ""), action.get("args"),
                             type=action.get("type", "tool"), progress=parsed.get("progress"),
                             last_result=parsed.get("last_result"),
                             cost_usd=parsed.get("cost_usd"), check_id=parsed.get("check_id"))
    now = datetime.now(UTC)
    state = _states.get(run_id) or rules.RunState(started_at=now)
    decision, new_state = rules.evaluate(_policy, state, check, now=now)
    answer = answers.answer_of(decision, new_state, _policy, now)
    values = params(run_id, parsed)
    values.update(outcome=decision.outcome, reason=decision.reason,
                  key=decision.repeat_key or values["key"], answer=dumps(answer))
    row = psycopg.Cursor(conn).execute(DECIDED_ONE, values, prepare=True).fetchone()
    if row is None:
        return 404, NOT_FOUND
    _states[run_id] = new_state
    return 200, dumps({**answer, "decision_id": row[0]}).encode()


_local = threading.local()


def thread_connection() -> Any:
    """This thread's own psycopg connection in autocommit (the raw applications': no Django)."""
    conn = getattr(_local, "conn", None)
    if conn is None or conn.closed:
        import psycopg

        url = os.environ["DATABASE_URL"].replace("postgres://", "postgresql://", 1)
        conn = _local.conn = psycopg.connect(url, autocommit=True, connect_timeout=2)
    return conn
