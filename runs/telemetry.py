"""OpenTelemetry (SPEC 18): the decisions in the traces the operators already run.

Off unless ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set;
then every check, start, finish, kill-switch engage and release and approval decision is a
span, exported over OTLP/HTTP (protobuf), and the decisions' counter and the check's
duration histogram go out through the same exporter (``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT``). The standard ``OTEL_*`` variables configure the rest
(service name default ``agent-governance``; ``OTEL_TRACES_SAMPLER``, ``OTEL_BSP_*``,
``OTEL_EXPORTER_OTLP_HEADERS``, ``OTEL_METRIC_EXPORT_INTERVAL``, ...; ``OTEL_TRACES_EXPORTER``
or ``OTEL_METRICS_EXPORTER`` ``none`` turns one signal off). docs/telemetry.md.

A collector that is down, slow or refusing never delays a check: a check's thread only
appends its ended span to the batch processor's bounded queue (``OTEL_BSP_MAX_QUEUE_SIZE``,
2048) and adds to in-memory aggregates; the export runs on the processor's and the metric
reader's own threads, each request bounded by a short timeout (2 s unless
``OTEL_EXPORTER_OTLP_TIMEOUT`` says otherwise). Spans that find the queue full and batches
the collector did not take are dropped and counted (Prometheus /metrics:
``governance_telemetry_dropped_spans_total{reason}``,
``governance_telemetry_failed_exports_total{signal}``), with one warning a minute at most.

Set up lazily, once per process and again in a forked child (granian's workers fork from
the process that imported the application): nothing runs until the first span.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

SERVICE_NAME = "agent-governance"
# The exporter's own timeout, where the OTEL_* variables set none: a hung collector holds
# the exporting thread (never a check's) this long per batch.
EXPORT_TIMEOUT_S = 2.0
WARN_EVERY_S = 60.0
# The SDK's and the exporter's loggers say every failure (or one per distinct message):
# quieted, this module warns once a minute with the counts instead.
_NOISY_LOGGERS = ("opentelemetry.sdk._shared_internal", "opentelemetry.exporter.otlp",
                  "opentelemetry.sdk.metrics", "opentelemetry.sdk.trace")


def _set(name: str) -> bool:
    return bool(os.environ.get(name, "").strip())


def traces_wanted() -> bool:
    return (_set("OTEL_EXPORTER_OTLP_ENDPOINT") or _set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")) \
        and os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() != "none" \
        and os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() != "true"


def metrics_wanted() -> bool:
    return traces_wanted() \
        and (_set("OTEL_EXPORTER_OTLP_ENDPOINT") or _set("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")) \
        and os.environ.get("OTEL_METRICS_EXPORTER", "otlp").strip().lower() != "none"


# --- Losses: counted, shown in /metrics, warned about once a minute ----------------------------

_warn_lock = threading.Lock()
_last_warning = -WARN_EVERY_S
_lost = {"spans": 0, "batches": 0}


def _lost_telemetry(*, spans: int = 0, batches: int = 0, signal: str = "traces",
                    reason: str = "export_failed") -> None:
    """Spans or batches dropped (a full queue, an export the collector did not take).
    Called on the exporting threads and, for a full queue, on the request's thread: counts
    in memory and Prometheus, logs at most once a minute."""
    global _last_warning
    from runs.check import metrics  # the Prometheus side (no-op while METRICS_TOKEN is unset)

    metrics.telemetry_lost(spans=spans, batches=batches, signal=signal, reason=reason)
    with _warn_lock:
        _lost["spans"] += spans
        _lost["batches"] += batches
        now = time.monotonic()
        if now - _last_warning < WARN_EVERY_S:
            return
        _last_warning = now
        spans_lost, batches_lost = _lost["spans"], _lost["batches"]
    log.warning("telemetry: the OTLP collector is not taking what is sent (latest: %s of %s); "
                "so far this process dropped %d spans and %d batches. Checks are not delayed.",
                reason, signal, spans_lost, batches_lost)


def _exporters() -> tuple[Any, Any]:
    """The OTLP/HTTP exporters, counting the batches they fail to deliver."""
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.metrics.export import MetricExportResult
    from opentelemetry.sdk.trace.export import SpanExportResult

    timeout = None if (_set("OTEL_EXPORTER_OTLP_TIMEOUT")
                       or _set("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")) else EXPORT_TIMEOUT_S

    class SpanExporter(OTLPSpanExporter):
        def export(self, spans: Sequence[Any]) -> Any:
            try:
                result = super().export(spans)
            except Exception:
                result = SpanExportResult.FAILURE
            if result is not SpanExportResult.SUCCESS:
                _lost_telemetry(spans=len(spans), batches=1)
            return result

    metric_timeout = None if (_set("OTEL_EXPORTER_OTLP_TIMEOUT")
                              or _set("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT")) \
        else EXPORT_TIMEOUT_S

    class MetricExporter(OTLPMetricExporter):
        def export(self, metrics_data: Any, timeout_millis: float = 10_000,
                   **kwargs: Any) -> Any:
            try:
                result = super().export(metrics_data, timeout_millis=timeout_millis, **kwargs)
            except Exception:
                result = MetricExportResult.FAILURE
            if result is not MetricExportResult.SUCCESS:
                _lost_telemetry(batches=1, signal="metrics")
            return result

    return SpanExporter(timeout=timeout), MetricExporter(timeout=metric_timeout)


def _bounded_processor(exporter: Any) -> Any:
    """The SDK's batch processor (its queue bounded by OTEL_BSP_MAX_QUEUE_SIZE), counting
    the spans it drops when the queue is full."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    class Bounded(BatchSpanProcessor):
        def on_end(self, span: Any) -> None:
            inner = getattr(self, "_batch_processor", None)
            queue = getattr(inner, "_queue", None)
            if queue is not None and len(queue) >= (queue.maxlen or 1 << 62):
                _lost_telemetry(spans=1, reason="queue_full")
            super().on_end(span)

    return Bounded(exporter)


