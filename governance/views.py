from __future__ import annotations

import threading

from django.conf import settings
from django.db import connection
from django.http import HttpRequest, HttpResponsePermanentRedirect, JsonResponse
from django.templatetags.static import static
from django.views.decorators.cache import never_cache
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_safe

from runs.live.events import redis_client


def favicon(request: HttpRequest) -> HttpResponsePermanentRedirect:
    """Browsers ask for /favicon.ico where a page names no icon (the API's JSON, 429)."""
    return HttpResponsePermanentRedirect(static("favicon.svg"))


# No CSRF check: a probe's POST is refused as a method (405 with Allow), not as a forgery.
@csrf_exempt
@never_cache
@require_safe
def healthz(request: HttpRequest) -> JsonResponse:
    """The process is alive; says nothing of its stores."""
    return JsonResponse({"status": "ok"})


# One probe at a time asks Redis in each process; the others meanwhile answer what it last said.
# Each ask may wait REDIS_TIMEOUT_S (100 ms) on a Redis that hangs, on an API-pool thread:
# asked by every probe, 60 connections on /readyz (each with a bearer token of its own, so
# each its own caller of the pool) held every API thread and another team's checks waited
# behind them for seconds (found by an attacker). A sequence of probes still sees each change.
_redis_asking = threading.Lock()
_redis_said = "error: not answered yet"  # until a probe has asked it


def _redis_state() -> str:
    global _redis_said
    if not _redis_asking.acquire(blocking=False):
        return _redis_said
    try:
        try:
            redis_client().ping()
            _redis_said = "ok"
        except Exception as exc:
            _redis_said = f"error: {type(exc).__name__}"
        return _redis_said
    finally:
        _redis_asking.release()


NO_REDIS = "not configured"


@csrf_exempt
@never_cache
@require_safe
def readyz(request: HttpRequest) -> JsonResponse:
    """SPEC 9: ready whenever the database answers, since checks need nothing else (SPEC 10:
    Redis is never the authority). Redis's state is in the body: "degraded" means live screens
    fall back to reading the database and Celery tasks wait, while checks are unaffected."""
    checks: dict[str, str] = {}
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        checks["database"] = "ok"
    except Exception as exc:
        checks["database"] = f"error: {type(exc).__name__}"
    # The embedded default runs without Redis (SPEC 9): said so, not left out, and not a
    # degradation.
    checks["redis"] = _redis_state() if settings.REDIS_URL else NO_REDIS
    if checks["database"] != "ok":
        status, code = "unavailable", 503
    elif all(v in ("ok", NO_REDIS) for v in checks.values()):
        status, code = "ok", 200
    else:
        status, code = "degraded", 200
    return JsonResponse({"status": status, "checks": checks}, status=code)
