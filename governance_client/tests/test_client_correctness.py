"""The client in the cases agents really meet: hung servers, 429s, parallel tool calls, big
args, outages with a later upload, closed runs, approvals and rate limits, asyncio."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from decimal import Decimal
from fractions import Fraction
from pathlib import PurePosixPath
from typing import Any, get_args, get_type_hints

import httpx
import pytest

from governance_client import (
    AsyncGovernanceClient,
    AsyncRun,
    Decision,
    GovernanceClient,
    LocalLimits,
    Run,
    RunClosed,
    repeat_key,
)
from governance_client._core import (
    BODY_LIMIT,
    OVERSIZE_KEY,
    POLL_MARGIN_S,
    attempt_timeout,
    poll_deadline,
)
from governance_client.testing import FakeGovernance, RateLimit

EDIT = {"path": "auth.py", "old": "user_id", "new": "account_id"}


def checks(fake: FakeGovernance) -> list[dict[str, Any]]:
    return [json.loads(r.content) for r in fake.requests if r.url.path.endswith("/check")]


# -- Deadlines ----------------------------------------------------------------------------------

@pytest.fixture
def hung_server() -> Iterator[tuple[str, list[socket.socket]]]:
    """A listener that accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            accepted.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}", accepted
    stop.set()
    thread.join(timeout=2)
    for conn in accepted:
        conn.close()
    listener.close()


def test_a_check_against_a_hung_server_returns_within_its_deadline(hung_server: Any) -> None:
    url, accepted = hung_server
    fake = FakeGovernance()
    run = fake.client().start_run("bot")
    run._client = GovernanceClient(url, "key", deadline=0.5)

    started = time.monotonic()
    decision = run.check("edit_file", EDIT)
    elapsed = time.monotonic() - started

    assert not decision.allowed and decision.reason == "governance_unavailable"
    assert elapsed < 2.0  # one overall deadline, not attempts x timeout plus backoff
    assert 1 <= len(accepted) <= 3


def test_fail_open_decides_locally_once_the_deadline_is_spent(hung_server: Any) -> None:
    url, _ = hung_server
    client = GovernanceClient(url, "key", deadline=0.4, fail_mode="open")
    started = time.monotonic()
    run = client.start_run("bot")  # the start too: a local run
    decision = run.check("edit_file", EDIT)

    assert run.local and decision.allowed and decision.local
    assert time.monotonic() - started < 3.0


def test_an_async_check_against_a_hung_server_returns_within_its_deadline(
    hung_server: Any,
) -> None:
    url, _ = hung_server
    fake = FakeGovernance()

    async def main() -> tuple[Decision, float]:
        async with fake.async_client() as client:
            run = await client.start_run("bot")
            run._client = AsyncGovernanceClient(url, "key", deadline=0.5)
            started = time.monotonic()
            decision = await run.check("edit_file", EDIT)
            return decision, time.monotonic() - started

    decision, elapsed = asyncio.run(main())
    assert decision.reason == "governance_unavailable" and elapsed < 2.0


def test_each_attempt_sends_what_is_left_of_the_deadline() -> None:
    fake = FakeGovernance()
    run = fake.client(deadline=5).start_run("bot")
    fake.fail_next(503)

    run.check("edit_file", EDIT)

    first, retry = checks(fake)
    assert 0 < retry["deadline_ms"] <= first["deadline_ms"] < 5000
    assert first["check_id"] == retry["check_id"]


def test_retry_after_of_a_429_is_honoured() -> None:
    answers = [httpx.Response(429, headers={"Retry-After": "0.3"},
                              json={"error": {"code": "too_many_failures", "message": ""}})]
    fake = FakeGovernance()

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/check") and answers:
            return answers.pop()
        return fake.handle(request)

    sleeps: list[float] = []
    client = GovernanceClient("http://governance.test", fake.api_key, sleep=sleeps.append,
                              transport=httpx.MockTransport(handler))
    decision = client.start_run("bot").check("edit_file", EDIT)

    assert decision.allowed
    assert sleeps == [0.3]


