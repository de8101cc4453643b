"""The ASGI application `manage.py serve` runs (docs/serving.md).

What it guarantees, by construction rather than by sizing:

- A request takes no thread before its whole body has arrived: the body is read here, on the
  event loop, within ``REQUEST_BODY_SECONDS`` (a total deadline, so a body sent a byte a
  second is cut off) and at most its size limit; a late body is answered 408 and a large one
  413 without a thread ever being involved. (Headers that never finish stay in granian's Rust
  code until its header read timeout: Python never sees them.)
- Then the request's synchronous part (Django's middleware and view) runs on one of two
  bounded thread pools (governance/pools.py): `/api/` and the health endpoints on the API's,
  everything else on the dashboard's. Dashboard traffic cannot take or queue behind the
  API's threads. Each pool thread keeps a persistent database connection, as under WSGI, and
  a request costs one hand-off to its pool and back.
- A live stream's view returns an async iterator (runs/dashboard/stream.py): once its headers
  are sent, it waits on the event loop and holds no thread.
- An ``async def`` view (an API long poll) runs on the event loop through Django's async
  middleware chain; its database work goes to the API pool (`governance.pools.api_thread`).

Chunked request bodies (``Transfer-Encoding: chunked``) are decoded by the server and read
here like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import hashlib
import io
import logging
import math
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "governance.settings")
django.setup(set_prefix=False)

from asgiref.sync import iscoroutinefunction  # noqa: E402
from django.conf import settings  # noqa: E402
from django.core.handlers.asgi import ASGIHandler, ASGIRequest  # noqa: E402
from django.core.handlers.base import BaseHandler  # noqa: E402
from django.http import HttpResponse, HttpResponseBase  # noqa: E402
from django.urls import ResolverMatch, URLPattern, URLResolver, get_resolver  # noqa: E402
from django.urls.exceptions import Resolver404  # noqa: E402

from runs import telemetry  # noqa: E402
from runs.check import edge  # noqa: E402
from runs.check.callers import (  # noqa: E402
    caller_of,
    forget_operator,
    operator_known,
    remember_operator,
)
from runs.check.lineages import turn_run  # noqa: E402

from . import connections, pools  # noqa: E402
from .handlers import Answer, ResolvedOnce, TextCharsetASGIRequest  # noqa: E402
from .pacing import AddressPacing  # noqa: E402
from .pools import pool_name  # noqa: E402
from .shares import TimeShare  # noqa: E402
from .sources import client_address, counted_source, source_of  # noqa: E402

if TYPE_CHECKING:
    from .direct import DirectApi

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

class BodyTooLarge(Exception):
    pass


class ClientGone(Exception):
    pass


class BodyTooFragmented(Exception):
    pass


# A body's pieces (one ASGI message each: granian hands over every chunk of a chunked body,
# and every read of a body trickled in small TCP segments, as a message of its own) cost the
# event loop about 30 us each whatever their size, so their number, not only the body's
# bytes, bounds the work of reading it (SPEC 10, bounded work per request). A body sent in
# chunks of one byte made each 64 KiB check 1.5 s of CPU, and a 1 MiB upload (or a page's
# form) kept a core busy for the whole REQUEST_BODY_SECONDS, with no key at all: three such
# connections made another team's checks take up to 3 s (found by an attacker). Any number
# of pieces is read up to BODY_PIECES_FREE; past that, a body must average at least
# BODY_BYTES_PER_PIECE a piece, far below what any HTTP client or network delivers.
BODY_PIECES_FREE = 256
BODY_BYTES_PER_PIECE = 1024


def body_limit(path: str) -> int:
    """The most a body may be, by route: the API's own limit (runs/check/edge.py), and for
    the dashboard Django's upload limit plus room for a policy file upload."""
    if path.startswith("/api/"):
        return edge.body_limit(path)
    return settings.DATA_UPLOAD_MAX_MEMORY_SIZE + settings.FILE_UPLOAD_MAX_MEMORY_SIZE


async def read_body(receive: Receive, limit: int) -> bytes:
    """The whole request body, refusing it past `limit` bytes without reading further."""
    parts: list[bytes] = []
    size = 0
    pieces = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        pieces += 1
        if pieces > BODY_PIECES_FREE and pieces * BODY_BYTES_PER_PIECE > size:
            raise BodyTooFragmented
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge
            parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


# The pools every team shares, with the settings naming a credential's share of its threads,
# a client address's calls and the pool's share of the process's time (None: not paced), and
# what its calls are in a refusal (`shared_request`).
SHARED_POOLS = {
    "operator": ("OPERATOR_THREADS_PER_CREDENTIAL", "OPERATOR_CALLS_PER_ADDRESS",
                 "OPERATOR_SHARE", "operator API requests"),
    "killswitch": ("OPERATOR_THREADS_PER_CREDENTIAL", "OPERATOR_CALLS_PER_ADDRESS",
                   None, "operator API requests"),
    "agent-bulk": ("AGENT_BULK_THREADS_PER_CREDENTIAL", "AGENT_BULK_CALLS_PER_ADDRESS",
                   "AGENT_BULK_SHARE",
                   "bulk requests (a run's decisions, local decisions, the runs list)"),
}
# A paced pool's call waits its turn at most this long; past it, 429 with the wait as its
# Retry-After (the client retries), so waiting calls never pile up behind a long debt.
SHARE_MOST_WAIT_S = 10.0
# What a quiet caller may spend at once on a paced pool before its calls start to wait.
SHARE_BURST_S = 0.25
# Callers whose paced turns a process keeps at most (beyond it, those owing nothing go).
PACED_CALLERS_MAX = 10_000


