"""The MCP gateway (SPEC 19) end to end: the `mcp` SDK's own client, `governance-mcp` as a real
process, a real upstream MCP server (tests/mcp_upstream.py) and the real governance server.

Over stdio: a loop refused at the policy's step, a denied tool hidden and refused, a rate-limited
call that waits, an approval decided from `manage.py approvals decide`, the kill switch, the
faults (an upstream that dies, a call before initialize, malformed JSON, the service down, an
approval denied), and resources and prompts passed through unchanged with an unchanged client
configuration. Over streamable HTTP on both sides: the same governance, and the session's end.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import anyio
import httpx
import pytest
from django.core.management import call_command
from django.db import connection
from governance_client.mcp_gateway.session import START_RETRY_S
from mcp.client.client import Client
from mcp.client.stdio import StdioServerParameters
from mcp_types import CreateMessageResult, TextContent

from policies.models import Team
from runs.killswitch.services import killswitch_engage
from runs.models import Approval, Run
from runs.models import Decision as AuditRecord
from tests.conftest import ROOT, Agent, Server, free_port, set_policy
from tests.workers import terminate, wait_for

# Processes and a real server: once, on the PostgreSQL stack (the gateway is the same on both).
pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

AGENT = "mcp-agent"
UPSTREAM = [sys.executable, "-m", "tests.mcp_upstream"]


def child_env() -> dict[str, str]:
    """The processes' environment: the test's (its client journal folder included, set by a
    session fixture after this module is imported), with the sources on the path."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), str(ROOT / "governance_client" / "src"), os.environ.get("PYTHONPATH", "")])}


def gateway_args(server: Server, token: str, *extra: str) -> list[str]:
    return ["-m", "governance_client.mcp_gateway", "--url", server.url, "--key", token,
            "--agent", AGENT, *extra]


def stdio_params(server: Server, token: str, *extra: str) -> StdioServerParameters:
    """The MCP client's configuration of the governed server: the gateway's command, the
    upstream's command after ``--``."""
    return StdioServerParameters(command=sys.executable,
                                 args=[*gateway_args(server, token, *extra), "--", *UPSTREAM],
                                 env=child_env(), cwd=str(ROOT))


def direct_params() -> StdioServerParameters:
    return StdioServerParameters(command=UPSTREAM[0], args=UPSTREAM[1:], env=child_env(),
                                 cwd=str(ROOT))


def the_run(agent: Agent) -> dict[str, Any]:
    runs = agent.http.get("/api/v1/runs", params={"agent": AGENT}).json()["runs"]
    assert len(runs) == 1, runs
    return runs[0]


def finished_run(agent: Agent) -> dict[str, Any]:
    return wait_for(lambda: (lambda r: r if r["status"] != "running" else None)(the_run(agent)),
                    timeout=20, what="the run's end")


def text(result: Any) -> str:
    return "\n".join(item.text for item in result.content if item.type == "text")


def upstream_text(result: Any) -> str:
    """The upstream's own result, without a warning (SPEC 16) the gateway may append."""
    return result.content[0].text


def run_async(main: Any) -> Any:
    return anyio.run(main)


# --- stdio -----------------------------------------------------------------------------------

def governed_policy(team: Team, **changes: Any) -> None:
    """One policy for a whole session: a loop stopped at the 4th identical call, a denied
    tool, a rate limit on `counter`, `publish` behind an approval, errors nudged at 2."""
    set_policy(team, **{
        "step_limits": {"max_steps": 50, "max_repeat_action": 3, "no_progress_window": 20},
        "tools": {"allow": None, "deny": ["files.delete_*"]},
        "rate_limits": [{"match": "files.counter", "per": "run", "max": 1, "window_s": 1}],
        "approvals": {"tools": ["files.publish"], "timeout_s": 600},
        "on_repeated_error": {"threshold": 2, "action": "nudge"},
        **changes})


def decide_when_asked(verdict: str, note: str = "not today") -> None:
    """The operator, from a shell: `manage.py approvals decide` on the gateway's request."""
    request = wait_for(lambda: Approval.objects.filter(status="pending").first(),
                       timeout=30, what="the gateway's approval request")
    try:
        call_command("approvals", "decide", str(request.pk), verdict, "--note", note)
    finally:
        connection.close()  # this thread's own connection


async def snapshot(client: Client) -> dict[str, Any]:
    """Everything but tools/call, as the client received it."""
    resources = await client.list_resources()
    read = await client.read_resource("doc://readme")
    prompts = await client.list_prompts()
    prompt = await client.get_prompt("review", {"code": "x = 1\n  y\t= 2"})
    tools = await client.list_tools()
    return {
        "resources": [r.model_dump(mode="json") for r in resources.resources],
        "read": [c.model_dump(mode="json") for c in read.contents],
        "prompts": [p.model_dump(mode="json") for p in prompts.prompts],
        "prompt": [m.model_dump(mode="json") for m in prompt.messages],
        "tools": {t.name: t.model_dump(mode="json") for t in tools.tools},
    }


