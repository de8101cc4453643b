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


def test_a_sub_agents_stop_the_agent_ends_with_finishes_the_parent_stopped() -> None:
    # What the integrations say when a handoff's receiver or a subgraph stopped and the
    # agent ends there: the parent is not stopped on the service (SPEC 20), but its block
    # finishes it stopped, with the notice, rather than completed with no output.
    fake = FakeGovernance(max_repeat_action=2)
    with fake.client().run("planner") as parent:
        with parent.child(agent="researcher") as sub:
            sub.check("search", {"q": 1})
            sub.check("search", {"q": 1})
            stop = sub.check("search", {"q": 1})
        assert parent.exit_status() == "completed"
        parent.subagent_stopped(stop, "Done so far: nothing.\n\n" + stop.user_notice())
        assert parent.exit_status() == "stopped" and parent.subagent_stop == stop
    stored = fake.runs[parent.id]
    assert (stored.status, stored.stop_reason) == (rules.STOPPED, "agent_stopped")
    assert stored.output == "Done so far: nothing.\n\n" + stop.user_notice()
    assert stop.reason == "loop_detected" and fake.runs[sub.id].status == rules.STOPPED


def test_a_parent_that_goes_on_after_a_sub_agents_stop_completes() -> None:
    fake = FakeGovernance(max_repeat_action=2)
    with fake.client().run("planner") as parent:
        with parent.child(agent="researcher") as sub:
            sub.check("search", {"q": 1})
            sub.check("search", {"q": 1})
            stop = sub.check("search", {"q": 1})
        parent.subagent_stopped(stop)
        assert parent.check("answer", {}).allowed  # the agent went on: forgotten
        assert parent.subagent_stop is None
    assert fake.runs[parent.id].status == rules.COMPLETED


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


def test_a_child_finished_after_its_parent_ends_stopped_with_it() -> None:
    """The service's answer (tests/test_run_tree.py): a descendant finished once its tree is
    over is stopped `parent_stopped`, whatever status its finish gave (SPEC 20)."""
    fake = FakeGovernance()
    client = fake.client()
    parent = client.start_run("planner")
    sub = parent.start_child("researcher")
    assert sub.check("search", {"n": 1}).allowed
    parent.finish("completed")
    sub.finish("completed", output="partial")
    run = fake.runs[sub.id]
    assert (run.status, run.state.stop_reason, run.output) == (
        rules.STOPPED, rules.PARENT_STOPPED, "partial")
    # Audited as the service audits it, so a later check answers that stop in its words.
    assert [d["reason"] for d in run.decisions] == ["step_ok", rules.PARENT_STOPPED]
    import httpx

    from governance_client.testing import BASE_URL

    with httpx.Client(transport=fake.transport(), base_url=BASE_URL,
                      headers={"Authorization": f"Bearer {fake.api_key}"}) as http:
        later = http.post(f"/api/v1/runs/{sub.id}/check",
                          json={"action": {"name": "search", "args": {"n": 2}}}).json()
    assert later["reason"] == rules.PARENT_STOPPED and parent.id in later["message"]
    assert later["rule"]["scope"] == parent.id, later


def test_a_childs_retried_check_after_its_parents_finish_answers_the_stop() -> None:
    """The service's answer (tests/test_run_tree.py): a check_id sent again once an ancestor
    is over is a new `parent_stopped`, not its first allow (SPEC 4.5, 20)."""
    import httpx

    from governance_client.testing import BASE_URL

    fake = FakeGovernance()
    with httpx.Client(transport=fake.transport(), base_url=BASE_URL,
                      headers={"Authorization": f"Bearer {fake.api_key}"}) as http:
        parent = http.post("/api/v1/runs", json={"agent": "planner"}).json()["run_id"]
        child = http.post("/api/v1/runs", json={"agent": "researcher",
                                                 "parent_run_id": parent}).json()["run_id"]
        sent = {"action": {"name": "pay.send", "args": {"amount": 100}}, "check_id": "X"}
        first = http.post(f"/api/v1/runs/{child}/check", json=sent).json()
        assert first["decision"] == "allow"
        assert http.post(f"/api/v1/runs/{parent}/finish",
                         json={"status": "completed"}).status_code == 200
        retried = http.post(f"/api/v1/runs/{child}/check", json=sent).json()
        assert (retried["decision"], retried["reason"]) == ("stop", rules.PARENT_STOPPED)
        assert retried["decision_id"] != first["decision_id"]
    assert fake.runs[child].status == rules.STOPPED


