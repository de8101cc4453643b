"""Checks: the request, retries with one check_id, fail modes, reported results."""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import httpx
import pytest

from governance_client import (
    GOVERNANCE_UNAVAILABLE,
    Decision,
    GovernanceClient,
    InvalidRequest,
    LocalLimits,
    result_digest,
)
from governance_client.testing import FakeGovernance

EDIT = {"path": "auth.py", "old": "user_id", "new": "account_id"}


def bodies(fake: FakeGovernance, suffix: str = "/check") -> list[dict[str, Any]]:
    return [json.loads(r.content) for r in fake.requests if r.url.path.endswith(suffix)]


def test_it_sends_the_action_as_the_spec_describes() -> None:
    fake = FakeGovernance()
    run = fake.client().start_run("bot")

    run.check("search.docs", {"query": "refund"}, type="llm", progress="p1", cost_usd=0.01)

    (body,) = bodies(fake)
    assert body["action"] == {"name": "search.docs", "args": {"query": "refund"}, "type": "llm"}
    assert body["progress"] == "p1"
    assert body["cost_usd"] == 0.01
    assert "last_result" not in body


def test_it_sends_a_fresh_check_id_with_every_check() -> None:
    fake = FakeGovernance()
    run = fake.client().start_run("bot")

    run.check("a")
    run.check("b")

    first, second = (b["check_id"] for b in bodies(fake))
    assert first != second
    assert len(first) == 32
    int(first, 16)


def test_it_returns_the_service_decision() -> None:
    fake = FakeGovernance()
    run = fake.client().start_run("bot")

    decision = run.check("edit_file", EDIT)

    assert decision.allowed
    assert decision.decision == "allow"
    assert decision.reason == "step_ok"
    assert decision.step == 1
    assert decision.repeat_count == 1
    assert decision.decision_id == 1
    assert decision.limits["max_repeat_action"] == 3
    assert decision.usage["steps"] == 1
    assert decision.local is False
    assert run.last_decision == decision


def test_it_retries_with_the_same_check_id() -> None:
    fake = FakeGovernance()
    sleeps: list[float] = []
    run = fake.client(sleep=sleeps.append).start_run("bot")
    # The service decides, then the answer is lost on the way back.
    fake.fail_next(httpx.ReadTimeout, processed=True)

    decision = run.check("edit_file", EDIT)

    first, retry = bodies(fake)
    assert first["check_id"] == retry["check_id"]
    assert decision.allowed and decision.step == 1
    assert fake.runs[run.id].steps == 1
    # Full jitter: anywhere between 0 and the first backoff (0.1 s by default).
    assert len(sleeps) == 1 and 0 <= sleeps[0] <= 0.1


def test_it_retries_502_503_504_with_full_jitter_exponential_backoff() -> None:
    fake = FakeGovernance()
    sleeps: list[float] = []
    run = fake.client(sleep=sleeps.append, attempts=4, backoff=0.1, deadline=10).start_run("bot")
    fake.fail_next(502, 503, 504)

    decision = run.check("edit_file", EDIT)

    assert decision.allowed
    assert len({b["check_id"] for b in bodies(fake)}) == 1
    assert len(sleeps) == 3
    for attempt, slept in enumerate(sleeps):
        assert 0 <= slept <= 0.1 * 2**attempt


def test_a_retried_check_never_counts_twice_towards_a_loop() -> None:
    fake = FakeGovernance(max_repeat_action=3)
    run = fake.client().start_run("bot")

    decisions = []
    for _ in range(3):
        fake.fail_next(httpx.ReadTimeout, processed=True)
        decisions.append(run.check("edit_file", EDIT))

    assert [d.allowed for d in decisions] == [True, True, True]
    assert [d.repeat_count for d in decisions] == [1, 2, 3]
    assert not run.check("edit_file", EDIT).allowed


