"""In-process costs of the check's request handling, without HTTP or database: what ninja's
generic machinery would cost per check, against what the check does instead (runs/check/api.py).

Reported as microseconds of CPU per call, best of several rounds, so that a busy machine
disturbs it less than the load points.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from . import agents as ag


def _best(fn: Callable[[], Any], *, rounds: int, calls: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        started = time.process_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.process_time() - started) / calls)
    return round(best * 1e6, 1)


def _check_operation() -> Any:
    from django.urls import resolve

    # ninja's URL view closes over its PathView, which holds the bound operations.
    view = resolve("/api/v1/runs/00000000-0000-0000-0000-000000000000/check").func
    path_view = inspect.getclosurevars(view).nonlocals["self"]
    return next(op for op in path_view.operations if op.view_func.__name__ == "check")


def measure(*, quick: bool) -> dict[str, float]:
    from django.http import HttpResponse
    from django.test import RequestFactory, override_settings

    from runs.check import metrics
    from runs.check import schemas as s
    from runs.check.api import _check_payload

    rounds, calls = (3, 300) if quick else (7, 1000)
    body = json.dumps(ag.script(ag.NORMAL, "0123456789abcdef0123")[5]).encode()
    request = RequestFactory().post("/api/v1/runs/x/check", body,
                                    content_type="application/json")
    request.body  # noqa: B018 - read once, as the middleware does before the view
    op = _check_operation()
    answer = {
        "decision": "allow", "reason": "step_ok", "decision_id": 1, "step": 5,
        "repeat_key": "search.docs:" + "0" * 32, "repeat_count": 1, "message": None,
        "next_action": None,
        "usage": {"steps": 5, "tool_calls": 4, "cost_usd": 0.006, "elapsed_s": 2.1},
        "limits": {"max_steps": 30, "max_repeat_action": 3, "no_progress_window": 4,
                   "max_seconds": 3600, "max_usd": 50.0, "max_tool_calls": None},
        "directive": None, "shadow": None, "approval": None, "retry_after_s": None,
        "rule": None, "trace_id": None,
    }

    def record_metrics() -> None:
        metrics.decision_made(team="bench", outcome="allow", reason="step_ok",
                              db_seconds=0.0012)
        metrics.check_answered(0.003)

    if "prometheus_client" not in sys.modules:
        # Measure what the server's workers pay: values in multiprocess (mmap) files.
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="bench-metrics-")
    with override_settings(METRICS_TOKEN="bench-micro"):
        metrics_us = _best(record_metrics, rounds=rounds, calls=calls)
    return {
        "metrics_record_us": metrics_us,
        "ninja_request_models_us": _best(
            lambda: op._get_values(request, {"run_id": "x"}, HttpResponse()),
            rounds=rounds, calls=calls),
        "check_payload_us": _best(lambda: _check_payload(request), rounds=rounds, calls=calls),
        "checkin_validate_us": _best(lambda: s.CheckIn.model_validate(json.loads(body)),
                                     rounds=rounds, calls=calls),
        "ninja_response_us": _best(
            lambda: op._result_to_response(request, answer, HttpResponse()),
            rounds=rounds, calls=calls),
        "json_response_us": _best(
            lambda: HttpResponse(json.dumps(answer), content_type="application/json"),
            rounds=rounds, calls=calls),
    }
