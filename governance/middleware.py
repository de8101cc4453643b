"""Cross-cutting HTTP concerns: the API's own middleware chain, JSON errors under /api/,
throttling, security headers."""

from __future__ import annotations

import functools
import logging
import unicodedata
import warnings
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.core.handlers.wsgi import WSGIRequest
from django.db import DatabaseError
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest
from django.shortcuts import render, resolve_url
from django.utils.cache import add_never_cache_headers, patch_cache_control
from whitenoise.middleware import WhiteNoiseMiddleware

from policies.services import agent_key_claim
from policies.tokens import token_prefix
from runs.check.edge import bearer_token, body_limit, error, too_large

from .deadlines import read_deadline, timed_out
from .handlers import ApiChain
from .pools import api_thread, pool, pool_name
from .sources import counted_source, source_of
from .text import text_problem
from .throttle import SIGN_IN_OUTCOME, SPARE_UNKNOWN_HASH, Throttle, Verdict

log = logging.getLogger(__name__)

api_key_throttle = Throttle(
    "api-key", limit=settings.THROTTLE_API_KEY_FAILURES, window=settings.THROTTLE_WINDOW_SECONDS
)
sign_in_throttle = Throttle(
    "sign-in", limit=settings.THROTTLE_SIGN_IN_FAILURES, window=settings.THROTTLE_WINDOW_SECONDS
)
# Every sign-in from one address, whatever the username: each password check costs a hash
# (pbkdf2, deliberately slow; Django hashes for unknown usernames too, to equalise timing),
# so a fresh username per attempt would otherwise spend the server's CPU without limit.
sign_in_address_throttle = Throttle(
    "sign-in-address", limit=settings.THROTTLE_SIGN_IN_FAILURES_PER_ADDRESS,
    window=settings.THROTTLE_WINDOW_SECONDS,
)
# Every password checked from one address, right or wrong: a success gives the failures'
# count back (people signing in must not use up their address's bound), so an account
# signing in to itself over and over cost a hash each without limit (found by an attacker).
# Never refused: past it the address's sign-ins are paced (governance/asgi.py).
sign_in_checks_throttle = Throttle(
    "sign-in-checks", limit=settings.THROTTLE_SIGN_IN_CHECKS_PER_ADDRESS,
    window=settings.THROTTLE_WINDOW_SECONDS,
)
# The address buckets' credential: the bucket is the address alone.
ANY_USERNAME = ""
_ERROR_CODES = {400: "bad_request", 403: "forbidden", 404: "not_found",
                405: "method_not_allowed", 500: "internal"}
_ERROR_MESSAGES = {
    400: "Bad request: a Host header that is missing or not allowed, or a malformed request.",
    500: "Internal error.",
}


def presented_key(request: HttpRequest) -> str:
    """The credential a request presented, as the throttle names it: the key's prefix (not
    secret: the dashboard shows it), or what kind of non-key it was."""
    header = request.headers.get("Authorization") or ""
    if not header:
        return "(no key)"
    token = bearer_token(header)
    if token is not None and (op_prefix := token_prefix(token.strip())) is not None:
        return f"op_{op_prefix}"  # an operator token's bucket (SPEC 17), apart from keys'
    claim = agent_key_claim(token.strip()) if token is not None else None
    return claim.prefix if claim is not None else "(not a key)"


def too_many_failures(verdict: Verdict) -> HttpResponse:
    response = error(429, "too_many_failures",
                     "Too many failed authentications with this key from this address; "
                     "retry after the Retry-After delay.")
    response["Retry-After"] = str(verdict.retry_after)
    return response


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

    @staticmethod
    async def _answer_async(response: HttpResponse) -> HttpResponse:
        """An answer made without awaiting anything, as the async chain returns it."""
        return response


def _on_dashboard_pool(fn: Callable[..., Any]) -> Callable[..., Any]:
    # Blocking work of a dashboard request reached through the async chain: on the
    # dashboard's pool, never on the event loop nor on the API's pool.
    return sync_to_async(fn, thread_sensitive=False, executor=pool("dashboard"))


API_PREFIX = "/api/"