def test_it_fails_closed_when_the_service_is_unreachable() -> None:
    fake = FakeGovernance()
    run = fake.client(retries=2).start_run("bot")
    fake.down = True

    decision = run.check("edit_file", EDIT)

    assert not decision.allowed
    assert decision.reason == GOVERNANCE_UNAVAILABLE
    assert decision.local
    assert "unreachable" in (decision.message or "")
    assert decision.next_action
    assert len(bodies(fake)) == 3  # the first attempt and two retries


def test_it_fails_closed_on_503_once_the_retries_are_spent() -> None:
    fake = FakeGovernance()
    run = fake.client(retries=1).start_run("bot")
    fake.fail_next(503, 503)

    decision = run.check("edit_file", EDIT)

    assert decision.reason == GOVERNANCE_UNAVAILABLE


def test_it_fails_closed_on_a_500_without_retrying() -> None:
    fake = FakeGovernance()
    run = fake.client().start_run("bot")
    fake.fail_next(500)

    assert run.check("edit_file", EDIT).reason == GOVERNANCE_UNAVAILABLE
    assert len(bodies(fake)) == 1


def test_it_checks_the_service_again_after_a_closed_outage() -> None:
    fake = FakeGovernance()
    run = fake.client().start_run("bot")
    fake.down = True
    assert not run.check("edit_file", EDIT).allowed
    fake.down = False

    assert run.check("edit_file", EDIT).allowed


def test_it_fails_open_under_the_local_max_steps() -> None:
    fake = FakeGovernance()
    client = fake.client(fail_mode="open", local_limits=LocalLimits(max_steps=5))
    run = client.start_run("bot")
    run.check("step", {"n": 0})
    run.check("step", {"n": 1})
    fake.down = True

    decisions = [run.check("step", {"n": n}) for n in range(2, 7)]

    assert [d.allowed for d in decisions] == [True, True, True, False, False]
    stop = decisions[3]
    assert stop.reason == "max_steps"
    assert stop.local
    assert stop.step == 6
    assert "max_steps=5" in (stop.message or "")
    assert stop.next_action
    assert all(d.local for d in decisions)


def test_it_fails_open_and_detects_a_loop_across_server_and_local_checks() -> None:
    fake = FakeGovernance(max_repeat_action=3)
    run = fake.client(fail_mode="open").start_run("bot")
    assert run.check("edit_file", EDIT).allowed
    assert run.check("edit_file", EDIT).allowed
    fake.down = True

    third = run.check("edit_file", dict(reversed(list(EDIT.items()))))
    fourth = run.check("edit_file", EDIT)

    assert third.allowed and third.local and third.repeat_count == 3
    assert not fourth.allowed
    assert fourth.reason == "loop_detected"
    assert fourth.local
    assert fourth.repeat_key == fake.runs[run.id].decisions[0]["repeat_key"]
    assert run.stop_decision == fourth


def test_a_local_stop_is_final_even_when_the_service_comes_back() -> None:
    fake = FakeGovernance(max_repeat_action=1)
    run = fake.client(fail_mode="open").start_run("bot")
    fake.down = True
    run.check("edit_file", EDIT)
    stop = run.check("edit_file", EDIT)
    fake.down = False
    sent = len(fake.requests)

    again = run.check("other_tool")

    assert (again.reason, again.step, again.local) == (stop.reason, stop.step, True)
    assert len(fake.requests) == sent


def test_local_limits_default_to_the_step_limits_of_the_run_policy() -> None:
    fake = FakeGovernance(max_repeat_action=2)
    run = fake.client(fail_mode="open").start_run("bot")
    fake.down = True

    decisions = [run.check("edit_file", EDIT) for _ in range(3)]

    assert [d.allowed for d in decisions] == [True, True, False]
    assert decisions[2].limits["max_repeat_action"] == 2


