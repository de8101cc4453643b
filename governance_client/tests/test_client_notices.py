"""What the end user reads (``Decision.user_notice``, the run's output) is apart from what the
agent's developer needs (``Decision.detail``, the log): no API step and no connection error
reaches the user, and a run that stopped waiting for an operator or a rate limit ends
``stopped``, with the notice as its output."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from governance_client.testing import FakeGovernance, RateLimit

API_WORDS = ("/api/v1", "GET ", "check_id", "retry_after_s", "fail_mode", "Error", "refused")


def assert_for_a_user(text: str) -> None:
    assert not any(word in text for word in API_WORDS), text


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_run_that_stopped_waiting_for_an_operator_ends_stopped_with_the_users_notice(
    kind: str
) -> None:
    fake = FakeGovernance(approvals=["refund.*"])

    def scenario_sync() -> tuple[str, object]:
        with fake.client(approval_timeout=30) as client, client.run("bot") as run:
            decision = run.check("refund.issue", {"order": 7})
        return run.id, decision

    async def scenario_async() -> tuple[str, object]:
        async with fake.async_client(approval_timeout=30) as client, \
                client.run("bot") as run:
            decision = await run.check("refund.issue", {"order": 7})
        return run.id, decision

    run_id, decision = scenario_sync() if kind == "sync" else asyncio.run(scenario_async())

    assert decision.decision == "pending" and not decision.allowed  # type: ignore[attr-defined]
    notice = decision.user_notice()  # type: ignore[attr-defined]
    assert "refund.issue needs an operator's approval" in notice and "30 s" in notice
    assert_for_a_user(notice)
    assert "/api/v1/approvals/" in (decision.detail or "")  # type: ignore[attr-defined]
    stored = fake.runs[run_id]
    assert (stored.status, stored.stop_reason) == ("stopped", "agent_stopped")
    assert stored.output == notice


def test_a_run_that_stopped_waiting_for_a_rate_limit_ends_stopped_with_the_users_notice(
) -> None:
    fake = FakeGovernance(rate_limits=[RateLimit(match="http.*", max=1, window_s=60)])
    with fake.client(wait_budget=5) as client, client.run("bot") as run:
        assert run.check("http.get", {"n": 1}).allowed
        decision = run.check("http.get", {"n": 2})

    assert decision.decision == "wait"
    notice = decision.user_notice()
    assert "http.get was run too often" in notice and "Try again in 60 s." in notice
    assert_for_a_user(notice)
    assert "retry_after_s" in (decision.detail or "")
    stored = fake.runs[run.id]
    assert (stored.status, stored.stop_reason, stored.output) == (
        "stopped", "agent_stopped", notice)


@pytest.mark.parametrize("fail_mode", ["closed", "open"])
def test_an_outage_notice_names_no_connection_error(fail_mode: str) -> None:
    fake = FakeGovernance(approvals=["refund.*"])
    run = fake.client(fail_mode=fail_mode).start_run("bot")  # type: ignore[arg-type]
    fake.down = True

    decision = run.check("refund.issue", {"order": 7})

    assert (decision.allowed, decision.reason) == (False, "governance_unavailable")
    assert "unreachable" in (decision.message or "")
    assert_for_a_user(decision.user_notice())
    assert "ConnectError" in (decision.detail or "")


def test_a_check_that_failed_with_a_timeout_tells_the_developer_alone() -> None:
    fake = FakeGovernance()
    run = fake.client(attempts=1).start_run("bot")
    fake.fail_next(httpx.ReadTimeout)

    decision = run.check("search", {"q": 1})

    assert_for_a_user(decision.user_notice())
    assert "ReadTimeout" in (decision.detail or "")


def test_a_check_the_service_did_not_answer_in_time_says_so_not_unreachable() -> None:
    # Found by a newcomer: a check that took over the 2 s deadline on a loaded machine was
    # told "The governance service is unreachable", which sends one looking for a network
    # fault; the fix is a longer deadline. Same stop, same fail mode, other words.
    fake = FakeGovernance()
    run = fake.client(attempts=1).start_run("bot")
    fake.fail_next(httpx.ReadTimeout)

    slow = run.check("search", {"q": 1})

    assert (slow.allowed, slow.reason, slow.local) == (False, "governance_unavailable", True)
    assert slow.message == ("The governance service did not answer within 2 s, so this "
                            "action was not run.")
    assert "unreachable" not in slow.user_notice()
    assert_for_a_user(slow.user_notice())
    assert "did not answer within the deadline (2 s; raise GovernanceClient(deadline=...)" \
        in (slow.detail or "")

    fake.down = True  # a refused connection: that one is unreachable
    gone = run.check("search", {"q": 2})
    assert gone.reason == "governance_unavailable"
    assert "unreachable" in (gone.message or "") and "deadline" not in (gone.detail or "")


def test_a_start_the_service_did_not_answer_in_time_says_so() -> None:
    from governance_client import GovernanceUnavailable

    fake = FakeGovernance()
    fake.fail_next(httpx.ReadTimeout, httpx.ReadTimeout, httpx.ReadTimeout)
    with pytest.raises(GovernanceUnavailable) as raised:
        fake.client().start_run("bot")
    assert raised.value.timed_out and raised.value.deadline == 2.0
    assert "did not answer in time" in raised.value.user_notice()
    assert "deadline of 2 s" in str(raised.value)

    fake.down = True
    with pytest.raises(GovernanceUnavailable) as refused:
        fake.client().start_run("bot")
    assert not refused.value.timed_out and "unreachable" in refused.value.user_notice()


@pytest.mark.parametrize(("status", "code", "again"), [
    (422, "invalid_request", False), (401, "unauthorized", False), (403, "forbidden", False),
    # A run or a parent that is over stays over; an external_id stays another run's.
    (409, "run_finished", False), (409, "parent_finished", False),
    (409, "external_id_conflict", False),
    (409, "approval_pending", True), (409, "kill_switch_engaged", True),
    (429, "too_many_requests", True), (503, "unavailable", True),
])
def test_a_refusal_a_retry_would_get_again_does_not_say_try_again(
        status: int, code: str, again: bool) -> None:
    # Found by a newcomer: an agent-bound key starting a child under another agent's name
    # (422) told the user "Try again later".
    from governance_client.errors import api_error

    notice = api_error(status, {"error": {"code": code, "message": "m"}}).user_notice()
    assert ("try again" in notice.lower()) is again, notice
    assert ("Trying again will not help" in notice) is not again, notice
    # The reason is what the service answered, never a generic one (found by a newcomer:
    # a refused sub-agent said "governance_error").
    reason = "killed" if code == "kill_switch_engaged" else code
    assert notice.startswith(f"Stopped by governance ({reason}): "), notice


def test_a_sub_agent_refused_under_a_stopped_parent_says_so() -> None:
    from governance_client import ParentFinished

    fake = FakeGovernance()
    with fake.client() as client, client.run("planner") as run:
        run.finish("stopped")
        with pytest.raises(ParentFinished) as refused, run.child(agent="researcher"):
            pass
    notice = refused.value.user_notice()
    assert notice.startswith("Stopped by governance (parent_finished): "), notice
    assert "sub-agent did not run" in notice and "Trying again will not help" in notice
    assert_for_a_user(notice)


def test_a_run_used_after_its_end_is_the_developers_to_fix() -> None:
    from governance_client import RunClosed

    fake = FakeGovernance()
    with fake.client() as client, client.run("bot") as run:
        pass
    with pytest.raises(RunClosed) as closed:
        run.check("search", {"q": 1})
    notice = closed.value.user_notice()
    assert notice.startswith("Stopped by governance (run_closed): "), notice
    assert "Try again later" not in notice and "Trying again will not help" in notice


def test_an_allows_notice_does_not_tell_the_user_the_agent_was_stopped() -> None:
    """An author who shows ``user_notice`` whatever the decision (the last decision of a loop
    that ran out of work, say) must not tell the user "Stopped by governance (step_ok)": an
    allow stopped nothing, so its notice is the partial response alone."""
    fake = FakeGovernance()
    with fake.client() as client, client.run("bot") as run:
        decision = run.check("search.docs", {"query": "refunds"})

    assert decision.allowed
    assert decision.user_notice("Found 2 articles.") == "Found 2 articles."
    assert decision.user_notice() == ""
    assert "Stopped" not in decision.user_notice("Found 2 articles.\n")
