"""One MCP session through the gateway (SPEC 19): a JSON-RPC relay between the MCP client and
the upstream MCP server that governs ``tools/call`` and ``tools/list`` and passes every other
message through unchanged, in both directions.

The relay works on the SDK's transport streams (``SessionMessage`` in, ``SessionMessage`` out),
whatever carries them (stdio or streamable HTTP on either side), so resources, prompts,
notifications, sampling, progress, cancellation and pings keep their ids and their content:
the gateway originates no request of its own, and answers only the calls it does not forward.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
from mcp.shared.message import ClientMessageMetadata, ServerMessageMetadata, SessionMessage
from mcp_types import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    PARSE_ERROR,
    ErrorData,
    JSONRPCError,
    JSONRPCNotification,
    JSONRPCRequest,
    JSONRPCResponse,
)
from mcp_types.methods import SPEC_CLIENT_NOTIFICATION_METHODS

from .. import rules
from .._core import result_digest
from ..aio import AsyncGovernanceClient, AsyncRun
from ..decision import GOVERNANCE_UNAVAILABLE, Decision
from ..errors import ApiError, GovernanceError, GovernanceUnavailable, KillSwitchEngaged

try:  # the `mcp` SDK depends on opentelemetry-api; still optional here
    from opentelemetry import context as _otel_context
    from opentelemetry import propagate as _otel_propagate
except ImportError:  # pragma: no cover
    _otel_context = _otel_propagate = None  # type: ignore[assignment]

logger = logging.getLogger("governance_client.mcp")

PROTOCOL_VERSION_HEADER = "mcp-protocol-version"
#: How long the end of a session may take to finish its run (the client's deadline and its
#: upload of local decisions): the session is not held longer.
FINISH_SECONDS = 15.0
#: With --fail-open, a session whose run was started locally (the service unreachable at its
#: start) tries to start it on the service again at a call: the wait after a failed try is
#: this many seconds at first, doubled after each failure up to START_RETRY_MAX_S (each
#: jittered down to half), so a service that stays down costs a call the client's deadline
#: now and then, not each time. The session's end tries once more, whenever it comes.
START_RETRY_S = 1.0
START_RETRY_MAX_S = 30.0

# What of a request's `_meta` is the MCP client's trace context (W3C, as the SDK puts it).
_TRACE_FIELDS = ("traceparent", "tracestate", "baggage")


@contextlib.contextmanager
def callers_trace(meta: Any) -> Iterator[None]:
    """The MCP client's trace context for what is done inside: MCP clients send it in a
    request's `_meta` (`traceparent`, `tracestate`), and with it current the client's checks
    send it on (`_core.traced_headers`), so a governed call's decision is a span of the
    agent's trace (SPEC 18), as a Python client's is (found by a newcomer: each check was a
    trace of its own). Without one, or without OpenTelemetry: nothing changes."""
    carrier = {name: value for name in _TRACE_FIELDS
               if isinstance(meta, Mapping) and isinstance(value := meta.get(name), str)}
    if _otel_context is None or "traceparent" not in carrier:
        yield
        return
    token = _otel_context.attach(_otel_propagate.extract(carrier))
    try:
        yield
    finally:
        _otel_context.detach(token)


@dataclass(frozen=True)
class GatewayConfig:
    """What ``governance-mcp`` was started with (see ``cli``)."""

    url: str
    key: str = field(repr=False)  # a secret: never in a log line or a traceback
    agent: str
    policy: str | None = None
    fail_open: bool = False
    max_wait: float = 30.0
    #: SERVER of the action names (``<SERVER>.<tool>``); None: the upstream's declared name.
    name: str | None = None
    #: Each session's run is a sub-agent's run under this one (SPEC 20): its checks count on
    #: the parent's tree and its limits bound them; None: a root run.
    parent_run_id: str | None = None


def make_client(config: GatewayConfig) -> AsyncGovernanceClient:
    """The one governance client of a gateway process, shared by its sessions."""
    return AsyncGovernanceClient(
        config.url, config.key, fail_mode="open" if config.fail_open else "closed",
        wait_budget=config.max_wait,
    )


def blocked(reason: str, message: str | None, next_action: str | None = None) -> str:
    """The text of a refused call (SPEC 19)."""
    words = " ".join(t.strip() for t in (message or "", next_action or "") if t and t.strip())
    return f"Blocked by governance ({reason}): {words or 'no detail given.'}"


def refusal(text: str) -> dict[str, Any]:
    """A ``tools/call`` result that refuses the call, fit for the model to read."""
    return {"content": [{"type": "text", "text": text}], "isError": True}


def _text_of(content: Any) -> str:
    if not isinstance(content, list):
        return ""
    return "\n".join(str(item.get("text")) for item in content
                     if isinstance(item, Mapping) and item.get("type") == "text"
                     and item.get("text") is not None)


def _id_in(exc: Exception) -> Any:
    """The request id in a message that did not parse, when it can be read (a JSON object with
    an ``id``, of the wrong shape otherwise); None when not."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return None
    try:
        for error in errors():
            value = error.get("input") if isinstance(error, Mapping) else None
            if isinstance(value, Mapping):
                found = value.get("id")
                if isinstance(found, int | str) and not isinstance(found, bool):
                    return found
    except Exception:
        return None
    return None


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (ValueError, TypeError, RecursionError):
        return False
    return True