def test_a_retry_after_past_the_deadline_is_not_waited_for() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, headers={"Retry-After": "30"})

    sleeps: list[float] = []
    client = GovernanceClient("http://governance.test", "key", sleep=sleeps.append,
                              transport=httpx.MockTransport(handler), fail_mode="closed")
    run = FakeGovernance().client().start_run("bot")
    run._client = client
    decision = run.check("edit_file", EDIT)

    assert decision.reason == "governance_unavailable"
    assert sleeps == []


def test_an_answer_the_service_expired_is_not_taken_as_a_decision() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"decision": "stop", "reason": "deadline_expired",
                                         "step": 0})

    run = FakeGovernance().client().start_run("bot")
    run._client = GovernanceClient("http://governance.test", "key",
                                   transport=httpx.MockTransport(handler))
    decision = run.check("edit_file", EDIT)

    assert decision.reason == "governance_unavailable" and decision.local
    assert run.stop_decision is None  # not final: the next check asks again


# -- Parallel tool calls, oversize args -------------------------------------------------------

def test_parallel_tool_calls_each_keep_their_result() -> None:
    fake = FakeGovernance()
    run = fake.client().start_run("bot")
    calls = [("search", {"q": "a"}, "c1"), ("search", {"q": "b"}, "c2"),
             ("fetch", {"u": "x"}, "c3")]
    decisions = [run.check(name, args, call_id=cid) for name, args, cid in calls]
    assert [d.call_id for d in decisions] == ["c1", "c2", "c3"]

    run.report(error="timeout", call_id="c1")
    run.report("page b", call_id="c2")
    run.report(error="404", call_id="c3")
    run.report(error="404 not found", call_id="c3")  # the same call again: replaces

    for name, args, cid in calls:
        run.check(name, {**args, "again": True}, call_id=cid + "'")

    sent = [c.get("last_result") for c in checks(fake)[3:]]
    assert [r["status"] for r in sent] == ["error", "ok", "error"]
    assert sent[0]["error"] == "timeout" and sent[2]["error"] == "404 not found"
    assert run.pending_results == {}


def test_oversize_args_get_a_decision_from_their_digest() -> None:
    fake = FakeGovernance(max_repeat_action=3)
    run = fake.client().start_run("bot")
    big = {"path": "data.csv", "content": "x" * (BODY_LIMIT * 2)}

    decisions = [run.check("write_file", big) for _ in range(4)]

    assert [d.allowed for d in decisions] == [True, True, True, False]
    assert decisions[3].reason == "loop_detected"
    for request in fake.requests[1:]:
        assert len(request.content) < BODY_LIMIT
    sent = checks(fake)[0]["action"]["args"]
    assert sent[OVERSIZE_KEY]["keys"] == ["content", "path"]
    assert sent[OVERSIZE_KEY]["bytes"] > BODY_LIMIT
    # Other big args are another call, with another digest.
    fake2 = FakeGovernance()
    run2 = fake2.client().start_run("bot")
    assert run2.check("write_file", {**big, "path": "other.csv"}).allowed
    assert checks(fake2)[0]["action"]["args"][OVERSIZE_KEY]["sha256"] != \
        sent[OVERSIZE_KEY]["sha256"]


def test_a_long_progress_value_is_sent_as_its_digest() -> None:
    fake = FakeGovernance()
    run = fake.client().start_run("bot")
    run.check("read", progress="p" * 1000)
    assert checks(fake)[0]["progress"].startswith("sha256:")


# -- Closed runs ------------------------------------------------------------------------------

