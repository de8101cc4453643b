"""The HTTP gateway (``governance-mcp --listen``) answers only the names it is reached by:
DNS rebinding protection, as the SDK's own servers have it (TransportSecuritySettings).
Found by a tester: `Host: evil.example:8123` with `Origin: http://evil.example` (a web page
that had its own name resolve to 127.0.0.1) opened a session and ran a tools/call upstream.

In process: the gateway's ASGI application, with a stand-in for the SDK's session transport
(the gateway end to end: the project's tests/test_mcp_gateway.py).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

pytest.importorskip("mcp")

from governance_client.mcp_gateway.cli import parse
from governance_client.mcp_gateway.http import HttpGateway, transport_security
from governance_client.mcp_gateway.session import GatewayConfig

INITIALIZE = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-11-25", "capabilities": {},
    "clientInfo": {"name": "page", "version": "0"}}}).encode()


class Transport:
    """Stands for the SDK's transport of one session: the requests that reached it."""

    is_terminated = False

    def __init__(self) -> None:
        self.received: list[bytes] = []

    async def handle_request(self, scope: Any, receive: Any, send: Any) -> None:
        self.received.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 202, "headers": []})
        await send({"type": "http.response.body", "body": b""})


def gateway(**allowed: Any) -> tuple[HttpGateway, Transport]:
    """A gateway listening on 127.0.0.1:8123 with one open session, "s"."""
    made = HttpGateway(GatewayConfig(url="http://gov", key="k", agent="a"),
                       client=None, upstream_url="http://up/mcp",  # type: ignore[arg-type]
                       security=transport_security("127.0.0.1", 8123, **allowed))
    transport = Transport()
    made.sessions["s"] = transport  # type: ignore[assignment]
    return made, transport


@dataclass
class Answer:
    status: int
    body: dict[str, Any] | None
    read: bool  # whether the gateway read the request's body


def request(app: HttpGateway, headers: dict[str, str] | list[tuple[str, str]],
            body: bytes = b"{}", session: str | None = "s") -> Answer:
    """POST ``body`` with ``headers`` (on session ``session``; None: an opening request)."""
    read = False

    async def receive() -> dict[str, Any]:
        nonlocal read
        read = True
        return {"type": "http.request", "body": body, "more_body": False}

    answered: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        answered.append(message)

    pairs = list(headers.items()) if isinstance(headers, dict) else headers
    if session is not None:
        pairs.append(("mcp-session-id", session))
    scope = {"type": "http", "method": "POST",
             "headers": [(k.encode(), v.encode()) for k, v in pairs]}
    anyio.run(app, scope, receive, send)
    content = b"".join(m.get("body", b"") for m in answered[1:])
    return Answer(answered[0]["status"], json.loads(content) if content else None, read)


def test_a_page_by_another_name_is_refused_before_anything_is_read_or_made(
        caplog: pytest.LogCaptureFixture) -> None:
    app, transport = gateway()
    caplog.set_level(logging.WARNING, logger="governance_client.mcp")
    evil = {"host": "evil.example:8123", "origin": "http://evil.example"}
    # The opening initialize: no session made, nothing sent to the service (the gateway
    # has no client here: reaching it would fail the test).
    refused = request(app, evil, INITIALIZE, session=None)
    assert (refused.status, refused.read) == (421, False)
    assert refused.body is not None and refused.body["jsonrpc"] == "2.0"
    assert refused.body["error"]["code"] == -32600
    assert "Invalid Host header" in refused.body["error"]["message"]
    assert list(app.sessions) == ["s"] and app.runs == {}
    # A request of an open session (a tools/call): not forwarded either.
    refused = request(app, evil)
    assert (refused.status, refused.read) == (421, False)
    # Its own name with a page's Origin: 403.
    page = request(app, {"host": "127.0.0.1:8123", "origin": "http://evil.example"})
    assert (page.status, page.read) == (403, False)
    assert page.body is not None and "Invalid Origin header" in page.body["error"]["message"]
    assert transport.received == []
    # Logged once per value, with what is allowed.
    request(app, evil)
    hosts = [r.getMessage() for r in caplog.records if "Host 'evil.example:8123'" in
             r.getMessage()]
    assert len(hosts) == 1 and "127.0.0.1:8123, localhost:8123, [::1]:8123" in hosts[0]


@pytest.mark.parametrize("headers", [
    {"host": "localhost:8124"},                       # another port
    {"host": "127.0.0.1"},                            # no port
    {"host": "localhost:8123.evil.example"},
    {},                                               # no Host at all
    [("host", "127.0.0.1:8123"), ("host", "evil.example:8123")],  # two
])
def test_only_its_own_names_and_port_are_answered(headers: Any) -> None:
    app, transport = gateway()
    refused = request(app, headers)
    assert (refused.status, refused.read) == (421, False)
    assert transport.received == []