class ProbeMiddleware(_SyncAndAsync):
    """First of ``MIDDLEWARE``: /healthz and /readyz answer whatever the Host header and the
    scheme. A load balancer's health check speaks plain HTTP to a node's own address: behind
    TLS with ``SECURE_SSL_REDIRECT`` every probe was a 301, and with the production
    ``ALLOWED_HOSTS`` a 400, and HAProxy took every node out (found by a newcomer following
    docs/deploy.md: every call answered 503). The probes read no session, build no URL from
    the Host and say nothing but their status, so nothing else of the chain applies to them."""

    def __init__(self, get_response: Callable[[HttpRequest], Any]):
        super().__init__(get_response)
        from . import views  # the views import the models: after the apps are ready

        self.probes = {"/healthz": views.healthz, "/readyz": views.readyz}

    def __call__(self, request: HttpRequest) -> Any:
        probe = self.probes.get(request.path)
        if probe is None:
            return self.get_response(request)
        if request.method not in ("GET", "HEAD"):
            # In the API's JSON envelope, as every other 405 (a newcomer's POST /healthz got
            # Django's empty text/html one).
            refused = error(405, "method_not_allowed",
                            f"{request.path} takes GET and HEAD only.")
            refused["Allow"] = "GET, HEAD"
            return self._answer_async(refused) if self.async_mode else refused
        if self.async_mode:
            return sync_to_async(probe, thread_sensitive=False, executor=pool("api"))(request)
        return probe(request)


class ApiRouteMiddleware(_SyncAndAsync):
    """First of ``MIDDLEWARE``: a request under /api/ leaves the pages' chain here for the
    API's own (``API_MIDDLEWARE``: JSON errors, the Host check, security headers, the
    failed-key throttle). Sessions, CSRF, sign-in, messages, htmx, frame options, static
    files and the sign-in throttle serve people in a browser and run only for the pages:
    an agent's bearer-key call never reads a session or a CSRF cookie, and they were about
    half of what the middleware cost a check (docs/performance.md).

    Being a middleware, the split is the same under every server interface that loads
    ``MIDDLEWARE``: `manage.py serve`'s ASGI application, WSGI and `runserver`, and the
    test client."""

    def __init__(self, get_response: Callable[[HttpRequest], Any]):
        super().__init__(get_response)
        self.api = ApiChain(is_async=self.async_mode)._middleware_chain

    def __call__(self, request: HttpRequest) -> Any:
        refused = _bad_length(request)
        if refused is not None:
            return self._answer_async(refused) if self.async_mode else refused
        if request.path == "/api":
            # The API's namespace without its slash: a JSON 404 naming where the API is, not
            # the pages' HTML 404 (found by a newcomer trying the bare prefix).
            missing = error(404, "not_found", "No such endpoint: /api. The API is under "
                            "/api/v1/ (its document: /api/v1/openapi.json).")
            if request.method == "HEAD":
                missing = _headless(missing)
            return self._answer_async(missing) if self.async_mode else missing
        if request.path.startswith(API_PREFIX):
            if request.method == "HEAD":
                # HEAD is GET without the body (RFC 9110 9.3.2): the API's operations name
                # GET only, so the request is served as one and its body left out; where
                # GET is not allowed, neither is HEAD (the 405 says what is).
                request.method = "GET"
                if self.async_mode:
                    return self._head_async(request)
                return _headless(self.api(request))
            return self.api(request)
        return self.get_response(request)

    async def _head_async(self, request: HttpRequest) -> HttpResponse:
        return _headless(await self.api(request))


_BAD_LENGTH = "Bad request: the Content-Length header is not a number."


def _bad_length(request: HttpRequest) -> HttpResponse | None:
    """A 400 for a Content-Length that is not digits (RFC 9112 6.3): Django reads it with
    int() when a body is read, and its ValueError was a 500 under a WSGI server (`make
    demo`'s runserver) wherever a body is read: the API, the pages' CSRF check, /healthz.
    `manage.py serve`'s server refuses such a request before the application."""
    length = request.META.get("CONTENT_LENGTH")
    if not length or (length.isascii() and length.strip().isdigit()):
        return None
    if request.path.startswith(API_PREFIX):
        return error(400, "bad_request", _BAD_LENGTH)
    return HttpResponseBadRequest(_BAD_LENGTH, content_type="text/plain; charset=utf-8")