def test_the_async_child_spends_the_roots_budget() -> None:
    fake = FakeGovernance(max_usd=0.25)

    async def scenario() -> list[bool]:
        async with fake.async_client() as client, client.run("planner") as parent, \
                parent.child(agent="writer") as sub:
            return [(await sub.check("llm", {"n": i}, type="llm", cost_usd=0.1)).allowed
                    for i in range(4)]

    assert asyncio.run(scenario()) == [True, True, False, False]


def test_the_decision_names_the_ancestor_whose_limit_stopped_it() -> None:
    from datetime import UTC, datetime
    from decimal import Decimal

    now = datetime(2026, 1, 1, tzinfo=UTC)
    policy = rules.Policy(max_steps=3, max_seconds=None, max_usd=Decimal("1"))
    root = rules.Ancestor(run_id="root-id", policy=policy,
                          state=rules.RunState(started_at=now, steps=3))
    check = rules.make_check("search", {"q": 1}, cost_usd=0.1)
    decision, state = rules.evaluate(policy, rules.RunState(started_at=now), check, now=now,
                                     tree=[root])
    assert (decision.reason, decision.scope, state.status) == ("max_steps", "root-id",
                                                               rules.STOPPED)
    own, _ = rules.evaluate(policy, rules.RunState(started_at=now, steps=3), check, now=now,
                            tree=[replace_steps(root, 0)])
    assert (own.reason, own.scope) == ("max_steps", None)  # the run's own limit first
    ended = replace_status(root, rules.COMPLETED)
    parent_over, _ = rules.evaluate(policy, rules.RunState(started_at=now), check, now=now,
                                    tree=[ended])
    assert (parent_over.reason, parent_over.scope) == (rules.PARENT_STOPPED, "root-id")


def replace_steps(ancestor: rules.Ancestor, steps: int) -> rules.Ancestor:
    from dataclasses import replace
    return replace(ancestor, state=replace(ancestor.state, steps=steps))


def replace_status(ancestor: rules.Ancestor, status: str) -> rules.Ancestor:
    from dataclasses import replace
    return replace(ancestor, state=replace(ancestor.state, status=status))


def test_an_approved_childs_tool_call_counts_on_its_ancestors_as_on_the_service() -> None:
    fake = FakeGovernance(approvals=["refund.*"], operator=lambda _a: ("approve", "ok"),
                          max_tool_calls=2)
    client = fake.client()
    with client.run("planner") as parent, parent.child(agent="payer") as sub:
        assert sub.check("refund.issue", {"amount": 1}).allowed  # approved by the operator
        assert fake.runs[parent.id].tool_calls == 1 == fake.runs[sub.id].tool_calls
        assert parent.check("search", {"q": 1}).allowed  # the tree's second tool call
        stopped = sub.check("search", {"q": 2})
        assert not stopped.allowed and stopped.reason == "max_tool_calls"
        assert parent.id in (stopped.message or "")


def test_the_fake_hands_a_child_start_only_a_child_of_that_parent() -> None:
    # As the service (tests/test_run_tree.py): an external_id of a run outside the parent
    # is a conflict, not that run with a budget of its own.
    from governance_client import ApiError

    fake = FakeGovernance()
    client = fake.client()
    parent = client.start_run("planner")
    client.start_run("researcher", external_id="job-1")
    with pytest.raises(ApiError) as refused:
        parent.start_child("researcher", external_id="job-1")
    assert refused.value.code == "external_id_conflict"
    child = parent.start_child("researcher", external_id="job-2")
    assert parent.start_child("researcher", external_id="job-2").id == child.id
