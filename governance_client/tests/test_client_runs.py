"""Runs: starting, error mapping, finishing, and the context manager."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest

from governance_client import (
    ApiError,
    AsyncGovernanceClient,
    GovernanceClient,
    GovernanceUnavailable,
    InvalidRequest,
    KillSwitchEngaged,
    RunFinished,
)
from governance_client.errors import api_error
from governance_client.testing import FakeGovernance

EDIT = {"path": "auth.py", "old": "user_id", "new": "account_id"}


def test_start_run_sends_the_spec_body_and_returns_the_run() -> None:
    fake = FakeGovernance()

    run = fake.client().start_run(
        "support-bot", task="refund", policy="default", metadata={"user": 7}, external_id="t-1"
    )

    (request,) = fake.requests
    assert request.url.path == "/api/v1/runs"
    assert request.headers["Authorization"] == "Bearer test-key"
    assert json.loads(request.content) == {
        "agent": "support-bot",
        "task": "refund",
        "policy": "default",
        "metadata": {"user": 7},
        "external_id": "t-1",
    }
    assert run.id in fake.runs
    assert run.status == "running"
    assert run.agent == "support-bot"
    assert run.data["policy"]["step_limits"]["max_steps"] == 18


def test_start_run_with_a_known_external_id_resumes_that_run() -> None:
    fake = FakeGovernance()
    client = fake.client()

    first = client.start_run("bot", external_id="ticket-42")
    second = client.start_run("bot", external_id="ticket-42")

    assert first.id == second.id
    assert len(fake.runs) == 1


def test_start_run_raises_kill_switch_engaged() -> None:
    fake = FakeGovernance()
    fake.kill_switch = "global: incident 12"

    with pytest.raises(KillSwitchEngaged) as raised:
        fake.client().start_run("bot")

    assert raised.value.status == 409
    assert raised.value.code == "kill_switch_engaged"
    assert "incident 12" in raised.value.message


def test_start_run_raises_invalid_request_naming_the_field() -> None:
    fake = FakeGovernance()

    with pytest.raises(InvalidRequest) as raised:
        fake.client().start_run("bot", policy="nope")

    assert raised.value.status == 422
    assert raised.value.code == "invalid_request"
    assert set(raised.value.fields) == {"policy"}


def test_it_raises_api_error_for_a_bad_key() -> None:
    fake = FakeGovernance()
    client = GovernanceClient("http://governance.test", "wrong", transport=fake.transport())

    with pytest.raises(ApiError) as raised:
        client.start_run("bot")

    assert (raised.value.status, raised.value.code) == (401, "unauthorized")


def test_an_error_without_a_json_body_is_still_an_api_error() -> None:
    error = api_error(404, None)

    assert type(error) is ApiError
    assert (error.status, error.code, error.fields) == (404, "http_404", {})


@pytest.mark.parametrize("suffix", ["/api/v1", "/api/v1/"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_base_url_ending_in_the_api_prefix_reaches_the_api(suffix: str, kind: str) -> None:
    """The API is "under /api/v1/" (README, SPEC 5), so authors give the client that URL:
    it used to send POST /api/v1/api/v1/runs and raise "404 not_found: Not Found"."""
    fake = FakeGovernance()
    url = "http://governance.test" + suffix

    if kind == "sync":
        with GovernanceClient(url, "test-key", transport=fake.transport()) as client, \
                client.run("bot") as run:
            assert run.check("search", {"q": 1}).allowed
    else:
        async def main() -> None:
            async with AsyncGovernanceClient(url, "test-key", transport=fake.transport()
                                             ) as client, client.run("bot") as run:
                assert (await run.check("search", {"q": 1})).allowed
        asyncio.run(main())

    assert {r.url.path for r in fake.requests} >= {"/api/v1/runs"}
    assert not any(r.url.path.startswith("/api/v1/api/") for r in fake.requests)


def test_an_error_page_that_is_not_the_api_names_the_url_it_came_from() -> None:
    """A base URL that is not the service (the dashboard's page, a proxy's path) answers an
    HTML 404: the error used to say only "unexpected error response"."""
    page = httpx.MockTransport(lambda request: httpx.Response(
        404, html="<h1>Not Found</h1>"))
    client = GovernanceClient("http://governance.test/teams/support", "k", transport=page)

    with pytest.raises(ApiError) as raised:
        client.start_run("bot")

    assert (raised.value.status, raised.value.code) == (404, "http_404")
    assert "POST http://governance.test/teams/support/api/v1/runs" in str(raised.value)
    assert "base URL" in str(raised.value)


def test_start_run_fails_closed_with_an_exception() -> None:
    fake = FakeGovernance()
    fake.down = True

    with pytest.raises(GovernanceUnavailable):
        fake.client().start_run("bot")


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_start_run_without_an_external_id_is_retried_under_the_clients_own_id(
    kind: str
) -> None:
    """An ambiguous failure (the start was processed, its answer lost) is sent again with the
    same external_id, which the client made: one run, and the start gets its whole deadline."""
    fake = FakeGovernance()
    fake.fail_next(httpx.ReadTimeout, processed=True)

    if kind == "sync":
        run_id = fake.client().start_run("bot").id
    else:
        async def start() -> str:
            async with fake.async_client() as client:
                return (await client.start_run("bot")).id
        run_id = asyncio.run(start())

    assert list(fake.runs) == [run_id]
    first, again = (json.loads(r.content)["external_id"] for r in fake.requests)
    assert first == again and first.startswith("client-")


def test_an_async_attempt_cut_short_while_connecting_counts_as_not_sent() -> None:
    """asyncio's timeout ends an attempt whose connection never completed (a server whose
    accept queue is full): nothing was sent, so it is retried even where a replay would not
    be safe."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    filler = socket.create_connection(listener.getsockname())  # the queue is now full
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"

    async def send() -> str:
        async with AsyncGovernanceClient(url, "k", deadline=1.5, backoff=0) as client:
            with pytest.raises(GovernanceUnavailable) as raised:
                await client._send("POST", "/api/v1/runs", lambda _: {}, replay_safe=False)
            return str(raised.value)

    try:
        message = asyncio.run(send())
    finally:
        filler.close()
        listener.close()
    assert "after 3 attempt(s)" in message and "ConnectTimeout" in message


