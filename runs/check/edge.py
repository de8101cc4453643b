"""The agent API's edge: what every layer in front of its views says the same way.

The ASGI application (governance/asgi.py) refuses a body before Django sees it, the API's
middleware (governance/middleware.py) refuses one that reached it another way (WSGI, the test
client), the views answer in the SPEC 5.3 envelope, and the throttle and the check both read
the bearer key. Each of those says it here, once: the body limit and its 413, the bearer
token, the JSON error. This module is small on purpose: the project imports it without the
API's views, schemas and services.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.http import HttpResponse
from django.http.response import HttpResponseBase

# The API's views `manage.py serve` calls without Django's handler, by URL name
# (governance/direct.py): filled by the views' module when the URLconf loads it.
direct_views: dict[str, Callable[..., HttpResponseBase]] = {}


def serve_directly(view_name: str, view: Callable[..., Any]) -> None:
    """Have the ASGI application serve ``POST`` to the URL named `view_name` (namespaced, as
    ``reverse`` takes it) by calling `view` with the request and the URL's arguments, without
    Django's handler (governance/direct.py). The view must answer every error itself."""
    direct_views[view_name] = view


def error(status: int, code: str, message: str, fields: dict[str, str] | None = None
          ) -> HttpResponse:
    """An API error in the SPEC 5.3 envelope."""
    body = {"error": {"code": code, "message": message, "fields": fields or {}}}
    return HttpResponse(json.dumps(body), status=status, content_type="application/json")


def run_busy() -> HttpResponse:
    """503 for a check that waited CHECK_LOCK_WAIT_MS for its run, held by another request of
    it (SPEC 10: a lock wait on the check's path is bounded): nothing decided, retry."""
    busy = error(503, "unavailable",
                 "The run is busy: another request of it holds it longer than a check waits "
                 f"({settings.CHECK_LOCK_WAIT_MS} ms). Nothing decided; retry.")
    busy["Retry-After"] = "1"
    return busy


def body_limit(path: str) -> int:
    """The most an API request's body may be: SPEC 5.3's 64 KiB for a check; other bodies (a
    finish carries up to 100,000 characters of output) only Django's own upload limit."""
    if path.endswith("/check"):
        return settings.CHECK_MAX_BODY_BYTES
    return settings.DATA_UPLOAD_MAX_MEMORY_SIZE


def too_large(limit: int) -> HttpResponse:
    """The 413 of a body over ``limit`` bytes."""
    return error(413, "payload_too_large", f"The body is over {limit // 1024} KiB.")


def bearer_token(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer`` header's value, parsed as ninja's HttpBearer
    does (the scheme in any case, the rest as it came); None for no header or another
    scheme."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token if scheme.lower() == "bearer" else None