def _headless(response: HttpResponse) -> HttpResponse:
    """The answer to a HEAD: the GET's status and headers (its Content-Length included, set by
    CommonMiddleware in the API's chain), no body."""
    if not response.streaming:
        response.content = b""
    return response


class ApiJsonMiddleware(_SyncAndAsync):
    """Outermost of the API's chain: every answer under /api/ is JSON, including the ones
    Django makes before any view or inner middleware runs (a refused Host header is a 400
    from CommonMiddleware, an exception in a middleware a 500 page)."""

    def __call__(self, request: HttpRequest) -> Any:
        if self.async_mode:
            return self.__acall__(request)
        return self.json(request, self.get_response(request))

    async def __acall__(self, request: HttpRequest) -> HttpResponse:
        return self.json(request, await self.get_response(request))

    @staticmethod
    def json(request: HttpRequest, response: HttpResponse) -> HttpResponse:
        if not request.path.startswith("/api/"):
            return response
        if 300 <= response.status_code < 400 and urlsplit(
                response.get("Location", "")).path == request.path + "/":
            # CommonMiddleware's added slash (`/api/v1` to `/api/v1/`): an empty HTML
            # redirect, where every answer under /api/ is JSON (found by an attacker). No
            # API path ends with a slash: there is nothing to go to. (The HTTPS redirect
            # keeps its path, and stays.)
            return error(404, "not_found", f"No such endpoint: {request.path}.")
        if response.status_code < 400:
            return response
        if response.get("Content-Type", "").startswith("application/json"):
            return response
        code = _ERROR_CODES.get(response.status_code, "error")
        message = _ERROR_MESSAGES.get(response.status_code, response.reason_phrase)
        replacement = error(response.status_code, code, message)
        for header in ("Allow", "Retry-After"):
            if response.has_header(header):
                replacement[header] = response[header]
        allowed = replacement.get("Allow", "").split(", ")
        if "GET" in allowed and "HEAD" not in allowed:  # served as GET (ApiRouteMiddleware)
            replacement["Allow"] = ", ".join([*allowed, "HEAD"])
        return replacement