def test_start_run_retries_a_connection_error_without_an_external_id() -> None:
    fake = FakeGovernance()
    fake.fail_next(httpx.ConnectError, 503)

    run = fake.client().start_run("bot")

    assert list(fake.runs) == [run.id]


def test_start_run_retries_any_failure_with_an_external_id() -> None:
    fake = FakeGovernance()
    fake.fail_next(httpx.ReadTimeout, processed=True)

    run = fake.client().start_run("bot", external_id="ticket-1")

    assert list(fake.runs) == [run.id]


def test_the_context_manager_finishes_completed_with_the_output() -> None:
    fake = FakeGovernance()

    with fake.client().run("bot") as run:
        run.check("answer", type="llm")
        run.output = "Refund sent."

    stored = fake.runs[run.id]
    assert (stored.status, stored.output) == ("completed", "Refund sent.")
    assert run.finished and run.status == "completed"


def test_the_context_manager_finishes_failed_and_reraises() -> None:
    fake = FakeGovernance()

    with pytest.raises(RuntimeError, match="tool crashed"), fake.client().run("bot") as run:
        run.output = "half done"
        raise RuntimeError("tool crashed")

    stored = fake.runs[run.id]
    assert (stored.status, stored.output) == ("failed", "half done")


def test_the_context_manager_finishes_a_stopped_run_with_its_partial_output() -> None:
    fake = FakeGovernance(max_repeat_action=3)

    with fake.client().run("bot") as run:
        for _ in range(10):
            decision = run.check("edit_file", EDIT)
            if not decision.allowed:
                run.output = decision.user_notice("auth.py: 3 matches replaced")
                break

    stored = fake.runs[run.id]
    assert stored.status == "stopped"
    assert stored.stop_reason == "loop_detected"  # the service keeps the stop reason
    assert stored.output and stored.output.startswith("auth.py: 3 matches replaced")
    assert json.loads(fake.requests[-1].content)["status"] == "stopped"


def test_the_context_manager_reports_a_stop_even_if_the_block_then_raises() -> None:
    fake = FakeGovernance(max_repeat_action=1)

    with pytest.raises(KeyError), fake.client().run("bot") as run:
        run.check("a")
        run.check("a")
        raise KeyError("after the stop")

    assert json.loads(fake.requests[-1].content)["status"] == "stopped"


def test_a_run_finished_inside_the_block_is_not_finished_again() -> None:
    fake = FakeGovernance()

    with fake.client().run("bot") as run:
        run.finish("failed", output="gave up")

    finishes = [r for r in fake.requests if r.url.path.endswith("/finish")]
    assert len(finishes) == 1
    assert fake.runs[run.id].status == "failed"


def test_finishing_twice_is_idempotent() -> None:
    fake = FakeGovernance()
    run = fake.client().start_run("bot")

    assert run.finish("completed", "done") is not None
    assert run.finish("completed", "done") is None
    assert fake.runs[run.id].status == "completed"


def test_a_run_finished_elsewhere_is_not_an_error() -> None:
    fake = FakeGovernance()
    client = fake.client()
    run = client.start_run("bot", external_id="e")
    client.start_run("bot", external_id="e").finish("completed")

    assert run.finish("completed") is None
    assert run.finished


def test_run_finished_is_an_api_error_with_its_code() -> None:
    error = api_error(409, {"error": {"code": "run_finished", "message": "already finished"}})

    assert isinstance(error, RunFinished)
    assert error.code == "run_finished"


def test_an_unreachable_service_on_exit_does_not_hide_the_agent_result() -> None:
    fake = FakeGovernance()

    with fake.client().run("bot") as run:
        run.output = "done"
        fake.down = True

    assert not run.finished
    assert fake.runs[run.id].status == "running"


def test_the_client_closes_the_http_client_it_created_only() -> None:
    fake = FakeGovernance()
    with fake.client() as client:
        pass
    assert client._http.is_closed

    shared = httpx.Client(transport=fake.transport())
    with GovernanceClient("http://governance.test", "test-key", http_client=shared) as client:
        client.start_run("bot")
    assert not shared.is_closed
    shared.close()


def test_an_invalid_fail_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="fail_mode"):
        GovernanceClient("http://x", "k", fail_mode="maybe")  # type: ignore[arg-type]
