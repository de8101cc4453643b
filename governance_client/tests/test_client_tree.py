"""Sub-agent runs in the client (SPEC 20): ``run.child`` (sync and async) and the fake's
tree rules, the same as the service's."""

from __future__ import annotations

import asyncio

import pytest

from governance_client import ParentFinished, rules
from governance_client.testing import FakeGovernance


def test_a_child_counts_on_its_parent_and_the_parents_limit_stops_it() -> None:
    fake = FakeGovernance(max_steps=3)
    client = fake.client()
    with client.run("planner") as parent:
        assert parent.check("plan", {"n": 0}).allowed
        with parent.child(agent="researcher") as sub:
            assert sub.check("search", {"n": 1}).allowed
            assert sub.check("search", {"n": 2}).allowed
            stopped = sub.check("search", {"n": 3})
            assert not stopped.allowed and stopped.reason == "max_steps"
            assert parent.id in (stopped.message or "")
    runs = fake.runs
    assert runs[sub.id].ancestors == (parent.id,) and runs[parent.id].children == [sub.id]
    assert runs[parent.id].steps == 4 and runs[sub.id].status == rules.STOPPED
    assert runs[sub.id].as_json()["parent_run_id"] == parent.id


def test_a_finished_parent_stops_its_children_and_refuses_new_ones() -> None:
    fake = FakeGovernance()
    client = fake.client()
    parent = client.start_run("planner")
    sub = parent.start_child("researcher")
    parent.finish("completed")
    answer = sub.check("search", {"n": 1})
    assert (answer.allowed, answer.reason) == (False, rules.PARENT_STOPPED)
    with pytest.raises(ParentFinished):
        parent.start_child("other")


def test_the_async_child_spends_the_roots_budget() -> None:
    fake = FakeGovernance(max_usd=0.25)

    async def scenario() -> list[bool]:
        async with fake.async_client() as client, client.run("planner") as parent, \
                parent.child(agent="writer") as sub:
            return [(await sub.check("llm", {"n": i}, type="llm", cost_usd=0.1)).allowed
                    for i in range(4)]

    assert asyncio.run(scenario()) == [True, True, False, False]