class StaticFilesMiddleware(WhiteNoiseMiddleware):
    """WhiteNoise, able to run in the async chain too: WhiteNoise's own middleware is
    sync-only, and Django would then hold a thread for the whole of every async view below
    it (an API long poll), one view at a time (docs/serving.md)."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]):
        with warnings.catch_warnings():
            # Before the first `collectstatic` there is no STATIC_ROOT; the finders
            # (WHITENOISE_USE_FINDERS) serve the apps' files meanwhile, so WhiteNoise's
            # "No directory at" is noise (every test server and a first `runserver` said it).
            warnings.filterwarnings("ignore", message="No directory at", category=UserWarning)
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
            static_file = await _on_dashboard_pool(self.find_file)(request.path_info)
        else:
            static_file = self.files.get(request.path_info)
        if static_file is not None:
            return self.serve(static_file, request)
        return await self.get_response(request)


class StorableInputMiddleware(_SyncAndAsync):
    """The pages' chain: a query-string or form value (or name) that cannot be stored (a NUL,
    a lone surrogate: governance/text.py) is refused with 400 before any view runs. Every
    form and filter would otherwise hand it to PostgreSQL, which refuses NUL in text, as a
    500; no valid input of a page contains one. (The API refuses them field by field, as
    422 naming the field, in its input models.)"""

    def __call__(self, request: HttpRequest) -> Any:
        if self.async_mode:
            return self.__acall__(request)
        return self.refused(request) or self.get_response(request)

    async def __acall__(self, request: HttpRequest) -> HttpResponse:
        return self.refused(request) or await self.get_response(request)

    @staticmethod
    def refused(request: HttpRequest) -> HttpResponse | None:
        # The path too: a view's free-text segment (an invitation's key) reached PostgreSQL
        # with a NUL as a 500 (found by an attacker: /accounts/reset/%00/abc/).
        problem = text_problem(request.path)
        if problem is not None:
            return HttpResponseBadRequest(f"The address {problem}: nothing was changed.",
                                          content_type="text/plain; charset=utf-8")
        sources = [request.GET]
        if request.method == "POST":
            sources.append(request.POST)
        for values in sources:
            for name, items in values.lists():
                for text in (name, *items):
                    problem = text_problem(text)
                    if problem is not None:
                        return HttpResponseBadRequest(
                            f"The field {name!r} {problem}: nothing was changed.",
                            content_type="text/plain; charset=utf-8")
        return None


class JsonApiErrorsMiddleware(_SyncAndAsync):
    """Under /api/: bodies over the limit get 413 before parsing; a failed authentication is
    counted per source and key, and past the limit its 401 becomes 429 (SPEC 10)."""

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
        # The body was read whole before the request was made (governance/asgi.py): the
        # size check does not block.
        refused = self.before_view(request)
        if refused is not None:
            return refused
        response = await self.get_response(request)
        if response.status_code != 401:
            return response
        # Counting a failure is a database write: on the API pool, never on the loop.
        return await api_thread(self.after_view)(request, response)

    @staticmethod
    def before_view(request: HttpRequest) -> HttpResponse | None:
        if request.method in {"POST", "PUT", "PATCH"}:
            if isinstance(request, WSGIRequest) and not request.META.get("CONTENT_LENGTH") \
                    and "chunked" in request.META.get("HTTP_TRANSFER_ENCODING", "").lower():
                # Django's WSGI request reads CONTENT_LENGTH bytes of the body, none without
                # it: a chunked body (which `manage.py serve`'s ASGI server decodes) would
                # reach the view empty and be refused as missing.
                return error(411, "length_required",
                             "This server (WSGI, as `make demo`'s) does not read a chunked "
                             "body: send the body with a Content-Length header.")
            limit = body_limit(request.path)
            try:
                # META, not request.headers: that mapping is built from every header on
                # first use, and a check never needs it (runs/check/api.py _serve_check).
                declared = int(request.META.get("CONTENT_LENGTH") or 0)
            except ValueError:
                declared = 0
            try:
                too_big = declared > limit or len(request.body) > limit
            except RequestDataTooBig:
                too_big = True
            if too_big:
                return too_large(limit)
            # NUL characters are refused by the schemas, field by field (runs/check/schemas.py):
            # an unknown field is ignored, whatever it holds.
        return None

    @staticmethod
    def after_view(request: HttpRequest, response: HttpResponse) -> HttpResponse:
        if response.status_code == 401:
            # Only here was the key checked and found wrong (missing, unknown, revoked): a
            # valid key never reaches this line, so it is never refused for a bucket.
            verdict = api_key_throttle.failed(source_of(request), presented_key(request))
            if verdict.refused:
                return too_many_failures(verdict)
        return response


@functools.cache
def _login_path() -> str:
    return resolve_url(settings.LOGIN_URL)


@functools.cache
def _password_change_path() -> str:
    return resolve_url("password_change")


def signed_in_name(raw: str) -> str:
    """A username as the sign-in form reads it (django.contrib.auth.forms.UsernameField:
    stripped, then NFKC): the throttle's credential. Counted as sent, " alice", a fullwidth
    "alice" and "alice" with a trailing em space were buckets of their own for one account,
    each a slow hash: password guessing went on past the limit, and 3 clients raised another
    team's check p99 4 to 10x (found by an attacker)."""
    return unicodedata.normalize("NFKC", raw.strip())


def _password_change_outcome(request: HttpRequest, response: HttpResponse) -> str | None:
    """What became of a password change's check of the old password: Django's form sends
    no signal. A redirect is its success; the form again with an error on the old password,
    a failure; anything else (a mismatch of the new ones) checked nothing that counts."""
    if request.path != _password_change_path():
        return None
    if response.status_code == 302:
        return "succeeded"
    form = (getattr(response, "context_data", None) or {}).get("form")
    return "failed" if form is not None and "old_password" in form.errors else None


# What `SignInThrottleMiddleware.attempt` counted: (source, username, the username bucket's
# window start, the address bucket's, the address's checks bucket's).
_Attempt = tuple[str, str, float | None, float | None, float | None]


