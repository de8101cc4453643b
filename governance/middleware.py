"""Cross-cutting HTTP concerns: JSON errors under /api/, throttling, security headers."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render, resolve_url
from whitenoise.middleware import WhiteNoiseMiddleware

from runs.check.api import error

from .pools import api_thread, pool
from .throttle import Throttle, source_of

api_key_throttle = Throttle(
    "api-key", limit=settings.THROTTLE_API_KEY_FAILURES, window=settings.THROTTLE_WINDOW_SECONDS
)
sign_in_throttle = Throttle(
    "sign-in", limit=settings.THROTTLE_SIGN_IN_FAILURES, window=settings.THROTTLE_WINDOW_SECONDS
)


def _has_nul(body: bytes) -> bool:
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return False  # not JSON at all: the view answers 400 invalid_json
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


class _SyncAndAsync:
    """A middleware that runs in either chain: the synchronous one (every sync view, on a
    pool thread) and the asynchronous one (async views, on the event loop: an API long poll).
    Without an async path Django would run it on a thread that stays blocked for the whole
    async view (docs/serving.md)."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]):
        self.get_response = get_response
        self.async_mode = iscoroutinefunction(get_response)
        if self.async_mode:
            markcoroutinefunction(self)


class StaticFilesMiddleware(WhiteNoiseMiddleware):
    """WhiteNoise, able to run in the async chain too: WhiteNoise's own middleware is
    sync-only, and Django would then hold a thread for the whole of every async view below
    it (an API long poll), one view at a time (docs/serving.md)."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]):
        super().__init__(get_response)
        self.async_mode = iscoroutinefunction(get_response)
        if self.async_mode:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:
        if self.async_mode:
            return self.__acall__(request)
        return super().__call__(request)

    async def __acall__(self, request: HttpRequest) -> Any:
        if self.autorefresh:  # DEBUG: it looks at the disk
            static_file = await sync_to_async(self.find_file, thread_sensitive=False,
                                              executor=pool("dashboard"))(request.path_info)
        else:
            static_file = self.files.get(request.path_info)
        if static_file is not None:
            return self.serve(static_file, request)
        return await self.get_response(request)


class JsonApiErrorsMiddleware(_SyncAndAsync):
    """Every answer under /api/ is JSON, including the ones Django makes before a view runs;
    bodies over the limit get 413 before parsing; sources sending bad keys are throttled."""

    def __call__(self, request: HttpRequest) -> Any:
        if self.async_mode:
            return self.__acall__(request)
        if not request.path.startswith("/api/"):
            return self.get_response(request)
        refused = self.before_view(request)
        if refused is not None:
            return refused
        return self.after_view(request, self.get_response(request))

    async def __acall__(self, request: HttpRequest) -> HttpResponse:
        if not request.path.startswith("/api/"):
            return await self.get_response(request)
        # The throttle's cache calls block: they run on the API pool, never on the loop.
        refused = await api_thread(self.before_view)(request)
        if refused is not None:
            return refused
        response = await self.get_response(request)
        return await api_thread(self.after_view)(request, response)

    def before_view(self, request: HttpRequest) -> HttpResponse | None:
        source = source_of(request)
        wait = api_key_throttle.blocked_for(source)
        if wait:
            response = error(429, "rate_limited", "Too many requests with a bad agent key.")
            response["Retry-After"] = str(int(wait) + 1)
            return response
        if request.method in {"POST", "PUT", "PATCH"}:
            # SPEC 5.3 caps a check body at 64 KiB; other bodies (a finish carries up to
            # 100,000 characters of output) only at Django's own upload limit.
            limit = (settings.CHECK_MAX_BODY_BYTES if request.path.endswith("/check")
                     else settings.DATA_UPLOAD_MAX_MEMORY_SIZE)
            try:
                declared = int(request.headers.get("Content-Length") or 0)
            except ValueError:
                declared = 0
            try:
                too_big = declared > limit or len(request.body) > limit
            except RequestDataTooBig:
                too_big = True
            if too_big:
                return error(413, "payload_too_large", f"The body is over {limit // 1024} KiB.")
            if b"\\u0000" in request.body and _has_nul(request.body):
                # PostgreSQL cannot store NUL in text or jsonb: refuse it as bad input.
                return error(422, "invalid_request", "The request is not valid.",
                             {"body": "strings must not contain NUL (\\u0000) characters"})
        return None

    def after_view(self, request: HttpRequest, response: HttpResponse) -> HttpResponse:
        if response.status_code == 401:
            api_key_throttle.failed(source_of(request))
        content_type = response.get("Content-Type", "")
        if response.status_code >= 400 and not content_type.startswith("application/json"):
            codes = {404: "not_found", 405: "method_not_allowed", 403: "forbidden"}
            code = codes.get(response.status_code, "error")
            replacement = error(response.status_code, code, response.reason_phrase)
            if response.has_header("Allow"):
                replacement["Allow"] = response["Allow"]
            return replacement
        return response


@functools.cache
def _login_path() -> str:
    return resolve_url(settings.LOGIN_URL)


class SignInThrottleMiddleware(_SyncAndAsync):
    """Refuses sign-in attempts from a source that failed too often (counted by the
    ``user_login_failed`` signal, see policies/apps.py)."""

    def __call__(self, request: HttpRequest) -> Any:
        if self.async_mode:
            return self.__acall__(request)
        return self.refused(request) or self.get_response(request)

    async def __acall__(self, request: HttpRequest) -> HttpResponse:
        # The sign-in view is synchronous: an async view never needs the throttle's lookup.
        if request.method == "POST" and request.path == _login_path():
            refused = await sync_to_async(self.refused, thread_sensitive=False,
                                          executor=pool("dashboard"))(request)
            if refused is not None:
                return refused
        return await self.get_response(request)

    def refused(self, request: HttpRequest) -> HttpResponse | None:
        if request.method == "POST" and request.path == _login_path():
            wait = sign_in_throttle.blocked_for(source_of(request))
            if wait:
                response = render(request, "429.html", {"wait": int(wait) + 1}, status=429)
                response["Retry-After"] = str(int(wait) + 1)
                return response
        return None


class SecurityHeadersMiddleware(_SyncAndAsync):
    """A Content-Security-Policy with no inline scripts: every script is a static file."""

    def __call__(self, request: HttpRequest) -> Any:
        if self.async_mode:
            return self.__acall__(request)
        return self.headers(self.get_response(request))

    async def __acall__(self, request: HttpRequest) -> HttpResponse:
        return self.headers(await self.get_response(request))

    @staticmethod
    def headers(response: HttpResponse) -> HttpResponse:
        response.setdefault("Content-Security-Policy", settings.CONTENT_SECURITY_POLICY)
        response.setdefault("Referrer-Policy", "same-origin")
        response.setdefault("Permissions-Policy", "camera=(), microphone=(), geolocation=()")
        return response
