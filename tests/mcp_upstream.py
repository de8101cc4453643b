"""A small upstream MCP server for the gateway's tests (tests/test_mcp_gateway.py), on the
SDK's MCPServer: ``python -m tests.mcp_upstream`` (stdio) or ``... http PORT``."""

from __future__ import annotations

import json
import sys

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import SamplingMessage, TextContent

server = MCPServer("files")
calls = {"count": 0}


@server.tool()
def search(query: str) -> str:
    """Always the same result, whatever the query."""
    return "no match"


@server.tool()
def counter() -> str:
    """A new result at every call (progress)."""
    calls["count"] += 1
    return f"call {calls['count']}"


@server.tool()
def broken(path: str) -> str:
    """Always fails (a ToolError: the SDK answers it with its text, without a traceback)."""
    raise ToolError(f"cannot open {path}")


@server.tool()
def delete_all() -> str:
    """A tool the tests' policy denies."""
    return "deleted"


@server.tool()
def publish(title: str) -> str:
    """A tool the tests' policy puts behind an operator's approval."""
    return f"published {title}"


@server.tool()
async def ask(question: str, ctx: Context) -> str:
    """Asks the client's model (sampling, a request of the server), reporting progress."""
    await ctx.report_progress(1, 2, "asking")
    answer = await ctx.session.create_message(
        [SamplingMessage(role="user", content=TextContent(type="text", text=question))],
        max_tokens=10)
    await ctx.report_progress(2, 2, "answered")
    return f"the model says: {answer.content.text}"


@server.tool()
def exit_now() -> str:
    """The upstream dies in the middle of a call."""
    import os

    os._exit(3)


@server.tool()
def garbage(ctx: Context) -> str:
    """Writes a line that is not JSON and an answer to this very call of the wrong shape on
    the transport's stdout, then answers the call properly (an upstream with a bug)."""
    import os

    from mcp.server import stdio

    # The SDK serves the wire from a duplicate of fd 1 and points fd 1 at stderr, so that a
    # stray print cannot corrupt it: a bug that reaches the wire writes to the duplicate.
    claim = getattr(stdio, "_claims", {}).get(1)
    wire = claim.private_fd if claim is not None and claim.private_fd is not None else 1
    os.write(wire, b"this is not json-rpc\n")
    # The context gives the id as text; the call's id on the wire is the client's (a number).
    request_id = int(ctx.request_id) if str(ctx.request_id).isdigit() else ctx.request_id
    os.write(wire, json.dumps({"jsonrpc": "2.0", "id": request_id,
                               "result": "not an object"}).encode() + b"\n")
    return "garbage written"


@server.tool()
async def hang() -> str:
    """Never answers (an upstream stuck in a call)."""
    await anyio.sleep_forever()
    return "never"


@server.resource("doc://readme", mime_type="text/plain")
def readme() -> str:
    return "Read me: ünïcødé  spaces\tand tabs\n"


@server.prompt()
def review(code: str) -> str:
    """Review some code."""
    return f"Please review:\n{code}"


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "http":
        server.run(transport="streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