def test_fail_open_starts_the_run_locally_when_the_service_is_unreachable() -> None:
    fake = FakeGovernance()
    fake.down = True
    client = fake.client(fail_mode="open", local_limits=LocalLimits(max_repeat_action=3))

    with client.run("bot") as run:
        decisions = [run.check("edit_file", EDIT) for _ in range(4)]
        sent = len(fake.requests)

    assert run.local and run.id.startswith("local-")
    assert [d.allowed for d in decisions] == [True, True, True, False]
    assert decisions[3].reason == "loop_detected"
    assert len(fake.requests) == sent  # neither the checks nor finish went to the service
    assert run.status == "stopped"


def test_report_feeds_last_result_to_the_next_check_only() -> None:
    fake = FakeGovernance()
    run = fake.client().start_run("bot")
    run.check("search", {"q": "a"})
    run.report({"hits": 3, "top": "doc-1"}, summary="3 hits")

    run.check("search", {"q": "b"})
    run.check("search", {"q": "c"})

    _, second, third = bodies(fake)
    assert second["last_result"] == {
        "status": "ok",
        "digest": result_digest({"top": "doc-1", "hits": 3}),
        "summary": "3 hits",
    }
    assert "last_result" not in third
    assert run.pending_result is None


def test_report_of_an_error_sends_its_normalized_text() -> None:
    fake = FakeGovernance()
    run = fake.client().start_run("bot")
    run.check("edit_file", EDIT)
    run.report(error=ValueError("  no matches\n found  "))

    run.check("edit_file", EDIT)

    assert bodies(fake)[1]["last_result"] == {"status": "error", "error": "no matches found"}


def test_report_limits_summary_and_error_to_2000_characters() -> None:
    fake = FakeGovernance()
    run = fake.client().start_run("bot")

    ok = run.report("x", summary="s" * 5000)
    error = run.report(error="e" * 5000)

    assert len(ok["summary"]) == 2000
    assert len(error["error"]) == 2000


def test_result_digest_is_stable_and_distinguishes_outputs() -> None:
    assert result_digest({"a": 1, "b": [1, 2]}) == result_digest({"b": [1, 2], "a": 1})
    assert result_digest("3 matches replaced") != result_digest("no matches found")
    assert len(result_digest(b"\x00bytes")) == 64


def test_report_without_a_result_sends_no_digest() -> None:
    fake = FakeGovernance()
    run = fake.client().start_run("bot")

    assert run.report() == {"status": "ok"}
    assert run.report(digest="d" * 200)["digest"] == result_digest("d" * 200)


def test_an_explicit_last_result_overrides_the_report() -> None:
    fake = FakeGovernance()
    run = fake.client().start_run("bot")
    run.check("a")
    run.report("ignored")

    run.check("b", last_result={"status": "ok", "digest": "abc"})

    assert bodies(fake)[1]["last_result"] == {"status": "ok", "digest": "abc"}


def test_the_repeated_error_directive_is_surfaced_on_the_decision() -> None:
    fake = FakeGovernance(max_repeat_action=100, error_threshold=3)
    run = fake.client().start_run("bot")
    run.check("edit_file", EDIT)
    for _ in range(3):
        run.report(error="no matches found")
        decision = run.check("edit_file", EDIT)

    assert decision.allowed
    assert decision.directive == {
        "type": "inject_message",
        "role": "user",
        "code": "repeated_error",
        "content": "The error 'no matches found' occurred 3 times. "
        "Change approach radically or abandon this subtask.",
    }


def test_a_refused_check_raises_with_the_error_code_and_fields() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/v1/runs":
            return httpx.Response(201, json={"run_id": "r1", "status": "running"})
        error = {"code": "invalid_request", "message": "bad", "fields": {"cost_usd": ">= 0"}}
        return httpx.Response(422, json={"error": error})

    client = GovernanceClient("http://x", "k", transport=httpx.MockTransport(handler))
    run = client.start_run("bot")

    with pytest.raises(InvalidRequest) as raised:
        run.check("a", cost_usd=0.5)

    assert raised.value.status == 422
    assert raised.value.fields == {"cost_usd": ">= 0"}


