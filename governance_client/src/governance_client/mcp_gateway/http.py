"""The gateway over streamable HTTP on both sides (``--upstream-url URL --listen HOST:PORT``).

Each MCP session of a client (its ``Mcp-Session-Id``, made by the gateway at ``initialize``)
is one upstream session and one run (``external_id`` the session id). The session ends, and
its run is finished, when the client deletes it, when it has been idle for ``idle_timeout``
seconds (then its id answers 404, as the SDK's own servers do), or when the upstream fails.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import socket
import sys
from collections.abc import Iterator, Sequence
from typing import Any
from uuid import uuid4

import anyio
from anyio.abc import TaskStatus
from mcp.client.streamable_http import streamable_http_client
from mcp.server.streamable_http import MCP_SESSION_ID_HEADER, StreamableHTTPServerTransport
from mcp.server.transport_security import TransportSecuritySettings
from mcp_types import INVALID_REQUEST, METHOD_NOT_FOUND, PARSE_ERROR
from starlette.types import Message, Receive, Scope, Send

from ..aio import AsyncGovernanceClient
from .cli import MAX_SESSIONS
from .session import GatewayConfig, GatewaySession

logger = logging.getLogger("governance_client.mcp")

IDLE_TIMEOUT = 30 * 60.0
RETRY_AFTER_S = 30  # a refused initialize's (MAX_SESSIONS)
MAX_OPENING_BODY = 4 * 1024 * 1024
# A request of a session (a tool call's arguments may be a file's content): read here before
# the SDK's transport, which reads any body whole (found by an attacker: a 300 MB ping took
# the gateway from 83 MB to 1.26 GB, and the body was forwarded upstream).
MAX_REQUEST_BODY = 16 * 1024 * 1024
UPSTREAM_FAILED_LINGER_S = 0.5


async def _json_error(send: Send, status: int, code: int, text: str,
                      request_id: Any = None, headers: tuple[tuple[bytes, bytes], ...] = ()
                      ) -> None:
    body = json.dumps({"jsonrpc": "2.0", "id": request_id,
                       "error": {"code": code, "message": text}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


def _replaying(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the body already read to the transport, then the request's
    own events (the client's disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _cause(exc: BaseException) -> BaseException:
    """The error inside the SDK's task groups (each wraps it in a group of one)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


# -- DNS rebinding ----------------------------------------------------------------------------
# A web page the agent's user opens can reach a gateway on 127.0.0.1 by a name it controls
# (resolved to 127.0.0.1 once the page is loaded): its requests then carry that name as Host
# and the page's Origin, and every tool call they make runs with the gateway's agent key. The
# gateway answered any Host and any Origin (found by a tester: `Host: evil.example:8123` with
# `Origin: http://evil.example` opened a session and ran a tools/call upstream, where the
# SDK's own server answers 421). It answers only the names it is reached by, as the SDK's
# servers do (TransportSecuritySettings): a request without an Origin (not a browser's)
# passes on its Host alone.

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")
#: Distinct refused Host or Origin values logged (each once), so a flood is not a log flood.
REFUSALS_LOGGED = 100


def _host_form(host: str, port: int | None) -> str:
    """``host`` as a Host header names it (an IPv6 address in brackets), with the port;
    ``:*`` (any port) when ``port`` is None."""
    name = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"{name}:{'*' if port is None else port}"


def _bind_kind(host: str) -> str:
    """``loopback``, ``any`` (0.0.0.0 or ::) or ``other``."""
    if host.lower() == "localhost":
        return "loopback"
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return "other"
    return "any" if address.is_unspecified else "loopback" if address.is_loopback else "other"


def transport_security(host: str, port: int | None, *, allowed_hosts: Sequence[str] = (),
                       allowed_origins: Sequence[str] = ()) -> TransportSecuritySettings:
    """The Host and Origin values a gateway listening on ``host:port`` answers: the address it
    listens on, and the loopback names of the port when that is a loopback address or every
    address (0.0.0.0, ::), with their ``http://`` origins; the deployment's own hosts
    (``--allowed-host``: behind a proxy, the name clients use), with their ``http://`` and
    ``https://`` origins (a proxy may add TLS), since a page of the very name the gateway is
    reached by is no other site's; and the deployment's own origins (``--allowed-origin``).
    A pattern ending in ``:*`` matches any port."""
    kind = _bind_kind(host)
    hosts = [] if kind == "any" else [_host_form(host, port)]
    if kind != "other":
        hosts += [_host_form(name, port) for name in LOOPBACK_HOSTS]
    hosts = list(dict.fromkeys(hosts))
    origins = [f"http://{name}" for name in hosts]
    origins += [f"{scheme}://{name}" for name in allowed_hosts for scheme in ("http", "https")]
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=[*hosts, *allowed_hosts],
        allowed_origins=list(dict.fromkeys([*origins, *allowed_origins])))