def test_a_run_whose_block_exited_refuses_checks() -> None:
    fake = FakeGovernance()
    with fake.client() as client:
        with client.run("bot") as run:
            run.check("edit_file", EDIT)
        sent = len(fake.requests)
        with pytest.raises(RunClosed):
            run.check("edit_file", EDIT)
        with pytest.raises(RunClosed):
            run.report("late")
    assert len(fake.requests) == sent


# -- One rules engine -------------------------------------------------------------------------

def test_the_fake_stops_a_soft_loop_on_its_budget_as_the_server_does() -> None:
    fake = FakeGovernance(max_usd=1.0)
    run = fake.client().start_run("bot")
    decisions = []
    for step in range(12):
        decisions.append(run.check("search", {"q": f"variant {step}"}, cost_usd=0.30))
        if not decisions[-1].allowed:
            break
        run.report("the same page")

    assert [d.allowed for d in decisions] == [True, True, True, False]
    assert decisions[-1].reason == "max_usd" and decisions[-1].step == 4


def test_the_fake_applies_no_progress_and_tool_deny() -> None:
    fake = FakeGovernance(no_progress_window=2, deny=["shell.*"])
    run = fake.client().start_run("bot")
    assert run.check("shell.exec", {"cmd": "ls"}).reason == "tool_denied"

    run = fake.client().start_run("bot")
    reasons = []
    for step in range(6):
        decision = run.check("search", {"q": step})
        reasons.append(decision.reason)
        if not decision.allowed:
            break
        run.report("same result")
    assert reasons[-1] == "no_progress"


def test_fail_open_decides_with_the_policy_of_the_run() -> None:
    fake = FakeGovernance(deny=["shell.*"], max_usd=0.5)
    run = fake.client(fail_mode="open").start_run("bot")
    fake.down = True

    denied = run.check("shell.exec", {"cmd": "rm"})
    assert denied.local and denied.reason == "tool_denied"


def test_fail_open_never_allows_locally_an_action_that_needs_an_approval() -> None:
    fake = FakeGovernance(approvals=["refund.*"], operator=lambda _a: ("approve", "ok"))
    run = fake.client(fail_mode="open").start_run("bot")
    fake.down = True

    refund = run.check("refund.issue", {"amount": 120})
    search = run.check("search", {"q": 1})

    assert refund.local and not refund.allowed and refund.reason == "governance_unavailable"
    assert "needs an operator's approval" in (refund.message or "")
    # Not decided: nothing counted, nothing to upload, and the run goes on locally.
    assert search.local and search.allowed and search.step == 1
    assert [entry["action"]["name"] for entry in run.unsynced] == ["search"]
    fake.down = False
    assert run.check("refund.issue", {"amount": 120}).allowed  # the operator approves


def test_fail_open_budgets_count_the_spend_seen_before_the_outage() -> None:
    fake = FakeGovernance(max_usd=1.0)
    run = fake.client(fail_mode="open").start_run("bot")
    assert run.check("search", {"q": 1}, cost_usd=0.6).allowed
    fake.down = True

    decision = run.check("search", {"q": 2}, cost_usd=0.6)

    assert decision.local and decision.reason == "max_usd"


def test_local_limits_override_the_policy() -> None:
    fake = FakeGovernance(max_steps=50)
    run = fake.client(fail_mode="open", local_limits=LocalLimits(max_steps=2)).start_run("bot")
    fake.down = True
    decisions = [run.check("t", {"n": n}) for n in range(3)]
    assert [d.allowed for d in decisions] == [True, True, False]
    assert decisions[2].reason == "max_steps"


# -- Outage, then the upload ------------------------------------------------------------------

