"""The MCP gateway (SPEC 19) end to end: the `mcp` SDK's own client, `governance-mcp` as a real
process, a real upstream MCP server (tests/mcp_upstream.py) and the real governance server.

Over stdio: a loop refused at the policy's step, a denied tool hidden and refused, a rate-limited
call that waits, an approval decided from `manage.py approvals decide`, the kill switch, the
faults (an upstream that dies, a call before initialize, malformed JSON, the service down, an
approval denied), and resources and prompts passed through unchanged with an unchanged client
configuration. Over streamable HTTP on both sides: the same governance, and the session's end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import anyio
import httpx
import pytest
from django.core.management import call_command
from mcp.client.client import Client
from mcp.client.stdio import StdioServerParameters

from policies.models import Team
from runs.killswitch.services import killswitch_engage
from runs.models import Approval, Run
from tests.conftest import ROOT, Agent, Server, free_port, set_policy
from tests.workers import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

AGENT = "mcp-agent"
UPSTREAM = [sys.executable, "-m", "tests.mcp_upstream"]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(
    [str(ROOT), str(ROOT / "governance_client" / "src"), os.environ.get("PYTHONPATH", "")])}


def gateway_args(server: Server, token: str, *extra: str) -> list[str]:
    return ["-m", "governance_client.mcp_gateway", "--url", server.url, "--key", token,
            "--agent", AGENT, *extra]


def stdio_params(server: Server, token: str, *extra: str) -> StdioServerParameters:
    """The MCP client's configuration of the governed server: the gateway's command, the
    upstream's command after ``--``."""
    return StdioServerParameters(command=sys.executable,
                                 args=[*gateway_args(server, token, *extra), "--", *UPSTREAM],
                                 env=ENV, cwd=str(ROOT))


def direct_params() -> StdioServerParameters:
    return StdioServerParameters(command=UPSTREAM[0], args=UPSTREAM[1:], env=ENV, cwd=str(ROOT))


def the_run(agent: Agent) -> dict[str, Any]:
    runs = agent.http.get("/api/v1/runs", params={"agent": AGENT}).json()["runs"]
    assert len(runs) == 1, runs
    return runs[0]


def finished_run(agent: Agent) -> dict[str, Any]:
    return wait_for(lambda: (lambda r: r if r["status"] != "running" else None)(the_run(agent)),
                    timeout=20, what="the run's end")


def text(result: Any) -> str:
    return "\n".join(item.text for item in result.content if item.type == "text")


def run_async(main: Any) -> Any:
    return anyio.run(main)


# --- stdio -----------------------------------------------------------------------------------

def test_a_loop_of_identical_calls_is_refused_at_the_policys_step_and_stops_the_run(
        server: Server, agent: Agent, team: Team) -> None:
    set_policy(team, step_limits={"max_steps": 50, "max_repeat_action": 3,
                                  "no_progress_window": 10})

    async def main() -> list[Any]:
        async with Client(stdio_params(server, agent.token), mode="legacy") as client:
            results = [await client.call_tool("search", {"query": "refund"}) for _ in range(4)]
            results.append(await client.call_tool("counter", {}))
            return results

    results = run_async(main)
    assert [r.is_error for r in results] == [False, False, False, True, True]
    assert all(text(r).startswith("no match") for r in results[:3])
    refused = text(results[3])
    assert refused.startswith("Blocked by governance (loop_detected): ")
    assert "max_repeat_action=3" in refused
    assert text(results[4]) == refused  # every later call is answered the same way

    run = finished_run(agent)
    assert (run["status"], run["stop_reason"], run["steps"]) == ("stopped", "loop_detected", 4)
    decisions = agent.http.get(f"/api/v1/runs/{run['run_id']}/decisions").json()["decisions"]
    assert [d["outcome"] for d in decisions] == ["allow", "allow", "allow", "stop"]
    assert {d["action"]["name"] for d in decisions} == {"files.search"}
    assert decisions[0]["action"]["args"] == {"query": "refund"}


def test_results_are_reported_so_repeated_errors_and_no_progress_count(
        server: Server, agent: Agent, team: Team) -> None:
    set_policy(team, step_limits={"max_steps": 50, "max_repeat_action": 100,
                                  "no_progress_window": 3},
               on_repeated_error={"threshold": 2, "action": "nudge"})

    async def main() -> list[Any]:
        async with Client(stdio_params(server, agent.token), mode="legacy") as client:
            out = [await client.call_tool("broken", {"path": f"/tmp/{i}"}) for i in range(3)]
            return out

    results = run_async(main)
    assert all(r.is_error for r in results)
    # The third call carries the second report of the same error: the nudge is appended.
    assert "cannot open" in text(results[0])
    run = finished_run(agent)
    decisions = agent.http.get(f"/api/v1/runs/{run['run_id']}/decisions").json()["decisions"]
    detail = agent.http.get(f"/api/v1/decisions/{decisions[2]['id']}").json()
    assert detail["last_result"]["status"] == "error"
    assert detail["last_result"]["digest"]
    assert detail["directive"] and detail["directive"]["content"] in text(results[2])


