"""The minimal baselines (issue 17), served outside the product's middleware.

- `bare`: parse the JSON body, answer a fixed JSON decision. The framework's floor.
- `durable`: the least work a durable check does, in one transaction of raw SQL: the run's
  `UPDATE ... RETURNING` (which also locks the row, as the real check's lock does), the
  repeat-count upsert of this action's key, and the audit `INSERT`. No auth, no rules, no
  validation beyond what the SQL needs.

The repeat counts live in a bench-only table (`bench_repeat_count`, created by the benchmark
before the server starts): the product keeps them inside the run's `memory` document, and a
per-key row is the least a durable count can be.
"""

from __future__ import annotations

import hashlib
import json

from django.db import connection, transaction
from django.http import HttpRequest, HttpResponse
from django.utils import timezone

from bench.views import ANSWER

UPDATE_RUN = "UPDATE runs_run SET steps = steps + 1 WHERE id = %s RETURNING steps"
UPSERT_REPEAT = """
INSERT INTO bench_repeat_count (run_id, repeat_key, count) VALUES (%s, %s, 1)
ON CONFLICT (run_id, repeat_key) DO UPDATE SET count = bench_repeat_count.count + 1
RETURNING count
"""
INSERT_DECISION = """
INSERT INTO runs_decision (run_id, step, outcome, reason, action_name, action_type, args,
    repeat_key, repeat_count, check_id, progress, last_result, cost_usd, answer, at)
VALUES (%s, %s, 'allow', 'step_ok', %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)
RETURNING id
"""
CREATE_TABLE = """
CREATE TABLE IF NOT EXISTS bench_repeat_count (
    run_id uuid NOT NULL, repeat_key text NOT NULL, count integer NOT NULL,
    PRIMARY KEY (run_id, repeat_key))
"""
JSON = "application/json"


def ready(request: HttpRequest) -> HttpResponse:
    return HttpResponse(b'{"ok":true}', content_type=JSON)


def bare(request: HttpRequest, run_id: str) -> HttpResponse:
    json.loads(request.body)
    return HttpResponse(json.dumps(ANSWER), content_type=JSON)


def durable(request: HttpRequest, run_id: str) -> HttpResponse:
    body = json.loads(request.body)
    action = body.get("action") or {}
    args = json.dumps(action.get("args"), sort_keys=True)
    key = f"{action.get('name', '')}:{hashlib.sha256(args.encode()).hexdigest()[:32]}"
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(UPDATE_RUN, [run_id])
        row = cursor.fetchone()
        if row is None:
            return HttpResponse(b'{"error":{"code":"not_found"}}', status=404, content_type=JSON)
        cursor.execute(UPSERT_REPEAT, [run_id, key])
        (count,) = cursor.fetchone()
        answer = {**ANSWER, "step": row[0], "repeat_key": key, "repeat_count": count}
        cursor.execute(INSERT_DECISION, [
            run_id, row[0], action.get("name", ""), action.get("type", "tool"), args,
            key, count, body.get("check_id"), json.dumps(body.get("progress")),
            json.dumps(body.get("last_result")), body.get("cost_usd") or 0,
            json.dumps(answer), timezone.now(),
        ])
        (decision_id,) = cursor.fetchone()
    return HttpResponse(json.dumps({**answer, "decision_id": decision_id}), content_type=JSON)


def fast_durable(request: HttpRequest, run_id: str) -> HttpResponse:
    """The one-statement minimal durable check (bench/minimal/fast.py) in this application:
    the ladder's rung of Django's request cycle (bench/ladder.py)."""
    from bench.minimal import fast

    # The thread's own psycopg connection, prepared statements on (Django's have them off):
    # bench/views.py `_psycopg`.
    status, answer = fast.durable(fast.thread_connection(), run_id, request.body)
    return HttpResponse(answer, status=status, content_type=JSON)
