"""A local OTLP/HTTP receiver for the benchmark's tracing phase (bench/tracing.py), in its own
process so that decoding what the server exports takes no time from the load generator.

    python -m bench.otlp_sink PORT [--print]

It decodes each protobuf request (ExportTraceServiceRequest, ExportMetricsServiceRequest),
counts the spans and the metric requests, and answers GET /count with them as JSON. With
``--print`` it also prints each span (its name, trace id and attributes) and each metric
(its name and data points' count) on stdout: the receiver docs/telemetry.md suggests for a
first look, with no collector installed.
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

PRINT = False  # --print (`main`)


def _value(value: Any) -> Any:
    """An OTLP AnyValue as the plain value it holds."""
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind in ("string_value", "bool_value", "int_value",
                                            "double_value") else str(value)


counts = {"spans": 0, "span_requests": 0, "metric_requests": 0, "check_spans": 0}
lock = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path == "/v1/traces":
            request = ExportTraceServiceRequest.FromString(body)
            spans = [s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
            if PRINT:
                for span in spans:
                    attributes = {a.key: _value(a.value) for a in span.attributes}
                    print(f"span {span.name}  trace {span.trace_id.hex()}  "
                          f"{json.dumps(attributes, sort_keys=True)}", flush=True)
            with lock:
                counts["spans"] += len(spans)
                counts["check_spans"] += sum(s.name.startswith("governance.check") for s in spans)
                counts["span_requests"] += 1
            answer = ExportTraceServiceResponse().SerializeToString()
        elif self.path == "/v1/metrics":
            request = ExportMetricsServiceRequest.FromString(body)
            if PRINT:
                for rm in request.resource_metrics:
                    for sm in rm.scope_metrics:
                        for metric in sm.metrics:
                            kind = metric.WhichOneof("data")
                            points = len(getattr(metric, kind).data_points) if kind else 0
                            print(f"metric {metric.name}  {kind}  {points} data point(s)",
                                  flush=True)
            with lock:
                counts["metric_requests"] += 1
            answer = ExportMetricsServiceResponse().SerializeToString()
        else:
            self.send_error(404)
            return
        self._answer(answer, "application/x-protobuf")

    def do_GET(self) -> None:
        with lock:
            self._answer(json.dumps(counts).encode(), "application/json")

    def _answer(self, body: bytes, kind: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.otlp_sink",
        description="A local OTLP/HTTP receiver on 127.0.0.1: counts what it receives "
                    "(GET /count), and with --print prints each span and metric.")
    parser.add_argument("port", type=int, help="the port to listen on (4318 is OTLP/HTTP's)")
    parser.add_argument("--print", action="store_true", help="print each span and metric")
    args = parser.parse_args()
    global PRINT
    PRINT = args.print
    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