def test_a_denied_tool_is_left_out_of_tools_list_and_refused_if_called(
        server: Server, agent: Agent, team: Team) -> None:
    set_policy(team, tools={"allow": None, "deny": ["files.delete_*"]})

    async def main() -> tuple[list[str], Any]:
        async with Client(stdio_params(server, agent.token), mode="legacy") as client:
            names = [tool.name for tool in (await client.list_tools()).tools]
            return names, await client.call_tool("delete_all", {})

    names, called = run_async(main)
    assert "delete_all" not in names and {"search", "broken", "counter"} <= set(names)
    assert called.is_error
    assert text(called).startswith("Blocked by governance (tool_denied): ")
    assert finished_run(agent)["stop_reason"] == "tool_denied"


def test_a_rate_limited_call_waits_and_succeeds(server: Server, agent: Agent,
                                                team: Team) -> None:
    set_policy(team, rate_limits=[{"match": "files.*", "per": "run", "max": 1, "window_s": 1}])

    async def main() -> tuple[list[Any], float]:
        async with Client(stdio_params(server, agent.token), mode="legacy") as client:
            first = await client.call_tool("counter", {})
            started = time.monotonic()
            second = await client.call_tool("counter", {})
            return [first, second], time.monotonic() - started

    (first, second), waited = run_async(main)
    assert (text(first), text(second)) == ("call 1", "call 2")
    assert not second.is_error and waited >= 0.5
    run = finished_run(agent)
    assert run["status"] == "completed"
    outcomes = [d["outcome"] for d in agent.http.get(
        f"/api/v1/runs/{run['run_id']}/decisions").json()["decisions"]]
    assert outcomes[0] == "allow" and "wait" in outcomes and outcomes[-1] == "allow"


def test_a_rate_limit_past_max_wait_answers_when_to_retry(server: Server, agent: Agent,
                                                          team: Team) -> None:
    set_policy(team, rate_limits=[{"match": "files.*", "per": "run", "max": 1,
                                   "window_s": 60}])

    async def main() -> list[Any]:
        async with Client(stdio_params(server, agent.token, "--max-wait", "0"),
                          mode="legacy") as client:
            return [await client.call_tool("counter", {}) for _ in range(2)]

    first, second = run_async(main)
    assert not first.is_error and second.is_error
    assert text(second).startswith("Blocked by governance (rate_limited): ")
    assert "Try again in" in text(second)
    assert finished_run(agent)["status"] == "completed"  # a wait is not a stop


@pytest.mark.parametrize("verdict", ["approve", "deny"])
def test_an_approval_decided_from_the_command_line_forwards_or_refuses_the_call(
        server: Server, agent: Agent, team: Team, verdict: str) -> None:
    set_policy(team, approvals={"tools": ["files.search"], "timeout_s": 600})

    def operator() -> None:
        request = wait_for(lambda: Approval.objects.filter(status="pending").first(),
                           timeout=30, what="the gateway's approval request")
        call_command("approvals", "decide", str(request.pk), verdict, "--note", "not today")

    async def main() -> Any:
        async with Client(stdio_params(server, agent.token), mode="legacy") as client:
            async with anyio.create_task_group() as tg:
                tg.start_soon(anyio.to_thread.run_sync, operator)
                return await client.call_tool("search", {"query": "pay"})

    result = run_async(main)
    if verdict == "approve":
        assert (result.is_error, text(result)) == (False, "no match")
        assert finished_run(agent)["status"] == "completed"
    else:
        assert result.is_error
        assert text(result).startswith("Blocked by governance (approval_denied): ")
        assert "not today" in text(result)
        assert finished_run(agent)["stop_reason"] == "approval_denied"