async def echo_model(context: Any, params: Any) -> CreateMessageResult:
    """The client's model, for the upstream's sampling requests: the question in capitals."""
    asked = params.messages[0].content.text
    return CreateMessageResult(role="assistant", model="echo",
                               content=TextContent(type="text", text=asked.upper()))


def test_a_governed_stdio_session(server: Server, agent: Agent, team: Team) -> None:
    """The same Client configuration against the upstream, then against the gateway in front
    of it (only the command differs): resources and prompts byte for byte, the denied tool
    left out; then a rate-limited call that waits, an approval approved from the command line,
    results reported (a repeated error nudged), and a loop refused at the 4th identical call,
    which stops the run: every later call is answered the same way."""
    governed_policy(team)

    async def main() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        async with Client(direct_params()) as client:  # the default mode (auto)
            direct = await snapshot(client)
        progress: list[tuple[float, float | None, str | None]] = []

        async def on_progress(done: float, total: float | None, message: str | None) -> None:
            progress.append((done, total, message))

        async with Client(stdio_params(server, agent.token),
                          sampling_callback=echo_model) as client:
            governed = await snapshot(client)
            # Sampling (the server's request to the client) and progress pass through.
            out_ask = await client.call_tool("ask", {"question": "hello"},
                                             progress_callback=on_progress)
            out: dict[str, Any] = {"counter": [await client.call_tool("counter", {})]}
            started = time.monotonic()
            out["counter"].append(await client.call_tool("counter", {}))
            out["waited"] = time.monotonic() - started
            async with anyio.create_task_group() as tg:
                tg.start_soon(anyio.to_thread.run_sync, decide_when_asked, "approve")
                out["publish"] = await client.call_tool("publish", {"title": "notes"})
            out["broken"] = [await client.call_tool("broken", {"path": "/x"}) for _ in range(3)]
            out["search"] = [await client.call_tool("search", {"query": "refund"})
                             for _ in range(4)]
            out["after"] = await client.call_tool("delete_all", {})
            out["ask"], out["progress"] = out_ask, progress
        return direct, governed, out

    direct, governed, out = run_async(main)
    assert "delete_all" in direct["tools"] and "delete_all" not in governed["tools"]
    del direct["tools"]["delete_all"]
    assert json.dumps(governed, sort_keys=True) == json.dumps(direct, sort_keys=True)
    assert governed["read"][0]["text"] == "Read me: ünïcødé  spaces\tand tabs\n"

    assert text(out["ask"]) == "the model says: HELLO"
    assert out["progress"] == [(1, 2, "asking"), (2, 2, "answered")]
    # The upstream's result first; the second identical call carries SPEC 16's warning as a
    # text item of its own, appended.
    assert [r.content[0].text for r in out["counter"]] == ["call 1", "call 2"]
    assert len(out["counter"][0].content) == 1
    assert "max_repeat_action is 3" in out["counter"][1].content[-1].text
    assert out["waited"] >= 0.3  # the second call waited for the rate limit, then ran
    assert (out["publish"].is_error, text(out["publish"])) == (False, "published notes")
    assert all(r.is_error for r in out["broken"])
    # The upstream's own words.
    assert text(out["broken"][0]) == "Error executing tool broken: cannot open /x"
    searches = out["search"]
    assert [r.is_error for r in searches] == [False, False, False, True]
    refused = text(searches[3])
    assert refused.startswith("Blocked by governance (loop_detected): ")
    assert "max_repeat_action=3" in refused
    assert text(out["after"]) == refused

    run = finished_run(agent)
    assert (run["status"], run["stop_reason"]) == ("stopped", "loop_detected")
    decisions = agent.http.get(f"/api/v1/runs/{run['run_id']}/decisions").json()["decisions"]
    assert {d["action"]["name"] for d in decisions} == {
        "files.ask", "files.counter", "files.publish", "files.broken", "files.search"}
    assert decisions[-1]["outcome"] == "stop" and decisions[-1]["reason"] == "loop_detected"
    assert "wait" in [d["outcome"] for d in decisions]
    assert [d["outcome"] for d in decisions if d["action"]["name"] == "files.publish"] == [
        "pending", "allow"]
    # The third `broken` check carried the second report of the same error: its nudge was
    # appended to that call's result; every report carried a digest.
    third = [d for d in decisions if d["action"]["name"] == "files.broken"][2]
    audited = AuditRecord.objects.get(pk=third["id"])
    assert audited.last_result["status"] == "error" and audited.last_result["digest"]
    assert audited.last_result["error"] == "Error executing tool broken: cannot open /x"
    assert audited.answer["directive"]["content"] in text(out["broken"][2])