def test_local_decisions_are_uploaded_when_the_service_returns() -> None:
    fake = FakeGovernance()
    run = fake.client(fail_mode="open").start_run("bot")
    run.check("search", {"q": 1}, cost_usd=0.1)
    run.report("page 1")
    fake.down = True
    local = [run.check("search", {"q": n}, cost_usd=0.1) for n in (2, 3)]
    assert all(d.local and d.allowed for d in local)
    assert len(run.unsynced) == 2
    fake.down = False

    after = run.check("search", {"q": 4}, cost_usd=0.1)

    stored = fake.runs[run.id]
    assert [e["check_id"] for e in stored.uploaded] == [d.check_id for d in local]
    assert run.unsynced == []
    assert after.step == 4 and stored.steps == 4 and stored.tool_calls == 4
    assert stored.cost_usd == pytest.approx(0.4)
    assert [d.get("local", False) for d in stored.decisions] == [False, True, True, False]


def test_a_failed_upload_is_kept_for_the_next_chance() -> None:
    fake = FakeGovernance()
    run = fake.client(fail_mode="open").start_run("bot")
    fake.down = True
    run.check("search", {"q": 1})
    fake.down = False
    fake.fail_next(503, 503, 503)  # the upload's three attempts

    run.check("search", {"q": 2})
    assert len(run.unsynced) == 1
    run.finish("completed")
    assert run.unsynced == [] and fake.runs[run.id].steps == 2


def test_a_local_stop_is_uploaded_at_finish_and_ends_the_run_on_the_service() -> None:
    fake = FakeGovernance(max_repeat_action=1)
    with fake.client(fail_mode="open") as client, client.run("bot") as run:
        fake.down = True
        run.check("edit_file", EDIT)
        stop = run.check("edit_file", EDIT)
        fake.down = False
    assert stop.reason == "loop_detected" and stop.local
    stored = fake.runs[run.id]
    assert (stored.status, stored.stop_reason, stored.steps) == ("stopped", "loop_detected", 2)


# -- Approvals and rate limits (SPEC 11, 12) ---------------------------------------------------

def test_a_pending_check_waits_for_the_operator_and_returns_the_final_answer() -> None:
    polls: list[str] = []

    def operator(approval: Any) -> Any:
        polls.append(approval.id)
        return "approve" if len(polls) >= 3 else None

    fake = FakeGovernance(approvals=["refund.*"], operator=operator)
    run = fake.client().start_run("bot")

    decision = run.check("refund.issue", {"order": 7})

    assert decision.allowed and decision.reason == "step_ok"
    assert len(polls) == 3
    same = {c["check_id"] for c in checks(fake)}
    assert len(same) == 1
    assert fake.runs[run.id].tool_calls == 1 and fake.runs[run.id].steps == 1


def test_a_denied_approval_is_a_stop_with_the_note() -> None:
    fake = FakeGovernance(approvals=["refund.*"],
                          operator=lambda approval: ("deny", "not over 100 EUR"))
    run = fake.client().start_run("bot")
    decision = run.check("refund.issue", {"order": 7})
    assert decision.reason == "approval_denied" and "not over 100 EUR" in (decision.message or "")
    # The note ends its sentence before the next one (it read "...100 EUR The action").
    assert "not over 100 EUR. The action was not run" in (decision.message or "")


def test_an_approval_nobody_decides_expires_into_a_stop() -> None:
    fake = FakeGovernance(approvals=["refund.*"], approval_timeout_s=120)
    run = fake.client().start_run("bot")
    decision = run.check("refund.issue", {"order": 7})
    assert decision.reason == "approval_expired" and not decision.allowed


def test_the_author_may_bound_the_wait_for_an_approval() -> None:
    fake = FakeGovernance(approvals=["refund.*"])
    run = fake.client(approval_timeout=30).start_run("bot")
    decision = run.check("refund.issue", {"order": 7})
    assert decision.decision == "pending" and not decision.allowed
    assert decision.approval is not None