@pytest.mark.parametrize("headers", [
    {"host": "127.0.0.1:8123"},                       # no Origin: not a browser
    {"host": "localhost:8123", "origin": "http://localhost:8123"},
    {"host": "LOCALHOST:8123", "origin": "http://[::1]:8123"},
    {"host": "[::1]:8123", "origin": "http://127.0.0.1:8123"},
])
def test_its_own_names_are_answered(headers: dict[str, str]) -> None:
    app, transport = gateway()
    assert request(app, headers).status == 202
    assert transport.received == [b"{}"]


def test_a_deployment_names_more_hosts_and_origins() -> None:
    app, transport = gateway(allowed_hosts=["mcp.example.com", "gw.internal:*"],
                             allowed_origins=["https://ide.example.com", "http://localhost:*"])
    for headers in ({"host": "mcp.example.com", "origin": "https://ide.example.com"},
                    {"host": "gw.internal:9000"},
                    {"host": "127.0.0.1:8123", "origin": "http://localhost:6274"}):
        assert request(app, headers).status == 202, headers
    # A page of a name it is reached by (through a proxy that adds TLS, or not).
    for origin in ("https://mcp.example.com", "http://gw.internal:9000"):
        assert request(app, {"host": "127.0.0.1:8123", "origin": origin}).status == 202
    assert request(app, {"host": "gw.internal:x"}).status == 421
    assert request(app, {"host": "mcp.example.com", "origin": "https://ide.example.org"}
                   ).status == 403
    assert len(transport.received) == 5


def test_the_hosts_of_each_kind_of_bind() -> None:
    loopback = ["127.0.0.1:80", "localhost:80", "[::1]:80"]
    assert transport_security("127.0.0.1", 80).allowed_hosts == loopback
    assert transport_security("0.0.0.0", 80).allowed_hosts == loopback
    assert transport_security("::1", 80).allowed_hosts == [
        "[::1]:80", "127.0.0.1:80", "localhost:80"]
    lan = transport_security("192.168.1.5", 80, allowed_hosts=["gw.lan:80"])
    assert lan.allowed_hosts == ["192.168.1.5:80", "gw.lan:80"]
    assert lan.allowed_origins == ["http://192.168.1.5:80", "http://gw.lan:80",
                                   "https://gw.lan:80"]


def test_on_port_80_a_host_and_origin_without_the_port_are_its_own() -> None:
    """Clients leave a scheme's default port out (httpx, so the SDK's client, sends `Host:
    127.0.0.1`): found by an attacker, a gateway on port 80 refused every client."""
    made = HttpGateway(GatewayConfig(url="http://gov", key="k", agent="a"),
                       client=None, upstream_url="http://up/mcp",  # type: ignore[arg-type]
                       security=transport_security("0.0.0.0", 80,
                                                   allowed_hosts=["gw.example:*"]))
    transport = Transport()
    made.sessions["s"] = transport  # type: ignore[assignment]
    for headers in ({"host": "127.0.0.1"}, {"host": "localhost:80"},
                    {"host": "localhost", "origin": "http://localhost"},
                    {"host": "gw.example"}, {"host": "gw.example", "origin": "https://gw.example"}):
        assert request(made, headers).status == 202, headers
    assert request(made, {"host": "127.0.0.1:8080"}).status == 421
    assert request(made, {"host": "127.0.0.1", "origin": "http://localhost:8080"}).status == 403
    assert request(made, {"host": "gw.example:\u0663"}).status == 421  # an Arabic-Indic 3


def test_the_command_line_takes_more_hosts_and_origins() -> None:
    base = ["--url", "u", "--key", "k", "--agent", "a", "--upstream-url", "http://up/mcp",
            "--listen", "127.0.0.1:9000"]
    args, _ = parse([*base, "--allowed-host", "mcp.example.com", "--allowed-host", "gw:*",
                     "--allowed-origin", "https://ide.example.com"])
    assert args.allowed_host == ["mcp.example.com", "gw:*"]
    assert args.allowed_origin == ["https://ide.example.com"]


@pytest.mark.parametrize("extra", [
    ["--allowed-host", "evil.example/path"],
    ["--allowed-host", "a b"],
    ["--allowed-origin", "evil.example"],              # no scheme
    ["--allowed-origin", "https://ide.example.com/"],  # a path
])
def test_bad_hosts_and_origins_exit_2(extra: list[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse(["--url", "u", "--key", "k", "--agent", "a", "--upstream-url", "http://up/mcp",
               "--listen", "127.0.0.1:9000", *extra])
    assert exited.value.code == 2


def test_hosts_and_origins_go_with_listen() -> None:
    with pytest.raises(SystemExit) as exited:
        parse(["--url", "u", "--key", "k", "--agent", "a", "--allowed-host", "x", "--", "cmd"])
    assert exited.value.code == 2