def test_a_rate_limit_past_max_wait_then_the_kill_switch(server: Server, agent: Agent,
                                                          team: Team) -> None:
    """A rate limit that does not clear within --max-wait: the call is refused saying when to
    retry, and the run goes on; a kill switch engaged mid-session refuses the next call with
    its reason, and every later one."""
    # A window within the run's time budget (a wait past it would be a max_seconds stop).
    set_policy(team, rate_limits=[{"match": "files.counter", "per": "run", "max": 1,
                                   "window_s": 10}])

    async def main() -> list[Any]:
        async with Client(stdio_params(server, agent.token, "--max-wait", "0"),
                          mode="legacy") as client:
            out = [await client.call_tool("counter", {}), await client.call_tool("counter", {})]
            with mock.patch("runs.killswitch.services._enqueue_fanout"):
                await anyio.to_thread.run_sync(lambda: killswitch_engage(
                    scope="agent", team=team, agent=AGENT, reason="runaway tool use"))
            out += [await client.call_tool("search", {"query": "x"}),
                    await client.call_tool("counter", {})]
            return out

    first, limited, killed, later = run_async(main)
    assert (first.is_error, upstream_text(first)) == (False, "call 1")
    assert limited.is_error
    assert text(limited).startswith("Blocked by governance (rate_limited): ")
    assert "Try again in" in text(limited)
    assert killed.is_error
    assert text(killed).startswith("Blocked by governance (killed): ")
    assert "runaway tool use" in text(killed)
    assert text(later) == text(killed)
    assert finished_run(agent)["status"] == "killed"


# --- faults ----------------------------------------------------------------------------------

@contextmanager
def raw_gateway(server: Server, token: str, *extra: str) -> Iterator[subprocess.Popen[str]]:
    """The gateway as a bare process, spoken to in JSON lines (no SDK client to correct us)."""
    process = subprocess.Popen(
        [sys.executable, *gateway_args(server, token, *extra), "--", *UPSTREAM],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env=child_env(), cwd=str(ROOT))
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


def test_faults_of_the_client_and_of_the_upstream_never_hang_the_session(
        server: Server, agent: Agent) -> None:
    """A call before initialize, malformed JSON, bad arguments: JSON-RPC errors, nothing
    checked; an unknown method is the upstream's own error; huge arguments are checked by
    their digest and forwarded whole; an upstream that dies mid-call answers that call with
    an error, ends the session, and the run is finished `failed`."""
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
        big = "x" * (100 * 1024)
        send(process, {"jsonrpc": "2.0", "id": 5, "method": "tools/call",
                       "params": {"name": "search", "arguments": {"query": big}}})
        answer = receive(process)
        assert answer["id"] == 5 and answer["result"]["content"][0]["text"] == "no match"
        send(process, {"jsonrpc": "2.0", "id": 6, "method": "tools/call",
                       "params": {"name": "exit_now", "arguments": {}}})
        died = receive(process)
        assert died["id"] == 6 and "exited" in died["error"]["message"]
        assert process.wait(timeout=20) != 0  # the session ended with its upstream

    run = finished_run(agent)
    assert run["status"] == "failed"
    decisions = agent.http.get(f"/api/v1/runs/{run['run_id']}/decisions").json()["decisions"]
    assert [d["action"]["name"] for d in decisions] == ["files.search", "files.exit_now"]
    assert decisions[0]["action"]["args"]["oversize_args"]["keys"] == ["query"]


def receive_within(process: subprocess.Popen[str], seconds: float) -> dict[str, Any] | None:
    """The gateway's next message, or None when it sends nothing for ``seconds``."""
    import select

    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], seconds)
    return receive(process) if ready else None


def test_an_upstream_that_hangs_or_writes_garbage_never_hangs_the_session(
        server: Server, agent: Agent) -> None:
    """An upstream stuck in one call: the other calls are answered meanwhile, the client's
    cancellation is relayed, and the session's end finishes the run. An upstream that writes
    a line that is not JSON-RPC, and an answer of the wrong shape to a call: that call gets one
    JSON-RPC error, never two answers, and the session goes on."""
    with raw_gateway(server, agent.token) as process:
        send(process, INITIALIZE)
        assert receive(process)["result"]["serverInfo"]["name"] == "files"
        send(process, {"jsonrpc": "2.0", "method": "notifications/initialized"})
        send(process, {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                       "params": {"name": "hang", "arguments": {}}})
        send(process, {"jsonrpc": "2.0", "id": 3, "method": "tools/call",
                       "params": {"name": "search", "arguments": {"query": "meanwhile"}}})
        answer = receive_within(process, 30)
        assert answer is not None and answer["id"] == 3, answer
        assert answer["result"]["content"][0]["text"] == "no match"
        send(process, {"jsonrpc": "2.0", "method": "notifications/cancelled",
                       "params": {"requestId": 2, "reason": "the user gave up"}})
        send(process, {"jsonrpc": "2.0", "id": 4, "method": "tools/call",
                       "params": {"name": "garbage", "arguments": {}}})
        broken = receive_within(process, 30)
        assert broken is not None and broken["id"] == 4, broken
        assert "malformed" in broken["error"]["message"], broken
        send(process, {"jsonrpc": "2.0", "id": 5, "method": "tools/call",
                       "params": {"name": "counter", "arguments": {}}})
        after = receive_within(process, 30)
        # The upstream's late proper answer to 4 is not passed on: 5's is the next message.
        assert after is not None and after["id"] == 5, after
        assert after["result"]["content"][0]["text"] == "call 1"
        assert receive_within(process, 1) is None  # nothing more: not 2, not 4 again
        assert process.stdin is not None
        process.stdin.close()  # the client leaves; the call to `hang` is still stuck upstream
        assert process.wait(timeout=30) == 0

    run = finished_run(agent)
    assert run["status"] == "completed"
    decisions = agent.http.get(f"/api/v1/runs/{run['run_id']}/decisions").json()["decisions"]
    assert [d["action"]["name"] for d in decisions] == [
        "files.hang", "files.search", "files.garbage", "files.counter"]