def _matches(value: str, allowed: Sequence[str]) -> bool:
    """``value`` is one of ``allowed`` (names compared without case, as DNS does, and a
    scheme's default port the same as none), or has the form of one that ends in ``:*``
    with a port or none."""
    value = _without_default_port(value.lower())
    for pattern in (p.lower() for p in allowed):
        if pattern.endswith(":*"):
            port = value[len(pattern) - 1:]
            if value == pattern[:-2] or (value.startswith(pattern[:-1]) and port.isascii()
                                         and port.isdigit()):
                return True
        elif value == _without_default_port(pattern):
            return True
    return False


def _without_default_port(value: str) -> str:
    """A Host or Origin with its scheme's default port left out, as clients send it (httpx,
    and so the MCP SDK's client, and browsers send `Host: name` for port 80: found by an
    attacker, a gateway listening on port 80 refused every client)."""
    if value.startswith("https://"):
        return value.removesuffix(":443")
    return value.removesuffix(":80")


class ListenError(Exception):
    """The address to listen on cannot be had (in use, not this host's)."""


def listening_socket(host: str, port: int) -> socket.socket:
    """The gateway's listening socket, bound before anything else starts, so a port in use is
    one line naming it (uvicorn's own bind failed with a traceback of its task group)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class HttpGateway:
    """An ASGI application: the gateway's streamable HTTP endpoint (any path)."""

    def __init__(self, config: GatewayConfig, client: AsyncGovernanceClient, upstream_url: str,
                 *, idle_timeout: float | None = IDLE_TIMEOUT,
                 max_sessions: int = MAX_SESSIONS,
                 security: TransportSecuritySettings | None = None) -> None:
        self.config = config
        #: The Host and Origin values answered (``transport_security``; default: a loopback
        #: address, any port). Checked here, before anything is read or made, rather than
        #: by the SDK's transport, which would see a request only once its session exists.
        self.security = security or transport_security("127.0.0.1", None)
        self._refusals_logged: set[tuple[str, str]] = set()
        self.max_sessions = max_sessions
        self.client = client
        self.upstream_url = upstream_url
        self.idle_timeout = idle_timeout
        self.sessions: dict[str, StreamableHTTPServerTransport] = {}
        self.runs: dict[str, GatewaySession] = {}
        self._tg: anyio.abc.TaskGroup | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if await self._refused(scope, send):
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        session_id = headers.get(MCP_SESSION_ID_HEADER.lower())
        if session_id is not None:
            transport = self.sessions.get(session_id)
            if transport is None:
                await _json_error(send, 404, INVALID_REQUEST, "Session not found")
                return
            if scope["method"] == "POST":
                body = await self._read_body(receive, MAX_REQUEST_BODY)
                if body is None:
                    await _json_error(send, 413, INVALID_REQUEST, "Request body too large "
                                      f"(over {MAX_REQUEST_BODY // (1024 * 1024)} MiB)")
                    return
                receive = _replaying(body, receive)
            await transport.handle_request(scope, receive, send)
            if transport.is_terminated:
                self.sessions.pop(session_id, None)
            return
        if scope["method"] != "POST":
            await _json_error(send, 400, INVALID_REQUEST, "Bad Request: Missing session ID")
            return
        body = await self._read_body(receive, MAX_OPENING_BODY)
        if body is None:
            await _json_error(send, 413, INVALID_REQUEST, "Request body too large")
            return
        try:
            message = json.loads(body)
        except (ValueError, RecursionError):  # nested past the parser's depth: not JSON here
            await _json_error(send, 400, PARSE_ERROR, "Parse error: the body is not JSON")
            return
        request_id = message.get("id") if isinstance(message, dict) else None
        if not isinstance(message, dict) or message.get("method") != "initialize":
            # Only an initialize opens a session. server/discover (the per-request era) is
            # answered as an unknown method, so that clients fall back to initialize.
            code = METHOD_NOT_FOUND if isinstance(message, dict) \
                and message.get("method") == "server/discover" else INVALID_REQUEST
            await _json_error(send, 400 if code == INVALID_REQUEST else 404, code,
                              "governance-mcp: a session starts with initialize", request_id)
            return
        if len(self.sessions) >= self.max_sessions:
            await _json_error(
                send, 503, INVALID_REQUEST,
                f"governance-mcp: {len(self.sessions)} sessions are open, the most this "
                "gateway holds (--max-sessions): close one (DELETE with its Mcp-Session-Id) "
                "or try again later", request_id,
                headers=((b"retry-after", str(RETRY_AFTER_S).encode()),))
            return
        await self._open(scope, _replaying(body, receive), send)

    async def _refused(self, scope: Scope, send: Send) -> bool:
        """Answer a request whose Host or Origin this gateway does not answer to (421, 403,
        a JSON-RPC error, nothing read or forwarded); False when it may go on."""
        settings = self.security
        if not settings.enable_dns_rebinding_protection:
            return False
        hosts = [v.decode("latin-1") for k, v in scope["headers"] if k.lower() == b"host"]
        origins = [v.decode("latin-1") for k, v in scope["headers"] if k.lower() == b"origin"]
        # One of each at most: with two, which one a proxy or the SDK reads is anyone's guess.
        if len(hosts) != 1 or not _matches(hosts[0], settings.allowed_hosts):
            self._log_refusal("Host", ", ".join(hosts) or "(none)")
            await _json_error(send, 421, INVALID_REQUEST,
                              "governance-mcp: Invalid Host header: this gateway does not "
                              "answer to that name (DNS rebinding protection; a name it is "
                              "reached by is given with --allowed-host)")
            return True
        if len(origins) > 1 or (origins and not _matches(origins[0],
                                                         settings.allowed_origins)):
            self._log_refusal("Origin", ", ".join(origins))
            await _json_error(send, 403, INVALID_REQUEST,
                              "governance-mcp: Invalid Origin header: pages of that origin "
                              "may not use this gateway (DNS rebinding protection; an origin "
                              "is allowed with --allowed-origin)")
            return True
        return False

    def _log_refusal(self, header: str, value: str) -> None:
        said = (header, value[:200])
        if said in self._refusals_logged or len(self._refusals_logged) >= REFUSALS_LOGGED:
            return
        self._refusals_logged.add(said)
        allowed = self.security.allowed_hosts if header == "Host" \
            else self.security.allowed_origins
        logger.warning("refused a request with %s %r (allowed: %s; more with --allowed-%s)",
                       header, said[1], ", ".join(allowed), header.lower())

    async def _read_body(self, receive: Receive, limit: int) -> bytes | None:
        """The request's body, or None past ``limit`` bytes (what was read is dropped)."""
        chunks: list[bytes] = []
        size = 0
        while True:
            event = await receive()
            if event["type"] != "http.request":
                break
            chunk = event.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
            if not event.get("more_body"):
                break
        return b"".join(chunks)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            event = await receive()
            if event["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif event["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def serve(self, host: str, port: int) -> None:
        import uvicorn

        class Server(uvicorn.Server):
            """uvicorn's server, but a SIGTERM or SIGINT it shut down on is not raised again
            as it returns: that killed the process before the `finally` below finished the
            open sessions' runs, left `running` until abandoned (found by a review)."""

            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                with super().capture_signals():
                    try:
                        yield
                    finally:
                        getattr(self, "_captured_signals", []).clear()

        sock = listening_socket(host, port)
        server = Server(uvicorn.Config(self, host=host, port=port, log_level="warning",
                                       lifespan="on"))
        # Said whatever the log level: the one line that tells the gateway is up, and where.
        print(f"governance-mcp: listening on http://{host}:{port}/ (any path), upstream "
              f"{self.upstream_url}, agent {self.config.agent}", file=sys.stderr, flush=True)
        if _bind_kind(host) == "any" and all(
                _bind_kind(name.rsplit(":", 1)[0]) == "loopback"
                for name in self.security.allowed_hosts):
            print("governance-mcp: on every address, but only requests addressed to "
                  f"{', '.join(LOOPBACK_HOSTS)} are answered: name the others with "
                  "--allowed-host HOST:PORT", file=sys.stderr, flush=True)
        async with anyio.create_task_group() as tg:
            self._tg = tg
            try:
                await server.serve(sockets=[sock])
            finally:
                tg.cancel_scope.cancel()
                with anyio.CancelScope(shield=True):
                    for session in list(self.runs.values()):
                        await session.finish()
                    await self.client.aclose()

    async def _open(self, scope: Scope, receive: Receive, send: Send) -> None:
        transport = StreamableHTTPServerTransport(mcp_session_id=uuid4().hex,
                                                  idle_timeout=self.idle_timeout)
        session_id = transport.mcp_session_id
        assert session_id is not None and self._tg is not None
        self.sessions[session_id] = transport
        await self._tg.start(self._session, transport)
        await transport.handle_request(scope, receive, send)

    async def _session(self, transport: StreamableHTTPServerTransport, *,
                       task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        session_id = transport.mcp_session_id
        assert session_id is not None
        session = GatewaySession(self.config, self.client, session_id=session_id)
        self.runs[session_id] = session
        try:
            async with transport.connect() as (read, write):
                task_status.started()
                idle = transport.idle_scope or anyio.CancelScope()
                with idle:
                    try:
                        async with streamable_http_client(self.upstream_url) as (up_read,
                                                                                 up_write):
                            await session.serve(read, write, up_read, up_write)
                    except Exception as exc:
                        logger.warning("session %s: upstream %s failed: %s", session_id,
                                       self.upstream_url, _cause(exc))
                        await session.upstream_failed(
                            f"the upstream MCP server at {self.upstream_url} cannot be reached")
                        # The transport's router delivers those errors to the client's open
                        # requests; leaving `connect` at once closed its stream first, and
                        # the client saw its request cut off instead of the reason.
                        await anyio.sleep(UPSTREAM_FAILED_LINGER_S)
                if idle.cancelled_caught:
                    logger.info("session %s expired (idle)", session_id)
        finally:
            self.sessions.pop(session_id, None)
            self.runs.pop(session_id, None)
            with anyio.CancelScope(shield=True):
                if not transport.is_terminated:
                    await transport.terminate()
                await session.finish()
