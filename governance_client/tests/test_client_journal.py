"""A run that ends while the service is down keeps its fail-open decisions and its finish in
the journal; the next start of a client of the same service and key sends them."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from governance_client.testing import FakeGovernance


def journal_files(fake: FakeGovernance) -> list[Path]:
    return sorted(Path(fake.journal).glob("*.json"))


def test_a_run_ended_during_an_outage_is_uploaded_and_finished_at_the_next_start() -> None:
    fake = FakeGovernance()
    with fake.client(fail_mode="open") as client, client.run("bot") as run:
        assert run.check("search", {"q": 0}).allowed
        fake.down = True
        assert all(run.check("search", {"q": q}).local for q in (1, 2))
        run.output = "Two more pages read during the outage."

    stored = fake.runs[run.id]
    assert (stored.status, stored.steps) == ("running", 1)  # nothing reached the service
    (kept,) = journal_files(fake)
    assert "test-key" not in kept.read_text()  # the key is never written
    assert len(json.loads(kept.read_text())["decisions"]) == 2

    fake.down = False
    with fake.client(fail_mode="open") as client:  # the next process, the same journal
        client.start_run("bot")

    stored = fake.runs[run.id]
    assert (stored.status, stored.steps, stored.output) == (
        "completed", 3, "Two more pages read during the outage.")
    assert [entry["action"]["args"]["q"] for entry in stored.uploaded] == [1, 2]
    assert journal_files(fake) == []


def test_the_async_client_keeps_and_sends_the_journal_too() -> None:
    fake = FakeGovernance(max_repeat_action=1)

    async def scenario() -> str:
        async with fake.async_client(fail_mode="open") as client:
            async with client.run("bot") as run:
                await run.check("edit", {"path": "a"})
                fake.down = True
                stop = await run.check("edit", {"path": "a"})
                assert stop.local and stop.reason == "loop_detected"
            fake.down = False
            await client.start_run("bot")
            return run.id

    run_id = asyncio.run(scenario())
    stored = fake.runs[run_id]
    assert (stored.status, stored.stop_reason, stored.steps) == ("stopped", "loop_detected", 2)
    assert "Stopped by governance (loop_detected)" in (stored.output or "")
    assert journal_files(fake) == []


def test_a_journal_that_cannot_be_sent_yet_is_kept_for_the_next_start() -> None:
    fake = FakeGovernance()
    with fake.client(fail_mode="open") as client, client.run("bot") as run:
        run.check("search", {"q": 0})
        fake.down = True
        run.check("search", {"q": 1})
    with fake.client(fail_mode="open") as client:
        assert client.start_run("bot").local  # still down: started locally, journal kept
    assert len(journal_files(fake)) == 1
    fake.down = False
    with fake.client(fail_mode="open") as client:
        client.start_run("bot")
    assert fake.runs[run.id].steps == 2 and journal_files(fake) == []


def test_another_key_does_not_send_this_keys_journal() -> None:
    fake = FakeGovernance()
    with fake.client(fail_mode="open") as client, client.run("bot") as run:
        run.check("search", {"q": 0})
        fake.down = True
        run.check("search", {"q": 1})
    fake.down = False
    fake.api_key = "another-key"
    from governance_client import GovernanceClient
    from governance_client.testing import BASE_URL

    with GovernanceClient(BASE_URL, "another-key", transport=fake.transport(),
                          journal=fake.journal) as other:
        other.start_run("bot")
    assert fake.runs[run.id].steps == 1 and len(journal_files(fake)) == 1


def test_the_journal_can_be_turned_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOVERNANCE_JOURNAL_DIR", str(tmp_path))
    fake = FakeGovernance()
    with fake.client(fail_mode="open", journal=False) as client, client.run("bot") as run:
        run.check("search", {"q": 0})
        fake.down = True
        run.check("search", {"q": 1})
    assert list(tmp_path.iterdir()) == [] and journal_files(fake) == []
