"""Django handlers of the project's own: the API's middleware chain and resolving a URL once.

Nothing here imports the project's apps: the benchmark's minimal application
(bench/minimal/) serves through governance/asgi.py, which uses `ResolvedOnce`.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured, MiddlewareNotUsed
from django.core.handlers.asgi import ASGIRequest
from django.core.handlers.base import BaseHandler
from django.core.handlers.exception import convert_exception_to_response
from django.core.handlers.wsgi import WSGIRequest
from django.http import HttpRequest
from django.utils.http import parse_header_parameters
from django.utils.module_loading import import_string


@dataclass(frozen=True, slots=True)
class Answer:
    """A whole answer, ready to send as ASGI messages (governance/direct.py makes them)."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


# Bytes a query or a form may hold: a codec that decodes them only with an error other than
# UnicodeDecodeError (which Django's reading expects) fails on some request.
_CHARSET_PROBES = (b"a=b&c=%FF+d", bytes(range(256)))


# The verdict depends on the name alone, and a client that declares one (`charset=utf-8`)
# declares it on every request, the checks' too: probed once per process, not per request.
@functools.lru_cache(maxsize=64)
def text_charset(name: str) -> bool:
    """Whether a request's declared charset decodes text as Django decodes a request's query
    (strictly, falling back to Latin-1 on a UnicodeDecodeError) and forms (errors replaced):
    `rot13`, `base64` or `zlib` are codecs but not of text, `undefined`, `idna` and
    `punycode` fail with another error (of Python's codecs, those three), and a NUL is no
    name at all."""
    try:
        for probe in _CHARSET_PROBES:
            str(probe, name, "replace")
            with contextlib.suppress(UnicodeDecodeError):
                str(probe, name)
    except (LookupError, ValueError):  # a UnicodeError other than a decoding's is a ValueError
        return False
    return True


class _TextCharset:
    """Django's content-type parameters, but a charset that decodes no text is ignored, as
    Django ignores a name it does not know. Django's own reading catches only that
    LookupError: a NUL (a ValueError) failed while the request was made, and a codec of
    another kind where the query or a form is first decoded, a 500 either way (under WSGI
    before any middleware: a plain text 500 on the API and /healthz too; found by an
    attacker)."""

    def _set_content_type_params(self, meta: Any) -> None:
        self.content_type, self.content_params = parse_header_parameters(
            meta.get("CONTENT_TYPE", ""))
        charset = self.content_params.get("charset")
        if charset is not None and text_charset(charset):
            self.encoding = charset


class TextCharsetWSGIRequest(_TextCharset, WSGIRequest):
    """The request of the project's WSGI application (governance/wsgi.py)."""


class TextCharsetASGIRequest(_TextCharset, ASGIRequest):
    """The request of the project's ASGI application (governance/asgi.py)."""


class ResolvedOnce:
    """A handler that takes the URL match already made for this request: governance/asgi.py
    resolves each request once to choose its thread (an async view or a pool), and Django
    would otherwise resolve it a second time to call the view. Any other request (WSGI, the
    test client, a middleware that set its own ``request.urlconf``) is resolved as usual."""

    def resolve_request(self, request: HttpRequest) -> Any:
        match = request.resolver_match
        if match is not None and not hasattr(request, "urlconf"):
            return match
        return super().resolve_request(request)  # type: ignore[misc]


class ApiChain(ResolvedOnce, BaseHandler):
    """Django's handler for the API: its own URL resolution and view call
    (``BaseHandler._get_response``, with this chain's view, template-response and exception
    hooks), inside the middleware of ``settings.API_MIDDLEWARE`` only, built as
    ``BaseHandler.load_middleware`` builds ``MIDDLEWARE`` (each layer wrapped so that an
    exception becomes a response at that layer)."""

    def __init__(self, *, is_async: bool) -> None:
        super().__init__()
        self._view_middleware = []
        self._template_response_middleware = []
        self._exception_middleware = []
        handler = convert_exception_to_response(
            self._get_response_async if is_async else self._get_response)
        for path in reversed(settings.API_MIDDLEWARE):
            middleware = import_string(path)
            # Every layer runs in both modes, so no layer needs a thread adapter: an async
            # view (the approvals long poll) holds no thread through this chain.
            if not (getattr(middleware, "sync_capable", True)
                    and getattr(middleware, "async_capable", False)):
                raise ImproperlyConfigured(
                    f"{path} in API_MIDDLEWARE must be sync_capable and async_capable")
            try:
                instance = middleware(handler)
            except MiddlewareNotUsed:
                continue
            if hasattr(instance, "process_view"):
                self._view_middleware.insert(
                    0, self.adapt_method_mode(is_async, instance.process_view))
            if hasattr(instance, "process_template_response"):
                self._template_response_middleware.append(
                    self.adapt_method_mode(is_async, instance.process_template_response))
            if hasattr(instance, "process_exception"):
                self._exception_middleware.append(
                    self.adapt_method_mode(False, instance.process_exception))
            handler = convert_exception_to_response(instance)
        self._middleware_chain = handler
