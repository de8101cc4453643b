"""The two baselines, served only by the benchmark's own server process (bench/urls.py).

- `bare`: parses the check body and answers a fixed JSON decision. No database, no auth, no
  validation: what Django, its middleware and granian cost per request, the ceiling.
- `durable`: the least a durable check can do: one transaction with one
  `UPDATE ... RETURNING` of the run and one `INSERT` of an audit row, raw SQL, no logic, no
  auth, no validation, through Django's `transaction.atomic` as a plain implementation would.

The real check is reported as ratios of these, measured in the same run on the same server
and database, so a noisy machine moves all three together.
"""

from __future__ import annotations

import json

from django.db import connection, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt

ANSWER = {
    "decision": "allow", "reason": "step_ok", "decision_id": 0, "step": 1,
    "repeat_key": "search.docs:0123456789abcdef0123456789abcdef", "repeat_count": 1,
    "message": None, "next_action": None,
    "usage": {"steps": 1, "tool_calls": 1, "cost_usd": 0.0012, "elapsed_s": 0.1},
    "limits": {"max_steps": 30, "max_repeat_action": 3, "no_progress_window": 4,
               "max_seconds": 3600, "max_usd": 50.0, "max_tool_calls": None},
    "directive": None, "shadow": None, "approval": None, "retry_after_s": None,
}

UPDATE_RUN = "UPDATE runs_run SET steps = steps + 1 WHERE id = %s RETURNING steps"
INSERT_DECISION = """
INSERT INTO runs_decision (run_id, step, outcome, reason, action_name, action_type, args,
    repeat_key, repeat_count, check_id, progress, last_result, cost_usd, answer, at)
VALUES (%s, %s, 'allow', 'step_ok', %s, %s, %s, '', 1, %s, %s, %s, %s, %s, %s)
RETURNING id
"""


@csrf_exempt
def bare(request: HttpRequest, run_id: str) -> HttpResponse:
    json.loads(request.body)
    return HttpResponse(json.dumps(ANSWER), content_type="application/json")


@csrf_exempt
def durable(request: HttpRequest, run_id: str) -> HttpResponse:
    body = json.loads(request.body)
    action = body.get("action") or {}
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(UPDATE_RUN, [run_id])
        row = cursor.fetchone()
        if row is None:
            return JsonResponse({"error": {"code": "not_found"}}, status=404)
        answer = {**ANSWER, "step": row[0]}
        cursor.execute(INSERT_DECISION, [
            run_id, row[0], action.get("name", ""), action.get("type", "tool"),
            json.dumps(action.get("args")), body.get("check_id"),
            json.dumps(body.get("progress")), json.dumps(body.get("last_result")),
            body.get("cost_usd") or 0, json.dumps(answer), timezone.now(),
        ])
        (decision_id,) = cursor.fetchone()
    return HttpResponse(json.dumps({**answer, "decision_id": decision_id}),
                        content_type="application/json")


def _count_runs() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM runs_run")
        return int(cursor.fetchone()[0])


@csrf_exempt
async def wait(request: HttpRequest) -> HttpResponse:
    """An async API view, the shape of a long poll: it waits on the event loop (up to 5 s,
    `?s=`) and reads the database on the API pool. tests/test_availability.py holds many
    of these open on a server with one API thread while checks go on."""
    import asyncio

    from governance.pools import api_thread

    try:
        seconds = min(5.0, max(0.0, float(request.GET.get("s", "1"))))
    except ValueError:
        seconds = 1.0
    await asyncio.sleep(seconds)
    runs = await api_thread(_count_runs)()
    return JsonResponse({"waited_s": seconds, "runs": runs})


# --- The ladder's rungs on the product's server (bench/ladder.py, issue 33) ------------------
# Each does the minimal durable check the fastest way (bench/minimal/fast.py: one statement,
# prepared, on a psycopg connection of the thread's own, `_psycopg`) behind one more layer of
# what the real check does: under /api/ they pass the API's
# middleware and its pool's housekeeping; `fast_auth` adds the bearer key (parsed and hashed
# as the check does, looked up in the statement); `fast_valid` adds the check's body parsing
# and validation (CheckIn) on top.

def _psycopg() -> object:
    # A psycopg connection of this thread's own, as the raw rungs use: Django's connections
    # have psycopg's prepared statements off (prepare_threshold None), so the statement would
    # be planned at every check on these rungs only and the difference would not be the
    # layer's. Django's housekeeping still runs on its own connection.
    from bench.minimal import fast

    return fast.thread_connection()


def _answer(status: int, body: bytes) -> HttpResponse:
    return HttpResponse(body, status=status, content_type="application/json")


@csrf_exempt
def fast_durable(request: HttpRequest, run_id: str) -> HttpResponse:
    from bench.minimal import fast

    return _answer(*fast.durable(_psycopg(), run_id, request.body))


def _claim(request: HttpRequest) -> object:
    from policies.services import agent_key_claim
    from runs.check.edge import bearer_token

    token = bearer_token(request.META.get("HTTP_AUTHORIZATION"))
    return agent_key_claim(token) if token else None


@csrf_exempt
def fast_auth(request: HttpRequest, run_id: str) -> HttpResponse:
    from bench.minimal import fast

    claim = _claim(request)
    if claim is None:
        return _answer(401, fast.UNAUTHORIZED)
    return _answer(*fast.durable(_psycopg(), run_id, request.body, claim=claim))


@csrf_exempt
def fast_valid(request: HttpRequest, run_id: str) -> HttpResponse:
    from bench.minimal import fast
    from runs.check.api import _reject_constant
    from runs.check.schemas import CheckIn

    claim = _claim(request)
    if claim is None:
        return _answer(401, fast.UNAUTHORIZED)
    data = json.loads(request.body, parse_constant=_reject_constant)
    CheckIn.model_validate(data).to_check()
    return _answer(*fast.durable(_psycopg(), run_id, request.body, claim=claim, parsed=data))