# --- The process's providers ------------------------------------------------------------------

@dataclass
class _Telemetry:
    pid: int
    tracer: Any = None  # None: tracing off in this process
    decisions: Any = None  # the counter, None without metrics
    duration: Any = None  # the histogram
    providers: list[Any] = field(default_factory=list)


_state: _Telemetry | None = None
_setup_lock = threading.Lock()


def _resource() -> Any:
    from opentelemetry.sdk.resources import Resource

    resource = Resource.create()
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
    return resource


def _build() -> _Telemetry:
    state = _Telemetry(pid=os.getpid())
    if not traces_wanted():
        return state
    from opentelemetry.sdk.trace import TracerProvider

    for name in _NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    resource = _resource()
    span_exporter, metric_exporter = _exporters()
    tracer_provider = TracerProvider(resource=resource)  # OTEL_TRACES_SAMPLER and the rest
    tracer_provider.add_span_processor(_bounded_processor(span_exporter))
    state.providers.append(tracer_provider)
    state.tracer = tracer_provider.get_tracer("agent-governance")
    if metrics_wanted():
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        reader = PeriodicExportingMetricReader(metric_exporter)
        meter_provider = MeterProvider(resource=resource, metric_readers=[reader])
        state.providers.append(meter_provider)
        _instruments(state, meter_provider)
    log.info("telemetry: OpenTelemetry on in process %d (%s)", state.pid,
             "traces and metrics" if state.decisions is not None else "traces")
    return state


# The check duration's buckets, in seconds: the SDK's default boundaries (0, 5, 10, 25, ...
# 10,000) are for milliseconds, and put every check in the first bucket, so no percentile
# could be read (found by a tester). These are OpenTelemetry's HTTP server duration buckets
# with two finer ones below 5 ms, where a check is answered; an operator's View overrides
# them.
CHECK_DURATION_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5,
                            0.75, 1.0, 2.5, 5.0, 10.0)


def _instruments(state: _Telemetry, meter_provider: Any) -> None:
    meter = meter_provider.get_meter("agent-governance")
    state.decisions = meter.create_counter(
        "governance.decisions", unit="{decision}",
        description="Check decisions, as audited, by decision, reason and team.")
    state.duration = meter.create_histogram(
        "governance.check.duration", unit="s", description="Time to answer a check.",
        explicit_bucket_boundaries_advisory=CHECK_DURATION_BUCKETS_S)


def _get() -> _Telemetry:
    global _state
    state = _state
    if state is not None and state.pid == os.getpid():
        return state
    with _setup_lock:
        state = _state
        if state is None or state.pid != os.getpid():
            try:
                state = _build()
            except Exception:  # a broken configuration must not break the checks
                log.warning("telemetry: could not set up OpenTelemetry; tracing is off",
                            exc_info=True)
                state = _Telemetry(pid=os.getpid())
            _state = state
    return state