def test_a_decision_is_frozen_and_its_allowed_flag_follows_the_outcome() -> None:
    decision = Decision(decision="stop", reason="max_steps", message="Step 19 exceeds 18.")

    assert decision.allowed is False
    with pytest.raises(AttributeError):
        decision.reason = "other"  # type: ignore[misc]


def test_a_decision_keeps_the_trace_id_of_the_answer() -> None:
    # Found by a newcomer: every check answer carries trace_id (SPEC 18), and Decision
    # dropped it, so the agent could not link a decision to its trace.
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/v1/runs":
            return httpx.Response(201, json={"run_id": "r1", "status": "running"})
        return httpx.Response(200, json={"decision": "allow", "reason": "step_ok",
                                         "trace_id": trace_id})

    run = GovernanceClient("http://x", "k", transport=httpx.MockTransport(handler),
                           journal=False).start_run("bot")

    decision = run.check("search.docs")

    assert decision.trace_id == trace_id
    assert Decision.from_state(decision.to_state()) == decision
    # Tracing off (null), or a service that predates it (absent): None.
    assert Decision.from_response({"decision": "allow", "trace_id": None}).trace_id is None
    assert FakeGovernance().client().start_run("bot").check("a").trace_id is None


def test_a_malformed_answer_is_a_stop_never_an_allow() -> None:
    assert not Decision.from_response({"decision": "maybe"}).allowed


def test_user_notice_shows_the_partial_response_reason_and_next_action() -> None:
    decision = Decision(
        decision="stop",
        reason="loop_detected",
        message="edit_file was called 3 times with the same arguments (max_repeat_action=3).",
        next_action="Return the partial response.",
    )

    assert decision.user_notice("Done so far: auth.py renamed.") == (
        "Done so far: auth.py renamed.\n\n"
        "Stopped by governance (loop_detected): edit_file was called 3 times with the same "
        "arguments (max_repeat_action=3).\n"
        "Next: Return the partial response."
    )


@pytest.mark.parametrize("cost", [-1, -0.01, 1_000_001, Decimal("-0.5")])
def test_a_cost_the_service_would_refuse_is_refused_before_anything_is_sent(cost) -> None:
    """Found by a new agent author: the service answers 422 for a negative cost_usd (SPEC
    5.2: a number >= 0), but FakeGovernance took it (its run's cost went down, -4.1 USD), and
    so did a fail-open run deciding locally, where a negative spend kept it under max_usd."""
    fake = FakeGovernance(max_usd=1.0)
    with fake.client() as client, client.run("bot") as run:
        with pytest.raises(ValueError, match="cost_usd is the spend since the previous check"):
            run.check("a", cost_usd=cost)
        assert fake.runs[run.id].checks == []
        assert run.check("a", cost_usd=0).allowed


def test_a_check_that_waits_says_so_in_the_log(caplog) -> None:
    """Found by a new agent author: a check slept for a rate limit, or blocked for minutes on
    an operator's approval, and nothing said why the agent seemed to hang."""
    import logging

    from governance_client.testing import RateLimit

    fake = FakeGovernance(rate_limits=[RateLimit(match="http.*", max=1, window_s=5)],
                          approvals=["payments.*"], operator=lambda approval: "approve")
    with caplog.at_level(logging.INFO, logger="governance_client"), fake.client() as client, \
            client.run("bot") as run:
        assert run.check("http.get", {"n": 1}).allowed
        assert run.check("http.get", {"n": 2}).allowed  # after a wait
        assert run.check("payments.refund", {"order": 42}).allowed  # after an approval
    said = [r.getMessage() for r in caplog.records if r.name == "governance_client"]
    assert any(m.startswith(f"http.get is rate limited (run {run.id}): checking it again in ")
               for m in said), said
    assert any(m.startswith("payments.refund waits for an operator's approval ")
               and f"(run {run.id}, expires at " in m for m in said), said
