"""The integration examples stop the seed's rename loop at the 4th identical edit_file call.

They need the ``examples`` extra (langgraph, openai-agents); without it they are skipped.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from governance_client import repeat_key
from governance_client.testing import FakeGovernance, FakeRun

pytestmark = pytest.mark.stack_independent

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

EDIT = {"path": "auth.py", "old": "user_id", "new": "account_id"}


def assert_stopped_at_the_fourth_edit(fake: FakeGovernance, outcome: Any) -> FakeRun:
    stored = fake.runs[outcome.run_id]
    assert outcome.stop is not None
    assert outcome.stop.reason == "loop_detected"
    assert outcome.stop.step == 4
    assert outcome.stop.repeat_key == repeat_key("edit_file", EDIT)
    assert [d["decision"] for d in stored.decisions] == ["allow", "allow", "allow", "stop"]
    assert (stored.status, stored.stop_reason) == ("stopped", "loop_detected")
    # The first edit did the work; the partial response and the stop reach the user.
    assert outcome.workspace.files["auth.py"].count("account_id") == 3
    assert outcome.answer.startswith("Done so far:\n- edit_file(auth.py, user_id → account_id)")
    assert "Stopped by governance (loop_detected)" in outcome.answer
    assert "Next: Return the partial response" in outcome.answer
    assert stored.output == outcome.answer
    return stored


def assert_outcomes_were_reported(stored: FakeRun) -> None:
    results = [check.get("last_result") for check in stored.checks]
    assert results[0] is None
    assert results[1] is not None and results[1]["status"] == "ok" and results[1]["digest"]
    assert results[2] == {"status": "error", "error": "no matches found"}
    assert results[3] == {"status": "error", "error": "no matches found"}


def test_the_langgraph_agent_is_stopped_at_the_fourth_identical_edit_file_call() -> None:
    pytest.importorskip("langgraph")
    import langgraph_agent

    fake = FakeGovernance(max_repeat_action=3)
    with fake.client() as client:
        outcome = langgraph_agent.run_agent(client)

    stored = assert_stopped_at_the_fourth_edit(fake, outcome)
    assert_outcomes_were_reported(stored)


def test_the_openai_agents_sdk_agent_is_stopped_at_the_fourth_identical_edit_file_call() -> None:
    pytest.importorskip("agents")
    import openai_agents_agent

    fake = FakeGovernance(max_repeat_action=3)
    with fake.client() as client:
        outcome = asyncio.run(openai_agents_agent.run_agent(client))

    stored = assert_stopped_at_the_fourth_edit(fake, outcome)
    assert_outcomes_were_reported(stored)
    assert outcome.model_calls == 4


@pytest.mark.parametrize(
    ("script", "module"),
    [("langgraph_agent.py", "langgraph"), ("openai_agents_agent.py", "agents")],
)
def test_the_examples_run_as_scripts_without_network(script: str, module: str) -> None:
    pytest.importorskip(module)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GOVERNANCE_", "OPENAI_"))}

    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )

    assert done.returncode == 0, done.stderr
    assert "Stopped by governance (loop_detected)" in done.stdout
