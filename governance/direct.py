"""An agent API operation served without Django's handler: the check (issue 33).

`manage.py serve`'s ASGI application (governance/asgi.py) serves ``POST`` to a view the API
registered with `runs.check.edge.serve_directly` (the check, ``api:check``) through
`DirectApi.respond` instead of Django's handler and the API's middleware chain. The request is
the same: read on the event loop within the same body limit and deadline, the same Django
request object, on the API's pool with the same connection housekeeping
(`governance.pools.run_request`), the URL resolved once. What this leaves out is the
machinery, not the work: the handler's dispatch (`BaseHandler.get_response`, the layers'
exception wrappers, ninja's per-method dispatch) and, for a 200 answer, setting the same
security headers one by one on every answer, which cost more than the rest of the chain
(``ResponseHeaders`` checks each name and value as it is set). The chain's work is done by
the chain's own hooks, in its order:

- before the view: a ``Content-Length`` that is not a number, an HTTPS redirect
  (``SECURE_SSL_REDIRECT``), a ``Host`` that ``ALLOWED_HOSTS`` refuses, a body over the limit:
  each of those is handed to Django's handler, which answers it as it always has (nothing
  was done yet). ``DISALLOWED_USER_AGENTS`` or ``PREPEND_WWW`` set: every request goes to the
  handler. (CommonMiddleware's slash redirect never applies: the path resolved to the view.)
- the view, as ninja would call it;
- an answer that is not a plain 200 (a refusal, a 401 that the failed-key throttle counts, a
  503) goes through the chain's response hooks one by one, as in the chain
  (JsonApiErrorsMiddleware, SecurityHeadersMiddleware, CommonMiddleware, SecurityMiddleware,
  ApiJsonMiddleware), and is logged as Django's handler logs a 4xx or 5xx;
- a plain 200 gets the headers those hooks add to a 200 JSON answer, computed by running the
  same hooks once on a probe answer for this request's kind (HTTPS or not: HSTS depends on
  it) and kept until a setting changes.

It runs only while ``API_MIDDLEWARE`` is the chain it knows (`CHAIN`): a project that adds a
layer gets Django's handler for every request, not a direct path that leaves it out.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.core.exceptions import DisallowedHost
from django.core.signals import setting_changed
from django.http import HttpRequest, HttpResponse
from django.http.response import HttpResponseBase
from django.middleware.common import CommonMiddleware
from django.middleware.security import SecurityMiddleware
from django.utils.log import log_response

from .handlers import Answer
from .middleware import (
    ApiJsonMiddleware,
    JsonApiErrorsMiddleware,
    SecurityHeadersMiddleware,
    _bad_length,
)

log = logging.getLogger(__name__)

# The API's chain this module does the work of (governance/settings.py API_MIDDLEWARE).
CHAIN = [
    "governance.middleware.ApiJsonMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "django.middleware.common.CommonMiddleware",
    "governance.middleware.SecurityHeadersMiddleware",
    "governance.middleware.JsonApiErrorsMiddleware",
]

# Stand-ins, in a 200 answer's header template, for the answer's own type and length (no
# header value the hooks set starts with a NUL byte).
_TYPE, _LENGTH = b"\0type", b"\0length"
View = Callable[..., HttpResponseBase]


def _never_called(request: HttpRequest) -> HttpResponse:  # the hooks' get_response
    raise AssertionError("only the hooks of this middleware are called")


class _Hooks:
    """Django's two middleware of the chain, made from the settings of the moment."""

    def __init__(self) -> None:
        self.security = SecurityMiddleware(_never_called)
        self.common = CommonMiddleware(_never_called)

    def after(self, request: HttpRequest, response: HttpResponseBase) -> HttpResponseBase:
        """The chain's response hooks, innermost first."""
        response = JsonApiErrorsMiddleware.after_view(request, response)  # type: ignore[arg-type]
        response = SecurityHeadersMiddleware.headers(request, response)  # type: ignore[arg-type]
        response = self.common.process_response(request, response)
        response = self.security.process_response(request, response)
        return ApiJsonMiddleware.json(request, response)  # type: ignore[arg-type]


class DirectApi:
    """See the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hooks: _Hooks | None = None
        # Per kind of request (HTTPS or not): the 200 answer's headers, the answer's own
        # Content-Type and Content-Length named by `_TYPE` and `_LENGTH`.
        self._ok_headers: dict[bool, list[tuple[bytes, bytes]]] = {}
        setting_changed.connect(self._forget, weak=False)

    @staticmethod
    def enabled() -> bool:
        return list(settings.API_MIDDLEWARE) == CHAIN

    def _forget(self, **_: Any) -> None:
        with self._lock:
            self._hooks = None
            self._ok_headers = {}

    def hooks(self) -> _Hooks:
        hooks = self._hooks
        if hooks is None:
            with self._lock:
                hooks = self._hooks = self._hooks or _Hooks()
        return hooks

    def respond(self, request: HttpRequest, view: View, kwargs: dict[str, Any]
                ) -> Answer | HttpResponseBase | None:
        """The view's answer with the chain's work done; None when Django's handler is to
        answer the request instead (nothing has been done then)."""
        if not self.enabled() or settings.DISALLOWED_USER_AGENTS or settings.PREPEND_WWW:
            return None
        hooks = self.hooks()
        if _bad_length(request) is not None or hooks.security.process_request(request):
            return None
        try:
            request.get_host()
        except DisallowedHost:
            return None  # the handler's 400, logged by Django's security logger
        if JsonApiErrorsMiddleware.before_view(request) is not None:
            return None
        try:
            response = view(request, **kwargs)
            if response.status_code == 200 and not response.streaming \
                    and isinstance(response, HttpResponse) and len(response.headers) == 1:
                return self.ok(request, response)
            response = hooks.after(request, response)
        except Exception:
            # The view answers its own errors (runs/check/api.py); this is the chain's own
            # last resort, a 500 in the API's envelope (ApiJsonMiddleware's).
            log.exception("the direct check path failed")
            response = hooks.after(request, HttpResponse(status=500))
        if response.status_code >= 400:
            log_response("%s: %s", response.reason_phrase, request.path, response=response,
                         request=request)
        request.close()
        return response

    def ok(self, request: HttpRequest, response: HttpResponse) -> Answer:
        body = response.content
        secure = request.is_secure()
        template = self._ok_headers.get(secure)
        if template is None:
            template = self._probe(request)
            with self._lock:
                self._ok_headers[secure] = template
        own = {_TYPE: response["Content-Type"].encode("latin1"),
               _LENGTH: str(len(body)).encode()}
        headers = [(name, own.get(value, value)) for name, value in template]
        request.close()
        return Answer(200, headers, body)

    def _probe(self, request: HttpRequest) -> list[tuple[bytes, bytes]]:
        """The headers the chain's hooks give a 200 JSON answer to `request`, in their order."""
        probe = self.hooks().after(
            request, HttpResponse(b"{}", content_type="application/json"))
        template: list[tuple[bytes, bytes]] = []
        for name, value in probe.items():
            own = {"content-type": _TYPE, "content-length": _LENGTH}.get(name.lower())
            template.append((name.encode("ascii"), own or value.encode("latin1")))
        values = [value for _, value in template]
        if _TYPE not in values or _LENGTH not in values:
            raise AssertionError(f"the API's hooks gave a 200 answer no length or type: "
                                 f"{probe.items()}")
        return template
