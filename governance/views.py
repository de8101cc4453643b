from __future__ import annotations

from django.conf import settings
from django.db import connection
from django.http import HttpRequest, HttpResponsePermanentRedirect, JsonResponse
from django.templatetags.static import static
from django.views.decorators.cache import never_cache

from runs.live.events import redis_client


def favicon(request: HttpRequest) -> HttpResponsePermanentRedirect:
    """Browsers ask for /favicon.ico where a page names no icon (the API's JSON, 429)."""
    return HttpResponsePermanentRedirect(static("favicon.svg"))


@never_cache
def healthz(request: HttpRequest) -> JsonResponse:
    """The process is alive; says nothing of its stores."""
    return JsonResponse({"status": "ok"})


@never_cache
def readyz(request: HttpRequest) -> JsonResponse:
    """Ready when the database (and Redis, if configured) answer."""
    checks: dict[str, str] = {}
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        checks["database"] = "ok"
    except Exception as exc:
        checks["database"] = f"error: {type(exc).__name__}"
    if settings.REDIS_URL:
        try:
            redis_client().ping()
            checks["redis"] = "ok"
        except Exception as exc:
            checks["redis"] = f"error: {type(exc).__name__}"
    ready = all(v == "ok" for v in checks.values())
    return JsonResponse({"status": "ok" if ready else "unavailable", "checks": checks},
                        status=200 if ready else 503)
