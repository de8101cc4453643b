"""What the gateway forwards of the MCP client's notifications (SPEC 19): the notifications
a client sends, and nothing else. Found by a tester: a `tools/call` sent without an id (or with
`"id": null`, which the SDK reads as no id) is a notification, and the relay forwarded every
notification whatever its method, so the call ran upstream with no check and no audit.

In process: a gateway session between the client's lines, read as the SDK's transports read
them, and a raw upstream that records everything it receives and answers what it is asked;
the client's fake service (``FakeGovernance``) decides.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import anyio
import pytest

pytest.importorskip("mcp")

from mcp.shared.message import SessionMessage
from mcp_types import JSONRPCRequest, JSONRPCResponse, jsonrpc_message_adapter

from governance_client.mcp_gateway.session import GatewayConfig, GatewaySession
from governance_client.testing import FakeGovernance

INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-11-25", "capabilities": {},
    "clientInfo": {"name": "raw", "version": "0"}}}
CALL = {"method": "tools/call", "params": {"name": "delete_all", "arguments": {}}}


def relayed(lines: list[Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]],
                                       FakeGovernance]:
    """Send ``lines`` through a gateway session (each read as stdio's and streamable HTTP's
    transports read a message); what the upstream received, what the client got back, and
    the fake service."""
    fake = FakeGovernance()
    received: list[dict[str, Any]] = []
    answered: list[dict[str, Any]] = []

    async def main() -> None:
        client_in, from_client = anyio.create_memory_object_stream[Any](100)
        to_client, client_out = anyio.create_memory_object_stream[Any](100)
        to_upstream, upstream_in = anyio.create_memory_object_stream[Any](100)
        upstream_out, from_upstream = anyio.create_memory_object_stream[Any](100)

        async def upstream() -> None:
            async for item in upstream_in:
                message = item.message
                received.append(message.model_dump(mode="json", exclude_none=True))
                if isinstance(message, JSONRPCRequest):
                    result = {"protocolVersion": "2025-11-25", "capabilities": {},
                              "serverInfo": {"name": "files", "version": "0"}} \
                        if message.method == "initialize" else \
                        {"content": [{"type": "text", "text": "ran"}], "isError": False}
                    await upstream_out.send(SessionMessage(JSONRPCResponse(
                        jsonrpc="2.0", id=message.id, result=result)))

        async def client() -> None:
            for line in lines:
                text = line if isinstance(line, str) else json.dumps(line)
                await client_in.send(SessionMessage(
                    jsonrpc_message_adapter.validate_json(text, by_name=False)))
                if isinstance(line, dict) and "id" in line and line["id"] is not None:
                    with anyio.fail_after(10):  # its answer before the next line
                        answered.append((await client_out.receive()).message.model_dump(
                            mode="json", exclude_none=True))
            await client_in.aclose()

        async with fake.async_client() as governance, anyio.create_task_group() as tg:
            config = GatewayConfig(url="http://governance.test", key=fake.api_key,
                                   agent="mcp-agent")
            session = GatewaySession(config, governance)
            tg.start_soon(upstream)
            tg.start_soon(client)
            with anyio.fail_after(20):
                await session.serve(from_client, to_client, from_upstream, to_upstream)
            tg.cancel_scope.cancel()

    anyio.run(main)
    return received, answered, fake


def test_a_tools_call_sent_as_a_notification_never_reaches_the_upstream(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="governance_client.mcp")
    received, answered, fake = relayed([
        INITIALIZE,
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        {"jsonrpc": "2.0", **CALL},                 # no id
        {"jsonrpc": "2.0", "id": None, **CALL},     # "id": null, read as no id
        {"jsonrpc": "2.0", "method": "ping"},       # any other request sent so
        {"jsonrpc": "2.0", "method": "notifications/made_up"},
        {"jsonrpc": "2.0", "method": "notifications/roots/list_changed"},
        {"jsonrpc": "2.0", "method": "notifications/progress",
         "params": {"progressToken": "t", "progress": 1}},
        {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
         "params": {"name": "search", "arguments": {"q": "x"}}},
    ])
    assert [(m.get("id"), m["method"]) for m in received if "method" in m] == [
        (1, "initialize"), (None, "notifications/initialized"),
        (None, "notifications/roots/list_changed"), (None, "notifications/progress"),
        (2, "tools/call")]
    assert [a["id"] for a in answered] == [1, 2]  # a notification is answered nothing
    (run,) = fake.runs.values()
    assert [c["action"]["name"] for c in run.checks] == ["files.search"]
    dropped = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 1 and dropped[0].levelno == logging.WARNING  # once a session
    assert "'tools/call'" in dropped[0].getMessage()
