"""OpenTelemetry (SPEC 18), in process: the check's span is the child of the agent's
`traceparent`, with the decision's attributes and never the args; stops, waits and
pendings are not errors; the answer carries the trace id; start, finish, the kill switch and
approval decisions get spans; the decisions counter and the check's duration histogram; losses
counted in /metrics. The real exporter against a real OTLP/HTTP receiver, through the real
server: tests/test_telemetry_e2e.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from django.test import override_settings
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from runs import telemetry
from tests.conftest import set_policy

pytestmark = pytest.mark.django_db

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.fixture
def traced() -> Iterator[tuple[InMemorySpanExporter, InMemoryMetricReader]]:
    exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
    telemetry.use(span_exporter=exporter, metric_reader=reader)
    yield exporter, reader
    telemetry.use()


def _start(api: Any, **extra: Any) -> str:
    response = api.post("/api/v1/runs", {"agent": "support-bot"}, content_type="application/json",
                        **extra)
    assert response.status_code == 201, response.content
    return response.json()["run_id"]


def _check(api: Any, run_id: str, name: str = "search.docs", status: int = 200,
           **extra: Any) -> dict[str, Any]:
    body = {"action": {"name": name, "args": {"query": "refund policy", "token": "s3cr3t"}}}
    response = api.post(f"/api/v1/runs/{run_id}/check", json.dumps(body),
                        content_type="application/json", **extra)
    assert response.status_code == status, response.content
    return response.json()


def _spans(exporter: InMemorySpanExporter, prefix: str) -> list[Any]:
    return [s for s in exporter.get_finished_spans() if s.name.startswith(prefix)]


def test_tracing_is_off_without_an_endpoint(api: Any, monkeypatch: Any) -> None:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    telemetry.use()
    assert not telemetry.enabled()
    answer = _check(api, _start(api), HTTP_TRACEPARENT=TRACEPARENT)
    assert answer["decision"] == "allow"
    assert answer["trace_id"] is None


def test_the_check_is_a_child_of_the_agents_span(api: Any, traced: Any) -> None:
    exporter, _ = traced
    run_id = _start(api)
    answer = _check(api, run_id, HTTP_TRACEPARENT=TRACEPARENT)
    assert answer["trace_id"] == TRACE_ID
    [span] = _spans(exporter, "governance.check")
    assert span.name == "governance.check search.docs"
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert span.parent is not None and format(span.parent.span_id, "016x") == PARENT_ID
    assert span.attributes is not None
    attributes = dict(span.attributes)
    assert {k: v for k, v in attributes.items() if k.startswith(("governance.", "gen_ai."))} == {
        "governance.decision": "allow", "governance.reason": answer["reason"],
        "governance.decision.id": answer["decision_id"], "governance.run.id": run_id,
        "governance.team": "support", "governance.agent": "support-bot",
        "governance.policy.name": "default", "governance.policy.version": 1,
        "governance.step": 1, "governance.rule": answer["reason"],
        "gen_ai.tool.name": "search.docs", "gen_ai.agent.name": "support-bot",
    }
    assert span.status.status_code is StatusCode.UNSET
    # Never the args, in any attribute.
    assert not any("s3cr3t" in str(v) or "refund" in str(v) for v in attributes.values())
    # The audit record keeps the trace its decision is in; a replay answers the same.
    from runs.models import Decision

    assert Decision.objects.get(pk=answer["decision_id"]).answer["trace_id"] == TRACE_ID


def test_a_check_without_traceparent_starts_a_trace(api: Any, traced: Any) -> None:
    exporter, _ = traced
    answer = _check(api, _start(api))
    [span] = _spans(exporter, "governance.check")
    assert span.parent is None
    assert answer["trace_id"] == format(span.context.trace_id, "032x")


def test_a_stop_is_not_an_error(api: Any, team: Any, traced: Any) -> None:
    exporter, _ = traced
    set_policy(team, tools={"allow": None, "deny": ["shell.*"]})
    run_id = _start(api)
    answer = _check(api, run_id, name="shell.exec")
    assert answer["decision"] == "stop"
    [span] = _spans(exporter, "governance.check")
    assert span.attributes["governance.decision"] == "stop"
    assert span.attributes["governance.reason"] == answer["reason"]
    assert span.attributes["governance.rule"] == telemetry.rule_name(answer)
    assert span.status.status_code is StatusCode.UNSET


def test_a_failure_to_decide_is_an_error(api: Any, traced: Any, monkeypatch: Any) -> None:
    exporter, _ = traced
    from django.db import OperationalError

    from runs.check import api as api_module

    run_id = _start(api)

    def broken(**kwargs: Any) -> Any:
        raise OperationalError("the database is gone")

    monkeypatch.setattr(api_module, "run_check", broken)
    assert _check(api, run_id, status=503)["error"]["code"] == "unavailable"
    [span] = _spans(exporter, "governance.check")
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes["error.type"] == "unavailable"


def test_a_refusal_is_named_not_an_error(api: Any, traced: Any) -> None:
    exporter, _ = traced
    _check(api, "00000000-0000-0000-0000-000000000000", status=404)
    [span] = _spans(exporter, "governance.check")
    assert span.attributes["governance.error"] == "not_found"
    assert span.status.status_code is StatusCode.UNSET


def test_start_and_finish_have_spans(api: Any, traced: Any) -> None:
    exporter, _ = traced
    run_id = _start(api, HTTP_TRACEPARENT=TRACEPARENT)
    response = api.post(f"/api/v1/runs/{run_id}/finish", {"status": "completed"},
                        content_type="application/json", HTTP_TRACEPARENT=TRACEPARENT)
    assert response.status_code == 200
    [start] = _spans(exporter, "governance.start")
    [finish] = _spans(exporter, "governance.finish")
    for span in (start, finish):
        assert format(span.context.trace_id, "032x") == TRACE_ID
        assert span.attributes["governance.run.id"] == run_id
        assert span.attributes["governance.agent"] == "support-bot"
    assert finish.attributes["governance.run.status"] == "completed"


def test_the_decisions_and_the_duration_are_metrics(api: Any, traced: Any) -> None:
    _, reader = traced
    run_id = _start(api)
    reason = _check(api, run_id)["reason"]
    _check(api, run_id, name="search.web")
    found = {m.name: m for rm in reader.get_metrics_data().resource_metrics
             for sm in rm.scope_metrics for m in sm.metrics}
    [point] = found["governance.decisions"].data.data_points
    assert point.value == 2
    assert dict(point.attributes) == {"governance.decision": "allow",
                                      "governance.reason": reason, "governance.team": "support"}
    [histogram] = found["governance.check.duration"].data.data_points
    assert histogram.count == 2 and 0 < histogram.sum < 10
    # Buckets in seconds, fine below a second (not the SDK's default, for milliseconds).
    assert tuple(histogram.explicit_bounds)[:4] == (0.001, 0.0025, 0.005, 0.01)
    assert max(histogram.explicit_bounds) == 10.0
    assert found["governance.check.duration"].unit == "s"


def test_the_service_name_defaults_to_agent_governance(monkeypatch: Any) -> None:
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    assert telemetry._resource().attributes["service.name"] == "agent-governance"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "governance-eu")
    assert telemetry._resource().attributes["service.name"] == "governance-eu"


@override_settings(METRICS_TOKEN="t")
def test_losses_are_counted_in_prometheus_and_warned_once_a_minute(client: Any,
                                                                    caplog: Any) -> None:
    telemetry._last_warning = -telemetry.WARN_EVERY_S
    with caplog.at_level("WARNING", logger="runs.telemetry"):
        telemetry._lost_telemetry(spans=3, batches=1)
        telemetry._lost_telemetry(spans=1, reason="queue_full")
    assert len([r for r in caplog.records if "dropped" in r.getMessage()]) == 1
    text = client.get("/metrics", HTTP_AUTHORIZATION="Bearer t").content.decode()
    assert 'governance_telemetry_dropped_spans_total{reason="export_failed"}' in text
    assert 'governance_telemetry_dropped_spans_total{reason="queue_full"}' in text
    assert 'governance_telemetry_failed_exports_total{signal="traces"}' in text


def test_an_approval_decision_has_a_span_and_a_pending_is_not_an_error(
        api: Any, team: Any, traced: Any) -> None:
    from runs.approvals.services import approval_decide

    exporter, _ = traced
    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 600})
    run_id = _start(api)
    response = api.post(f"/api/v1/runs/{run_id}/check",
                        {"action": {"name": "payments.refund"}, "check_id": "pay-1"},
                        content_type="application/json")
    answer = response.json()
    assert answer["decision"] == "pending"
    [check] = _spans(exporter, "governance.check")
    assert check.attributes["governance.decision"] == "pending"
    assert check.status.status_code is StatusCode.UNSET
    approval_decide(team=team, approval_id=answer["approval"]["id"], decision="approve",
                    note="ok")
    [decided] = _spans(exporter, "governance.approval.decide")
    assert decided.attributes["governance.approval.status"] == "approved"
    assert decided.attributes["governance.run.id"] == run_id
    assert decided.attributes["gen_ai.tool.name"] == "payments.refund"
    # The final answer is the same check's: it carries the pending answer's trace (SPEC 18),
    # on the approval and on the check sent again (it was null).
    assert answer["trace_id"]
    again = api.post(f"/api/v1/runs/{run_id}/check",
                     {"action": {"name": "payments.refund"}, "check_id": "pay-1"},
                     content_type="application/json").json()
    assert (again["decision"], again["trace_id"]) == ("allow", answer["trace_id"])
    polled = api.get(f"/api/v1/approvals/{answer['approval']['id']}").json()
    assert polled["decision"]["trace_id"] == answer["trace_id"]


@pytest.mark.django_db(transaction=True)
def test_a_kill_switch_engage_and_release_have_spans(team: Any, traced: Any) -> None:
    from runs.killswitch.services import killswitch_engage, killswitch_release

    exporter, _ = traced
    switch = killswitch_engage(scope="team", team=team, reason="incident 7")
    killswitch_release(scope="team", team=team, reason="fixed")
    [engaged] = _spans(exporter, "governance.killswitch.engage")
    [released] = _spans(exporter, "governance.killswitch.release")
    for span in (engaged, released):
        assert span.attributes["governance.killswitch.scope"] == "team"
        assert span.attributes["governance.team"] == "support"
        assert span.attributes["governance.killswitch.id"] == switch.pk
        assert span.attributes["governance.killswitch.changed"] is True


@pytest.mark.django_db(transaction=True)
def test_an_engage_or_release_that_changes_nothing_says_so_on_its_span(team: Any,
                                                                        traced: Any) -> None:
    from runs.killswitch.services import killswitch_engage, killswitch_release

    exporter, _ = traced
    first = killswitch_engage(scope="team", team=team, reason="incident 7")
    again = killswitch_engage(scope="team", team=team, reason="incident 7, again")
    assert again.pk == first.pk and not again.engaged_now  # the API answers changed: false
    killswitch_release(scope="team", team=team, reason="fixed")
    assert killswitch_release(scope="team", team=team, reason="fixed again") is None
    engaged = _spans(exporter, "governance.killswitch.engage")
    released = _spans(exporter, "governance.killswitch.release")
    assert [s.attributes["governance.killswitch.changed"] for s in engaged] == [True, False]
    assert [s.attributes["governance.killswitch.changed"] for s in released] == [True, False]


@pytest.mark.parametrize("header", ["garbage", "00-" + "0" * 32 + "-" + "0" * 16 + "-01",
                                    "ff-" + TRACE_ID + "-" + PARENT_ID + "-01x"])
def test_a_malformed_traceparent_starts_a_trace(api: Any, traced: Any, header: str) -> None:
    exporter, _ = traced
    answer = _check(api, _start(api), HTTP_TRACEPARENT=header)
    [span] = _spans(exporter, "governance.check")
    assert span.parent is None
    assert answer["trace_id"] == format(span.context.trace_id, "032x") != TRACE_ID


def test_flush_exports_what_the_process_holds(traced: Any) -> None:
    exporter, _ = traced
    with telemetry.span("governance.start", attributes={"governance.agent": "bot"}):
        pass
    telemetry.flush(timeout_s=1)
    assert [s.name for s in exporter.get_finished_spans()] == ["governance.start"]