def still_serves_then_ends(process: subprocess.Popen[str], call_id: int, query: str) -> None:
    """The session goes on (a call is answered as usual), then the client leaves: the
    gateway ends the session, its run completed, and exits 0."""
    send(process, {"jsonrpc": "2.0", "id": call_id, "method": "tools/call",
                   "params": {"name": "search", "arguments": {"query": query}}})
    assert receive(process)["result"]["content"][0]["text"] == "no match"
    assert process.poll() is None
    assert process.stdin is not None
    process.stdin.close()
    assert process.wait(timeout=20) == 0


def test_arguments_that_are_not_json_are_refused_and_the_session_goes_on(
        server: Server, agent: Agent) -> None:
    """The SDK reads NaN and Infinity, JSON has neither: such a call used to end the whole
    session (the run finished `failed`, as if the upstream had died). Arguments the service
    refuses are refused with its reason."""
    with raw_gateway(server, agent.token) as process:
        send(process, INITIALIZE)
        assert receive(process)["result"]["serverInfo"]["name"] == "files"
        send(process, {"jsonrpc": "2.0", "method": "notifications/initialized"})
        for i, value in enumerate(("NaN", "Infinity", "-Infinity"), start=2):
            call = {"jsonrpc": "2.0", "id": i, "method": "tools/call",
                    "params": {"name": "search", "arguments": {"query": "VALUE"}}}
            send(process, json.dumps(call).replace('"VALUE"', value))
            refused = receive(process)
            assert refused["id"] == i and refused["error"]["code"] == -32602, refused
        # Arguments the service refuses (a NUL): the model is told what, not to try later.
        send(process, {"jsonrpc": "2.0", "id": 8, "method": "tools/call",
                       "params": {"name": "search", "arguments": {"query": "a\u0000b"}}})
        refused = receive(process)["result"]
        assert refused["isError"] is True
        assert "action.args: must not contain NUL" in refused["content"][0]["text"]
        assert "try again later" not in refused["content"][0]["text"]
        still_serves_then_ends(process, 9, "x")
    run = finished_run(agent)
    assert run["status"] == "completed"
    decisions = agent.http.get(f"/api/v1/runs/{run['run_id']}/decisions").json()["decisions"]
    assert [d["action"]["args"] for d in decisions] == [{"query": "x"}]  # nothing else checked


def test_a_call_is_named_after_the_upstreams_declared_name_whatever_the_client_sends_first(
        server: Server, agent: Agent, team: Team) -> None:
    """Found by an attacker (over HTTP): a second initialize, which the upstream refused,
    left the session's name unknown, and a call sent then was checked as `mcp.delete_all`:
    the policy's `files.delete_*` did not match it, and the denied tool ran. A second
    initialize is refused now, and no call is checked before the upstream's answer to the
    first has named the session: here everything is sent before reading any answer."""
    governed_policy(team)
    with raw_gateway(server, agent.token) as process:
        send(process, INITIALIZE)
        send(process, {"jsonrpc": "2.0", "id": 2, "method": "initialize", "params": {}})
        send(process, {"jsonrpc": "2.0", "method": "notifications/initialized"})
        send(process, {"jsonrpc": "2.0", "id": 3, "method": "tools/call",
                       "params": {"name": "delete_all", "arguments": {}}})
        answers = {message["id"]: message for message in (receive(process) for _ in range(3))}
        assert answers[1]["result"]["serverInfo"]["name"] == "files"
        assert answers[2]["error"]["code"] == -32600, answers[2]
        assert "already received" in answers[2]["error"]["message"]
        refused = answers[3]["result"]
        assert refused["isError"] is True and "deleted" not in json.dumps(refused), refused
    run = finished_run(agent)
    decisions = agent.http.get(f"/api/v1/runs/{run['run_id']}/decisions").json()["decisions"]
    assert [(d["action"]["name"], d["outcome"]) for d in decisions] == [
        ("files.delete_all", "stop")]


def test_ids_and_progress_tokens_that_are_not_strings_or_numbers_leave_the_session_alone(
        server: Server, agent: Agent) -> None:
    """MCP's request ids and progress tokens are strings or integers; the SDK leaves a
    notification's params untyped, and a list or an object there ended the whole session
    (found by an attacker: over stdio the gateway exited, over HTTP the session was dropped
    and the run finished `failed`, blamed on the upstream)."""
    with raw_gateway(server, agent.token) as process:
        send(process, INITIALIZE)
        assert receive(process)["result"]["serverInfo"]["name"] == "files"
        send(process, {"jsonrpc": "2.0", "method": "notifications/initialized"})
        for odd in ([1], {"a": 1}):
            send(process, {"jsonrpc": "2.0", "method": "notifications/cancelled",
                           "params": {"requestId": odd}})
        send(process, {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                       "params": {"name": "search", "arguments": {"query": "x"},
                                  "_meta": {"progressToken": {"a": 1}}}})
        answer = receive(process)
        assert answer["id"] == 2, answer
        still_serves_then_ends(process, 3, "y")
    assert finished_run(agent)["status"] == "completed"


