"""SPEC 18: with opentelemetry-api installed, every request carries the current span's
`traceparent`, so the service's span for the check nests under the framework's tool span;
without an active span (or without the package) nothing is added."""

from __future__ import annotations

import asyncio

import pytest

from governance_client.testing import FakeGovernance

trace = pytest.importorskip("opentelemetry.trace")
sdk_trace = pytest.importorskip("opentelemetry.sdk.trace")


def _checks(fake: FakeGovernance) -> list[str | None]:
    return [r.headers.get("traceparent") for r in fake.requests if r.url.path.endswith("/check")]


def _tool_span() -> tuple[object, str]:
    tracer = sdk_trace.TracerProvider().get_tracer("agent")
    span = tracer.start_span("execute_tool search.docs")
    context = span.get_span_context()
    return span, (f"00-{context.trace_id:032x}-{context.span_id:016x}-"
                  f"{int(context.trace_flags):02x}")


def test_a_check_inside_an_active_span_carries_its_traceparent() -> None:
    fake = FakeGovernance()
    run = fake.client().start_run("bot")
    span, expected = _tool_span()
    with trace.use_span(span, end_on_exit=True):
        run.check("search.docs", {"query": "refund"})
    run.check("search.docs", {"query": "again"})  # outside: none
    assert _checks(fake) == [expected, None]


def test_the_async_client_sends_it_too() -> None:
    fake = FakeGovernance()

    async def scenario() -> None:
        async with fake.async_client() as client:
            run = await client.start_run("bot")
            span, expected = _tool_span()
            with trace.use_span(span, end_on_exit=True):
                await run.check("search.docs")
            assert _checks(fake) == [expected]

    asyncio.run(scenario())


def test_without_opentelemetry_nothing_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    from governance_client import _core

    monkeypatch.setattr(_core, "_otel_propagate", None)
    fake = FakeGovernance()
    run = fake.client().start_run("bot")
    span, _ = _tool_span()
    with trace.use_span(span, end_on_exit=True):
        run.check("search.docs")
    assert _checks(fake) == [None]