class RunTurns:
    """One check of a run at a time on this process's API pool; the others of the same run
    wait their turn on the event loop, holding no thread. A run's checks take its lock one
    after the other anyway: waiting for it on pool threads only took them from every other
    run (found by an attacker: 32 concurrent checks of one run, behind an upload holding it,
    held every API thread, and another team's checks waited 0.3 to 5 s). The wait for the
    turn holds nothing but the request, so it is not cut short: a check whose agent gave up
    meanwhile is audited expired when its turn comes (README "Deadlines"), and the wait for
    the run's lock in PostgreSQL, on a thread, is bounded (CHECK_LOCK_WAIT_MS). Only the
    event loop reads and writes it."""

    def __init__(self) -> None:
        self._turns: dict[str, tuple[asyncio.Lock, int]] = {}  # by credential and run

    @contextlib.asynccontextmanager
    async def turn(self, whose: tuple[str, Any]) -> AsyncIterator[None]:
        """The turn of a check of run ``whose[1]`` sent with credential ``whose[0]``."""
        key = f"{whose[0]}:{str(whose[1]).lower()}"
        lock, waiting = self._turns.get(key) or (asyncio.Lock(), 0)
        self._turns[key] = (lock, waiting + 1)
        try:
            async with lock:
                yield
        finally:
            lock, waiting = self._turns[key]
            if waiting > 1:
                self._turns[key] = (lock, waiting - 1)
            else:
                del self._turns[key]