def test_a_client_that_leaves_while_a_call_waits_for_an_operator_ends_the_run(
        server: Server, agent: Agent, team: Team) -> None:
    governed_policy(team)
    with raw_gateway(server, agent.token) as process:
        send(process, INITIALIZE)
        receive(process)
        send(process, {"jsonrpc": "2.0", "method": "notifications/initialized"})
        send(process, {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                       "params": {"name": "publish", "arguments": {"title": "x"}}})
        request = wait_for(lambda: Approval.objects.filter(status="pending").first(),
                           timeout=30, what="the gateway's approval request")
        assert process.stdin is not None
        process.stdin.close()  # the client leaves
        assert process.wait(timeout=20) == 0
    run = finished_run(agent)
    assert run["status"] == "completed"
    request.refresh_from_db()
    assert request.status == "cancelled"


class Link:
    """The network between the gateway and the service: a TCP forwarder the test can cut
    (open connections dropped, new ones closed at once) and restore."""

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.up = True
        self.open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                inbound, _ = self.listener.accept()
            except OSError:
                return
            if not self.up:
                inbound.close()
                continue
            try:
                outbound = socket.create_connection(self.target)
            except OSError:
                inbound.close()
                continue
            self.open += [inbound, outbound]
            for a, b in ((inbound, outbound), (outbound, inbound)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.close()

    def cut(self) -> None:
        self.up = False
        for end in self.open:
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
        self.open.clear()

    def close(self) -> None:
        self.cut()
        self.listener.close()


def test_the_service_down_refuses_calls_by_default_and_forwards_them_with_fail_open(
        server: Server, agent: Agent) -> None:
    """Fail closed: the service down when the session starts, every call is refused naming
    the outage (tools/list still answers); once it is back, the next call starts the run and
    runs. Fail open: the service down mid-session, the call is decided locally and forwarded,
    and the local decision is uploaded once the service answers again."""
    port = int(server.url.rsplit(":", 1)[1])
    link = Link(port)
    through = Server(url=link.url, process=None)  # type: ignore[arg-type]

    async def fail_closed() -> list[Any]:
        link.cut()
        async with Client(stdio_params(through, agent.token), mode="legacy") as client:
            assert "search" in [t.name for t in (await client.list_tools()).tools]
            refused = await client.call_tool("counter", {})
            link.up = True
            return [refused, await client.call_tool("counter", {})]

    async def fail_open() -> list[Any]:
        async with Client(stdio_params(through, agent.token, "--fail-open"),
                          mode="legacy") as client:
            out = [await client.call_tool("counter", {})]
            link.cut()
            out.append(await client.call_tool("counter", {}))
            link.up = True
            out.append(await client.call_tool("search", {"query": "x"}))
            return out

    try:
        refused, ran = run_async(fail_closed)
        assert refused.is_error
        assert text(refused).startswith("Blocked by governance (governance_unavailable): ")
        assert (ran.is_error, upstream_text(ran)) == (False, "call 1")
        first = finished_run(agent)
        assert (first["status"], first["steps"]) == ("completed", 1)
        Run.objects.filter(pk=first["run_id"]).update(agent="mcp-agent-before")

        results = run_async(fail_open)
    finally:
        link.close()
    assert [(r.is_error, upstream_text(r)) for r in results] == [
        (False, "call 1"), (False, "call 2"), (False, "no match")]
    run = finished_run(agent)
    assert run["status"] == "completed"
    decisions = agent.http.get(f"/api/v1/runs/{run['run_id']}/decisions").json()["decisions"]
    assert [(d["action"]["name"], d["outcome"], d["local"]) for d in decisions] == [
        ("files.counter", "allow", False), ("files.counter", "allow", True),
        ("files.search", "allow", False)]


def test_a_session_begun_during_an_outage_gets_its_run_once_the_service_answers(
        server: Server, agent: Agent, team: Team) -> None:
    """Fail open, the service down when the session starts: its run is started locally, and
    the calls are decided with the client's local limits (the policy is not known: the denied
    tool is listed) and forwarded. Once the service is back, the next call starts the run
    there, which records the earlier calls as local decisions before it checks that one; the
    policy governs from then on, and the session's end finishes the run (found by a tester:
    the session stayed local to its end, and no run had its calls)."""
    governed_policy(team)
    port = int(server.url.rsplit(":", 1)[1])
    link = Link(port)
    through = Server(url=link.url, process=None)  # type: ignore[arg-type]

    async def main() -> tuple[list[str], list[str], list[Any]]:
        link.cut()
        async with Client(stdio_params(through, agent.token, "--fail-open"),
                          mode="legacy") as client:
            listed_locally = [t.name for t in (await client.list_tools()).tools]
            out = [await client.call_tool("search", {"query": "refund"}),
                   await client.call_tool("counter", {})]
            assert not agent.http.get("/api/v1/runs", params={"agent": AGENT}).json()["runs"]
            link.up = True
            # The next start is due at most 4 retry periods after the last one that failed
            # (at the initialization, and at worst at both calls).
            await anyio.sleep(4 * START_RETRY_S + 0.2)
            out.append(await client.call_tool("search", {"query": "x"}))
            listed = [t.name for t in (await client.list_tools()).tools]
            return listed_locally, listed, out

    try:
        listed_locally, listed, results = run_async(main)
    finally:
        link.close()
    assert [r.is_error for r in results] == [False, False, False]
    assert (upstream_text(results[1]), upstream_text(results[2])) == ("call 1", "no match")
    assert "delete_all" in listed_locally and "delete_all" not in listed
    run = finished_run(agent)
    assert (run["status"], run["steps"]) == ("completed", 3)
    decisions = agent.http.get(f"/api/v1/runs/{run['run_id']}/decisions").json()["decisions"]
    assert [(d["action"]["name"], d["outcome"], d["local"]) for d in decisions] == [
        ("files.search", "allow", True), ("files.counter", "allow", True),
        ("files.search", "allow", False)]


# --- streamable HTTP -------------------------------------------------------------------------

@contextmanager
def process(*args: str, port: int) -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, *args], env=child_env(), cwd=str(ROOT),
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
        terminate(proc)


