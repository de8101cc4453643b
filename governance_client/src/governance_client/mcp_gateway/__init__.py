"""``governance-mcp``: a governing MCP proxy (SPEC 19). Needs the ``[mcp]`` extra.

Between an MCP client (Claude Desktop and Code, Cursor, the Agents SDK, LangChain's MCP
adapters) and an MCP server, every ``tools/call`` is checked first (one run per MCP session),
the policy's denied tools are left out of ``tools/list``, and everything else passes through
unchanged. See ``docs/mcp.md``.
"""

from .cli import main
from .session import GatewayConfig, GatewaySession

__all__ = ["GatewayConfig", "GatewaySession", "main"]
