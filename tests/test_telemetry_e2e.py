"""OpenTelemetry end to end (SPEC 18): the production server (`manage.py serve`, two forked
worker processes) exports to a real OTLP/HTTP receiver started here, which decodes the
protobuf requests (opentelemetry-proto): a check sent with a known `traceparent` arrives as
its child span with the decision's attributes, and the metrics arrive too; with a receiver
that accepts connections and never answers, checks are still answered within SPEC 10's 2 s.
One server for the module (a start costs seconds), its receiver answering, then hung.
Either stack (the one the suite runs on)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from policies.services import agent_key_create
from tests.conftest import Server, server_env, start_server

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True),
              pytest.mark.usefixtures("attack_turn")]

DEADLINE_S = 2.0
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_METRIC_EXPORT_INTERVAL": "500"}


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


@dataclass
class Receiver:
    """An OTLP/HTTP collector in miniature: what it was sent, decoded."""

    url: str = ""
    hung: threading.Event = field(default_factory=threading.Event)  # accept, never answer
    released: threading.Event = field(default_factory=threading.Event)
    held: int = 0  # requests taken while hung
    spans: list[dict[str, Any]] = field(default_factory=list)
    metrics: set[str] = field(default_factory=set)
    services: set[str] = field(default_factory=set)

    def span_named(self, prefix: str, timeout: float = 10) -> list[dict[str, Any]]:
        ends = time.monotonic() + timeout
        while time.monotonic() < ends:
            found = [s for s in list(self.spans) if s["name"].startswith(prefix)]
            if found:
                return found
            time.sleep(0.05)
        raise AssertionError(f"no span {prefix!r} arrived; got {[s['name'] for s in self.spans]}")


@contextlib.contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    received = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if received.hung.is_set():
                received.held += 1
                received.released.wait()
                self.close_connection = True
                return
            assert self.headers.get("Content-Type") == "application/x-protobuf"
            if self.path == "/v1/traces":
                request = ExportTraceServiceRequest.FromString(body)
                for resource_spans in request.resource_spans:
                    for attr in resource_spans.resource.attributes:
                        if attr.key == "service.name":
                            received.services.add(_value(attr.value))
                    for scope in resource_spans.scope_spans:
                        for span in scope.spans:
                            received.spans.append({
                                "name": span.name, "trace_id": span.trace_id.hex(),
                                "parent_span_id": span.parent_span_id.hex(),
                                "status": span.status.code,
                                "attributes": {a.key: _value(a.value) for a in span.attributes},
                            })
                answer = ExportTraceServiceResponse().SerializeToString()
            elif self.path == "/v1/metrics":
                request = ExportMetricsServiceRequest.FromString(body)
                for resource_metrics in request.resource_metrics:
                    for scope in resource_metrics.scope_metrics:
                        received.metrics.update(m.name for m in scope.metrics)
                answer = ExportMetricsServiceResponse().SerializeToString()
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    received.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield received
    finally:
        received.released.set()
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with otlp_receiver() as received:
        yield received


@pytest.fixture(scope="module")
def traced_server(receiver: Receiver, django_db_setup: Any) -> Iterator[Server]:
    srv = start_server(env=server_env(
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url,
        # Small batches and a small queue: with the receiver hung, the queue fills while
        # the exporting thread waits for it.
        OTEL_BSP_MAX_QUEUE_SIZE="16", OTEL_BSP_MAX_EXPORT_BATCH_SIZE="4", **FAST_EXPORT))
    yield srv
    srv.stop()


def test_a_check_arrives_as_the_child_of_the_agents_span(team: Any, receiver: Receiver,
                                                          traced_server: Server) -> None:
    token = agent_key_create(team=team, name="traced").token
    with httpx.Client(base_url=traced_server.url, timeout=10,
                      headers={"Authorization": f"Bearer {token}"}) as http:
        run_id = http.post("/api/v1/runs", json={"agent": "support-bot"}).json()["run_id"]
        response = http.post(
            f"/api/v1/runs/{run_id}/check",
            json={"action": {"name": "search.docs", "args": {"q": "secret-arg"}}},
            headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
        assert response.status_code == 200, response.text
        answer = response.json()
    [span] = receiver.span_named("governance.check")
    receiver.span_named("governance.start")
    ends = time.monotonic() + 10
    while "governance.decisions" not in receiver.metrics and time.monotonic() < ends:
        time.sleep(0.1)
    assert answer["trace_id"] == TRACE_ID
    assert span["name"] == "governance.check search.docs"
    assert (span["trace_id"], span["parent_span_id"]) == (TRACE_ID, PARENT_ID)
    assert span["status"] == 0  # unset: a decision is not an error
    attributes = span["attributes"]
    assert attributes["governance.decision"] == "allow"
    assert attributes["governance.reason"] == answer["reason"]
    assert attributes["governance.decision.id"] == answer["decision_id"]
    assert attributes["governance.run.id"] == run_id
    assert attributes["governance.team"] == "support"
    assert attributes["governance.agent"] == attributes["gen_ai.agent.name"] == "support-bot"
    assert attributes["governance.policy.name"] == "default"
    assert attributes["governance.step"] == 1
    assert attributes["gen_ai.tool.name"] == "search.docs"
    assert not any("secret-arg" in str(v) for v in attributes.values())
    assert receiver.services == {"agent-governance"}
    assert {"governance.decisions", "governance.check.duration"} <= receiver.metrics


def test_a_call_through_the_mcp_gateway_is_a_span_of_the_mcp_clients_trace(
        team: Any, receiver: Receiver, traced_server: Server) -> None:
    """MCP clients send their trace context in a request's `_meta` (the SDK does, from its
    current span); the gateway checks the call within it, so the decision is a span of the
    agent's trace (found by a newcomer: each gateway check was a trace of its own)."""
    import anyio
    from mcp.client.client import Client

    from runs.models import Decision
    from tests.test_mcp_gateway import AGENT, stdio_params

    token = agent_key_create(team=team, name="mcp-traced").token
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"

    async def main() -> Any:
        async with Client(stdio_params(traced_server, token)) as client:
            traced = await client.call_tool(
                "search", {"query": "refund"},
                meta={"traceparent": f"00-{trace_id}-{parent_id}-01"})  # type: ignore[arg-type]
            plain = await client.call_tool("search", {"query": "other"})
            return traced, plain

    traced, plain = anyio.run(main)
    assert not traced.is_error and not plain.is_error
    ends = time.monotonic() + 10
    while True:
        spans = [s for s in receiver.span_named("governance.check files.search")
                 if s["trace_id"] == trace_id]
        if spans or time.monotonic() > ends:
            break
        time.sleep(0.05)
    assert [s["parent_span_id"] for s in spans] == [parent_id]
    answers = [d.answer for d in Decision.objects.filter(run__agent=AGENT).order_by("pk")]
    assert answers[0].get("trace_id") == trace_id
    assert answers[1].get("trace_id") not in (None, trace_id)  # its own trace: no context sent


def test_a_hung_collector_never_delays_a_check(team: Any, receiver: Receiver,
                                               traced_server: Server) -> None:
    token = agent_key_create(team=team, name="hung").token
    receiver.hung.set()
    took = []
    with httpx.Client(base_url=traced_server.url, timeout=10,
                      headers={"Authorization": f"Bearer {token}"}) as http:
        for _ in range(4):
            run_id = http.post("/api/v1/runs", json={"agent": "bot"}).json()["run_id"]
            for n in range(10):
                started = time.monotonic()
                response = http.post(f"/api/v1/runs/{run_id}/check",
                                     json={"action": {"name": f"tool.{n}"}})
                took.append(time.monotonic() - started)
                assert response.status_code == 200, response.text
                assert response.json()["trace_id"] is not None
    assert receiver.held, "the server never tried to export"
    slowest = max(took)
    assert slowest < DEADLINE_S, f"a check took {slowest:.2f} s with the collector hung"
    print(f"slowest of {len(took)} checks with the collector hung: {slowest:.3f} s")
