"""``governance-mcp``: the MCP gateway's command line (SPEC 19).

    governance-mcp --url URL --key KEY --agent NAME [--policy P] [--fail-open]
                   [--max-wait S] [--name SERVER] [--parent-run-id RUN] -- COMMAND [ARGS...]
    governance-mcp --url URL --key KEY --agent NAME --upstream-url URL --listen HOST:PORT
                   [--allowed-host HOST:PORT]... [--allowed-origin ORIGIN]...

The first form spawns the upstream MCP server COMMAND over stdio and serves the MCP client
over its own stdio (what Claude Desktop, Claude Code, Cursor and the Agents SDK's
``MCPServerStdio`` start); the second serves streamable HTTP and reaches the upstream over
streamable HTTP. ``GOVERNANCE_URL`` and ``GOVERNANCE_KEY`` may replace ``--url`` and ``--key``.
Logs go to stderr: stdout is the MCP wire.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
from collections.abc import Sequence

import anyio

from ..aio import AsyncGovernanceClient
from ..errors import agent_key_problem
from .session import GatewayConfig, GatewaySession, make_client

# With --listen, each session holds an upstream session, a run and about 1 MB of the
# gateway's memory for up to 30 minutes idle: without a cap, 300 initialize requests of 200
# bytes took 270 MB and started 300 runs (found by an attacker).
MAX_SESSIONS = 100

# What a Host header (a name or an address, an IPv6 one in brackets, and a port or `*`) and an
# Origin (its scheme too, no path) look like: a typo is said at the start, not found as every
# request refused.
_HOST = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(:([0-9]{1,5}|\*))?")
_ORIGIN = re.compile(rf"https?://{_HOST.pattern}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="governance-mcp",
        description="Govern every MCP tool call with the agent governance check.",
        epilog="Example: governance-mcp --agent my-agent -- npx -y "
               "@modelcontextprotocol/server-filesystem /tmp")
    parser.add_argument("--url", default=os.environ.get("GOVERNANCE_URL"),
                        help="the governance service (default: $GOVERNANCE_URL)")
    parser.add_argument("--key", default=os.environ.get("GOVERNANCE_KEY"),
                        help="an agent key (default: $GOVERNANCE_KEY)")
    parser.add_argument("--agent", required=True, help="the agent name of the runs")
    parser.add_argument("--policy", help="the policy of the runs (default: the team's default)")
    parser.add_argument("--fail-open", action="store_true",
                        help="while the service is unreachable, decide locally with the "
                             "run's policy (the client's defaults if the session started "
                             "during the outage) and upload later (default: refuse every "
                             "call)")
    parser.add_argument("--max-wait", type=float, default=30.0, metavar="S",
                        help="how long a rate-limited call waits before it is refused "
                             "(default 30)")
    parser.add_argument("--name", metavar="SERVER",
                        help="SERVER in the action names <SERVER>.<tool> (default: the "
                             "upstream's declared name)")
    parser.add_argument("--parent-run-id", metavar="RUN",
                        default=os.environ.get("GOVERNANCE_PARENT_RUN_ID") or None,
                        help="start each session's run as a sub-agent's run under RUN, so the "
                             "parent's limits bound it (default: $GOVERNANCE_PARENT_RUN_ID; "
                             "none: a root run)")
    parser.add_argument("--upstream-url", help="the upstream MCP server's streamable HTTP URL")
    parser.add_argument("--listen", metavar="HOST:PORT",
                        help="serve streamable HTTP there (with --upstream-url)")
    parser.add_argument("--allowed-host", action="append", default=[], metavar="HOST:PORT",
                        help="with --listen: one more Host the gateway answers to, and its "
                             "http:// and https:// origins (repeatable; HOST:* for any port), "
                             "e.g. the name a proxy in front of it is reached by (default: "
                             "the --listen address, and the loopback names of its port on a "
                             "loopback or every-address bind)")
    parser.add_argument("--allowed-origin", action="append", default=[], metavar="ORIGIN",
                        help="with --listen: one more Origin whose pages may use the gateway "
                             "(repeatable; e.g. https://ide.example.com, http://localhost:*; "
                             "default: the origins of the allowed hosts); a request "
                             "without an Origin (not a browser's) is answered on its Host")
    parser.add_argument("--max-sessions", type=int, default=MAX_SESSIONS, metavar="N",
                        help="with --listen: the most MCP sessions open at once; past it an "
                             f"initialize is answered 503 (default {MAX_SESSIONS})")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="-- COMMAND [ARGS...]: the upstream MCP server to spawn over stdio")
    return parser


def parse(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, GatewayConfig]:
    parser = _parser()
    args = parser.parse_args(argv)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    args.command = command
    if not args.url or not args.key:
        parser.error("--url and --key (or GOVERNANCE_URL and GOVERNANCE_KEY) are required")
    problem = agent_key_problem(args.key)
    if problem is not None:
        # Before anything starts: sent as it is, no request could carry it, and the gateway
        # took that for an outage (with --fail-open, every call ran ungoverned).
        parser.error(f"--key (or GOVERNANCE_KEY): {problem}; give it exactly as it was "
                     "issued (the key is not shown here)")
    if args.max_wait < 0:
        parser.error("--max-wait must be >= 0")
    if args.max_sessions < 1:
        parser.error("--max-sessions must be >= 1")
    http = args.upstream_url is not None or args.listen is not None
    if http and (args.upstream_url is None or args.listen is None):
        parser.error("--upstream-url and --listen go together")
    if http and command:
        parser.error("give either -- COMMAND [ARGS...] or --upstream-url and --listen")
    if not http and not command:
        parser.error("give the upstream: -- COMMAND [ARGS...], or --upstream-url and --listen")
    if args.listen is not None:
        host, _, port = args.listen.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            parser.error("--listen must be HOST:PORT")
        args.host, args.port = host.strip("[]"), int(port)
    elif args.allowed_host or args.allowed_origin:
        parser.error("--allowed-host and --allowed-origin go with --listen")
    for name in args.allowed_host:
        if not _HOST.fullmatch(name):
            parser.error(f"--allowed-host {name!r} is not HOST or HOST:PORT (or HOST:*)")
    for origin in args.allowed_origin:
        if not _ORIGIN.fullmatch(origin):
            parser.error(f"--allowed-origin {origin!r} is not an origin: "
                         "http[s]://HOST[:PORT] (or :*), no path")
    config = GatewayConfig(url=args.url, key=args.key, agent=args.agent, policy=args.policy,
                           fail_open=args.fail_open, max_wait=args.max_wait, name=args.name,
                           parent_run_id=args.parent_run_id)
    return args, config


async def serve_stdio(config: GatewayConfig, command: Sequence[str]) -> str | None:
    """Relay the client on this process's stdio to the upstream COMMAND; the run's end."""
    client = make_client(config)
    session = GatewaySession(config, client)
    try:
        async with anyio.create_task_group() as tg:
            # SIGTERM (a client's shutdown after its grace period) or SIGINT: the session
            # ends there, its run finished (`_end_on_signal`).
            tg.start_soon(_end_on_signal, session, client)
            await _relay(session, command)
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await session.finish()
            await client.aclose()
    return session.status


async def _end_on_signal(session: GatewaySession, client: AsyncGovernanceClient) -> None:
    """SIGTERM or SIGINT ends the session: its run is finished (`completed`, or `stopped`
    after a stop), then the process exits. Not by cancelling the relay: the SDK's stdio
    transport reads stdin in a thread that only the client's EOF ends, so a client that
    signals without closing stdin (a supervisor, Ctrl-C in a terminal) waited on a process
    that neither exited nor finished its run, left `running` until abandoned (found by a
    review)."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            break
    with anyio.CancelScope(shield=True):
        await session.finish()
        await client.aclose()
    logging.shutdown()
    os._exit(1 if session.status == "failed" else 0)