def _credential(scope: Scope) -> str:
    """Who a request is from, before it is authenticated (a shared pool's caller, a check's
    turn on its run): its bearer token's
    digest, the token as the authentication reads it (any case of "Bearer", spaces around),
    so that one token is one caller however its header is spelled; else no credential."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            if scheme.lower() == "bearer":
                return "token:" + hashlib.sha256(token.strip().encode("latin-1")).hexdigest()
            return "header:" + hashlib.sha256(value).hexdigest()
    return "token:"


# The health endpoints: answered to anyone, whatever the credential (governance/middleware.py
# ProbeMiddleware).
PROBES = frozenset({"/healthz", "/readyz"})
# A cheap answer's longest wait for its address's turn (governance/pacing.py).
CHEAP_MOST_WAIT_S = 10.0


def _cheap(scope: Scope, status: int) -> bool:
    """Whether an answer is one whose sending is paced by its client address
    (governance/pacing.py), being no valid key's work: a health probe's; under /api/, a
    failed authentication's (401), a 404 (an unknown route or run, before or after the key
    was checked), any answer to a call with no credential at all, and a 429 to a credential
    this process does not know as a live key or token (the failed-key throttle's
    ``too_many_failures``, a shared pool's refusal of bogus tokens). A known key's refusal (a
    shared pool's cap, too many waiting polls) and every answer of a key's work (a check, its
    422, its 503) are never paced."""
    path = scope["path"]
    if path in PROBES:
        return True
    if not path.startswith("/api/"):
        return False
    if status in (401, 404):
        return True
    if not any(name == b"authorization" for name, _ in scope.get("headers", ())):
        return True
    if status != 429:
        return False
    credential = _credential(scope)
    return not (caller_of(credential).startswith("team:") or operator_known(credential, "")
                or operator_known(credential, _operator_team(path)))


def _client(scope: Scope) -> str:
    """The request's client address as the failed-key throttle counts it (governance/
    sources.py: X-Forwarded-For only from TRUSTED_PROXIES; an IPv6 client by its /64)."""
    client = scope.get("client")
    forwarded = b",".join(value for name, value in scope.get("headers", ())
                          if name == b"x-forwarded-for")
    return counted_source(client_address(str(client[0]) if client else "unknown",
                                         forwarded.decode("latin-1")))


# An operator API call's team, from its path (SPEC 17: /api/v1/teams/{slug}/...).
_OPERATOR_TEAM = re.compile(r"/api/v1/teams/([^/]+)/")


# A dashboard page's team, from its path (/teams/{slug}/...).
_PAGE_TEAM = re.compile(r"/teams/([^/]+)/")
# A live stream's opening (runs/*/urls.py: `.../stream`, a team's `live`): never paced as a
# page, since its looks at the database are, on the look lane (runs/live/looks.py), and a
# browser opens several at once on every page and again at each stream's end.
_STREAM = re.compile(r"/teams/[^/]+/(.+/)?(stream|live)")


def _operator_team(path: str) -> str:
    """The slug an operator call's path names ("" for none: the teams list, a decision)."""
    named = _OPERATOR_TEAM.match(path)
    return named[1].lower() if named else ""


def _paced_caller(pool: str, path: str, credential: str) -> str:
    """Whose turn and time a paced call is (`Application.pace_of`). An agent's bulk call:
    its key's team once this process knows it (runs/check/callers.py); every credential not
    known yet (a key's first call in this process, a wrong one) is one caller together, so
    that neither many new keys nor many wrong ones get a turn each (found measuring it: four
    new keys' first reads of 60 MB, one per key and process, made the attack 2.5 to 3x
    again). An operator call: the team its path names (a token may serve many teams, and a
    team's viewers many tokens: found by an attacker, 16 viewer tokens reading a run's
    1,000 decisions of 55 MB over and over from 16 addresses made another team's check p99
    10 to 50x), once its token was found to see that team in this process; a call that
    names none (the teams list, an approval's decision) is its live token's; every other call
    is one caller together, as for the bulk calls (found by an attacker after it: bogus
    tokens naming a team made that team's own calls wait 8 s, and a new slug on each call
    was a new share each, never paced)."""
    if pool == "operator":
        team = _operator_team(path)
        if not operator_known(credential, team):
            return "operator: not known yet"
        return f"slug:{team}" if team else credential
    caller = caller_of(credential)
    return caller if caller.startswith("team:") else "not known yet"


async def _looked_up(executor: Any, look: Callable[[str, str], bool], credential: str,
                     team: str) -> bool:
    """Whether ``look`` (a pacing lookup: `sees_team`, `session_sees_team`) finds that the
    credential is the team's, on the pool's thread. A store that fails it says no: the call
    is then paced as not known, and its view meets the failure and answers it as always (an
    error escaping here would be the server's 500)."""
    try:
        return await asyncio.get_running_loop().run_in_executor(
            executor, pools.run_request, look, credential, team)
    except Exception as exc:  # any store's error: not known, as said above
        log.info("a pacing lookup failed: %r", exc)
        return False


def _refusal_page(template: str, wait: float) -> HttpResponse:
    """A page's 429 made before the request reaches Django's middleware (a paced page or
    sign-in), with the headers the middleware gives every page (found by an attacker: the
    paced sign-in's 429 had no Content-Security-Policy, framing or caching rule)."""
    from django.template.loader import render_to_string

    seconds = str(math.ceil(wait))
    refused = HttpResponse(render_to_string(template, {"wait": seconds}), status=429)
    refused["Retry-After"] = seconds
    refused["Cache-Control"] = "no-store"
    refused["Content-Security-Policy"] = settings.CONTENT_SECURITY_POLICY
    refused["X-Frame-Options"] = "DENY"
    refused["X-Content-Type-Options"] = "nosniff"
    refused["Referrer-Policy"] = "same-origin"
    return refused


@functools.cache
def _sign_ins_throttled() -> bool:
    """Whether this application throttles sign-ins (the benchmark's minimal one serves this
    module with no middleware and none of the models the throttle reads: its POSTs failed
    importing them)."""
    return "governance.middleware.SignInThrottleMiddleware" in settings.MIDDLEWARE


def _past_sign_in_bound(request: ASGIRequest) -> str | None:
    """`sign_in_past_address_bound`, imported once the apps are ready; None where sign-ins
    are not throttled."""
    if not _sign_ins_throttled():
        return None
    from .middleware import sign_in_past_address_bound

    return sign_in_past_address_bound(request)


def _declared_length(scope: Scope) -> int:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


def _has_async_views(patterns: list[Any]) -> bool:
    for entry in patterns:
        if isinstance(entry, URLResolver):
            if _has_async_views(entry.url_patterns):
                return True
        elif isinstance(entry, URLPattern) and _is_async(entry.callback):
            return True
    return False


@functools.lru_cache(maxsize=4096)
def _resolved(resolver: URLResolver, path: str) -> ResolverMatch | None:
    """The URL match of ``path``, None for no match. Cached: an agent checks the same run's
    URL at every step, and the resolution, on the event loop every request shares, was 3% of
    a check's Python under load (docs/performance.md "Python cuts of issue 17, measured"). Keyed
    by the resolver too, which Django makes anew when the URLconf changes (tests that
    override it). A match is only read: Django passes copies of its arguments to the view."""
    try:
        return resolver.resolve(path)
    except Resolver404:
        return None


def _is_async(view: Any) -> bool:
    # django-ninja marks the path view of an async operation with `is_async`.
    return iscoroutinefunction(view) or bool(getattr(view, "is_async", False))


class SyncHandler(ResolvedOnce, BaseHandler):
    """Django's synchronous middleware chain, as WSGI runs it, called on a pool thread."""

    def __init__(self) -> None:
        super().__init__()
        self.load_middleware(is_async=False)


class Application(ResolvedOnce, ASGIHandler):
    """See the module docstring. `ASGIHandler` gives the async middleware chain (for async
    views), the request class and the response encoding."""

    # Django's, but a declared charset that decodes no text is ignored (governance/handlers.py).
    request_class = TextCharsetASGIRequest

    def __init__(self) -> None:
        super().__init__()
        self.sync_handler = SyncHandler()
        self.any_async_view = _has_async_views(get_resolver().url_patterns)
        # Requests in progress in this process on the shared pools (operator, kill switch,
        # agents' bulk calls), by pool and credential or address (the event loop alone reads
        # and writes it).
        self.held: dict[str, int] = {}
        # The paced shared pools' turns and time, by pool and caller (`pace_of`).
        self.shares: dict[str, tuple[asyncio.Lock, TimeShare]] = {}
        self.run_turns = RunTurns()
        # The cheap answers' turns, by client address (`paced_send`).
        self.cheap = AddressPacing(settings.CHEAP_ANSWERS_PER_ADDRESS,
                                   2 * settings.CHEAP_ANSWERS_PER_ADDRESS, CHEAP_MOST_WAIT_S)
        # Loading the URLconf (above) registered the API's direct views, if it has the API.
        self.direct: DirectApi | None = None
        if edge.direct_views:
            from .direct import DirectApi

            self.direct = DirectApi()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.lifespan(receive, send)
            return
        if scope["type"] != "http":  # websockets are off (--no-ws)
            return
        # While its request is here, a connection is never taken for an idle one
        # (governance/connections.py).
        client = scope.get("client")
        peer = (client[0], client[1]) if client else None
        if peer is not None:
            connections.in_flight.add(peer)
        try:
            await self.handle(scope, receive, self.paced_send(scope, send))
        finally:
            if peer is not None:
                connections.in_flight.discard(peer)

    def paced_send(self, scope: Scope, send: Send) -> Send:
        """``send``, but a cheap answer (`_cheap`) starts only once its client address's turn
        has come (governance/pacing.py): the wait is on the event loop, after the answer was
        made, so it holds no thread, and the client's next request on the connection comes
        that much later (found by an attacker: one address's random bad keys on 8 kept-alive
        connections, 450 to 630 a second, made another team's check p99 10 to 40x). Every
        answer goes through here, whichever path made it (Django's handler, the direct check,
        a refusal before Django)."""

        async def paced(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and _cheap(scope, message["status"]):
                wait = self.cheap.wait_s(_client(scope))
                if wait:
                    await asyncio.sleep(wait)
            await send(message)

        return paced

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        limit = body_limit(path)
        if _declared_length(scope) > limit:
            await self.refuse(send, path, 413)
            return
        try:
            # A deadline on this task, not a task of its own (`asyncio.wait_for` made one per
            # request: measured in docs/performance.md "The ladder").
            async with asyncio.timeout(settings.REQUEST_BODY_SECONDS):
                body = await read_body(receive, limit)
        except BodyTooLarge:
            await self.refuse(send, path, 413)
            return
        except BodyTooFragmented:
            await self.refuse(send, path, 400, (
                f"The request body came in too many pieces (over {BODY_PIECES_FREE:,}, "
                f"under {BODY_BYTES_PER_PIECE:,} bytes each on average): send it in "
                f"fewer, larger chunks."))
            return
        except TimeoutError:
            await self.refuse(send, path, 408)
            return
        except ClientGone:
            # granian reports a malformed chunked body as the client's disconnect too (a
            # chunk size that is not hexadecimal): answered 400, where returning without an
            # answer made granian's own 500 (found by an attacker). A client that really
            # went hears nothing, as before.
            with contextlib.suppress(Exception):
                await self.refuse(send, path, 400, "The request body could not be read: its "
                                                   "chunked framing is malformed.")
            return
        # Django's own request making: a path that is not UTF-8 is a 400, not an error.
        request, refused = self.create_request(scope, io.BytesIO(body))
        if request is None:
            await self.send_response(refused, send)
            return
        loop = asyncio.get_running_loop()
        view = self.direct_view(request)
        if view is None and self.any_async_view and self.resolves_to_async_view(request):
            executor = pools.pool("api")
            response = await self.serve(receive, send, self.get_response_async(request))
        else:
            # The method as Django serves it (upper-cased), not as the request line spelt it.
            name = pool_name(path, request.method)
            executor = pools.pool(name)
            if name in SHARED_POOLS:
                await self.shared_request(scope, receive, send, request, name, executor)
                return
            if view is not None:
                # The check: on the same pool with the same housekeeping, without Django's
                # handler (governance/direct.py); one of a run's checks at a time on the pool.
                assert request.resolver_match is not None
                # The turn is the key's on the run: another key's checks (another team's,
                # one that guessed the run's id) never queue in front of the run's own. A
                # child run's check takes its tree's root's turn: it locks the root first.
                run_id = str(request.resolver_match.kwargs.get("run_id"))
                credential = _credential(scope)
                async with self.run_turns.turn((credential, turn_run(run_id))):
                    made = await self.check_in_share(name, caller_of(credential),
                                                     functools.partial(self.respond_direct,
                                                                       request, view))
                if isinstance(made, Answer):
                    await self.send_answer(made, send)
                    return
            elif name == "api":
                # No caller holds every API thread (pools.FairPool).
                made = await asyncio.wrap_future(pools.fair(name).submit(
                    caller_of(_credential(scope)), functools.partial(self.respond_sync, request)))
            elif name == "dashboard":
                made = await self.page(request, executor)
            else:
                made = await loop.run_in_executor(executor, self.respond_sync, request)
            if not made.streaming:
                # Whole, and closed on its thread already (respond_sync): nothing is left
                # to stop if the client goes away, so no race with a disconnect listener
                # (two tasks per request: docs/performance.md).
                await self.send_whole(made, send)
                return
            response = await self.serve(receive, send, _ready(made))
        if response is not None:
            # Django's request_finished (connection housekeeping) belongs on a thread of the
            # pool that used the connection.
            await loop.run_in_executor(executor, response.close)

    async def shared_request(self, scope: Scope, receive: Receive, send: Send,
                             request: ASGIRequest, pool: str, executor: Any) -> None:
        """A call on a pool every team shares: the operator API (SPEC 17) on the operator or
        kill switch pool, an agent's bulk call on the agents' bulk pool. One credential may
        hold a share of the pool's threads at once, and one client address a number of calls
        (running or queued), so neither one token or key nor many (a viewer may make many
        tokens, and an invalid one is a caller too until its 401) from one client can take
        a pool (found by attackers: one viewer's 64 concurrent heavy reads queued every
        other team's operator calls for seconds; one team's agent key did the same to the
        bulk calls). Past either, 429 at once, before any thread or query. Each pool counts
        apart: a token's slow read never makes its own kill switch wait or refused."""
        credential = _credential(scope)
        held: tuple[str, ...] = (f"{pool}:{credential}", f"{pool}:address:{source_of(request)}")
        per_credential, per_address, share, calls = SHARED_POOLS[pool]
        limits = (getattr(settings, per_credential), getattr(settings, per_address))
        if pool == "agent-bulk" and pools.paced_only(request.path):
            held = ()  # one run's or one decision's read: paced below, never refused here
        if any(self.held.get(key, 0) >= limit for key, limit in zip(held, limits,
                                                                   strict=False)):
            refused = edge.error(
                429, "too_many_requests",
                f"This credential or this client already has as many {calls} in progress on "
                "this server process as it may: wait for an answer before sending the next.")
            refused["Retry-After"] = "1"
            await self.send_response(refused, send)
            return
        for key in held:
            self.held[key] = self.held.get(key, 0) + 1
        try:
            if share is None:
                made = await asyncio.get_running_loop().run_in_executor(
                    executor, self.respond_sync, request)
            else:
                if pool == "operator":
                    await self.learn_operator(request, credential, executor)
                caller = _paced_caller(pool, request.path, credential)
                paced = await self.paced(request, executor, pool, caller,
                                         getattr(settings, share))
                if caller.startswith("slug:") and getattr(request, "role", None) is None:
                    # A token found to see the team, whose call did not find it so (revoked,
                    # expired, its owner removed; or refused before its view ran) is looked
                    # up again at its next call, as a page's session is (`page`): remembered
                    # for good, a revoked token's calls were paced as the team's and the
                    # team's own waited behind them (found by an attacker: a median of 12 ms
                    # became 830 ms).
                    forget_operator(credential, caller[len("slug:"):])
                if isinstance(paced, float):
                    refused = edge.error(
                        429, "too_many_requests",
                        f"Your team's {calls} have used their share of this server "
                        "process's time: try again in the Retry-After header's seconds.")
                    refused["Retry-After"] = str(math.ceil(paced))
                    await self.send_response(refused, send)
                    return
                made, took = paced
                # A key found right by this call is its team's from now on, and its team owes
                # what the call took too.
                if (payer := _paced_caller(pool, request.path, credential)) != caller:
                    self.pace_of(pool, payer)[1].spend(took)
        finally:
            for key in held:
                left = self.held.pop(key) - 1
                if left:
                    self.held[key] = left
        if made.streaming:  # no operator API answer streams; served as any other would be
            response = await self.serve(receive, send, _ready(made))
            if response is not None:
                await asyncio.get_running_loop().run_in_executor(executor, response.close)
            return
        await self.send_whole(made, send)

    async def check_in_share(self, pool: str, caller: str, job: Callable[[], Any]) -> Any:
        """A check on its pool's threads (`pools.FairPool`); a caller whose checks are heavy
        (`FairPool.heavy`: each takes more than a few ms of CPU, such as 60 KiB of small JSON
        values to walk) waits on the event loop, holding no thread, until what its last ones
        took is paid back at `WEB_HEAVY_CHECKS_SHARE` of the process's time (governance/shares.py).
        A thread apiece was not enough: a team's heavy checks on one thread per process
        still took the cores and the interpreter's lock from another team's (found by an
        attacker: p99 7 to 40x, SPEC 10). Such a check is delayed, never refused; a light
        caller's checks are not paced at all."""
        fair = pools.fair(pool)
        bucket: TimeShare | None = None
        begun: float | None = None
        if fair.heavy(caller):
            _, bucket = self.pace_of("heavy-checks", caller)
            while (wait := bucket.wait_s(settings.HEAVY_CHECKS_SHARE)) > 0:
                await asyncio.sleep(wait)
            begun = bucket.begin()
        future = fair.submit(caller, job)
        try:
            return await asyncio.wrap_future(future)
        finally:
            if bucket is not None:
                bucket.spend(getattr(future, "cpu_s", 0.0), begun)

    async def paced(self, request: ASGIRequest, executor: Any, pool: str, caller: str,
                    share: float) -> tuple[HttpResponseBase, float] | float:
        """`respond_timed` on `executor` in `caller`'s turn, once what its last calls took is
        paid back at `share` of the process's time (`pace_of`); or, without serving it, the
        wait, when it would end more than SHARE_MOST_WAIT_S after the call came, the time
        waiting for the turn included (the caller answers 429 with it)."""
        turns, bucket = self.pace_of(pool, caller)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SHARE_MOST_WAIT_S
        # The wait for the turn counts too: many calls of one caller queued for it waited
        # far past SHARE_MOST_WAIT_S and were never refused (found by an attacker: 150 of a
        # team's pages at once, the last served after 12.9 s).
        try:
            async with asyncio.timeout(SHARE_MOST_WAIT_S):
                await turns.acquire()
        except TimeoutError:
            return SHARE_MOST_WAIT_S
        holding = True
        try:
            wait = bucket.wait_s(share)
            if wait > deadline - loop.time():
                return max(wait, 1.0)
            if wait:
                await asyncio.sleep(wait)
            # The turn ends as the call starts, once the call's cost can be expected (the
            # caller's first call keeps it to its end: governance/shares.py).
            if (begun := bucket.begin()) is not None:
                turns.release()
                holding = False
            made, took = await loop.run_in_executor(executor, self.respond_timed, request)
            bucket.spend(took, begun)
            return made, took
        finally:
            if holding:
                turns.release()

    async def page(self, request: ASGIRequest, executor: Any) -> HttpResponseBase:
        """A dashboard page or form on the dashboard's pool. A team's (its path names it),
        asked for by a session signed in as the team's member, is paced with the team's
        operator API calls: together they take at most ``OPERATOR_SHARE`` of the process's
        time, however many people, sessions and addresses ask (found by an attacker: one
        team's viewers looping the audit page of 50 policy diffs raised another team's
        check p99 from 10 to 235 ms). Past ``SHARE_MOST_WAIT_S`` of waiting, a 429 page
        with the wait. A session this process does not know yet for the team is looked up
        first (`session_sees_team`: served unpaced until its view had looked, a new
        session's first pages all started at once, found measuring it). Any other page (no
        team, no session, an outsider's 403: as cheap as that look) is served at once, as
        is a live stream's opening (`_STREAM`)."""
        loop = asyncio.get_running_loop()
        if request.method == "POST" and (address := _past_sign_in_bound(request)):
            return await self.sign_in_paced(request, executor, address)
        named = _PAGE_TEAM.match(request.path)
        cookie = request.COOKIES.get(settings.SESSION_COOKIE_NAME)
        if named is None or not cookie or _STREAM.fullmatch(request.path):
            return await loop.run_in_executor(executor, self.respond_sync, request)
        team = named[1]  # as the page looks it up: exactly (`team_view`)
        session = "session:" + hashlib.sha256(cookie.encode(errors="replace")).hexdigest()
        if not operator_known(session, team):
            from policies.access import session_sees_team  # the apps' models: once ready

            if not await _looked_up(executor, session_sees_team, cookie, team):
                return await loop.run_in_executor(executor, self.respond_sync, request)
            remember_operator(session, team)
        caller = f"slug:{team}"  # the team's operator calls' caller (`_paced_caller`)
        paced = await self.paced(request, executor, "operator", caller,
                                 settings.OPERATOR_SHARE)
        # A session whose page found no member's role (signed out, removed; or refused,
        # its view never ran) is looked up again at its next page: remembered for good, a
        # removed member's old cookie was charged to the team and queued its people's
        # pages behind cheap 403s (found by an attacker: a member's page 3.6 s).
        if getattr(request, "role", None) is None:
            forget_operator(session, team)
        if isinstance(paced, float):
            return _refusal_page("429_share.html", paced)
        return paced[0]

    async def sign_in_paced(self, request: ASGIRequest, executor: Any,
                            address: str) -> HttpResponseBase:
        """A sign-in from an address past its bound (of failures, or of passwords checked),
        paced in that address's share of the process's time (``SIGN_IN_SHARE``): past the
        failures' bound an unknown username costs no hash, but each real account's still
        does, limited only by its own (address, username) bucket, so an address naming many
        accounts (a team admin can make them) cost about 800 hashes a minute, 0.46 s of CPU
        each in production; a right password, never a failure, any number. Waiting holds no
        thread; past ``SHARE_MOST_WAIT_S`` of it, the sign-in page's 429 with the wait. Any
        other address's sign-ins are never paced (docs/reliability.md)."""
        paced = await self.paced(request, executor, "sign-in", f"address:{address}",
                                 settings.SIGN_IN_SHARE)
        if isinstance(paced, float):
            return _refusal_page("429.html", paced)
        return paced[0]

    async def learn_operator(self, request: ASGIRequest, credential: str,
                             executor: Any) -> None:
        """Before an operator call of a token this process does not know for the team its
        path names (or, naming none, at all): whether the token is live and sees that team
        (one lookup on the pool's thread), so that its first call is paced as its team's,
        not with every call not known yet (which bogus tokens may keep busy: found by an
        attacker)."""
        team = _operator_team(request.path)
        if operator_known(credential, team):
            return
        from policies.tokens import sees_team  # the apps' models: after they are ready

        secret = (edge.bearer_token(request.META.get("HTTP_AUTHORIZATION")) or "").strip()
        if await _looked_up(executor, sees_team, secret, team):
            remember_operator(credential, team)

    def pace_of(self, pool: str, caller: str) -> tuple[asyncio.Lock, TimeShare]:
        """A paced pool's turns and time for ``caller`` (its team once known, runs/check/
        callers.py), made on first use: the caller's calls wait their turn (holding the
        lock) one after the other, until what its last ones
        took is paid back at the pool's share of the process's time (governance/shares.py),
        then run (the turn ends as the call starts: calls run one at a time spread a team's
        reads over more of the others' checks, p99 2.4 to 3.6x against 1.6 to 2.2x; but a
        call owes what its caller's last one took as it starts, so queued calls do not all
        start together once the debt is paid: docs/performance.md, `heavy_reads`). So one
        team's heavy reads, however many keys and addresses send them, leave the checks
        their CPU (found by an attacker: four keys reading a run's 1,000 decisions of 60 KB
        over and over made another team's check p99 12x), and cost the other teams' bulk
        calls nothing but the threads: a bucket the whole process shared made every team
        repay one team's reads (found by an attacker after it: another team's runs list
        refused for 25 s)."""
        key = f"{pool}:{caller}"
        if key not in self.shares:
            if len(self.shares) >= PACED_CALLERS_MAX:
                # Forget the callers that owe nothing and wait for nothing.
                self.shares = {k: (turns, bucket) for k, (turns, bucket) in self.shares.items()
                               if turns.locked() or bucket.wait_s(1.0) > 0}
            self.shares[key] = (asyncio.Lock(), TimeShare(SHARE_BURST_S))
        return self.shares[key]

    def respond_timed(self, request: ASGIRequest) -> tuple[HttpResponseBase, float]:
        """`respond_sync`, and the time it held its thread. Wall time, not the thread's CPU
        time (which the live screens' lane charges, runs/live/looks.py): a bulk call's cost
        is as much PostgreSQL's as the process's (a page of 1,000 decisions of 60 KB is
        about 0.2 s of PostgreSQL's CPU and 0.35 s of the thread's), and charged its CPU time
        alone the attack above still made another team's p99 3.2x (1.7x charged wall
        time). On a busy machine the wall time counts waits too, so bulk calls yield to the
        checks, the order SPEC 10 asks for."""
        started = time.monotonic()
        made = self.respond_sync(request)
        return made, time.monotonic() - started

    def direct_view(self, request: ASGIRequest) -> Callable[..., HttpResponseBase] | None:
        """The view the API serves without Django's handler for this request, if any (a POST
        to the check: runs/check/edge.py `serve_directly`). The URL's match is kept on the
        request, as `resolves_to_async_view` keeps it."""
        if self.direct is None or request.method != "POST" or not edge.direct_views:
            return None
        match = _resolved(get_resolver(), request.path_info)
        if match is None:
            return None
        request.resolver_match = match
        return edge.direct_views.get(match.view_name)

    def respond_direct(self, request: ASGIRequest, view: Callable[..., HttpResponseBase]
                       ) -> Answer | HttpResponseBase:
        """The direct view's answer on this (API pool) thread, with the connection
        housekeeping of every API request (`pools.run_request`); Django's handler answers
        what the direct path hands back (governance/direct.py)."""
        assert self.direct is not None and request.resolver_match is not None
        direct, kwargs = self.direct, request.resolver_match.kwargs

        def answer() -> Answer | HttpResponseBase:
            made = direct.respond(request, view, kwargs)
            return made if made is not None else self.sync_handler.get_response(request)

        return pools.run_request(answer)

    async def send_answer(self, answer: Answer, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": answer.status,
                        "headers": answer.headers})
            await send({"type": "http.response.body", "body": answer.body})
        except Exception as exc:
            # Nearly always the client went away mid-answer (granian raises then).
            log.info("a response was not sent whole: %r", exc)

    def respond_sync(self, request: ASGIRequest) -> HttpResponseBase:
        """The request on this pool thread, from request_started to request_finished (for a
        stream: to its response, whose close sends request_finished once it has ended).

        An API request (the API's pool) does what those signals' receivers do, without the
        signals: Django's receivers are the connections' housekeeping
        (`close_old_connections`, before and after), the query log of DEBUG and the caches'
        close (a no-op for Redis and local memory), and the dispatch, with every receiver
        looking up the thread's connections and caches through asgiref's context-local
        storage, cost 40 to 90 us of a worker's 900 per check (docs/performance.md
        "Connection housekeeping"). A non-streaming response holds nothing to close (Django
        keeps only a stream's iterator or file to close); a stream's close, once it has been
        sent, sends request_finished as for a page."""
        from django.core import signals

        if pool_name(request.path, request.method) in ("api", "agent-bulk"):
            return pools.run_request(self.sync_handler.get_response, request)
        signals.request_started.send(sender=self.__class__, environ=request.META)
        response = self.sync_handler.get_response(request)
        if not response.streaming:
            # Its content is made: closing it now (request_finished: the connection's
            # housekeeping) spares a second hand-off to this pool after it is sent.
            response.close()
        return response

    def resolves_to_async_view(self, request: ASGIRequest) -> bool:
        """Whether the request's view is async; the match is kept on the request, and the
        handler that calls the view takes it (`ResolvedOnce`) instead of resolving again."""
        match = _resolved(get_resolver(), request.path_info)
        if match is None:
            return False
        request.resolver_match = match
        return _is_async(match.func)

    async def send_whole(self, response: HttpResponseBase, send: Send) -> None:
        response._handler_class = self.__class__  # type: ignore[attr-defined]
        try:
            await self.send_response(response, send)
        except Exception as exc:
            # Nearly always the client went away mid-answer (granian raises then).
            log.info("a response was not sent whole: %r", exc)

    async def serve(self, receive: Receive, send: Send,
                    getting: Awaitable[HttpResponseBase]) -> HttpResponseBase | None:
        """Send the response, stopping (and closing a stream) when the client goes away.
        Returns the response, or None when the client left before it was made."""
        made: list[HttpResponseBase] = []

        async def respond() -> None:
            response = await getting
            made.append(response)
            response._handler_class = self.__class__  # type: ignore[attr-defined]
            await self.send_response(response, send)

        responding = asyncio.ensure_future(respond())
        disconnected = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait([responding, disconnected], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (responding, disconnected):
                if not task.done():
                    task.cancel()
                    try:
                        await task
                    except asyncio.CancelledError:
                        pass
                    except Exception:
                        log.debug("request task failed while cancelled", exc_info=True)
        if disconnected.done() and not disconnected.cancelled():
            disconnected.exception()  # the client left (RequestAborted): nothing to report
        if responding.done() and not responding.cancelled():
            exc = responding.exception()
            if exc is not None:
                # Nearly always the client went away mid-answer (granian raises then).
                log.info("a response was not sent whole: %r", exc)
        return made[0] if made else None

    async def refuse(self, send: Send, path: str, status: int, why: str = "") -> None:
        """413, 408 or 400 (``why``) from here, before Django: JSON under /api/, as every API
        answer."""
        if status == 400:
            response: HttpResponseBase = (
                edge.error(400, "bad_request", why) if path.startswith("/api/")
                else HttpResponse(why, status=400, content_type="text/plain"))
        elif path.startswith("/api/"):
            if status == 413:
                response = edge.too_large(edge.body_limit(path))
            else:
                response = edge.error(408, "request_timeout",
                                      f"The request body did not arrive within "
                                      f"{settings.REQUEST_BODY_SECONDS} s.")
        else:
            response = HttpResponse(
                "Request body too large" if status == 413 else "Request body too slow",
                status=status, content_type="text/plain")
        response["Connection"] = "close"
        await self.send_response(response, send)

    async def lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                connections.start(settings.MAX_IDLE_CONNECTIONS_PER_ADDRESS,
                                  settings.TRUSTED_PROXIES)
                freeze_startup_objects()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                # The spans and metrics this worker still holds (at most 2 s, SPEC 18).
                await asyncio.to_thread(telemetry.flush)
                await send({"type": "lifespan.shutdown.complete"})
                return


def freeze_startup_objects() -> None:
    """Every module the requests use imported (the URL patterns and their views), then what
    the worker holds from its start moved out of the garbage collector's reach
    (`gc.freeze`): a full collection otherwise walks it all, about 140,000 objects, 140 to
    180 ms of a worker holding the GIL, and a request that builds many containers (a check's
    args of 29,000 nested arrays) sets one off. An attacker's such checks made another
    team's check p99 500 ms (SPEC 10); the same pause falls on any request now and then.
    Nothing frozen is ever freed: it is what the process keeps until it exits anyway."""
    get_resolver().url_patterns  # noqa: B018 (imports every URL module and view)
    gc.collect()
    gc.freeze()


async def _ready(response: HttpResponseBase) -> HttpResponseBase:
    return response


application = Application()
