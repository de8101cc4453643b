"""A LangGraph agent's trace with the governance decisions inside (SPEC 18, docs/telemetry.md).

    .venv/bin/python examples/traced_langgraph.py

Self-contained and real: it migrates a fresh SQLite database in a temporary folder, applies
examples/policies.yaml, creates an agent key, starts the production server (`manage.py serve`)
with tracing on, exporting over OTLP/HTTP to a receiver in this process, and runs a LangGraph
agent whose scripted model loops on one `edit_file` call (the seed article's rename loop).
The agent traces with the OpenTelemetry SDK: `invoke_agent` around the run and an
`execute_tool` span per tool call (GenAI semantic conventions, as a framework's
instrumentation makes them); the governance client, with `opentelemetry-api` installed, sends
the current span's `traceparent` with each check. The agent's spans and the server's, joined
by their ids, are printed as one tree.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "governance_client" / "examples"))

import httpx  # noqa: E402
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel  # noqa: E402
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langgraph.graph import END, START, MessagesState, StateGraph  # noqa: E402
from opentelemetry import trace  # noqa: E402
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.resources import Resource  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)
from rename_loop import AGENT, EDIT_ARGS, TASK, Workspace, narration  # noqa: E402

from governance_client import GovernanceClient  # noqa: E402

SERVER_SPANS: list[dict[str, Any]] = []


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


class Receiver(BaseHTTPRequestHandler):
    """The server's spans, as an OTLP/HTTP collector receives them."""

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path == "/v1/traces":
            for rs in ExportTraceServiceRequest.FromString(body).resource_spans:
                service = next((_value(a.value) for a in rs.resource.attributes
                                if a.key == "service.name"), "?")
                for scope in rs.scope_spans:
                    for span in scope.spans:
                        SERVER_SPANS.append({
                            "service": service, "name": span.name,
                            "span_id": span.span_id.hex(),
                            "parent": span.parent_span_id.hex() or None,
                            "start": span.start_time_unix_nano, "end": span.end_time_unix_nano,
                            "attributes": {a.key: _value(a.value) for a in span.attributes}})
        answer = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args: Any) -> None:
        pass


def manage(env: dict[str, str], *args: str) -> str:
    return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env, check=True,
                          capture_output=True, text=True).stdout


def start_server(folder: str, collector: str) -> tuple[subprocess.Popen[bytes], str, str]:
    env = {**os.environ, "DATABASE_URL": f"sqlite:///{folder}/db.sqlite3", "DEBUG": "false",
           "SECRET_KEY": os.environ.get("SECRET_KEY", "example-only"),
           "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{collector}/v1/traces",
           "OTEL_BSP_SCHEDULE_DELAY": "100"}
    manage(env, "migrate", "--noinput", "-v0")
    manage(env, "apply_policies", "examples/policies.yaml")
    token = manage(env, "create_agent_key", "--team", "support", "--name", "traced",
                   "--agent", AGENT).split()[-1]
    with __import__("socket").socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, "manage.py", "serve", "--port", str(port),
                               "--workers", "1"], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return server, url, token
        except httpx.HTTPError:
            time.sleep(0.2)
    server.terminate()
    raise SystemExit("the server did not start")


