"""What a request's body may cost the HTTP gateway (``governance-mcp --listen``), in process:
its ASGI application with a stand-in for the SDK's session transport (the gateway end to end:
the project's tests/test_mcp_gateway.py)."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest

pytest.importorskip("mcp")

from governance_client.mcp_gateway.http import MAX_REQUEST_BODY, HttpGateway
from governance_client.mcp_gateway.session import GatewayConfig

CHUNK = 1024 * 1024


class Transport:
    """Stands for the SDK's transport of one session: what reached it."""

    is_terminated = False

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []

    async def handle_request(self, scope: Any, receive: Any, send: Any) -> None:
        self.received.append(await receive())


def post(gateway: HttpGateway, chunks: int) -> tuple[list[dict[str, Any]], int]:
    """POST `chunks` MiB on session "s"; the gateway's answer, and how many chunks it read."""
    read = 0

    async def receive() -> dict[str, Any]:
        nonlocal read
        read += 1
        return {"type": "http.request", "body": b"x" * CHUNK, "more_body": read < chunks}

    answered: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        answered.append(message)

    scope = {"type": "http", "method": "POST",
             "headers": [(b"host", b"127.0.0.1:8123"), (b"mcp-session-id", b"s")]}
    anyio.run(gateway, scope, receive, send)
    return answered, read


def test_a_sessions_request_past_the_bound_is_refused_unread_and_the_session_goes_on() -> None:
    """Found by an attacker: the SDK's transport read a session's request whole (a 300 MB
    ping took the gateway from 83 MB to 1.26 GB, and it was forwarded upstream)."""
    gateway = HttpGateway(GatewayConfig(url="http://gov", key="k", agent="a"),
                          client=None, upstream_url="http://up/mcp")  # type: ignore[arg-type]
    transport = Transport()
    gateway.sessions["s"] = transport  # type: ignore[assignment]
    answered, read = post(gateway, 40)
    assert answered[0]["status"] == 413
    assert "too large" in json.loads(answered[1]["body"])["error"]["message"]
    assert read == MAX_REQUEST_BODY // CHUNK + 1  # read no further than past the bound
    assert transport.received == [] and "s" in gateway.sessions
    # Within the bound the transport gets the body the gateway read, whole.
    answered, read = post(gateway, 2)
    assert answered == [] and read == 2
    assert transport.received == [{"type": "http.request", "body": b"x" * 2 * CHUNK,
                                   "more_body": False}]
