"""SPEC 19: a gateway stopped with a signal finishes its sessions' runs.

Over stdio: a client that ends the gateway with SIGTERM (or a person with Ctrl-C, SIGINT)
without closing its stdin first: the gateway finishes the session's run (`completed`) and
exits. Before, the SDK's stdio transport kept reading stdin in a thread that only the
client's EOF ends: the process neither exited nor finished its run, left `running` until
abandoned. With `--listen`: a SIGTERM finishes every open session's run before the process
exits. Before, uvicorn raised the signal again as it returned, which killed the process
before the runs were finished.

The gateway runs as a real process against the client's fake service served over HTTP on a
thread (no database needed), relaying to the tests' small upstream (tests/mcp_upstream.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import anyio
import httpx
import pytest
from governance_client.testing import FakeGovernance

from tests.conftest import ROOT, free_port
from tests.workers import terminate, wait_for

pytest.importorskip("mcp")

KEY = "gov_0123456789ab_signal-test-secret"


@pytest.fixture
def service() -> Iterator[tuple[FakeGovernance, str]]:
    """The fake service on a real port, as the gateway reaches the real one."""
    fake = FakeGovernance(api_key=KEY)
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def _relay(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            request = httpx.Request(self.command, f"http://fake{self.path}",
                                    headers=dict(self.headers), content=body)
            with lock:
                answer = fake.handle(request)
            self.send_response(answer.status_code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer.content)))
            self.end_headers()
            self.wfile.write(answer.content)

        do_GET = do_POST = _relay

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield fake, f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()


def _send(gateway: subprocess.Popen[bytes], message: dict[str, Any]) -> None:
    assert gateway.stdin is not None
    gateway.stdin.write((json.dumps(message) + "\n").encode())
    gateway.stdin.flush()


def _answer(gateway: subprocess.Popen[bytes]) -> dict[str, Any]:
    assert gateway.stdout is not None
    return json.loads(gateway.stdout.readline())


def _env(journal: Any) -> dict[str, str]:
    return {**os.environ, "GOVERNANCE_JOURNAL_DIR": str(journal),
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "governance_client" / "src"),
                                           os.environ.get("PYTHONPATH", "")])}


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_finishes_the_sessions_run_and_ends_the_gateway(service, tmp_path, signum):
    fake, url = service
    env = _env(tmp_path)
    gateway = subprocess.Popen(
        [sys.executable, "-m", "governance_client.mcp_gateway", "--url", url, "--key", KEY,
         "--agent", "desktop", "--", sys.executable, "-m", "tests.mcp_upstream"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
        cwd=str(ROOT))
    try:
        _send(gateway, {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "test", "version": "1"}}})
        assert "result" in _answer(gateway)
        _send(gateway, {"jsonrpc": "2.0", "method": "notifications/initialized"})
        _send(gateway, {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                        "params": {"name": "search", "arguments": {"query": "refunds"}}})
        assert _answer(gateway)["result"]["content"][0]["text"] == "no match"
        [run] = fake.runs.values()
        assert run.status == "running"
        gateway.send_signal(signum)  # stdin stays open, as a supervisor's stop leaves it
        started = time.monotonic()
        assert gateway.wait(timeout=15) == 0
        assert time.monotonic() - started < 10
        assert run.status == "completed", run.status
    finally:
        if gateway.poll() is None:
            gateway.kill()
            gateway.wait()


def test_a_sigterm_finishes_the_open_sessions_runs_of_the_http_gateway(service, tmp_path):
    from mcp.client.client import Client

    fake, url = service
    env = _env(tmp_path)
    up_port, gw_port = free_port(), free_port()
    upstream = subprocess.Popen([sys.executable, "-m", "tests.mcp_upstream", "http",
                                 str(up_port)], env=env, cwd=str(ROOT),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    gateway = subprocess.Popen(
        [sys.executable, "-m", "governance_client.mcp_gateway", "--url", url, "--key", KEY,
         "--agent", "cursor", "--upstream-url", f"http://127.0.0.1:{up_port}/mcp",
         "--listen", f"127.0.0.1:{gw_port}"],
        env=env, cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def listening(port: int) -> bool:
        try:
            httpx.get(f"http://127.0.0.1:{port}/mcp", timeout=1)
        except httpx.TransportError:
            return False
        return True

    try:
        wait_for(lambda: listening(up_port) and listening(gw_port), timeout=30,
                 what="the upstream and the gateway")
        exited: list[int] = []

        async def session() -> None:
            async with Client(f"http://127.0.0.1:{gw_port}/mcp") as client:
                result = await client.call_tool("search", {"query": "refunds"})
                assert result.content[0].text == "no match"
                [run] = fake.runs.values()
                assert run.status == "running"
                gateway.send_signal(signal.SIGTERM)  # the session still open
                exited.append(await anyio.to_thread.run_sync(
                    lambda: gateway.wait(timeout=15)))

        anyio.run(session)  # its end's DELETE finds no gateway: the SDK logs it
        assert exited == [0]
        [run] = fake.runs.values()
        assert run.status == "completed", run.status
    finally:
        for proc in (gateway, upstream):
            if proc.poll() is None:
                terminate(proc)