def test_over_streamable_http_both_sides(server: Server, agent: Agent, team: Team) -> None:
    """The gateway serving streamable HTTP, its upstream over streamable HTTP: resources and
    prompts unchanged, the denied tool left out and refused, a loop refused, an approval
    denied from the command line; each MCP session is a run, finished when the client
    deletes the session."""
    governed_policy(team, step_limits={"max_steps": 50, "max_repeat_action": 2,
                                       "no_progress_window": 10})
    up_port, gw_port = free_port(), free_port()
    with process("-m", "tests.mcp_upstream", "http", str(up_port), port=up_port) as upstream, \
            process(*gateway_args(server, agent.token), "--upstream-url", upstream,
                    "--listen", f"127.0.0.1:{gw_port}", port=gw_port) as gateway:

        async def session(url: str) -> dict[str, Any]:
            progress: list[Any] = []

            async def on_progress(done: float, total: float | None, message: str | None) -> None:
                progress.append((done, total, message))

            # The handshake era on both (the per-request era has no sampling back-channel).
            async with Client(url, mode="legacy", sampling_callback=echo_model) as client:
                read = await client.read_resource("doc://readme")
                prompt = await client.get_prompt("review", {"code": "a\tb"})
                tools = sorted(t.name for t in (await client.list_tools()).tools)
                asked = await client.call_tool("ask", {"question": "hi"},
                                               progress_callback=on_progress)
                calls = [await client.call_tool("search", {"query": "q"}) for _ in range(3)]
                return {"read": [c.model_dump(mode="json") for c in read.contents],
                        "prompt": [m.model_dump(mode="json") for m in prompt.messages],
                        "tools": tools, "calls": calls, "asked": text(asked),
                        "progress": progress}

        async def one_call(tool: str, args: dict[str, Any], verdict: str | None = None) -> Any:
            async with Client(gateway) as client, anyio.create_task_group() as tg:
                if verdict is not None:
                    tg.start_soon(anyio.to_thread.run_sync, decide_when_asked, verdict)
                return await client.call_tool(tool, args)

        async def main() -> list[Any]:
            return [await session(upstream), await session(gateway),
                    await one_call("publish", {"title": "x"}, "deny"),
                    await one_call("delete_all", {}),
                    await one_call("counter", {})]

        direct, governed, denied, forbidden, quiet = anyio.run(main)

    assert governed["read"] == direct["read"] and governed["prompt"] == direct["prompt"]
    assert direct["asked"] == "the model says: HI"
    # Relayed unchanged, with SPEC 16's warning appended (this policy's limit is 2).
    assert governed["asked"].startswith("the model says: HI\n")
    assert "max_repeat_action is 2" in governed["asked"]
    assert governed["progress"] == direct["progress"] == [(1, 2, "asking"), (2, 2, "answered")]
    assert "delete_all" in direct["tools"] and "delete_all" not in governed["tools"]
    assert [c.is_error for c in governed["calls"]] == [False, False, True]
    assert text(governed["calls"][2]).startswith("Blocked by governance (loop_detected): ")
    assert text(denied).startswith("Blocked by governance (approval_denied): ")
    assert "not today" in text(denied)
    assert text(forbidden).startswith("Blocked by governance (tool_denied): ")
    assert (quiet.is_error, upstream_text(quiet)) == (False, "call 1")

    def ends() -> list[tuple[str, str | None]] | None:
        runs = agent.http.get("/api/v1/runs", params={"agent": AGENT}).json()["runs"]
        if any(r["status"] == "running" for r in runs):
            return None
        return [(r["status"], r["stop_reason"]) for r in reversed(runs)]

    assert wait_for(ends, timeout=20, what="the runs' ends") == [
        ("stopped", "loop_detected"), ("stopped", "approval_denied"),
        ("stopped", "tool_denied"), ("completed", None)]
    # Each run's external_id is its MCP session id, made by the gateway.
    assert len({r.external_id for r in Run.objects.filter(agent=AGENT)}) == 4