def use(*, span_exporter: Any = None, metric_reader: Any = None) -> None:
    """Tests: trace through these (an in-memory exporter, exported at each span's end, and an
    in-memory metric reader) instead of what the environment says. ``use()`` with none:
    back to the environment's, set up again on the next span."""
    global _state
    with _setup_lock:
        if _state is not None:
            for provider in _state.providers:
                with contextlib.suppress(Exception):
                    provider.shutdown()
        if span_exporter is None:
            _state = None
            return
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor

        state = _Telemetry(pid=os.getpid())
        tracer_provider = TracerProvider(resource=_resource())
        tracer_provider.add_span_processor(SimpleSpanProcessor(span_exporter))
        state.providers.append(tracer_provider)
        state.tracer = tracer_provider.get_tracer("agent-governance")
        if metric_reader is not None:
            from opentelemetry.sdk.metrics import MeterProvider

            meter_provider = MeterProvider(resource=_resource(), metric_readers=[metric_reader])
            state.providers.append(meter_provider)
            _instruments(state, meter_provider)
        _state = state


def enabled() -> bool:
    return _get().tracer is not None


# --- Spans -------------------------------------------------------------------------------------

def _parent(meta: Mapping[str, Any] | None) -> Any:
    """The context of the W3C ``traceparent`` (and ``tracestate``) a request carried, from
    Django's META; None without one."""
    if not meta:
        return None
    traceparent = meta.get("HTTP_TRACEPARENT")
    if not traceparent:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {"traceparent": traceparent}
    state = meta.get("HTTP_TRACESTATE")
    if state:
        carrier["tracestate"] = state
    return TraceContextTextMapPropagator().extract(carrier)


@contextlib.contextmanager
def span(name: str, *, meta: Mapping[str, Any] | None = None,
         attributes: Mapping[str, Any] | None = None) -> Iterator[Any]:
    """A span around an operation (a start, a finish, an engage...), the child of the
    request's ``traceparent`` when ``meta`` (a request's META) has one; yields the span, or
    None while tracing is off. An exception ends it as an error and goes on."""
    tracer = _get().tracer
    if tracer is None:
        yield None
        return
    attrs = {k: v for k, v in (attributes or {}).items() if v is not None}
    with tracer.start_as_current_span(name, context=_parent(meta), kind=_kind(meta),
                                      attributes=attrs) as current:
        yield current


def _kind(meta: Mapping[str, Any] | None) -> Any:
    from opentelemetry.trace import SpanKind

    return SpanKind.SERVER if meta is not None else SpanKind.INTERNAL


def annotate(target: Any, attributes: Mapping[str, Any]) -> None:
    """Set the attributes that are not None on a span (None: tracing off)."""
    if target is None:
        return
    try:
        target.set_attributes({k: v for k, v in attributes.items() if v is not None})
    except Exception:
        log.debug("telemetry: could not annotate a span", exc_info=True)


# The check's span and what the check's services learn about the run, for the view to
# record once the answer is known (the services never see the request).
@dataclass(slots=True)
class CheckTrace:
    span: Any
    started: float
    team: str | None = None
    facts: dict[str, Any] | None = None


_check: contextvars.ContextVar[CheckTrace | None] = contextvars.ContextVar(
    "governance_check_trace", default=None)
_SERVER_KIND: Any = None


@contextlib.contextmanager
def check_span(meta: Mapping[str, Any]) -> Iterator[CheckTrace | None]:
    """The check's span (``governance.check``, renamed with the action's name once the body
    is read), the child of the request's ``traceparent``. Yields None while tracing is off.
    On the path of every check: the span is made current by hand (one context attach), not
    through the SDK's nested context managers, and its attributes are set once, at the end
    (``check_answered``)."""
    global _SERVER_KIND
    tracer = _get().tracer
    if tracer is None:
        yield None
        return
    from opentelemetry import context as otel_context
    from opentelemetry import trace as otel_trace

    if _SERVER_KIND is None:
        _SERVER_KIND = otel_trace.SpanKind.SERVER
    current = tracer.start_span("governance.check", context=_parent(meta), kind=_SERVER_KIND,
                                record_exception=False, set_status_on_exception=False)
    token = otel_context.attach(otel_trace.set_span_in_context(current))
    trace = CheckTrace(span=current, started=time.perf_counter())
    check_token = _check.set(trace)
    try:
        yield trace
    finally:
        _check.reset(check_token)
        otel_context.detach(token)
        current.end()


def check_facts(*, run_id: Any, team: str, agent: str, policy: tuple[str, int] | None
                ) -> None:
    """The run's facts, from the check's locking read, kept for the check's span."""
    trace = _check.get()
    if trace is None:
        return
    trace.team = team
    facts: dict[str, Any] = {"governance.run.id": str(run_id), "governance.team": team,
                             "governance.agent": agent, "gen_ai.agent.name": agent}
    if policy is not None:
        facts["governance.policy.name"] = policy[0]
        facts["governance.policy.version"] = policy[1]
    trace.facts = facts


def check_trace_id() -> str | None:
    """The check's trace id (32 hex digits) for its answer; None while tracing is off."""
    trace = _check.get()
    if trace is None:
        return None
    context = trace.span.get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else None