class SignInThrottleMiddleware(_SyncAndAsync):
    """Sign-in attempts (and the password change's check of the old password), per source
    and username, and per source alone (SPEC 10): an attempt is counted in both buckets
    before the password is checked, so that no number of concurrent attempts gets past
    either limit. A (source, username) bucket over its limit is refused even with the right
    password (else guessing could go on), before any hashing; past the address's bound
    nobody is refused, but an unknown username fails without the equalising hash
    (governance/passwords.py). The auth framework's signals (policies/apps.py), or the
    password change's answer, say what became of the attempt: a failure keeps its counts; a
    success clears its username's bucket and gives its address's count back (one's own
    sign-in must not reset the address's bound: an attacker with an account would); anything
    else (a form without a password, a CSRF refusal) gives both back."""

    def __call__(self, request: HttpRequest) -> Any:
        if self.async_mode:
            return self.__acall__(request)
        if not self.is_sign_in(request):
            return self.get_response(request)
        refused, attempt = self.attempt(request)
        if refused is not None:
            return refused
        response = self.get_response(request)
        if attempt is not None:
            self.settle(request, attempt, response)
        return response

    async def __acall__(self, request: HttpRequest) -> HttpResponse:
        # The sign-in view is synchronous: an async view never needs the throttle, and a
        # sign-in reaching this chain counts on the dashboard's pool (database calls).
        if not self.is_sign_in(request):
            return await self.get_response(request)
        refused, attempt = await _on_dashboard_pool(self.attempt)(request)
        if refused is not None:
            return refused
        response = await self.get_response(request)
        if attempt is not None:
            await _on_dashboard_pool(self.settle)(request, attempt, response)
        return response

    @staticmethod
    def is_sign_in(request: HttpRequest) -> bool:
        # The password change checks the signed-in user's password too (found by an
        # attacker: wrong old passwords were never counted, each a slow hash).
        return request.method == "POST" and request.path in (_login_path(),
                                                             _password_change_path())

    @staticmethod
    def attempt(request: HttpRequest) -> tuple[HttpResponse | None, _Attempt | None]:
        """Count a sign-in attempt: (the 429 answer if a bucket is over its limit, what was
        counted); nothing is counted for a form without a username or password."""
        if request.path == _password_change_path():
            # The signed-in user's own bucket at this address: a wrong old password is a
            # failed sign-in of that account, as far as guessing goes.
            if not request.user.is_authenticated or not request.POST.get("old_password"):
                return None, None
            source, username = source_of(request), request.user.get_username()
            verdict, window_start = sign_in_throttle.attempt(source, username)
            if verdict.refused:
                return _sign_in_refused(request, verdict), None
            # The old password is checked whatever becomes of the new ones (a mismatch of
            # them was a hash never counted): never given back.
            sign_in_checks_throttle.attempt(source, ANY_USERNAME)
            return None, (source, username, window_start, None, None)
        username = signed_in_name(request.POST.get("username") or "")
        if not username or not request.POST.get("password"):
            return None, None  # no credential to check: nothing to count
        source = source_of(request)
        verdict, address_window = sign_in_address_throttle.attempt(source, ANY_USERNAME)
        if verdict.refused:
            # Never refused by source alone (SPEC 10): past the address's bound an unknown
            # username fails without the equalising hash (governance/passwords.py).
            setattr(request, SPARE_UNKNOWN_HASH, True)
        verdict, window_start = sign_in_throttle.attempt(source, username)
        if verdict.refused:
            if address_window is not None:  # no password was checked: not the address's
                sign_in_address_throttle.give_back(source, ANY_USERNAME, address_window)
            return _sign_in_refused(request, verdict), None
        _, checks_window = sign_in_checks_throttle.attempt(source, ANY_USERNAME)
        return None, (source, username, window_start, address_window, checks_window)

    @staticmethod
    def settle(request: HttpRequest, attempt: _Attempt, response: HttpResponse) -> None:
        source, username, window_start, address_window, checks_window = attempt
        outcome = getattr(request, SIGN_IN_OUTCOME, None) or _password_change_outcome(
            request, response)
        if outcome == "succeeded":
            sign_in_throttle.succeeded(source, username)
        elif outcome != "failed" and window_start is not None:
            sign_in_throttle.give_back(source, username, window_start)
        if outcome != "failed" and address_window is not None:
            sign_in_address_throttle.give_back(source, ANY_USERNAME, address_window)
        if outcome is None and checks_window is not None:  # no password was checked
            sign_in_checks_throttle.give_back(source, ANY_USERNAME, checks_window)


