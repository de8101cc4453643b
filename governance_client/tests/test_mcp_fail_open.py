"""A gateway session (SPEC 19) whose run was started locally, with --fail-open, because the
service was unreachable when the session began: the calls are decided with the client's local
limits, the start on the service is tried again now and then (not at every call), and once it
succeeds the local decisions are uploaded to the run it started and the service decides (found
by a tester: such a session stayed local to its end, and its calls had no run and no audit).

The session runs in process, against the client's fake service (``FakeGovernance``), down and
back as the test says; tests/test_mcp_gateway.py does the same with real processes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

pytest.importorskip("mcp")

from governance_client.mcp_gateway import session as gateway
from governance_client.mcp_gateway.session import GatewayConfig, GatewaySession
from governance_client.testing import FakeGovernance


def starts(fake: FakeGovernance) -> int:
    """The starts the gateway sent (answered or not)."""
    return sum(1 for r in fake.requests if r.method == "POST" and r.url.path == "/api/v1/runs")


def in_session(fake: FakeGovernance,
               scenario: Callable[[GatewaySession], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        config = GatewayConfig(url="http://governance.test", key=fake.api_key,
                               agent="mcp-agent", fail_open=True, name="files")
        async with fake.async_client(fail_mode="open") as client:
            session = GatewaySession(config, client)
            fake.down = True  # when the session begins
            await session._start()
            assert session.run is not None and session.run.local
            return await scenario(session)

    return anyio.run(main)


def due(session: GatewaySession) -> None:
    """Time has passed: the next start on the service is due."""
    session._retry_at = 0.0


def test_the_run_is_started_on_the_service_once_it_answers_and_gets_the_local_decisions(
) -> None:
    fake = FakeGovernance(deny=["files.delete_*"])

    async def scenario(session: GatewaySession) -> list[Any]:
        # Decided with the client's local limits: the policy's deny list is not known.
        out = [await session._decide(1, "search", {"q": "a"}),
               await session._decide(2, "delete_all", {})]
        fake.down = False
        out.append(await session._decide(3, "search", {"q": "b"}))  # not due yet: local
        assert session.run is not None and session.run.local and not fake.runs
        due(session)
        out.append(await session._decide(4, "search", {"q": "c"}))
        out.append(await session._decide(5, "delete_all", {}))  # now the service decides
        out.append(await session.finish())
        return out

    out = in_session(fake, scenario)
    assert out[:4] == [None, None, None, None]
    assert out[4].startswith("Blocked by governance (tool_denied): ")
    assert out[5] == "stopped"
    (run,) = fake.runs.values()
    assert [(e["action"]["name"], e["decision"]) for e in run.uploaded] == [
        ("files.search", "allow"), ("files.delete_all", "allow"), ("files.search", "allow")]
    assert [(d["decision"], d.get("local", False)) for d in run.decisions] == [
        ("allow", True), ("allow", True), ("allow", True), ("allow", False), ("stop", False)]
    assert (run.status, run.stop_reason, run.steps) == ("stopped", "tool_denied", 5)


def test_a_service_that_stays_down_is_asked_again_less_and_less_often() -> None:
    fake = FakeGovernance()

    async def scenario(session: GatewaySession) -> list[int]:
        counted = [starts(fake)]
        for call in range(5):  # within the first wait: decided locally, nothing sent
            assert await session._decide(call, "search", {"q": call}) is None
        counted.append(starts(fake))
        waits = []
        for _ in range(7):
            due(session)
            await session._decide(9, "search", {"q": "again"})
            waits.append(session._retry_at - anyio.current_time())
        counted.append(starts(fake))
        return [*counted, *waits]

    counted = in_session(fake, scenario)
    attempts = FakeGovernance().async_client().settings.attempts
    assert counted[:3] == [attempts, attempts, 8 * attempts]
    waits = counted[3:]
    # Doubling from START_RETRY_S (jittered down by at most half) up to START_RETRY_MAX_S.
    for failures, wait in enumerate(waits, start=2):
        bound = min(gateway.START_RETRY_MAX_S, gateway.START_RETRY_S * 2 ** (failures - 1))
        assert bound / 2 - 0.1 <= wait <= bound


def test_a_local_stop_is_uploaded_and_the_service_answers_it() -> None:
    """A loop stopped locally ends the session's calls while the run is only local; once it
    is started on the service, the upload records the stop there (the run ends with its
    reason), and the service's answer refuses the next call."""
    fake = FakeGovernance()

    async def scenario(session: GatewaySession) -> list[Any]:
        out = [await session._decide(n, "search", {"q": "same"}) for n in range(4)]
        out.append(await session._decide(5, "other", {}))  # the stop stands, locally
        fake.down = False
        due(session)
        out.append(await session._decide(6, "other", {}))
        out.append(await session.finish())
        return out

    out = in_session(fake, scenario)
    assert out[:3] == [None, None, None]
    assert out[3].startswith("Blocked by governance (loop_detected): ")
    assert "decided locally" in out[3] and out[4] == out[3]
    assert out[5].startswith("Blocked by governance (loop_detected): The run is already "
                             "stopped")
    assert out[6] == "stopped"
    (run,) = fake.runs.values()
    assert [e["decision"] for e in run.uploaded] == ["allow", "allow", "allow", "stop"]
    assert (run.status, run.stop_reason, run.steps) == ("stopped", "loop_detected", 4)
    assert run.finished


def test_the_sessions_end_starts_the_run_if_the_service_answers_by_then() -> None:
    fake = FakeGovernance()

    async def scenario(session: GatewaySession) -> str | None:
        assert await session._decide(1, "search", {"q": "a"}) is None
        fake.down = False  # back, before the next start is due: the end does not wait
        return await session.finish()

    assert in_session(fake, scenario) == "completed"
    (run,) = fake.runs.values()
    assert [e["action"]["name"] for e in run.uploaded] == ["files.search"]
    assert (run.status, run.steps, run.finished) == ("completed", 1, True)


def test_a_session_that_ends_during_the_outage_sends_nothing() -> None:
    fake = FakeGovernance()

    async def scenario(session: GatewaySession) -> str | None:
        assert await session._decide(1, "search", {"q": "a"}) is None
        return await session.finish()

    assert in_session(fake, scenario) == "completed"
    assert not fake.runs


@pytest.mark.parametrize(("failure", "told"), [
    ("slow", "The governance service did not answer in time, so this tool was not run."),
    ("down", "The governance service is unreachable, so this tool was not run."),
])
def test_a_closed_session_says_whether_the_service_was_slow_or_unreachable(
    failure: str, told: str
) -> None:
    # Found by a newcomer: a start that got no answer within the deadline on a loaded
    # machine was told "unreachable", which sent them looking for a network fault.
    import httpx

    fake = FakeGovernance()

    async def main() -> str | None:
        config = GatewayConfig(url="http://governance.test", key=fake.api_key,
                               agent="mcp-agent", name="files")
        async with fake.async_client() as client:
            session = GatewaySession(config, client)
            if failure == "slow":
                fake.fail_next(httpx.ReadTimeout, httpx.ReadTimeout, httpx.ReadTimeout)
            else:
                fake.down = True
            await session._start()
            return session.start_refusal

    refusal = anyio.run(main)
    assert refusal is not None
    assert refusal.startswith(f"Blocked by governance (governance_unavailable): {told}")