async def _relay(session: GatewaySession, command: Sequence[str]) -> None:
    from mcp.client.stdio import StdioServerParameters, stdio_client
    from mcp.server.stdio import stdio_server

    async with stdio_server() as (client_read, client_write):
        try:
            # The upstream gets this process's whole environment, as if started directly.
            params = StdioServerParameters(command=command[0], args=list(command[1:]),
                                           env=dict(os.environ))
            async with stdio_client(params) as (up_read, up_write):
                session._client_write = client_write
                await session.serve(client_read, client_write, up_read, up_write)
            # The client left: nothing more to write (the transport's writer ends with it).
            await client_write.aclose()
        except Exception as exc:
            logging.getLogger("governance_client.mcp").error(
                "upstream %s failed: %s", command[0], exc)
            session._client_write = client_write
            await session.upstream_failed(f"the upstream MCP server {command[0]} failed")
        if session.upstream_gone is not None:
            # The upstream is gone, so is the session: the run ends `failed`, the answers
            # already sent reach stdout, and the process exits (the SDK's stdio transport
            # reads stdin in a thread that only the client's EOF would end).
            with anyio.CancelScope(shield=True):
                await session.finish()
                await client_write.aclose()
                await anyio.sleep(0.2)
            logging.shutdown()
            os._exit(1)


async def serve_http(config: GatewayConfig, upstream_url: str, host: str, port: int,
                     max_sessions: int = MAX_SESSIONS, allowed_hosts: Sequence[str] = (),
                     allowed_origins: Sequence[str] = ()) -> None:
    from .http import HttpGateway, transport_security

    security = transport_security(host, port, allowed_hosts=allowed_hosts,
                                  allowed_origins=allowed_origins)
    await HttpGateway(config, make_client(config), upstream_url, max_sessions=max_sessions,
                      security=security).serve(host, port)


def main(argv: Sequence[str] | None = None) -> int:
    args, config = parse(argv)
    logging.basicConfig(level=os.environ.get("GOVERNANCE_MCP_LOG", "WARNING").upper(),
                        stream=sys.stderr, format="governance-mcp: %(levelname)s %(message)s")
    if args.command:
        status = anyio.run(serve_stdio, config, args.command)
        return 1 if status == "failed" else 0
    from .http import ListenError

    try:
        anyio.run(serve_http, config, args.upstream_url, args.host, args.port,
                  args.max_sessions, args.allowed_host, args.allowed_origin)
    except ListenError as exc:
        print(f"governance-mcp: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