def test_a_long_polls_attempts_last_as_long_as_the_service_holds_them() -> None:
    # A check's 2 s deadline is shared by its attempts...
    assert attempt_timeout(2.0, 3) == pytest.approx(2 / 3)
    # ...a 60 s poll's attempts each get the 60 s on top of their share of the rest, never
    # more than what is left (tests/test_client_waits_e2e.py has the poll against the server).
    assert attempt_timeout(62.0, 3, hold=60) == pytest.approx(60 + 2 / 3)
    assert attempt_timeout(30.0, 2, hold=60) == 30.0


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_poll_answered_too_late_is_polled_again_and_the_approval_kept(kind: str) -> None:
    # Found by a newcomer: on a loaded machine a long poll's answer came after the poll's
    # deadline; the wait ended as an outage, the run's block finished the run, and that
    # cancelled the approval the operator was about to give. A slow service is polled again
    # until the approval's own timeout.
    polls = 0
    fake = FakeGovernance(approvals=["refund.*"])

    def operator(_approval: Any) -> Any:
        nonlocal polls
        polls += 1
        if polls == 1:  # the next poll gets no answer in time, at every attempt
            fake.fail_next(httpx.ReadTimeout, httpx.ReadTimeout, httpx.ReadTimeout)
        return "approve" if polls >= 3 else None

    fake.operator = operator

    def scenario_sync() -> Any:
        with fake.client() as client, client.run("bot") as run:
            return run.check("refund.issue", {"order": 7})

    async def scenario_async() -> Any:
        async with fake.async_client() as client, client.run("bot") as run:
            return await run.check("refund.issue", {"order": 7})

    decision = scenario_sync() if kind == "sync" else asyncio.run(scenario_async())

    assert (decision.allowed, decision.reason) == (True, "step_ok")
    (approval,) = fake.approvals.values()
    assert approval.status == "approved" and polls == 3
    (run,) = fake.runs.values()
    assert (run.status, run.tool_calls) == ("completed", 1)


def test_a_long_poll_may_answer_later_than_a_checks_deadline() -> None:
    # The service holds the poll `wait` seconds on purpose; a loaded one answers it a few
    # seconds late. The default 2 s deadline left each attempt 0.67 s of that.
    fake = FakeGovernance(approvals=["refund.*"], operator=lambda _a: "approve")
    run = fake.client().start_run("bot")

    assert run.check("refund.issue", {"order": 7}).allowed

    (poll,) = [r for r in fake.requests if "/approvals/" in r.url.path]
    wait = int(poll.url.params["wait"])
    assert poll.extensions["timeout"]["read"] > wait + 3  # 60.67 before
    assert poll_deadline(fake.client().settings, 60) == 60 + POLL_MARGIN_S
    assert poll_deadline(fake.client(deadline=30).settings, 60) == 90


def test_a_rate_limited_check_sleeps_and_retries_by_itself() -> None:
    fake = FakeGovernance(rate_limits=[RateLimit(match="http.*", max=2, window_s=10)])
    sleeps: list[float] = []
    run = fake.client(sleep=lambda s: (sleeps.append(s), fake.advance(s))).start_run("bot")

    decisions = [run.check("http.get", {"n": n}) for n in range(3)]

    assert all(d.allowed for d in decisions)
    assert sleeps == [pytest.approx(10.0)]
    assert len(checks(fake)) == 4  # the third check was sent twice, with one check_id


def test_the_fake_counts_a_pending_answer_once_in_the_window_as_the_service_does() -> None:
    # As on the service (tests/test_approvals_idle_rate.py): the pending answer takes the
    # slot, its approval none; a denied request keeps its slot.
    verdicts = iter(["approve", ("deny", "no")])
    fake = FakeGovernance(approvals=["refund.*"], operator=lambda _a: next(verdicts),
                          rate_limits=[RateLimit(match="refund.*", max=2, window_s=60)])
    client = fake.client(wait_budget=0)
    assert client.start_run("bot").check("refund.issue", {"order": 1}).allowed
    assert client.start_run("bot").check("refund.issue", {"order": 2}).reason == \
        "approval_denied"
    third = client.start_run("bot").check("refund.issue", {"order": 3})
    assert (third.decision, third.reason) == ("wait", "rate_limited")