def _id_or_token(value: Any) -> str | int | None:
    """A request id or progress token as MCP defines them (a string or an integer), else
    None: the SDK leaves a notification's params untyped, and a list or an object there,
    looked up in the session's tables, ended the whole session (found by an attacker)."""
    return value if isinstance(value, str | int) and not isinstance(value, bool) else None


class UpstreamGone(Exception):
    """The upstream MCP server exited or cannot be reached."""


class GatewaySession:
    """The relay of one MCP session, and its run.

    ``serve`` relays until the client or the upstream ends the session; ``finish`` then ends
    the run: ``failed`` if the upstream died, ``stopped`` if a stop ended it, else
    ``completed``.
    """

    def __init__(self, config: GatewayConfig, client: AsyncGovernanceClient, *,
                 session_id: str | None = None) -> None:
        self.config = config
        self.client = client
        self.session_id = session_id
        self.server_name: str | None = config.name
        self.protocol_version: str | None = None
        self.client_info: dict[str, Any] = {}
        self.initialized = False
        self.run: AsyncRun | None = None
        self.start_refusal: str | None = None
        #: The text of the stop that ended the run: every later call is answered with it.
        self.stop_text: str | None = None
        self.upstream_gone: str | None = None
        self.finished = False
        #: How the run was finished (None: not yet, or no run).
        self.status: str | None = None
        self._start_lock = anyio.Lock()
        # A run started locally: the starts on the service that failed since, and when the
        # next one is due (anyio.current_time).
        self._start_failures = 0
        self._retry_at = 0.0
        self._started = anyio.Event()
        self._client_write: Any = None
        self._upstream_write: Any = None
        # Requests of the client forwarded upstream and not answered yet: id -> method.
        self._inflight: dict[Any, str] = {}
        self._init_id: Any = None
        # Set once the upstream answered the session's initialize (or is gone): a call is
        # named after the name it declares there (`action_name`), so no call is checked
        # before it is known (found by an attacker: a call sent before that answer, or
        # after a second initialize the upstream refused, was checked as `mcp.<tool>`, and
        # a policy's `files.*` patterns did not match it: a denied tool ran).
        self._named = anyio.Event()
        if config.name is not None:
            self._named.set()
        self._init_refused: str | None = None
        self._lists: set[Any] = set()
        self._calls: dict[Any, str] = {}
        self._directives: dict[Any, str] = {}
        # Calls being checked (not forwarded yet): id -> (cancel scope, message).
        self._held: dict[Any, tuple[anyio.CancelScope, SessionMessage]] = {}
        # progressToken -> the request that carried it (to route progress back over HTTP).
        self._progress: dict[Any, Any] = {}
        # The transport's metadata of each forwarded request (over HTTP: how to end its stream).
        self._metadata: dict[Any, Any] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self._dropped_said = False

    # -- the relay ------------------------------------------------------------------------

    async def serve(self, client_read: Any, client_write: Any, upstream_read: Any,
                    upstream_write: Any) -> None:
        self._client_write, self._upstream_write = client_write, upstream_write
        async with anyio.create_task_group() as tg:
            self._tg = tg
            tg.start_soon(self._from_upstream, upstream_read)
            await self._from_client(client_read)
            # The client closed the session: the run ends now, before the upstream is shut
            # down (a client gives a server only a few seconds to exit before killing it).
            await self.finish()
            tg.cancel_scope.cancel()

    async def _from_client(self, read: Any) -> None:
        # A transport that closes the stream under the read: the client is gone.
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError,
                                 anyio.EndOfStream):
            await self._relay_client(read)

    async def _relay_client(self, read: Any) -> None:
        async for item in read:
            if isinstance(item, Exception):
                await self._reply_error(None, PARSE_ERROR, f"Parse error: {item}")
                continue
            message = item.message
            if isinstance(message, JSONRPCRequest):
                await self._client_request(item)
            elif isinstance(message, JSONRPCNotification):
                if message.method not in SPEC_CLIENT_NOTIFICATION_METHODS:
                    # Only the notifications an MCP client sends (initialized, cancelled,
                    # progress, roots/list_changed) go on. A request sent without an id (or
                    # with "id": null) reads as a notification, and a `tools/call` so sent
                    # was forwarded: it ran with no check and no audit (found by a tester).
                    self._drop(message)
                    continue
                if message.method == "notifications/cancelled":
                    cancelled = _id_or_token((message.params or {}).get("requestId"))
                    held = self._held.get(cancelled)
                    if held is not None:
                        held[0].cancel()  # never forwarded: the upstream does not know it
                        continue
                    if cancelled in self._inflight:
                        # Forwarded: the upstream is told; no answer is due to the client,
                        # and over HTTP the request's stream is ended now.
                        await self._unanswered(cancelled)
                if message.method == "notifications/initialized":
                    self.initialized = True
                await self._to_upstream(item)
            else:
                await self._to_upstream(item)  # answers to the upstream's own requests

    def _drop(self, message: JSONRPCNotification) -> None:
        """A notification no MCP client sends: not forwarded (a notification has no answer, so
        the client is told nothing). Said once a session, so that a client sending many
        cannot flood the log."""
        if not self._dropped_said:
            self._dropped_said = True
            logger.warning("session %s: a notification %.100r from the MCP client was dropped "
                           "(not a client notification; a request needs an id); later ones "
                           "are dropped without a word", self.session_id or "stdio",
                           message.method)

    async def _client_request(self, item: SessionMessage) -> None:
        message: JSONRPCRequest = item.message  # type: ignore[assignment]
        method, params = message.method, message.params or {}
        if method == "server/discover":
            # The per-request era (2026-07-28) has no session, and a governed run needs one:
            # clients fall back to the initialize handshake on this answer.
            await self._reply_error(message.id, METHOD_NOT_FOUND,
                                    "governance-mcp speaks the initialize handshake")
            return
        if method == "initialize":
            if self._init_id is not None:
                # One handshake a session (MCP): a second one would leave the session's
                # name to an answer that may never come.
                await self._reply_error(message.id, INVALID_REQUEST,
                                        "initialize was already received on this session")
                return
            self._init_id = message.id
            info = params.get("clientInfo")
            self.client_info = dict(info) if isinstance(info, Mapping) else {}
            self.initialized = True
            assert self._tg is not None
            self._tg.start_soon(self._start)
        elif method == "tools/call":
            if not self.initialized:
                await self._reply_error(message.id, INVALID_REQUEST,
                                        "tools/call received before initialize")
                return
            name, args = params.get("name"), params.get("arguments")
            if not isinstance(name, str) or not name or \
                    (args is not None and not isinstance(args, Mapping)):
                await self._reply_error(message.id, INVALID_PARAMS,
                                        "tools/call needs a name and an arguments object")
                return
            if not _is_json(args):
                # The SDK reads NaN and Infinity, JSON has neither: the check could not be
                # sent, and its error ended the whole session as an upstream failure.
                await self._reply_error(message.id, INVALID_PARAMS,
                                        "tools/call arguments must be JSON (no NaN or "
                                        "Infinity)")
                return
            assert self._tg is not None
            scope = anyio.CancelScope()
            self._held[message.id] = (scope, item)
            self._tg.start_soon(self._govern_call, item, scope)
            return
        elif method == "tools/list":
            self._lists.add(message.id)
            if self.initialized:
                await self._started.wait()  # the policy's deny list is the run's
        token = _id_or_token((params.get("_meta") or {}).get("progressToken")) \
            if isinstance(params.get("_meta"), Mapping) else None
        if token is not None:
            self._progress[token] = message.id
        self._inflight[message.id] = method
        self._metadata[message.id] = item.metadata
        await self._to_upstream(item)

    async def _unanswered(self, request_id: Any) -> None:
        metadata = self._metadata.get(request_id)
        self._forget(request_id)
        callback = getattr(metadata, "on_request_unanswered", None)
        if callback is not None:
            with contextlib.suppress(Exception):
                await callback()

    async def _from_upstream(self, read: Any) -> None:
        try:
            async for item in read:
                if isinstance(item, Exception):
                    await self._malformed(item)
                    continue
                await self._upstream_message(item)
        except Exception as exc:
            logger.warning("reading the upstream MCP server failed: %s", exc)
        await self.upstream_failed("the upstream MCP server exited")
        assert self._tg is not None
        self._tg.cancel_scope.cancel()

    async def _malformed(self, exc: Exception) -> None:
        request_id = _id_in(exc)
        logger.warning("the upstream MCP server sent a malformed message: %s", exc)
        if request_id is not None and request_id in self._inflight:
            self._forget(request_id)
            if request_id == self._init_id:
                self._init_refused = "a malformed answer"
                self._named.set()
            await self._reply_error(request_id, INTERNAL_ERROR,
                                    "the upstream MCP server sent a malformed answer")

    async def _upstream_message(self, item: SessionMessage) -> None:
        message = item.message
        if isinstance(message, JSONRPCError) and message.id is None:
            await self._to_client(item)  # an error about no request in particular
            return
        if isinstance(message, JSONRPCResponse | JSONRPCError):
            request_id: Any = message.id
            if request_id not in self._inflight:
                # Answered already (a malformed answer to it was answered with an error) or
                # never asked: a second answer to one id breaks the client's session.
                logger.warning("the upstream MCP server answered %r, which waits for no "
                               "answer: dropped", request_id)
                return
            self._inflight.pop(request_id, None)
            self._metadata.pop(request_id, None)
            for token in [t for t, owner in self._progress.items() if owner == request_id]:
                del self._progress[token]
            if request_id == self._init_id:
                if isinstance(message, JSONRPCResponse):
                    self._initialized_by(message.result)
                else:
                    self._init_refused = message.error.message
                self._named.set()
            if isinstance(message, JSONRPCResponse) and request_id in self._lists:
                message = JSONRPCResponse(jsonrpc="2.0", id=request_id,
                                          result=self._filtered(message.result))
            if request_id in self._calls:
                message = self._called(request_id, message)
            self._lists.discard(request_id)
            await self._to_client(SessionMessage(message))
            return
        # The upstream's own requests and notifications: over HTTP, on the stream of the
        # request they belong to (progress by its token), else the session's stream.
        related = None
        params = message.params or {}
        if isinstance(message, JSONRPCNotification) and message.method == "notifications/progress":
            related = self._progress.get(_id_or_token(params.get("progressToken")))
        elif self._calls:
            related = next(reversed(self._calls))
        if related is not None and related not in self._inflight:
            related = None
        await self._to_client(SessionMessage(
            message, metadata=ServerMessageMetadata(related_request_id=related)))

    def _forget(self, request_id: Any) -> None:
        self._inflight.pop(request_id, None)
        self._metadata.pop(request_id, None)
        for token in [t for t, owner in self._progress.items() if owner == request_id]:
            del self._progress[token]
        self._lists.discard(request_id)
        self._calls.pop(request_id, None)
        self._directives.pop(request_id, None)

    async def upstream_failed(self, why: str) -> None:
        """The upstream is gone: every request it left unanswered is answered with an error,
        and the run will end ``failed``."""
        if self.upstream_gone is None:
            self.upstream_gone = why
            logger.warning("%s: the session ends", why)
        self._named.set()  # no answer to the initialize is coming: calls are refused
        for request_id in list(self._inflight):
            self._forget(request_id)
            await self._reply_error(request_id, INTERNAL_ERROR, why)

    # -- sending --------------------------------------------------------------------------

    async def _to_upstream(self, item: SessionMessage) -> None:
        metadata = None
        if self.protocol_version is not None:
            metadata = ClientMessageMetadata(
                headers={PROTOCOL_VERSION_HEADER: self.protocol_version})
        try:
            await self._upstream_write.send(SessionMessage(item.message, metadata=metadata))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            message = item.message
            if isinstance(message, JSONRPCRequest):
                self._forget(message.id)
                await self._reply_error(message.id, INTERNAL_ERROR,
                                        self.upstream_gone or "the upstream MCP server exited")

    async def _to_client(self, item: SessionMessage) -> None:
        try:
            await self._client_write.send(item)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            logger.info("the MCP client is gone: %s not delivered", type(item.message).__name__)

    async def _reply_error(self, request_id: Any, code: int, text: str) -> None:
        await self._to_client(SessionMessage(JSONRPCError(
            jsonrpc="2.0", id=request_id, error=ErrorData(code=code, message=text))))

    async def _reply(self, request_id: Any, result: dict[str, Any]) -> None:
        await self._to_client(SessionMessage(JSONRPCResponse(jsonrpc="2.0", id=request_id,
                                                             result=result)))

    # -- the run --------------------------------------------------------------------------

    async def _start(self) -> None:
        try:
            await self.ensure_run()
        finally:
            self._started.set()

    async def ensure_run(self, *, now: bool = False) -> AsyncRun | None:
        """The session's run, started on first need (its initialization); None while it
        cannot be started (``start_refusal`` says why: every call is refused with it).

        With --fail-open, the service unreachable at the start gives a run started locally
        (the client's), which decides the calls until a start on the service succeeds: one
        is tried when due (``START_RETRY_S``; ``now``: at once), and the run it starts takes
        the local one over (``RunCore.adopt``): the local decisions are uploaded before its
        first check, and the service decides from then on."""
        async with self._start_lock:
            local = self.run
            if local is not None and (not local.local or
                                      (not now and anyio.current_time() < self._retry_at)):
                return local
            metadata = {"gateway": "governance-mcp"}
            if self.client_info.get("name"):
                metadata["mcp_client"] = str(self.client_info["name"])[:100]
            try:
                run = await self.client.start_run(
                    self.config.agent, policy=self.config.policy, metadata=metadata,
                    external_id=self.session_id, parent_run_id=self.config.parent_run_id)
            except KillSwitchEngaged as exc:
                self.start_refusal = blocked("killed", exc.message or exc.user_message,
                                             exc.user_next)
            except GovernanceUnavailable as exc:
                # A slow service (no answer within the deadline) is told apart from an
                # unreachable one, as the client's checks tell them.
                outage = "did not answer in time" if exc.timed_out else "is unreachable"
                logger.warning("governance %s, the run is not started: %s", outage, exc)
                self.start_refusal = blocked(
                    GOVERNANCE_UNAVAILABLE, f"The governance service {outage}, so this "
                    "tool was not run.", "Try again once it answers." if exc.timed_out
                    else "Try again once it is reachable.")
            except ApiError as exc:
                logger.error("the run could not be started: %s", exc)
                self.start_refusal = blocked(exc.code, exc.message)
            except GovernanceError as exc:
                self.start_refusal = blocked(exc.reason, str(exc))
            else:
                return self._started_run(run, local)
            # Refused: a run started locally stops deciding too (fail-open is for outages,
            # not for a service that says no); the next call asks again.
            return None

    def _started_run(self, run: AsyncRun, local: AsyncRun | None) -> AsyncRun:
        self.start_refusal = None
        if run.local:  # the service unreachable (fail open): the client started it locally
            self._start_failures += 1
            window = min(START_RETRY_MAX_S, START_RETRY_S * 2 ** (self._start_failures - 1))
            # Jittered like the client's retries (but down to half only, so that the wait
            # stays one): gateways cut off together do not all come back in the same second.
            self._retry_at = anyio.current_time() + window * random.uniform(0.5, 1.0)
            if local is None:
                self.run = local = run
            return local
        if local is not None:
            run.adopt(local)
            # A stop made locally was made with the client's local limits, not the
            # policy: the service's answer to the next call replaces it (the upload ends
            # the run there with the local stop's reason, so it answers that stop).
            self.stop_text = None
            logger.warning("governance reachable again: the session's run %s is started on "
                           "the service, %d local decision(s) to upload", run.id,
                           len(run.unsynced))
        self.run = run
        logger.info("session's run %s started%s", run.id,
                    f" under run {self.config.parent_run_id}"
                    if self.config.parent_run_id else "")
        return run

    def _initialized_by(self, result: Mapping[str, Any]) -> None:
        version = result.get("protocolVersion")
        self.protocol_version = version if isinstance(version, str) else None
        info = result.get("serverInfo")
        if self.server_name is None and isinstance(info, Mapping) and info.get("name"):
            self.server_name = str(info["name"])

    def action_name(self, tool: str) -> str:
        return f"{self.server_name or 'mcp'}.{tool}"

    def _filtered(self, result: dict[str, Any]) -> dict[str, Any]:
        """A ``tools/list`` page without the tools the run's policy denies (enforce mode: in
        shadow mode nothing is denied, so nothing is left out)."""
        tools = result.get("tools")
        if self.run is None or not isinstance(tools, list):
            return result
        policy = rules.Policy.from_document(self.run.data.get("policy") or {})
        if policy.mode == "shadow":
            return result
        kept = [tool for tool in tools
                if not (isinstance(tool, Mapping) and isinstance(tool.get("name"), str)
                        and rules.tool_denied(policy, self.action_name(tool["name"])))]
        return {**result, "tools": kept}

    async def _govern_call(self, item: SessionMessage, scope: anyio.CancelScope) -> None:
        message: JSONRPCRequest = item.message  # type: ignore[assignment]
        params = message.params or {}
        answer: str | None = None
        with scope, callers_trace(params.get("_meta")):
            try:
                answer = await self._decide(message.id, params["name"],
                                            params.get("arguments") or {})
            except Exception:
                # One call that could not be checked is refused (fail closed); raised, it
                # would end the whole session, reported as the upstream's failure.
                logger.exception("the check of %s failed", params["name"])
                answer = blocked("gateway_error", "The gateway could not check this call, "
                                 "so it was not run.")
            finally:
                self._held.pop(message.id, None)
        if scope.cancelled_caught:
            # Cancelled by the client while checked or waiting: nothing was run, no answer
            # is due; over HTTP the request's stream is ended all the same.
            unanswered = getattr(item.metadata, "on_request_unanswered", None)
            if unanswered is not None:
                await unanswered()
            return
        if answer is not None:
            await self._reply(message.id, refusal(answer))
            return
        self._calls[message.id] = params["name"]
        self._inflight[message.id] = "tools/call"
        self._metadata[message.id] = item.metadata
        token = _id_or_token((params.get("_meta") or {}).get("progressToken")) \
            if isinstance(params.get("_meta"), Mapping) else None
        if token is not None:
            self._progress[token] = message.id
        await self._to_upstream(item)

    async def _decide(self, request_id: Any, tool: str, args: Mapping[str, Any]) -> str | None:
        """None when the call may be forwarded, else the text it is refused with."""
        if self.stop_text is not None and not (self.run is not None and self.run.local):
            return self.stop_text
        if self.upstream_gone is not None:
            return blocked("upstream_unavailable", self.upstream_gone)
        await self._started.wait()
        run = await self.ensure_run()
        if run is None:
            return self.start_refusal
        await self._named.wait()
        if self.upstream_gone is not None:
            return blocked("upstream_unavailable", self.upstream_gone)
        if self.server_name is None and self._init_refused is not None:
            return blocked("invalid_request", "The upstream MCP server refused this session's "
                           f"initialize ({self._init_refused}): its tools have no name to "
                           "check, so none is run.", "Start a new session.")
        if self.stop_text is not None:  # a local stop, and the run is still only local
            return self.stop_text
        try:
            decision = await run.check(self.action_name(tool), args, type="tool",
                                       call_id=str(request_id))
        except GovernanceError as exc:
            reason = exc.code if isinstance(exc, ApiError) else exc.reason
            text = exc.message if isinstance(exc, ApiError) else str(exc)
            logger.warning("check of %s refused: %s", tool, exc)
            if isinstance(exc, ApiError) and exc.status == 422:
                # The call itself is refused (a name over 200 characters, a NUL in its
                # arguments): the same call will never pass, so the model is told what to
                # change rather than to try again.
                named = "; ".join(f"{field}: {problem}" for field, problem in exc.fields.items())
                return blocked(reason, f"{text} ({named})." if named else text,
                               "Do not send this call again as it is: change what is named.")
            return blocked(reason, text, "Do not run this tool now; try again later.")
        if decision.allowed:
            directive = decision.directive
            if isinstance(directive, Mapping) and directive.get("content"):
                self._directives[request_id] = str(directive["content"])
            return None
        text = blocked(decision.reason, decision.message, decision.next_action)
        if self._ends_run(decision):
            self.stop_text = text
        return text

    @staticmethod
    def _ends_run(decision: Decision) -> bool:
        return decision.decision == "stop" and decision.reason != GOVERNANCE_UNAVAILABLE

    def _called(self, request_id: Any, message: JSONRPCResponse | JSONRPCError
                ) -> JSONRPCResponse | JSONRPCError:
        """Report the outcome of a forwarded call (the next check's ``last_result``); append
        the allow's directive to its result."""
        self._calls.pop(request_id, None)
        directive = self._directives.pop(request_id, None)
        run = self.run
        if isinstance(message, JSONRPCError):
            # A protocol error of the upstream: the call failed, reported as an error.
            if run is not None:
                with contextlib.suppress(GovernanceError):
                    run.report(error=message.error.message or "error", call_id=str(request_id))
            return message
        result = message.result
        content = result.get("content")
        digest = result_digest(content)
        try:
            if run is not None:
                if result.get("isError"):
                    run.report(error=_text_of(content) or "tool error", digest=digest,
                               call_id=str(request_id))
                else:
                    run.report(content, digest=digest, call_id=str(request_id))
        except GovernanceError as exc:  # the run is closed: nothing to report to
            logger.info("result of call %s not reported: %s", request_id, exc)
        if directive is None:
            return message
        items = list(content) if isinstance(content, list) else []
        items.append({"type": "text", "text": directive})
        return JSONRPCResponse(jsonrpc="2.0", id=request_id, result={**result, "content": items})

    async def finish(self) -> str | None:
        """End the run once the session is over; the status it was finished with."""
        if self.finished or self.run is None:
            return None
        self.finished = True
        # Calls still checked or waiting (for an operator, a rate limit) are given up: the
        # session is over, and the run's finish must not wait behind them.
        for scope, _ in list(self._held.values()):
            scope.cancel()
        with anyio.CancelScope(shield=True), anyio.move_on_after(2.0):
            while self._held:
                await anyio.sleep(0.01)
        if self.run.local:
            # The last chance for the calls decided locally to reach the service: a run
            # started locally finishes without sending anything.
            with anyio.CancelScope(shield=True), anyio.move_on_after(FINISH_SECONDS):
                await self.ensure_run(now=True)
            if self.run.local and self.run.kept:
                logger.warning("the session's run never reached the service: %d call(s) "
                               "decided locally have no run and no audit record",
                               len(self.run.kept))
        run = self.run
        if self.upstream_gone is not None:
            status = "failed"
        elif self.stop_text is not None or run.stop_decision is not None:
            status = "stopped"
        else:
            status = "completed"
        self.status = status
        with anyio.CancelScope(shield=True), anyio.move_on_after(FINISH_SECONDS):
            try:
                await run.finish(status)  # type: ignore[arg-type]
            except GovernanceError as exc:
                # Kept in the client's journal and sent at the next start.
                logger.warning("run %s not finished (%s): %s", run.id, status, exc)
        return status