def sign_in_past_address_bound(request: HttpRequest) -> str | None:
    """The client address of a sign-in (or password change) sent from an address this process
    saw go past ``THROTTLE_SIGN_IN_FAILURES_PER_ADDRESS`` failures, or
    ``THROTTLE_SIGN_IN_CHECKS_PER_ADDRESS`` passwords checked, in a window not yet ended; else
    None. No query: such sign-ins are paced before they reach a thread (governance/asgi.py
    `Application.page`), since past the bound each one naming a real account still costs a
    password hash (found by an attacker: usernames a team admin made, 10 failures a window
    each, were 800 hashes a minute from one address; and right passwords, never counted as
    failures, any number)."""
    if not SignInThrottleMiddleware.is_sign_in(request):
        return None
    source = source_of(request)
    past = (sign_in_address_throttle.over(source, ANY_USERNAME)
            or sign_in_checks_throttle.over(source, ANY_USERNAME))
    return counted_source(source) if past else None


def _sign_in_refused(request: HttpRequest, verdict: Verdict) -> HttpResponse:
    response = render(request, "429.html", {"wait": verdict.retry_after}, status=429)
    response["Retry-After"] = str(verdict.retry_after)
    return response


class ReadDeadlineMiddleware(_SyncAndAsync):
    """A page's reads (GET and HEAD, on the dashboard's pool) within
    ``DASHBOARD_STATEMENT_TIMEOUT_MS`` on PostgreSQL (governance/deadlines.py); a page whose
    read PostgreSQL cancelled answers a 503 page that says so, never a 500. Forms (POST) are
    writes: an engage or a policy save is never cut short. Pages have no async views (the
    async chain serves the API's long polls): that chain passes through."""

    def __call__(self, request: HttpRequest) -> Any:
        if (self.async_mode or request.method not in ("GET", "HEAD")
                or pool_name(request.path) != "dashboard"):  # /readyz: the API's pool
            return self.get_response(request)
        with read_deadline():
            return self.get_response(request)

    @staticmethod
    def process_exception(request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if not isinstance(exception, DatabaseError) or not timed_out(exception):
            return None
        log.warning("%s %s: a read took longer than %s ms and was cancelled", request.method,
                    request.path, settings.DASHBOARD_STATEMENT_TIMEOUT_MS)
        response = render(request, "503_slow.html",
                          {"seconds": settings.DASHBOARD_STATEMENT_TIMEOUT_MS / 1000},
                          status=503)
        response["Retry-After"] = "10"
        return response


class SecurityHeadersMiddleware(_SyncAndAsync):
    """A Content-Security-Policy with no inline scripts: every script is a static file. And
    no page a signed-in person sees is kept by a browser or proxy cache (a new key's token,
    the audit log): ``Cache-Control: no-store`` on every authenticated dashboard answer."""

    def __call__(self, request: HttpRequest) -> Any:
        if self.async_mode:
            return self.__acall__(request)
        return self.headers(request, self.get_response(request))

    async def __acall__(self, request: HttpRequest) -> HttpResponse:
        response = await self.get_response(request)
        if request.path.startswith("/api/"):
            return self.headers(request, response)  # no user to look up
        # Whether someone is signed in may take a session read: not on the event loop.
        return await _on_dashboard_pool(self.headers)(request, response)

    @staticmethod
    def headers(request: HttpRequest, response: HttpResponse) -> HttpResponse:
        user = getattr(request, "user", None)
        if (not request.path.startswith("/api/") and user is not None
                and user.is_authenticated):
            if response.has_header("Cache-Control"):
                patch_cache_control(response, no_store=True, private=True)
            else:
                add_never_cache_headers(response)  # no-store, private, max-age=0 ...
        response.setdefault("Content-Security-Policy", settings.CONTENT_SECURITY_POLICY)
        response.setdefault("Referrer-Policy", "same-origin")
        response.setdefault("Permissions-Policy", "camera=(), microphone=(), geolocation=()")
        return response