def test_the_fake_stops_before_it_makes_a_check_wait() -> None:
    # The rate limits come after rules 1 to 9 (SPEC 12, 15): a loop is a stop, not a wait.
    fake = FakeGovernance(max_repeat_action=1,
                          rate_limits=[RateLimit(match="http.*", max=1, window_s=60)])
    run = fake.client(wait_budget=0).start_run("bot")
    assert run.check("http.get", {"n": 1}).allowed
    repeated = run.check("http.get", {"n": 1})
    assert (repeated.decision, repeated.reason) == ("stop", "loop_detected")


def test_a_rate_limit_longer_than_the_wait_budget_is_returned() -> None:
    fake = FakeGovernance(rate_limits=[RateLimit(match="http.*", max=1, window_s=60)])
    run = fake.client(wait_budget=5).start_run("bot")
    run.check("http.get", {"n": 1})
    decision = run.check("http.get", {"n": 2})
    assert decision.decision == "wait" and not decision.allowed
    assert decision.retry_after_s == pytest.approx(60)
    assert run.stop_decision is None

    no_wait = fake.client(wait_for_rate_limits=False).start_run("bot")
    assert no_wait.check("http.get", {"n": 3}).decision == "wait"


# -- asyncio ----------------------------------------------------------------------------------

def test_the_async_client_has_the_same_surface() -> None:
    fake = FakeGovernance(max_repeat_action=3)

    async def main() -> list[Decision]:
        async with fake.async_client() as client, client.run("bot") as run:
            decisions = []
            for _ in range(4):
                decision = await run.check("edit_file", EDIT, call_id="c")
                decisions.append(decision)
                if not decision.allowed:
                    run.output = decision.user_notice("partial")
                    break
                run.report(error="no matches found", call_id="c")
            return decisions

    decisions = asyncio.run(main())
    assert [d.reason for d in decisions][-1] == "loop_detected"
    (stored,) = fake.runs.values()
    assert (stored.status, stored.stop_reason) == ("stopped", "loop_detected")
    assert stored.output and stored.output.startswith("partial")
    assert decisions[-1].repeat_key == repeat_key("edit_file", EDIT)


@pytest.mark.parametrize(("progress", "error"), [
    (float("nan"), ValueError), (float("inf"), ValueError), ({"page": 2}, TypeError),
    (True, TypeError), ([1], TypeError),
])
def test_a_progress_the_service_would_refuse_is_refused_before_anything_is_sent(
        progress: Any, error: type[Exception]) -> None:
    fake = FakeGovernance()
    run = fake.client(fail_mode="open").start_run("bot")
    with pytest.raises(error, match="progress must be"):
        run.check("search", {"q": 1}, progress=progress)
    fake.down = True  # nor decided locally, to be refused in the upload after it ran
    with pytest.raises(error, match="progress must be"):
        run.check("search", {"q": 1}, progress=progress)
    assert not run.unsynced and not fake.runs[run.id].checks


@pytest.mark.parametrize(("args", "error", "says"), [
    ({"when": datetime(2026, 1, 1)}, TypeError, "args['when'] is a datetime"),
    ({"paths": ["a", PurePosixPath("b")]}, TypeError, "args['paths'][1] is a PurePosixPath"),
    ({"score": float("nan")}, ValueError, "args['score'] is nan"),
    ([("q", 1)], TypeError, "args of search must be a dict"),
])
def test_args_that_are_not_json_are_refused_naming_the_value_before_anything_is_sent(
        args: Any, error: type[Exception], says: str) -> None:
    """A Path, a datetime or a NaN in a hand-written agent's args used to raise httpx's
    "Object of type datetime is not JSON serializable" from deep inside the send, naming
    neither the tool nor the key, after the reported result had been taken."""
    fake = FakeGovernance()
    run = fake.client(fail_mode="open").start_run("bot")
    run.report("earlier result")
    for down in (False, True):
        fake.down = down
        with pytest.raises(error, match=re.escape(says)):
            run.check("search", args)
    assert not run.unsynced and not fake.runs[run.id].checks
    fake.down = False
    run.check("search", {"q": 1})
    assert fake.runs[run.id].checks[0]["last_result"]["status"] == "ok"  # still sent