def test_the_http_gateway_says_where_it_listens_and_why_it_cannot(server: Server,
                                                                  agent: Agent) -> None:
    """Found by a newcomer: `--listen` printed nothing at its start, a port in use was a
    51-line traceback, and an upstream that could not be reached cut the client's request off
    ("SSE stream ended without a response") with a traceback in the gateway's log."""
    gw_port, nowhere = free_port(), free_port()
    args = [sys.executable, *gateway_args(server, agent.token), "--upstream-url",
            f"http://127.0.0.1:{nowhere}/mcp", "--listen", f"127.0.0.1:{gw_port}"]
    first = subprocess.Popen(args, env=child_env(), cwd=str(ROOT), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        line = first.stderr.readline() if first.stderr else ""
        assert line.startswith(f"governance-mcp: listening on http://127.0.0.1:{gw_port}/")
        assert f"upstream http://127.0.0.1:{nowhere}/mcp" in line
        taken = subprocess.run(args, env=child_env(), cwd=str(ROOT), capture_output=True,
                               text=True, timeout=30)
        assert taken.returncode == 2
        assert taken.stderr.strip().splitlines() == [
            f"governance-mcp: cannot listen on 127.0.0.1:{gw_port}: Address already in use"]

        async def main() -> BaseException | None:
            try:
                with anyio.fail_after(20):
                    async with Client(f"http://127.0.0.1:{gw_port}/mcp") as client:
                        await client.list_tools()
            except BaseException as exc:  # the SDK raises it in its own task group
                return exc
            return None

        failed = anyio.run(main)
        while isinstance(failed, BaseExceptionGroup) and len(failed.exceptions) == 1:
            failed = failed.exceptions[0]
        assert failed is not None and "cannot be reached" in str(failed), repr(failed)
        assert f"http://127.0.0.1:{nowhere}/mcp" in str(failed)
    finally:
        first.terminate()
        _, log = first.communicate(timeout=10)
    assert "Traceback" not in log, log


def test_the_http_gateway_holds_at_most_max_sessions(server: Server, agent: Agent) -> None:
    """Found by an attacker: 300 initialize requests of 200 bytes held 300 sessions (270 MB of
    the gateway, 300 runs) for 30 minutes each. Past --max-sessions an initialize is refused
    503 with Retry-After, saying how to free one; a deleted session makes room."""
    up_port, gw_port = free_port(), free_port()
    initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "many", "version": "1"}}}
    accept = {"Accept": "application/json, text/event-stream"}
    with process("-m", "tests.mcp_upstream", "http", str(up_port), port=up_port) as upstream, \
            process(*gateway_args(server, agent.token), "--upstream-url", upstream,
                    "--listen", f"127.0.0.1:{gw_port}", "--max-sessions", "2",
                    port=gw_port) as gateway, httpx.Client(timeout=30, headers=accept) as http:
        opened = [http.post(gateway, json=initialize) for _ in range(2)]
        assert [answer.status_code for answer in opened] == [200, 200]
        refused = http.post(gateway, json=initialize)
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "30"
        assert "2 sessions are open, the most this gateway holds (--max-sessions)" \
            in refused.json()["error"]["message"]
        session = opened[0].headers["mcp-session-id"]
        assert http.delete(gateway, headers={"Mcp-Session-Id": session}).status_code == 200
        assert http.post(gateway, json=initialize).status_code == 200


def test_the_http_gateway_bounds_what_a_body_costs_it(server: Server, agent: Agent) -> None:
    """Found by an attacker: an opening body nested past the parser's depth was a plain-text
    500. It is a JSON-RPC parse error, and the gateway goes on. (A session's request past
    16 MiB, which the SDK's transport read whole, is refused unread past the bound:
    governance_client/tests/test_mcp_http_bounds.py, in process, where the client's end of
    an answered-early upload cannot race the answer.)"""
    up_port, gw_port = free_port(), free_port()
    accept = {"Accept": "application/json, text/event-stream"}
    with process("-m", "tests.mcp_upstream", "http", str(up_port), port=up_port) as upstream, \
            process(*gateway_args(server, agent.token), "--upstream-url", upstream,
                    "--listen", f"127.0.0.1:{gw_port}", port=gw_port) as gateway, \
            httpx.Client(timeout=60, headers=accept) as http:
        nested = http.post(gateway, content=b"[" * 100_000,
                           headers={"Content-Type": "application/json"})
        assert nested.status_code == 400 and nested.json()["error"]["code"] == -32700
        opened = http.post(gateway, json={**INITIALIZE, "params": {
            **INITIALIZE["params"], "protocolVersion": "2025-06-18"}})
        assert opened.status_code == 200, opened.text
        session = {"Mcp-Session-Id": opened.headers["mcp-session-id"],
                   "Mcp-Protocol-Version": "2025-06-18", "Content-Type": "application/json"}
        http.post(gateway, json={"jsonrpc": "2.0", "method": "notifications/initialized"},
                  headers=session)
        ping = http.post(gateway, json={"jsonrpc": "2.0", "id": 3, "method": "ping"},
                         headers=session)
        assert ping.status_code == 200 and '"id":3' in ping.text.replace(" ", ""), ping.text