def run_agent(client: GovernanceClient, tracer: trace.Tracer) -> str:
    workspace = Workspace()
    edit_file = tool(workspace.edit_file, description="Replace `old` with `new` in a file.")
    turns = [AIMessage(content=narration(i), tool_calls=[
        {"name": "edit_file", "args": dict(EDIT_ARGS), "id": f"call_{i}"}]) for i in range(8)]
    model = GenericFakeChatModel(messages=iter(turns))

    def agent(state: MessagesState) -> dict[str, Any]:
        with tracer.start_as_current_span("chat scripted-model",
                                          attributes={"gen_ai.operation.name": "chat"}):
            return {"messages": [model.invoke(state["messages"])]}

    def tools(state: MessagesState) -> dict[str, Any]:
        results: list[Any] = []
        last = state["messages"][-1]
        for call in last.tool_calls:
            with tracer.start_as_current_span(f"execute_tool {call['name']}", attributes={
                    "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": call["name"],
                    "gen_ai.tool.call.id": call["id"]}):
                decision = run.check(call["name"], call["args"], call_id=call["id"])
                if not decision.allowed:
                    results.append(AIMessage(content=decision.user_notice(
                        workspace.partial_response()), name="governance"))
                    return {"messages": results}
                try:
                    output = edit_file.invoke(call["args"])
                except Exception as exc:  # reported: the service counts repeated errors
                    run.report(error=exc)
                    output = f"error: {exc}"
                else:
                    run.report(output)
                results.append(ToolMessage(content=str(output), tool_call_id=call["id"]))
        return {"messages": results}

    def route(state: MessagesState) -> str:
        last = state["messages"][-1]
        return "tools" if isinstance(last, AIMessage) and last.tool_calls else END

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", tools)
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", route, ["tools", END])
    graph.add_conditional_edges("tools", lambda s: END if isinstance(
        s["messages"][-1], AIMessage) else "agent", ["agent", END])
    app = graph.compile()
    invoke = tracer.start_as_current_span(f"invoke_agent {AGENT}", attributes={
        "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": AGENT})
    with invoke, client.run(AGENT, task=TASK) as run:
        state = app.invoke({"messages": [HumanMessage(TASK)]}, {"recursion_limit": 40})
        run.output = str(state["messages"][-1].content)
    return run.output or ""


def tree(agent_spans: list[Any]) -> list[str]:
    spans = [{"service": AGENT, "name": s.name, "span_id": format(s.context.span_id, "016x"),
              "parent": format(s.parent.span_id, "016x") if s.parent else None,
              "start": s.start_time, "end": s.end_time, "attributes": dict(s.attributes or {})}
             for s in agent_spans] + SERVER_SPANS
    children: dict[str | None, list[dict[str, Any]]] = {}
    for span in sorted(spans, key=lambda s: s["start"]):
        children.setdefault(span["parent"], []).append(span)
    lines: list[str] = []

    def label(span: dict[str, Any]) -> str:
        a = span["attributes"]
        ms = (span["end"] - span["start"]) / 1e6
        text = f"{span['name']}  [{span['service']}] {ms:.1f} ms"
        if "governance.decision" in a:
            text += (f"  decision={a['governance.decision']} reason={a['governance.reason']} "
                     f"step={a['governance.step']} policy={a['governance.policy.name']}"
                     f" v{a['governance.policy.version']}")
        elif span["name"] in ("governance.start", "governance.finish"):
            text += (f"  run={str(a.get('governance.run.id'))[:8]} "
                     f"status={a.get('governance.run.status')}")
        return text

    def walk(span: dict[str, Any], prefix: str, last: bool, top: bool) -> None:
        lines.append((prefix + ("└─ " if last else "├─ ") if not top else "") + label(span))
        below = children.get(span["span_id"], [])
        for i, child in enumerate(below):
            walk(child, prefix + ("" if top else ("   " if last else "│  ")),
                 i == len(below) - 1, False)

    for root in children.get(None, []):
        walk(root, "", True, True)
    return lines


def main() -> int:
    collector = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource({"service.name": AGENT}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    tracer = trace.get_tracer("example")
    with tempfile.TemporaryDirectory() as folder:
        server, url, token = start_server(folder, f"http://127.0.0.1:{collector.server_port}")
        try:
            with GovernanceClient(url, token) as client:
                answer = run_agent(client, tracer)
            ends = time.monotonic() + 10
            while time.monotonic() < ends and not any(
                    s["name"] == "governance.finish" for s in SERVER_SPANS):
                time.sleep(0.1)
        finally:
            server.terminate()
            server.wait(timeout=30)
    print(answer, end="\n\n")
    print("\n".join(tree(list(exporter.get_finished_spans()))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