def test_the_kill_switch_refuses_the_next_call(server: Server, agent: Agent,
                                               team: Team) -> None:
    async def main() -> list[Any]:
        async with Client(stdio_params(server, agent.token), mode="legacy") as client:
            first = await client.call_tool("counter", {})
            with mock.patch("runs.killswitch.services._enqueue_fanout"):
                await anyio.to_thread.run_sync(lambda: killswitch_engage(
                    scope="agent", team=team, agent=AGENT, reason="runaway tool use"))
            return [first, await client.call_tool("counter", {}),
                    await client.call_tool("search", {"query": "x"})]

    first, second, third = run_async(main)
    assert not first.is_error and second.is_error
    assert text(second).startswith("Blocked by governance (killed): ")
    assert "runaway tool use" in text(second)
    assert text(third) == text(second)
    assert finished_run(agent)["status"] == "killed"


def test_an_unchanged_client_configuration_works_by_swapping_only_the_server_command(
        server: Server, agent: Agent) -> None:
    """The same Client configuration (default mode, its callbacks) against the upstream and
    against the gateway in front of it: the same tools, resources and prompts, byte for
    byte; only the command differs."""

    async def session(params: StdioServerParameters) -> dict[str, Any]:
        async with Client(params) as client:
            resources = await client.list_resources()
            read = await client.read_resource("doc://readme")
            prompts = await client.list_prompts()
            prompt = await client.get_prompt("review", {"code": "x = 1\n  y\t= 2"})
            tools = await client.list_tools()
            called = await client.call_tool("search", {"query": "q"})
            return {
                "resources": [r.model_dump(mode="json") for r in resources.resources],
                "read": [c.model_dump(mode="json") for c in read.contents],
                "prompts": [p.model_dump(mode="json") for p in prompts.prompts],
                "prompt": [m.model_dump(mode="json") for m in prompt.messages],
                "tools": sorted(t.name for t in tools.tools),
                "called": [c.model_dump(mode="json") for c in called.content],
            }

    async def main() -> tuple[dict[str, Any], dict[str, Any]]:
        direct = await session(direct_params())
        governed = await session(stdio_params(server, agent.token))
        return direct, governed

    direct, governed = run_async(main)
    assert json.dumps(governed, sort_keys=True) == json.dumps(direct, sort_keys=True)
    assert governed["read"][0]["text"] == "Read me: ünïcødé  spaces\tand tabs\n"
    assert the_run(agent)["steps"] == 1


# --- faults ----------------------------------------------------------------------------------

@contextmanager
def raw_gateway(server: Server, token: str, *extra: str) -> Iterator[subprocess.Popen[str]]:
    """The gateway as a bare process, spoken to in JSON lines (no SDK client to correct us)."""
    process = subprocess.Popen(
        [sys.executable, *gateway_args(server, token, *extra), "--", *UPSTREAM],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env=ENV, cwd=str(ROOT))
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)


def send(process: subprocess.Popen[str], message: Any) -> None:
    assert process.stdin is not None
    process.stdin.write((message if isinstance(message, str) else json.dumps(message)) + "\n")
    process.stdin.flush()


def receive(process: subprocess.Popen[str]) -> dict[str, Any]:
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line, "the gateway closed its stdout"
    return json.loads(line)


INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-11-25", "capabilities": {},
    "clientInfo": {"name": "raw", "version": "0"}}}


def test_a_call_before_initialize_and_malformed_json_are_json_rpc_errors(
        server: Server, agent: Agent) -> None:
    with raw_gateway(server, agent.token) as process:
        send(process, {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
                       "params": {"name": "search", "arguments": {"query": "x"}}})
        early = receive(process)
        assert early["id"] == 7 and early["error"]["code"] == -32600
        send(process, "{not json")
        assert receive(process)["error"]["code"] == -32700
        send(process, INITIALIZE)
        assert receive(process)["result"]["serverInfo"]["name"] == "files"
        send(process, {"jsonrpc": "2.0", "method": "notifications/initialized"})
        send(process, {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                       "params": {"name": "search", "arguments": "not an object"}})
        assert receive(process)["error"]["code"] == -32602
        send(process, {"jsonrpc": "2.0", "id": 3, "method": "no/such/method"})
        assert receive(process)["error"]["code"] == -32601  # the upstream's own answer
        send(process, {"jsonrpc": "2.0", "id": 4, "method": "ping"})
        assert receive(process) == {"jsonrpc": "2.0", "id": 4, "result": {}}
    # No tool call was checked: the run was started, nothing counted.
    assert the_run(agent)["steps"] == 0


def test_huge_arguments_are_checked_by_their_digest_and_forwarded_whole(
        server: Server, agent: Agent) -> None:
    big = "x" * (100 * 1024)

    async def main() -> Any:
        async with Client(stdio_params(server, agent.token), mode="legacy") as client:
            return await client.call_tool("search", {"query": big})

    assert text(run_async(main)) == "no match"
    run = finished_run(agent)
    decision = agent.http.get(f"/api/v1/runs/{run['run_id']}/decisions").json()["decisions"][0]
    assert decision["outcome"] == "allow"
    assert decision["action"]["args"]["oversize_args"]["keys"] == ["query"]


