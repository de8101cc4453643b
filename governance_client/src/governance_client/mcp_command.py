"""The ``governance-mcp`` command's entry point, apart from the gateway's package: the gateway
imports the ``mcp`` SDK, which only the ``[mcp]`` extra installs, and a command installed
without it should say so in one line instead of a traceback."""

from __future__ import annotations

import sys
from collections.abc import Sequence

# The client is on no package index: the extra is installed from a checkout of the repository
# (a bare "governance-client[mcp]" finds nothing there, or someone else's package).
MISSING_SDK = ("governance-mcp: the MCP gateway needs the MCP SDK, which the client's [mcp] "
               "extra installs, from a checkout of this repository: "
               "pip install \"./governance_client[mcp]\" (into the checkout's own .venv: "
               ".venv/bin/pip install -e \"./governance_client[mcp]\")")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        from .mcp_gateway.cli import main as gateway
    except ModuleNotFoundError as exc:
        if exc.name != "mcp" and not (exc.name or "").startswith("mcp."):
            raise
        print(MISSING_SDK, file=sys.stderr)
        return 2
    return gateway(argv)