def test_the_http_gateway_answers_only_the_names_it_is_reached_by(server: Server,
                                                                  agent: Agent) -> None:
    """Found by a tester (DNS rebinding): `Host: evil.example:PORT` with `Origin:
    http://evil.example`, a web page whose name resolves to 127.0.0.1, opened a session and
    ran a tools/call upstream with the gateway's key, where the SDK's own server answers 421.
    A name or a page the gateway does not answer to is refused (421, 403) with a JSON-RPC
    error: no session, no run, nothing forwarded; a name given with --allowed-host (a proxy's)
    and a client without an Origin are answered."""
    up_port, gw_port = free_port(), free_port()
    accept = {"Accept": "application/json, text/event-stream"}
    evil = {"Host": f"evil.example:{gw_port}", "Origin": "http://evil.example"}
    opening = {**INITIALIZE, "params": {**INITIALIZE["params"], "protocolVersion": "2025-06-18"}}
    call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
            "params": {"name": "counter", "arguments": {}}}
    with process("-m", "tests.mcp_upstream", "http", str(up_port), port=up_port) as upstream, \
            process(*gateway_args(server, agent.token), "--upstream-url", upstream,
                    "--listen", f"127.0.0.1:{gw_port}", "--allowed-host",
                    f"gw.example:{gw_port}", port=gw_port) as gateway, \
            httpx.Client(timeout=30, headers=accept) as http:
        refused = http.post(gateway, json=opening, headers=evil)
        assert refused.status_code == 421, refused.text
        assert refused.json()["error"]["code"] == -32600
        assert "mcp-session-id" not in refused.headers
        page = http.post(gateway, json=opening, headers={"Origin": "http://evil.example"})
        assert page.status_code == 403 and "Invalid Origin" in page.json()["error"]["message"]
        assert agent.http.get("/api/v1/runs", params={"agent": AGENT}).json()["runs"] == []

        opened = http.post(gateway, json=opening)  # a client of its own: no Origin
        assert opened.status_code == 200, opened.text
        session = {"Mcp-Session-Id": opened.headers["mcp-session-id"],
                   "Mcp-Protocol-Version": "2025-06-18"}
        http.post(gateway, json={"jsonrpc": "2.0", "method": "notifications/initialized"},
                  headers=session)
        # The page's call on that session: refused, not run (the next call is the first).
        assert http.post(gateway, json=call, headers={**session, **evil}).status_code == 421
        proxied = http.post(gateway, json=call,
                            headers={**session, "Host": f"gw.example:{gw_port}"})
        assert proxied.status_code == 200 and "call 1" in proxied.text, proxied.text

    run = the_run(agent)
    decisions = agent.http.get(f"/api/v1/runs/{run['run_id']}/decisions").json()["decisions"]
    assert [d["action"]["name"] for d in decisions] == ["files.counter"]


def test_a_sub_agents_gateway_session_runs_under_its_parent(server: Server, agent: Agent,
                                                            team: Team) -> None:
    """Found by a newcomer: a sub-agent that reaches its tools through its own gateway got a
    fresh budget, the escape SPEC 20 closes. With `--parent-run-id` (or
    GOVERNANCE_PARENT_RUN_ID, as an orchestrator sets it for the sub-agent it spawns) the
    session's run is a child of that run: the parent's limits bound it; under a finished
    parent no call runs."""
    set_policy(team, step_limits={"max_steps": 3, "max_repeat_action": 10,
                                  "no_progress_window": 20})
    parent = agent.start(agent="orchestrator")["run_id"]
    for i in range(2):
        assert agent.check(parent, args={"i": i})["decision"] == "allow"

    async def session(params: StdioServerParameters, calls: int) -> list[Any]:
        async with Client(params) as client:
            return [await client.call_tool("search", {"query": f"q{i}"}) for i in range(calls)]

    by_env = stdio_params(server, agent.token)
    by_env.env = {**(by_env.env or {}), "GOVERNANCE_PARENT_RUN_ID": parent}
    results = run_async(lambda: session(by_env, 3))
    assert [r.is_error for r in results] == [False, True, True]
    assert text(results[1]).startswith("Blocked by governance (max_steps): ")
    run = finished_run(agent)
    assert (run["parent_run_id"], run["root_run_id"]) == (parent, parent)
    assert (run["status"], run["stop_reason"]) == ("stopped", "max_steps")
    stop = agent.http.get(f"/api/v1/runs/{run['run_id']}/decisions").json()["decisions"][-1]
    assert stop["rule"]["scope"] == parent  # the ancestor's limit, named
    assert agent.http.post(f"/api/v1/runs/{parent}/finish",
                           json={"status": "completed"}).status_code == 200

    by_flag = stdio_params(server, agent.token, "--parent-run-id", parent)
    refused = run_async(lambda: session(by_flag, 1))[0]
    assert refused.is_error
    assert text(refused).startswith("Blocked by governance (parent_finished): "), text(refused)
    assert the_run(agent)["run_id"] == run["run_id"]  # no run started under a finished parent
