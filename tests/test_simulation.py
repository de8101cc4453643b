"""The simulated agents drive the real server and end with the reasons they are built for."""

from __future__ import annotations

import threading

import pytest

from governance_client import GovernanceClient
from runs.models import Run
from runs.simulation import BEHAVIOURS, simulate

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

EXPECTED = {
    "normal": ("completed", None),
    "hard_loop": ("stopped", "loop_detected"),
    "soft_loop": ("stopped", "no_progress"),
    "over_budget": ("stopped", "max_usd"),
    "repeated_error": ("completed", None),
    "long_run": ("stopped", "max_steps"),
    "denied_tool": ("stopped", "tool_denied"),
}


def test_each_behaviour_ends_as_designed(server, team, agent_token):
    from tests.conftest import set_policy

    set_policy(team, tools={"deny": ["shell.*"]})
    with GovernanceClient(server.url, agent_token) as client:
        for kind, behaviour in BEHAVIOURS.items():
            with client.run("sim-bot", task=kind) as run:
                behaviour(run, __import__("random").Random(1), lambda: None)
            row = Run.objects.get(pk=run.id)
            assert (row.status, row.stop_reason) == EXPECTED[kind], kind
            assert row.output, kind


def test_simulate_agents_finishes_the_runs_it_was_asked_for(server, team, agent_token):
    with GovernanceClient(server.url, agent_token) as client:
        counts = simulate(client, agents=3, runs=9, pace_s=0, seed=3, stop=threading.Event(),
                          log=lambda line: None)
    assert sum(counts.values()) == 9
    assert Run.objects.filter(status="running").count() == 0
    assert Run.objects.count() == 9


class Waits(threading.Event):
    """A stop event that records each wait instead of waiting, and is set after `count`."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.waits: list[float] = []
        self.count = count

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(float(timeout or 0))
        if len(self.waits) >= self.count:
            self.set()
        return self.is_set()


@pytest.mark.django_db(transaction=False)
def test_an_agent_refused_by_a_kill_switch_says_so_once_and_waits_longer_each_time():
    """Found by a newcomer: with the team's switch engaged, each simulated agent tried again
    every 5 s and the demo's terminal showed a refused start a second."""
    from governance_client.testing import FakeGovernance

    fake = FakeGovernance()
    fake.kill_switch = "the team kill switch"
    said: list[str] = []
    stop = Waits(6)
    with fake.client() as client:
        simulate(client, agents=1, runs=0, pace_s=0.0, seed=1, stop=stop, log=said.append)
    assert stop.waits == [5.0, 10.0, 20.0, 30.0, 30.0, 30.0]
    assert said == ["agent 0: kill switch engaged, waiting until it is released"]