def rule_name(answer: Mapping[str, Any]) -> str:
    rule = answer.get("rule")
    if isinstance(rule, Mapping) and rule.get("name"):
        return str(rule["name"])
    return str(answer.get("reason", ""))


def check_answered(trace: CheckTrace | None, *, name: str | None, status: int,
                   answer: Mapping[str, Any] | None, error_code: str | None = None) -> None:
    """The check's outcome on its span: the decision's attributes (never the args), an
    error status only when the check could not be decided (5xx); and its duration."""
    if trace is None:
        return
    try:
        current = trace.span
        if name:
            current.update_name(f"governance.check {name}")
        attributes: dict[str, Any] = {**(trace.facts or {}), "http.response.status_code": status,
                                      "gen_ai.tool.name": name}
        if answer is not None:
            attributes.update({
                "governance.decision": answer.get("decision"),
                "governance.reason": answer.get("reason"),
                "governance.decision.id": answer.get("decision_id"),
                "governance.step": answer.get("step"),
                "governance.rule": rule_name(answer),
            })
        elif error_code:
            attributes["governance.error"] = error_code
        annotate(current, attributes)
        if status >= 500:
            from opentelemetry.trace import Status, StatusCode

            current.set_status(Status(StatusCode.ERROR, error_code or "not decided"))
            current.set_attribute("error.type", error_code or str(status))
        duration = _get().duration
        if duration is not None:
            decided = {"governance.decision": answer.get("decision")} if answer else {}
            duration.record(time.perf_counter() - trace.started, decided)
    except Exception:
        log.debug("telemetry: could not record a check", exc_info=True)


def decision_made(*, team: str, outcome: str, reason: str) -> None:
    """The ``governance.decisions`` counter: a decision the check audited."""
    counter = _get().decisions
    if counter is None:
        return
    try:
        counter.add(1, {"governance.decision": outcome, "governance.reason": reason,
                        "governance.team": team})
    except Exception:
        log.debug("telemetry: could not count a decision", exc_info=True)


def traced(name: str, describe: Any) -> Any:
    """A decorator: the function's call is a span ``name`` (an operator's engage, release or
    approval decision), with the attributes ``describe(kwargs, result)`` gives; an exception
    (a refusal) is recorded on the span and raised on."""
    import functools

    def decorator(function: Any) -> Any:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with span(name) as current:
                result = function(*args, **kwargs)
                if current is not None:
                    try:
                        annotate(current, describe(kwargs, result))
                    except Exception:
                        log.debug("telemetry: could not describe %s", name, exc_info=True)
                return result

        return wrapper

    return decorator


def _switch(kwargs: Mapping[str, Any], switch: Any, *, changed: bool) -> dict[str, Any]:
    team, run = kwargs.get("team"), kwargs.get("run")
    return {"governance.killswitch.scope": kwargs.get("scope"),
            "governance.team": getattr(team, "slug", None),
            "governance.agent": kwargs.get("agent") or None,
            "governance.run.id": str(run.pk) if run is not None else None,
            "governance.killswitch.id": getattr(switch, "pk", None),
            "governance.killswitch.changed": changed}


def describe_engage(kwargs: Mapping[str, Any], switch: Any) -> dict[str, Any]:
    """An engage always returns a switch: the one it engaged, or the one already engaged
    (``engaged_now`` tells them apart, as the API's ``changed`` does)."""
    return _switch(kwargs, switch, changed=bool(getattr(switch, "engaged_now", False)))


def describe_release(kwargs: Mapping[str, Any], switch: Any) -> dict[str, Any]:
    """A release returns the switch it released, or None when nothing was engaged."""
    return _switch(kwargs, switch, changed=switch is not None)


def describe_approval(kwargs: Mapping[str, Any], approval: Any) -> dict[str, Any]:
    return {"governance.approval.id": str(approval.pk),
            "governance.approval.status": approval.status,
            "governance.run.id": str(approval.run_id), "governance.team": approval.team.slug,
            "governance.agent": approval.run.agent, "governance.step": approval.step,
            "gen_ai.tool.name": approval.action_name}


def flush(timeout_s: float = 2.0) -> None:
    """Export what this process still holds (a worker's graceful shutdown: the ASGI lifespan's
    end), waiting ``timeout_s`` at most: a hung collector must not hold a shutdown either."""
    state = _state
    if state is None or state.pid != os.getpid() or not state.providers:
        return

    def run() -> None:
        for provider in state.providers:
            with contextlib.suppress(Exception):
                provider.force_flush(int(timeout_s * 1000))

    worker = threading.Thread(target=run, name="telemetry-flush", daemon=True)
    worker.start()
    worker.join(timeout_s)