@pytest.mark.parametrize("cost", [Decimal("0.25"), Fraction(1, 4)])
def test_a_cost_in_decimal_is_sent_as_a_json_number(cost: Any) -> None:
    """Money is often a Decimal: it used to raise "Object of type Decimal is not JSON
    serializable" from the send."""
    fake = FakeGovernance()
    run = fake.client().start_run("bot")
    assert run.check("search", {"q": 1}, cost_usd=cost).allowed
    assert fake.runs[run.id].checks[0]["cost_usd"] == 0.25


@pytest.mark.parametrize("kind", [Run, AsyncRun])
def test_the_check_signature_takes_a_decimal_cost(kind: type[Any]) -> None:
    """The annotation says what is taken: an author's mypy --strict accepts a Decimal."""
    assert Decimal in get_args(get_type_hints(kind.check)["cost_usd"])


@pytest.mark.parametrize(("cost", "error"), [
    (float("nan"), ValueError), (float("inf"), ValueError), ("0.1", TypeError),
    (True, TypeError),
])
def test_a_cost_json_cannot_carry_is_refused_naming_cost_usd(cost: Any,
                                                            error: type[Exception]) -> None:
    fake = FakeGovernance()
    run = fake.client().start_run("bot")
    with pytest.raises(error, match="cost_usd must be"):
        run.check("search", {"q": 1}, cost_usd=cost)
    assert not fake.runs[run.id].checks


def test_a_run_the_service_ended_uploads_nothing_of_what_follows_in_an_outage() -> None:
    fake = FakeGovernance(max_steps=1)
    run = fake.client(fail_mode="open").start_run("bot")
    assert run.check("search", {"q": 1}).allowed
    assert run.check("search", {"q": 2}).reason == "max_steps"
    fake.down = True
    again = run.check("search", {"q": 3})
    assert not again.allowed and again.local
    assert not run.unsynced  # the service's own stop, answered again: nothing happened


def test_a_run_started_locally_refuses_what_its_local_limits_say_needs_an_operator() -> None:
    fake = FakeGovernance()
    fake.down = True
    client = fake.client(fail_mode="open", local_limits=LocalLimits(
        deny=("shell.*",), approvals=("payments.*",)))
    run = client.start_run("bot")
    assert run.id.startswith("local-")
    refund, shell, search = (run.check(name, {}) for name in (
        "payments.refund", "shell.exec", "search"))
    assert (refund.allowed, refund.reason) == (False, "governance_unavailable")
    assert "needs an operator's approval" in (refund.message or "")
    assert (shell.allowed, shell.reason) == (False, "tool_denied")
    assert not search.allowed  # the denied tool was a local stop: final for the run


def test_an_api_error_says_its_fields_in_its_text() -> None:
    from governance_client import InvalidRequest

    error = InvalidRequest(422, "invalid_request", "The request is not valid.",
                           {"progress": "must be a number", "action.name": "too long"})
    assert str(error) == ("422 invalid_request: The request is not valid. "
                          "(progress: must be a number; action.name: too long)")
    assert str(InvalidRequest(422, "invalid_request", "Bad.")) == "422 invalid_request: Bad."


def test_the_same_action_checked_after_the_author_stopped_waiting_resumes_its_approval() -> None:
    approve = False
    fake = FakeGovernance(approvals=["refund.*"],
                          operator=lambda _a: "approve" if approve else None)
    run = fake.client(approval_timeout=30).start_run("bot")
    first = run.check("refund.issue", {"order": 7})
    assert first.decision == "pending"

    approve = True  # the operator decides meanwhile
    again = run.check("refund.issue", {"order": 7})

    assert again.allowed and again.check_id == first.check_id  # not a 409 approval_pending
    assert len(fake.approvals) == 1
    later = run.check("refund.issue", {"order": 7})  # a new request: settled, not resumed
    assert later.check_id != first.check_id