def test_an_upstream_that_dies_fails_the_call_and_the_run(server: Server,
                                                          agent: Agent) -> None:
    async def main() -> str:
        async with Client(stdio_params(server, agent.token), mode="legacy") as client:
            await client.call_tool("counter", {})
            with pytest.raises(Exception) as died:  # noqa: PT011 - any error, never a hang
                with anyio.fail_after(20):
                    await client.call_tool("exit_now", {})
            return str(died.value)

    run_async(main)
    run = finished_run(agent)
    assert run["status"] == "failed"


def test_the_service_down_refuses_calls_by_default_and_forwards_them_with_fail_open(
        server: Server, agent: Agent) -> None:
    closed_port = free_port()
    down = Server(url=f"http://127.0.0.1:{closed_port}", process=None)  # type: ignore[arg-type]

    async def main(*extra: str) -> Any:
        async with Client(stdio_params(down, agent.token, *extra), mode="legacy") as client:
            tools = [t.name for t in (await client.list_tools()).tools]
            assert "search" in tools
            return await client.call_tool("search", {"query": "x"})

    refused = run_async(main)
    assert refused.is_error
    assert text(refused).startswith("Blocked by governance (governance_unavailable): ")
    forwarded = anyio.run(main, "--fail-open")
    assert (forwarded.is_error, text(forwarded)) == (False, "no match")


# --- streamable HTTP -------------------------------------------------------------------------

@contextmanager
def process(*args: str, port: int) -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, *args], env=ENV, cwd=str(ROOT),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        def up() -> bool:
            try:
                httpx.get(url, timeout=1)
            except httpx.TransportError:
                assert proc.poll() is None, "the process exited"
                return False
            return True

        wait_for(up, timeout=30, what=f"{args[1]} on port {port}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_over_streamable_http_both_sides(server: Server, agent: Agent, team: Team) -> None:
    set_policy(team, step_limits={"max_steps": 50, "max_repeat_action": 2,
                                  "no_progress_window": 10},
               tools={"allow": None, "deny": ["files.delete_*"]})
    up_port, gw_port = free_port(), free_port()
    with process("-m", "tests.mcp_upstream", "http", str(up_port), port=up_port) as upstream, \
            process(*gateway_args(server, agent.token), "--upstream-url", upstream,
                    "--listen", f"127.0.0.1:{gw_port}", port=gw_port) as gateway:

        async def session(url: str) -> dict[str, Any]:
            async with Client(url) as client:
                read = await client.read_resource("doc://readme")
                prompt = await client.get_prompt("review", {"code": "a\tb"})
                tools = sorted(t.name for t in (await client.list_tools()).tools)
                calls = [await client.call_tool("search", {"query": "q"}) for _ in range(3)]
                denied = await client.call_tool("delete_all", {})
                return {"read": [c.model_dump(mode="json") for c in read.contents],
                        "prompt": [m.model_dump(mode="json") for m in prompt.messages],
                        "tools": tools, "calls": calls, "denied": denied}

        async def main() -> tuple[dict[str, Any], dict[str, Any]]:
            return await session(upstream), await session(gateway)

        direct, governed = anyio.run(main)
        assert governed["read"] == direct["read"] and governed["prompt"] == direct["prompt"]
        assert "delete_all" in direct["tools"] and "delete_all" not in governed["tools"]
        assert [c.is_error for c in governed["calls"]] == [False, False, True]
        assert text(governed["calls"][2]).startswith("Blocked by governance (loop_detected)")
        assert text(governed["denied"]) == text(governed["calls"][2])
        run = finished_run(agent)
        assert (run["status"], run["stop_reason"]) == ("stopped", "loop_detected")
        stored = Run.objects.get(pk=run["run_id"])
        assert stored.external_id  # the gateway's MCP session id

        # A second session is a second run, finished `completed` when the client deletes it.
        async def quiet() -> None:
            async with Client(gateway) as client:
                await client.call_tool("counter", {})

        anyio.run(quiet)
        runs = agent.http.get("/api/v1/runs", params={"agent": AGENT}).json()["runs"]
        wait_for(lambda: agent.http.get(f"/api/v1/runs/{runs[0]['run_id']}").json()["status"]
                 == "completed", timeout=20, what="the second run's end")