def test_the_same_action_checked_after_an_outage_cut_its_approval_wait_resumes_it() -> None:
    polls = 0
    fake = FakeGovernance(approvals=["refund.*"])

    def operator(_approval: Any) -> Any:
        nonlocal polls
        polls += 1
        if polls == 2:  # the service goes down during the client's wait
            fake.down = True
        return "approve" if polls > 3 else None

    fake.operator = operator
    run = fake.client(fail_mode="open").start_run("bot")
    cut = run.check("refund.issue", {"order": 7})
    assert (cut.allowed, cut.reason) == (False, "governance_unavailable")

    fake.down = False
    again = run.check("refund.issue", {"order": 7})
    assert again.allowed and again.check_id == cut.check_id
    assert len(fake.approvals) == 1


def test_the_async_client_resumes_an_approval_it_stopped_waiting_for() -> None:
    approve = False
    fake = FakeGovernance(approvals=["refund.*"],
                          operator=lambda _a: "approve" if approve else None)

    async def scenario() -> tuple[Decision, Decision]:
        nonlocal approve
        async with fake.async_client(approval_timeout=30) as client:
            run = await client.start_run("bot")
            first = await run.check("refund.issue", {"order": 7})
            approve = True
            return first, await run.check("refund.issue", {"order": 7})

    first, again = asyncio.run(scenario())
    assert first.decision == "pending" and again.allowed
    assert again.check_id == first.check_id and len(fake.approvals) == 1


def test_an_approval_wait_cancelled_from_outside_is_resumed_by_the_same_action() -> None:
    """A framework's timeout around a tool (asyncio.wait_for, a hook's timeout) cancels the
    check while it long-polls the approval. The request stays open on the service, so the
    same action checked again must resume it, as after the client's own give-up: it was
    refused 409 approval_pending, naming a check_id the agent never saw. Found by an agent
    author."""
    fake = FakeGovernance(approvals=["refund.*"], operator=lambda _a: None)

    class SlowPolls(httpx.AsyncBaseTransport):
        """The long poll held open, as the service holds it while nobody decides."""

        def __init__(self) -> None:
            self.inner, self.hold = fake.transport(), True

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if self.hold and "/approvals/" in request.url.path:
                await asyncio.sleep(30)
            return await self.inner.handle_async_request(request)

    polls = SlowPolls()

    async def scenario() -> tuple[Decision, int]:
        async with AsyncGovernanceClient("http://governance.test", fake.api_key,
                                         transport=polls, journal=fake.journal) as client:
            run = await client.start_run("bot")
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(run.check("refund.issue", {"order": 7}), 0.2)
            polls.hold = False
            fake.operator = lambda _a: "approve"
            again = await run.check("refund.issue", {"order": 7})
            return again, len(fake.runs[run.id].checks)

    again, checks = asyncio.run(scenario())
    assert again.allowed and again.reason == "step_ok"
    assert len(fake.approvals) == 1 and checks == 2  # the same request, resumed


def test_a_sync_approval_wait_interrupted_is_resumed_by_the_same_action() -> None:
    approve = False
    fake = FakeGovernance(approvals=["refund.*"])

    def operator(_approval: Any) -> Any:
        if not approve:
            raise KeyboardInterrupt  # Ctrl-C while the agent waits for the operator
        return "approve"

    fake.operator = operator
    run = fake.client().start_run("bot")
    with pytest.raises(KeyboardInterrupt):
        run.check("refund.issue", {"order": 7})
    approve = True
    again = run.check("refund.issue", {"order": 7})
    assert again.allowed and len(fake.approvals) == 1
