"""Sub-agent runs (SPEC 20, 21): the start's parent rules, a tree counted and bounded as one,
`parent_stopped`, kill switches over descendants, the run's tree on the API."""

from __future__ import annotations

import json
import uuid

import pytest
from django.test import Client

from policies.services import agent_key_create
from runs.check import lineages
from runs.models import Decision, Run
from tests.conftest import set_policy

pytestmark = [pytest.mark.django_db, pytest.mark.both_stores]


def post(api: Client, path: str, body: dict) -> dict:
    response = api.post(path, json.dumps(body), content_type="application/json")
    return {**response.json(), "http": response.status_code}


def start(api: Client, agent: str = "bot", **extra: object) -> str:
    body = post(api, "/api/v1/runs", {"agent": agent, **extra})
    assert body["http"] == 201, body
    return body["run_id"]


def check(api: Client, run_id: str, name: str = "search", **extra: object) -> dict:
    return post(api, f"/api/v1/runs/{run_id}/check",
                {"action": {"name": name, "args": {"n": str(uuid.uuid4())}}, **extra})


@pytest.fixture(autouse=True)
def _forget_lineage() -> None:
    # Each test's process memory of trees starts empty: the first check of a child run
    # must find its ancestors itself (the Relock path) as a fresh server process would.
    lineages._LINEAGE.clear()


def test_a_child_starts_under_its_parent_with_the_parents_policy(api, team):
    parent = start(api)
    child = start(api, "helper", parent_run_id=parent)
    grandchild = start(api, "helper", parent_run_id=child)
    run = Run.objects.get(pk=grandchild)
    assert (str(run.parent_run_id), str(run.root_run_id), run.depth) == (child, parent, 2)
    assert run.ancestors == [parent, child]
    assert run.policy_version.document["name"] == "default"
    body = api.get(f"/api/v1/runs/{parent}").json()
    assert body["children"] == [child] and body["parent_run_id"] is None
    assert body["root_run_id"] is None
    assert api.get(f"/api/v1/runs/{child}").json()["parent_run_id"] == parent
    # The start's own answer says where the run is (found by a newcomer: it did not).
    started = post(api, "/api/v1/runs", {"agent": "helper", "parent_run_id": child})
    assert (started["parent_run_id"], started["root_run_id"]) == (child, parent)
    root = post(api, "/api/v1/runs", {"agent": "bot"})
    assert (root["parent_run_id"], root["root_run_id"]) == (None, None)


def test_a_run_lists_its_first_children_and_says_it_has_more(api, team, monkeypatch):
    from runs.audit import selectors

    monkeypatch.setattr(selectors, "CHILDREN_LISTED", 3)
    parent = start(api, "planner")
    children = [start(api, "helper", parent_run_id=parent) for _ in range(4)]
    body = api.get(f"/api/v1/runs/{parent}").json()
    # (Children started within one clock tick have no order between them.)
    assert len(body["children"]) == 3 and set(body["children"]) < set(children)
    assert body["children_more"] is True
    assert api.get(f"/api/v1/runs/{children[0]}").json()["children_more"] is False


def test_an_agent_bound_key_sees_only_its_agents_children(api, team):
    """SPEC 10: an agent-bound key sees only runs of its agent; another agent's child of its
    run was listed, while reading it answered 404 (found by an attacker)."""
    bound = Client(HTTP_AUTHORIZATION="Bearer "
                   + agent_key_create(team=team, name="b", agent="planner").token)
    parent = start(bound, "planner")
    mine = start(api, "planner", parent_run_id=parent)
    theirs = start(api, "helper", parent_run_id=parent)
    assert bound.get(f"/api/v1/runs/{theirs}").status_code == 404
    assert bound.get(f"/api/v1/runs/{parent}").json()["children"] == [mine]
    assert set(api.get(f"/api/v1/runs/{parent}").json()["children"]) == {mine, theirs}


def test_the_parent_rules_of_a_start(api, team, other_team):
    unknown = post(api, "/api/v1/runs", {"agent": "bot", "parent_run_id": str(uuid.uuid4())})
    assert unknown["http"] == 404 and "parent_run_id" in unknown["error"]["fields"]
    other = Client(HTTP_AUTHORIZATION="Bearer "
                   + agent_key_create(team=other_team, name="k").token)
    theirs = start(other)
    refused = post(api, "/api/v1/runs", {"agent": "bot", "parent_run_id": theirs})
    assert refused["http"] == 404 and "parent_run_id" in refused["error"]["fields"]
    bad = post(api, "/api/v1/runs", {"agent": "bot", "parent_run_id": "nope"})
    assert bad["http"] == 422 and "parent_run_id" in bad["error"]["fields"]
    # An agent-bound key names only its agent's runs as parents (SPEC 10).
    bound = Client(HTTP_AUTHORIZATION="Bearer "
                   + agent_key_create(team=team, name="b", agent="helper").token)
    others = start(api, "bot")
    hidden = post(bound, "/api/v1/runs", {"agent": "helper", "parent_run_id": others})
    assert hidden["http"] == 404
    # Depth: the root is 0, at most 5.
    run = start(api)
    for _ in range(5):
        run = start(api, parent_run_id=run)
    deep = post(api, "/api/v1/runs", {"agent": "bot", "parent_run_id": run})
    assert deep["http"] == 422 and "parent_run_id" in deep["error"]["fields"]
    # A parent that is over: 409 parent_finished.
    done = start(api)
    post(api, f"/api/v1/runs/{done}/finish", {"status": "completed"})
    over = post(api, "/api/v1/runs", {"agent": "bot", "parent_run_id": done})
    assert over["http"] == 409 and over["error"]["code"] == "parent_finished"
    # Not "is completed (reason: completed)" (found by a newcomer).
    assert over["error"]["message"] == ("The parent run is completed: no sub-agent may start "
                                        "under it.")
    # A parent whose own ancestor is over (the parent itself still reads running).
    middle = start(api, "helper", parent_run_id=(root := start(api)))
    post(api, f"/api/v1/runs/{root}/finish", {"status": "completed"})
    dead = post(api, "/api/v1/runs", {"agent": "bot", "parent_run_id": middle})
    assert dead["http"] == 409 and dead["error"]["code"] == "parent_finished", dead
    assert root in dead["error"]["message"]


def test_an_external_id_hands_a_child_start_only_a_child_of_that_parent(api, team):
    # Given back as it was, a root run with a budget of its own answered a start that named
    # a parent: the "sub-agent" then ran outside the tree its parent's limits bound.
    parent = start(api)
    root = start(api, "helper", external_id="job-1")
    escaped = post(api, "/api/v1/runs", {"agent": "helper", "external_id": "job-1",
                                         "parent_run_id": parent})
    assert escaped["http"] == 409 and escaped["error"]["code"] == "external_id_conflict"
    assert "external_id" in escaped["error"]["fields"]
    child = start(api, "helper", external_id="job-2", parent_run_id=parent)
    again = post(api, "/api/v1/runs", {"agent": "helper", "external_id": "job-2",
                                       "parent_run_id": parent})
    assert (again["http"], again["run_id"]) == (200, child)  # a retry of that start
    elsewhere = post(api, "/api/v1/runs", {"agent": "helper", "external_id": "job-2",
                                           "parent_run_id": root})
    assert elsewhere["http"] == 409
    # A start that names no parent gets the run as before, whatever its place in a tree.
    assert post(api, "/api/v1/runs", {"agent": "helper", "external_id": "job-2"}
                )["run_id"] == child


def test_a_childs_checks_count_on_every_ancestor_and_its_limits_bound_the_tree(api, team):
    set_policy(team, step_limits={"max_steps": 5})
    root = start(api)
    child = start(api, "helper", parent_run_id=root)
    grandchild = start(api, "helper", parent_run_id=child)
    allowed = [check(api, run)["decision"] for run in (root, child, grandchild, grandchild,
                                                         child)]
    assert allowed == ["allow"] * 5
    assert [Run.objects.get(pk=r).steps for r in (root, child, grandchild)] == [5, 4, 2]
    stopped = check(api, grandchild)
    assert (stopped["decision"], stopped["reason"]) == ("stop", "max_steps")
    assert stopped["message"] == (f"Ancestor run {root}'s limit bounds its sub-agents' runs. "
                                  "Tree step 6 is past max_steps=5: the action was not run "
                                  "and this run is stopped.")
    # SPEC 16's rule names the ancestor whose limit it is, in the answer and the audit.
    assert stopped["rule"]["name"] == "max_steps" and stopped["rule"]["scope"] == root
    assert stopped["rule"]["limit"] == {"max_steps": 5}
    assert api.get(f"/api/v1/decisions/{stopped['decision_id']}").json()["rule"] == \
        stopped["rule"]
    # A later check of the stopped run names the same rule, the ancestor's (found by a
    # newcomer: it named the run's own policy and scope, with limit {"status": "running"}).
    later = check(api, grandchild)
    assert (later["decision"], later["reason"]) == ("stop", "max_steps")
    assert later["rule"] == stopped["rule"]
    # The child ended; its stop does not stop its ancestors.
    statuses = [Run.objects.get(pk=r).status for r in (root, child, grandchild)]
    assert statuses == ["running", "running", "stopped"]


def test_the_runs_own_limit_comes_before_its_ancestors(api, team):
    set_policy(team, budgets={"max_usd": 1.0, "max_seconds": 45, "max_tool_calls": None})
    root = start(api)
    child = start(api, "helper", parent_run_id=root)
    assert check(api, root, cost_usd=0.5)["decision"] == "allow"
    own = check(api, child, cost_usd=1.0)
    assert (own["reason"], root in own["message"]) == ("max_usd", False)
    other = start(api, "helper", parent_run_id=root)
    tree_stop = check(api, other, cost_usd=0.6)
    assert tree_stop["reason"] == "max_usd" and root in tree_stop["message"]
    assert float(Run.objects.get(pk=root).cost_usd) == pytest.approx(2.1)


def test_an_ancestor_that_ends_stops_its_descendants(api, team):
    root = start(api)
    child = start(api, "helper", parent_run_id=root)
    grandchild = start(api, "helper", parent_run_id=child)
    assert check(api, grandchild)["decision"] == "allow"
    post(api, f"/api/v1/runs/{root}/finish", {"status": "completed"})
    answer = check(api, grandchild)
    assert (answer["decision"], answer["reason"]) == ("stop", "parent_stopped")
    assert root in answer["message"] and "completed" in answer["message"]
    assert Run.objects.get(pk=grandchild).status == "stopped"
    assert Decision.objects.filter(run_id=grandchild, reason="parent_stopped").count() == 1


@pytest.mark.parametrize("finished_as", ["completed", "failed", "stopped"])
def test_a_descendant_finished_after_its_tree_ended_ends_stopped_with_it(
        api, team, finished_as):
    """Found by a review: a child finished `completed` under a root that was over, where its
    next check would have stopped it (SPEC 20: a stop of an ancestor stops the tree). Its
    finish now finds it stopped `parent_stopped`, audited like a kill (no action, the step
    unchanged), and stores the output as any stopped run's finish does (SPEC 5.1)."""
    root = start(api)
    child = start(api, "helper", parent_run_id=root)
    grandchild = start(api, "helper", parent_run_id=child)
    assert check(api, grandchild)["decision"] == "allow"
    post(api, f"/api/v1/runs/{root}/finish", {"status": "completed"})
    done = post(api, f"/api/v1/runs/{grandchild}/finish",
                {"status": finished_as, "output": "partial"})
    assert done["http"] == 200, done
    assert (done["status"], done["stop_reason"]) == ("stopped", "parent_stopped"), done
    run = Run.objects.get(pk=grandchild)
    assert (run.status, run.stop_reason, run.output, run.steps) == (
        "stopped", "parent_stopped", "partial", 1)
    stop = Decision.objects.get(run_id=grandchild, reason="parent_stopped")
    assert (stop.outcome, stop.step, stop.action_name) == ("stop", 1, "")
    assert stop.answer["rule"]["scope"] == root and root in stop.answer["message"]
    assert "the action was not run" not in stop.answer["message"]
    # Its later check answers that stop; a second finish is a second finish.
    again = check(api, grandchild)
    assert (again["decision"], again["reason"]) == ("stop", "parent_stopped")
    assert post(api, f"/api/v1/runs/{grandchild}/finish",
                {"status": "completed"})["http"] == 409
    # A child of a running tree finishes as it says.
    other = start(api, "helper", parent_run_id=start(api))
    assert post(api, f"/api/v1/runs/{other}/finish", {"status": finished_as})["status"] == \
        finished_as


def test_a_kill_switch_over_the_parent_covers_its_children(api, team, users):
    from unittest import mock

    from runs.killswitch.services import killswitch_engage
    root = start(api)
    child = start(api, "helper", parent_run_id=root)
    assert check(api, child)["decision"] == "allow"
    with mock.patch("runs.killswitch.services._enqueue_fanout"):  # the check's own read
        killswitch_engage(scope="run", run=Run.objects.get(pk=root), reason="runaway",
                          actor=users["operator"])
    answer = check(api, child)
    assert (answer["decision"], answer["reason"]) == ("stop", "killed")
    assert Run.objects.get(pk=child).status == "killed"
    # The switch is named by its run, the parent's: not "this run" (found by a newcomer).
    assert f"the kill switch of run {root}, engaged by" in answer["message"]
    # And by the stop's rule, as the fan-out's kill names it (found by an attacker: empty).
    assert answer["rule"]["limit"] == {"scope": "run", "team": team.slug, "run": root}
    assert answer["rule"]["observed"] == {"engaged_by": "operator", "reason": "runaway"}
    assert check(api, child)["rule"] == answer["rule"]  # the replayed stop names it too


def test_the_fanout_of_a_switch_over_a_parent_kills_its_descendants(api, team, users):
    from unittest import mock

    from runs.killswitch.fanout import killswitch_fanout
    from runs.killswitch.services import killswitch_engage
    root = start(api)
    child = start(api, "helper", parent_run_id=root)
    grandchild = start(api, "helper", parent_run_id=child)
    sibling_tree = start(api)
    with mock.patch("runs.killswitch.services._enqueue_fanout"):
        switch = killswitch_engage(scope="run", run=Run.objects.get(pk=child),
                                   reason="runaway", actor=users["operator"])
    result = killswitch_fanout(switch_id=switch.pk)
    assert result is not None and sorted(result.killed) == sorted([child, grandchild])
    assert [Run.objects.get(pk=r).status for r in (root, child, grandchild, sibling_tree)] \
        == ["running", "killed", "killed", "running"]
    killed = Decision.objects.get(run_id=grandchild, reason="killed")
    assert f"the kill switch of run {child}, engaged by" in killed.answer["message"]
    assert killswitch_fanout(switch_id=switch.pk).killed == []


def test_a_start_under_a_parent_that_was_stopped_says_why_in_the_stops_own_words(
        api, team, users):
    """A sub-agent started under a parent a kill switch ended (once the fan-out has marked it
    killed) was refused "The parent run is killed (reason: killed)": the operator's reason,
    which every check of that parent answers, was lost, and it is the message an MCP
    gateway's session shows its model. Found by an agent author."""
    from unittest import mock

    from runs.killswitch.fanout import killswitch_fanout
    from runs.killswitch.services import killswitch_engage
    root = start(api)
    with mock.patch("runs.killswitch.services._enqueue_fanout"):
        switch = killswitch_engage(scope="run", run=Run.objects.get(pk=root),
                                   reason="runaway refunds", actor=users["operator"])
    killswitch_fanout(switch_id=switch.pk)
    killed = post(api, "/api/v1/runs", {"agent": "bot", "parent_run_id": root})
    assert killed["http"] == 409 and killed["error"]["code"] == "parent_finished"
    message = killed["error"]["message"]
    assert f"the kill switch of run {root}, engaged by operator: runaway refunds" in message

    # A parent its own limit stopped names that limit, as its later checks do.
    set_policy(team, step_limits={"max_repeat_action": 1})
    looping = start(api)
    body = {"action": {"name": "search", "args": {"q": 1}}}
    post(api, f"/api/v1/runs/{looping}/check", body)
    assert post(api, f"/api/v1/runs/{looping}/check", body)["reason"] == "loop_detected"
    refused = post(api, "/api/v1/runs", {"agent": "bot", "parent_run_id": looping})
    assert refused["http"] == 409
    assert "max_repeat_action=1" in refused["error"]["message"]


def test_an_agent_switch_covers_the_sub_agents_of_that_agent(api, team, users):
    from unittest import mock

    from runs.killswitch.fanout import killswitch_fanout
    from runs.killswitch.services import killswitch_engage
    root = start(api, "planner")
    child = start(api, "helper", parent_run_id=root)
    other = start(api, "helper")
    with mock.patch("runs.killswitch.services._enqueue_fanout"):
        switch = killswitch_engage(scope="agent", team=team, agent="planner",
                                   reason="runaway", actor=users["operator"])
    refused = post(api, "/api/v1/runs", {"agent": "helper", "parent_run_id": root})
    assert refused["http"] == 409 and refused["error"]["code"] == "kill_switch_engaged"
    killswitch_fanout(switch_id=switch.pk)
    assert [Run.objects.get(pk=r).status for r in (root, child, other)] \
        == ["killed", "killed", "running"]


def test_a_check_locks_the_root_first_then_down_to_its_run(api, team):
    """The lock order of a tree (docs/reliability.md): ancestors root first, then the run;
    a process that did not know the ancestors starts again rather than lock them late."""
    from unittest import mock

    from runs.check import check_store
    root = start(api)
    child = start(api, "helper", parent_run_id=root)
    grandchild = start(api, "helper", parent_run_id=child)
    lineages._LINEAGE.clear()  # as a process that did not start these runs
    taken: list[tuple[str, list[str]]] = []
    stores = (check_store.OrmCheck, check_store.PostgresCheck)
    originals = {(cls, name): getattr(cls, name) for cls in stores
                 for name in ("lock", "lock_ancestors")}

    def spy(cls, name):
        def wrapped(self, **kwargs):
            ids = kwargs.get("ids") or [kwargs.get("run_id")]
            if ids:
                taken.append((name, [str(i) for i in ids]))
            return originals[(cls, name)](self, **kwargs)
        return wrapped

    with mock.patch.multiple(check_store.OrmCheck, lock=spy(check_store.OrmCheck, "lock"),
                             lock_ancestors=spy(check_store.OrmCheck, "lock_ancestors")), \
            mock.patch.multiple(check_store.PostgresCheck,
                                lock=spy(check_store.PostgresCheck, "lock"),
                                lock_ancestors=spy(check_store.PostgresCheck,
                                                   "lock_ancestors")):
        assert check(api, grandchild)["decision"] == "allow"
        assert check(api, grandchild)["decision"] == "allow"
    # First attempt: the run alone (its ancestors unknown), then again root first.
    assert taken == [("lock", [grandchild]),
                     ("lock_ancestors", [root, child]), ("lock", [grandchild]),
                     ("lock_ancestors", [root, child]), ("lock", [grandchild])]
    assert check_store.ANCESTOR_LOCK_SQL.endswith("FOR UPDATE")


def test_the_fanout_locks_parents_before_their_children(api, team):
    from django.db import connection, transaction
    from django.test.utils import CaptureQueriesContext

    from runs.killswitch import fanout
    root = start(api)
    start(api, "helper", parent_run_id=root)
    with CaptureQueriesContext(connection) as seen, transaction.atomic():
        fanout._locked_batch(Run.objects.filter(status="running"))
    locking = [q["sql"] for q in seen.captured_queries if "runs_run" in q["sql"]]
    assert locking and '"depth" ASC' in locking[0].split("ORDER BY")[1]


def test_the_run_pages_show_the_tree_and_the_list_shows_a_childs_parent(api, team, users):
    from django.urls import reverse
    set_policy(team, step_limits={"max_steps": 5})
    root = start(api, "planner")
    child = start(api, "helper", parent_run_id=root)
    grandchild = start(api, "helper", parent_run_id=child)
    check(api, grandchild)
    page = Client()
    page.force_login(users["operator"])
    html = page.get(reverse("runs:run", args=[team.slug, root])).content.decode()
    assert f'data-child-run="{child}"' in html and "data-tree-counted" in html
    assert "1 / 5" in html  # the grandchild's step counted on the root
    assert "Tree usage" not in html  # the root's counters are the tree's: shown once
    assert "This run with its sub-agents (their checks count here too)" in html
    html = page.get(reverse("runs:run", args=[team.slug, grandchild])).content.decode()
    assert f'data-parent-run="{child}"' in html and "in the tree of" in html
    # Two cards of counters, each named (found by a newcomer).
    assert "Tree usage against the root's limits" in html
    assert "This run's own usage, against its policy" in html
    listed = page.get(reverse("runs:runs", args=[team.slug])).content.decode()
    assert f'data-parent-run="{root}"' in listed
    confirm = page.get(reverse("runs:killswitch-run", args=[team.slug, root])).content.decode()
    assert 'data-descendants="2"' in confirm


def test_a_backtest_replays_a_tree_stop_as_recorded(api, team, tmp_path):
    from tests.test_backtest import backtest, draft_file
    set_policy(team, step_limits={"max_steps": 5},
               budgets={"max_seconds": None, "max_usd": None, "max_tool_calls": None})
    root = start(api)
    child = start(api, "helper", parent_run_id=root)
    for run in (root, root, root, child, child):
        assert check(api, run)["decision"] == "allow"
    stopped = check(api, child)
    assert stopped["reason"] == "max_steps" and root in stopped["message"]
    post(api, f"/api/v1/runs/{root}/finish", {"status": "completed"})
    # The child's own policy under a draft of 50 steps would not stop it: its tree did, and
    # the tree is replayed as recorded.
    roomy = backtest(team, "--file", draft_file(tmp_path, team, step_limits={"max_steps": 50}))
    assert (roomy["runs"], roomy["changed"]) == (2, 0)
    # A draft that stops the child earlier by its own limit is the draft's change.
    tight = backtest(team, "--file", draft_file(tmp_path, team, step_limits={"max_steps": 1}))
    changes = {c["run_id"]: c["draft"] for c in tight["changes"]}
    assert changes[child] == {"status": "stopped", "stop_reason": "max_steps", "step": 2}


def test_a_backtest_replays_a_stop_by_the_trees_end_at_a_finish_as_recorded(
        api, team, tmp_path):
    # The record of a finish that found the tree over has no action: it ends the replayed
    # run at its step, as a kill's record does, and is no check for the draft to decide.
    from tests.test_backtest import backtest, draft_file
    set_policy(team, step_limits={"max_steps": 5},
               budgets={"max_seconds": None, "max_usd": None, "max_tool_calls": None})
    root = start(api)
    child = start(api, "helper", parent_run_id=root)
    for run in (root, child, child):
        assert check(api, run)["decision"] == "allow"
    post(api, f"/api/v1/runs/{root}/finish", {"status": "completed"})
    assert post(api, f"/api/v1/runs/{child}/finish", {"status": "completed"})[
        "stop_reason"] == "parent_stopped"
    same = backtest(team, "--file", draft_file(tmp_path, team, step_limits={"max_steps": 5}))
    assert (same["runs"], same["changed"]) == (2, 0), same
    # A draft of 1 step stops the child at its 2nd: the finish's record is no check.
    tight = backtest(team, "--file", draft_file(tmp_path, team, step_limits={"max_steps": 1}))
    changes = {c["run_id"]: c["draft"] for c in tight["changes"]}
    assert changes[child] == {"status": "stopped", "stop_reason": "max_steps", "step": 2}


def test_a_childs_uploaded_local_decisions_count_on_its_ancestors(api, team):
    root = start(api)
    child = start(api, "helper", parent_run_id=root)
    body = post(api, f"/api/v1/runs/{child}/local-decisions", {"decisions": [
        {"check_id": f"local-{i}", "action": {"name": "search", "args": {"i": i},
                                              "type": "tool"},
         "cost_usd": 0.1, "decision": "allow", "reason": "step_ok"} for i in range(3)]})
    assert body["http"] == 200 and body["recorded"] == 3
    row = Run.objects.get(pk=root)
    assert (row.steps, row.tool_calls, float(row.cost_usd)) == (3, 3, pytest.approx(0.3))


def test_an_approved_childs_tool_call_counts_on_every_ancestor(api, team):
    from runs.approvals.services import approval_decide

    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 600},
               budgets={"max_tool_calls": 2})
    root = start(api)
    child = start(api, "helper", parent_run_id=root)
    grandchild = start(api, "helper", parent_run_id=child)
    lineages._LINEAGE.clear()  # the decision's process knows nothing of the tree: it reads it
    asked = post(api, f"/api/v1/runs/{grandchild}/check",
                 {"action": {"name": "payments.refund", "args": {}, "type": "tool"},
                  "check_id": "refund-1"})
    assert asked["decision"] == "pending", asked
    # Asking counted the step on every run of the tree; the tool call waits for the answer.
    assert [Run.objects.get(pk=r).tool_calls for r in (root, child, grandchild)] == [0, 0, 0]
    approval_decide(team=team, approval_id=asked["approval"]["id"], decision="approve",
                    note="")
    runs = [Run.objects.get(pk=r) for r in (root, child, grandchild)]
    assert [(r.steps, r.tool_calls) for r in runs] == [(1, 1), (1, 1), (1, 1)]
    # Counted where the tree's limits look: one more tool call of the tree is its second,
    # the next its third, past the root's max_tool_calls.
    allowed = post(api, f"/api/v1/runs/{child}/check",
                   {"action": {"name": "lookup", "args": {"n": "y"}, "type": "tool"},
                    "check_id": "lookup-1"})
    assert allowed["decision"] == "allow", allowed
    stopped = post(api, f"/api/v1/runs/{grandchild}/check",
                   {"action": {"name": "lookup", "args": {"n": "x"}, "type": "tool"},
                    "check_id": "lookup-2"})
    assert (stopped["decision"], stopped["reason"]) == ("stop", "max_tool_calls"), stopped
    assert stopped["rule"]["scope"] == root


def test_an_approval_is_no_allow_once_the_tree_cannot_take_it(api, team):
    """Found by an attacker: a child's request approved after its parent finished answered
    allow; one approved after its siblings used the parent's tool calls put the tree past
    max_tool_calls. Either way the request is now cancelled, the child stopped with the
    ancestor's reason, and the decision refused saying so."""
    from governance.errors import AppError
    from runs.approvals.services import approval_decide

    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 600},
               budgets={"max_tool_calls": 2})

    def ask(run_id: str, check_id: str) -> dict:
        asked = post(api, f"/api/v1/runs/{run_id}/check",
                     {"action": {"name": "payments.refund", "args": {}, "type": "tool"},
                      "check_id": check_id})
        assert asked["decision"] == "pending", asked
        return asked

    # Siblings used the parent's tool calls while the request waited.
    root = start(api)
    waiting, sibling = (start(api, "helper", parent_run_id=root) for _ in range(2))
    asked = ask(waiting, "refund-1")
    assert [check(api, sibling)["decision"] for _ in range(3)] == ["allow", "allow", "stop"]
    with pytest.raises(AppError) as refused:
        approval_decide(team=team, approval_id=asked["approval"]["id"], decision="approve",
                        note="")
    assert refused.value.status == 409 and "max_tool_calls=2" in refused.value.message
    assert Run.objects.get(pk=root).tool_calls == 2
    replay = post(api, f"/api/v1/runs/{waiting}/check",
                  {"action": {"name": "payments.refund", "args": {}, "type": "tool"},
                   "check_id": "refund-1"})
    assert (replay["decision"], replay["reason"]) == ("stop", "max_tool_calls"), replay
    assert replay["rule"]["scope"] == root and replay["approval"]["status"] == "cancelled"
    assert Run.objects.get(pk=waiting).status == "stopped"

    # A kill switch over the parent was engaged while the request waited, its fan-out not
    # run yet (found by an attacker: the approval answered allow until the fan-out came).
    from unittest import mock

    from runs.killswitch.services import killswitch_engage
    root = start(api)
    child = start(api, "helper", parent_run_id=root)
    asked = ask(child, "refund-3")
    with mock.patch("runs.killswitch.services._enqueue_fanout"):
        killswitch_engage(scope="run", run=Run.objects.get(pk=root), reason="runaway")
    with pytest.raises(AppError) as refused:
        approval_decide(team=team, approval_id=asked["approval"]["id"], decision="approve",
                        note="")
    assert refused.value.status == 409 and refused.value.code == "kill_switch_engaged"
    assert f"the kill switch of run {root}" in refused.value.message
    assert Run.objects.get(pk=child).status == "killed"
    replay = post(api, f"/api/v1/runs/{child}/check",
                  {"action": {"name": "payments.refund", "args": {}, "type": "tool"},
                   "check_id": "refund-3"})
    assert (replay["decision"], replay["reason"]) == ("stop", "killed"), replay
    assert replay["rule"]["limit"] == {"scope": "run", "team": team.slug, "run": root}

    # The parent finished while its child's request waited.
    root = start(api)
    child = start(api, "helper", parent_run_id=root)
    asked = ask(child, "refund-2")
    assert post(api, f"/api/v1/runs/{root}/finish", {"status": "completed"})["http"] == 200
    with pytest.raises(AppError) as refused:
        approval_decide(team=team, approval_id=asked["approval"]["id"], decision="approve",
                        note="")
    assert refused.value.status == 409 and root in refused.value.message
    child_run = Run.objects.get(pk=child)
    assert (child_run.status, child_run.stop_reason) == ("stopped", "parent_stopped")
    assert child_run.awaited_approval is None


def test_a_childs_request_is_cancelled_once_its_parent_is_over(api, team):
    """Found by an attacker: after the parent's finish a child's request stayed pending, the
    retried check answered pending again, and the agent waited for the expiry to learn that
    its tree was over. The next look (the check again, or the request's poll) cancels it
    and stops the child with parent_stopped (SPEC 20)."""
    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 600})
    body = {"action": {"name": "payments.refund", "args": {}, "type": "tool"},
            "check_id": "refund-1"}
    from runs.approvals.services import settle_due_for_team
    from runs.models import Approval

    root = start(api)
    retried, polled, listed = (start(api, "helper", parent_run_id=root) for _ in range(3))
    asked = [post(api, f"/api/v1/runs/{run}/check", body) for run in (retried, polled, listed)]
    assert [a["decision"] for a in asked] == ["pending"] * 3, asked
    finished = post(api, f"/api/v1/runs/{root}/finish", {"status": "completed"})
    assert finished["http"] == 200, finished

    again = post(api, f"/api/v1/runs/{retried}/check", body)
    assert (again["decision"], again["reason"]) == ("stop", "parent_stopped"), again
    assert again["approval"]["status"] == "cancelled" and again["rule"]["scope"] == root
    poll = api.get(f"/api/v1/approvals/{asked[1]['approval']['id']}?wait=0").json()
    assert poll["status"] == "cancelled", poll
    assert (poll["decision"]["decision"], poll["decision"]["reason"]) == (
        "stop", "parent_stopped"), poll
    for run_id in (retried, polled):
        run = Run.objects.get(pk=run_id)
        assert (run.status, run.stop_reason) == ("stopped", "parent_stopped")
        assert run.awaited_approval is None
    # A look at the team's requests (its approvals list, the beat's sweep) settles them too.
    assert Approval.objects.get(pk=asked[2]["approval"]["id"]).status == "pending"
    assert settle_due_for_team(team) == 1
    assert Approval.objects.get(pk=asked[2]["approval"]["id"]).status == "cancelled"
    assert Run.objects.get(pk=listed).stop_reason == "parent_stopped"


def test_a_teams_look_finds_an_ended_trees_request_behind_many_waiting_ones(api, team):
    """A look settles a bounded share: the requests whose parent ended are chosen by the
    database, not among the ones expiring first (found by a reviewer: behind 20 requests of
    live trees, an ended tree's was never looked at)."""
    from runs.approvals.services import settle_due_for_team
    from runs.models import Approval

    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 600})
    body = {"action": {"name": "payments.refund", "args": {}, "type": "tool"},
            "check_id": "refund"}
    live = start(api)
    for _ in range(5):
        asked = post(api, f"/api/v1/runs/{start(api, 'helper', parent_run_id=live)}/check",
                     body)
        assert asked["decision"] == "pending", asked
    ended = start(api)
    late = post(api, f"/api/v1/runs/{start(api, 'helper', parent_run_id=ended)}/check", body)
    assert post(api, f"/api/v1/runs/{ended}/finish", {"status": "completed"})["http"] == 200
    assert settle_due_for_team(team, limit=2) == 1
    assert Approval.objects.get(pk=late["approval"]["id"]).status == "cancelled"
    assert Approval.objects.filter(status="pending").count() == 5


def test_an_ancestors_limit_names_the_ancestors_policy_and_version(api, team):
    from policies.document import parse_policy
    from policies.services import policy_save

    set_policy(team, step_limits={"max_steps": 2})
    parent_version = team.policies.get(name="default").current.version
    document = {**team.policies.get(name="default").current.document, "name": "helpers"}
    document["step_limits"] = {**document["step_limits"], "max_steps": 50}
    document.pop("warnings", None)
    policy_save(team=team, document=parse_policy(document), actor=None, source="test")
    root = start(api)
    child = start(api, "helper", parent_run_id=root, policy="helpers")
    assert [check(api, child)["decision"] for _ in range(2)] == ["allow", "allow"]
    stopped = check(api, child)
    assert (stopped["reason"], stopped["rule"]["scope"]) == ("max_steps", root)
    assert (stopped["rule"]["policy"], stopped["rule"]["version"]) == ("default", parent_version)
    assert api.get(f"/api/v1/decisions/{stopped['decision_id']}").json()["rule"] == \
        stopped["rule"]


def _second_policy(team, name: str, **document_changes: object) -> None:
    from policies.document import parse_policy
    from policies.services import policy_save

    document = {**team.policies.get(name="default").current.document, "name": name}
    for key, value in document_changes.items():
        document[key] = {**document[key], **value} if isinstance(value, dict) else value
    document.pop("warnings", None)
    policy_save(team=team, document=parse_policy(document), actor=None, source="test")


def test_an_ancestors_limit_is_enforced_as_its_own_policy_says_not_the_childs(api, team):
    """Found by an attacker: a child started on a shadow policy under an enforcing parent
    was only told 'would stop' at the parent's limits, and the tree ran past them."""
    set_policy(team, step_limits={"max_steps": 3})
    _second_policy(team, "observe", mode="shadow", step_limits={"max_steps": 1000})
    root = start(api)
    child = start(api, "helper", parent_run_id=root, policy="observe")
    assert [check(api, child)["decision"] for _ in range(3)] == ["allow"] * 3
    stopped = check(api, child)
    assert (stopped["decision"], stopped["reason"]) == ("stop", "max_steps")
    assert stopped["rule"]["scope"] == root
    assert Run.objects.get(pk=child).status == "stopped"
    other = start(api, "helper", parent_run_id=root, policy="observe")
    assert check(api, other)["decision"] == "stop"  # the tree is full: the parent's limit

    # And the other way round: a shadow parent's limit is a would-stop for an enforcing child.
    set_policy(team, mode="shadow", step_limits={"max_steps": 2})
    _second_policy(team, "strict", mode="enforce", step_limits={"max_steps": 1000})
    observed = start(api)
    strict = start(api, "helper", parent_run_id=observed, policy="strict")
    answers = [check(api, strict) for _ in range(4)]
    assert [a["decision"] for a in answers] == ["allow"] * 4  # a would-stop runs
    assert [(a.get("shadow") or {}).get("reason") for a in answers] == [
        None, None, "max_steps", "max_steps"]
    assert answers[2]["rule"]["scope"] == observed
    assert Run.objects.get(pk=strict).status == "running"


def test_a_shadow_childs_own_would_stop_does_not_hide_its_enforcing_parents_limits(api, team):
    """Found by a tester: once a shadow child passed its own max_steps, its checks were
    would-stops of its own and the parent's limits were never read: the tree ran past the
    parent's max_steps, max_usd and max_tool_calls."""
    set_policy(team, step_limits={"max_steps": 6}, budgets={"max_usd": 1.0})
    _second_policy(team, "observe", mode="shadow", step_limits={"max_steps": 2})
    root = start(api)
    child = start(api, "helper", parent_run_id=root, policy="observe")
    answers = [check(api, child) for _ in range(7)]
    assert [a["decision"] for a in answers] == ["allow"] * 6 + ["stop"]
    assert [(a.get("shadow") or {}).get("reason") for a in answers[:6]] == [
        None, None, "max_steps", "max_steps", "max_steps", "max_steps"]
    assert (answers[6]["reason"], answers[6]["rule"]["scope"]) == ("max_steps", root)
    assert Run.objects.get(pk=root).steps == 7
    # The cost too: the child's own would-stops come first, the parent's budget stops it.
    spender = start(api, "helper", parent_run_id=start(api), policy="observe")
    costs = [check(api, spender, cost_usd=0.3) for _ in range(4)]
    assert [a["decision"] for a in costs] == ["allow"] * 3 + ["stop"]
    assert costs[3]["reason"] == "max_usd" and costs[3]["rule"]["scope"] != "run"


def test_a_shadow_parents_would_stop_leaves_an_enforcing_childs_own_rules_enforced(api, team):
    """Found by an attacker: once a shadow parent passed its max_steps, an enforcing child's
    every check was that would-stop, and the child's own rules were never read: a denied
    tool, a loop, its budget, its rate limit and its approvals all answered allow (SPEC 20:
    those rules stay per run)."""
    set_policy(team, mode="shadow", step_limits={"max_steps": 2})
    _second_policy(team, "strict", mode="enforce",
                   step_limits={"max_steps": 1000, "max_repeat_action": 2},
                   tools={"allow": ["*"], "deny": ["shell.*"]},
                   rate_limits=[{"match": "fetch", "per": "run", "max": 1, "window_s": 5}],
                   approvals={"tools": ["payments.*"], "timeout_s": 60},
                   budgets={"max_usd": 1.0})
    children = {}

    def child() -> str:
        parent = start(api)
        run_id = start(api, "helper", parent_run_id=parent, policy="strict")
        answers = [check(api, run_id) for _ in range(3)]
        # Past the parent's max_steps: would-stops from here on.
        assert answers[2]["shadow"]["reason"] == "max_steps", answers
        children[run_id] = parent
        return run_id

    denied = check(api, child(), "shell.exec")
    assert (denied["decision"], denied["reason"]) == ("stop", "tool_denied"), denied
    looping = child()
    same = {"action": {"name": "search", "args": {"q": "same"}}}
    answers = [post(api, f"/api/v1/runs/{looping}/check", same) for _ in range(3)]
    assert [a["decision"] for a in answers] == ["allow", "allow", "stop"], answers
    assert answers[2]["reason"] == "loop_detected" and answers[2]["rule"]["scope"] == "run"
    spending = child()
    costs = [check(api, spending, cost_usd=0.4) for _ in range(3)]
    assert [a["decision"] for a in costs] == ["allow", "allow", "stop"], costs
    assert costs[2]["reason"] == "max_usd"
    limited = child()
    assert check(api, limited, "fetch")["decision"] == "allow"
    waited = check(api, limited, "fetch")
    assert (waited["decision"], waited["reason"]) == ("wait", "rate_limited"), waited
    pending = check(api, child(), "payments.refund", check_id="refund-1")
    assert (pending["decision"], pending["reason"]) == ("pending", "approval_required"), pending
    # The allows still report the parent's would-stop, and no parent was stopped.
    assert costs[1]["shadow"]["reason"] == "max_steps"
    assert not Run.objects.filter(pk__in=children.values()).exclude(status="running").exists()


def test_a_childs_local_allows_under_a_shadow_parent_break_nothing_of_the_parents(api, team):
    """A shadow parent's passed limit is no violation of an uploaded local allow (SPEC 10:
    a shadow policy enforces nothing, so breaks nothing)."""
    set_policy(team, mode="shadow", step_limits={"max_steps": 2})
    _second_policy(team, "big", mode="enforce", step_limits={"max_steps": 1000})
    child = start(api, "helper", parent_run_id=start(api), policy="big")
    body = post(api, f"/api/v1/runs/{child}/local-decisions", {"decisions": [
        {"check_id": f"local-{i}", "action": {"name": "search", "args": {"i": i}},
         "decision": "allow", "reason": "step_ok"} for i in range(4)]})
    assert body["http"] == 200 and body["recorded"] == 4
    flagged = [d.answer["policy_violation"] for d in Decision.objects.filter(run_id=child)]
    assert flagged == [False] * 4


def test_a_shadow_childs_local_allow_past_its_enforcing_parents_limit_is_flagged(api, team):
    """Found by an attacker: the service's check stops a shadow child at its enforcing
    parent's max_steps, but the same action uploaded as a local allow was not flagged."""
    set_policy(team, step_limits={"max_steps": 3})
    _second_policy(team, "observe", mode="shadow", step_limits={"max_steps": 1000})
    root = start(api)
    for _ in range(3):
        assert check(api, root)["decision"] == "allow"
    child = start(api, "helper", parent_run_id=root, policy="observe")
    body = post(api, f"/api/v1/runs/{child}/local-decisions", {"decisions": [
        {"check_id": "local-1", "action": {"name": "search", "args": {}},
         "decision": "allow", "reason": "step_ok"}]})
    assert body["http"] == 200 and body["recorded"] == 1
    answer = Decision.objects.get(run_id=child).answer
    assert answer["policy_violation"] and answer["violation"].startswith("max_steps: "), answer


def test_a_childs_uploaded_budget_warning_is_its_own_budgets(api, team):
    """A fail-open client decides without the tree, so the budget warning it uploads is of
    the run's own budgets (found by an attacker: the parent's budget, nearer its limit, was
    taken as warned; the child's own warning was sent again, the parent's never)."""
    set_policy(team, step_limits={"max_steps": 14})
    _second_policy(team, "cw", step_limits={"max_steps": 10})
    root = start(api)
    for _ in range(4):
        check(api, root)
    child = start(api, "helper", parent_run_id=root, policy="cw")
    warned = {"type": "inject_message", "role": "user", "code": "budget",
              "content": "This run is at step 9 of max_steps=10."}
    body = post(api, f"/api/v1/runs/{child}/local-decisions", {"decisions": [
        {"check_id": f"local-{i}", "action": {"name": "search", "args": {"i": i}},
         "decision": "allow", "reason": "step_ok", **({"directive": warned} if i == 8 else {})}
        for i in range(9)]})
    assert body["http"] == 200 and body["recorded"] == 9
    last = Decision.objects.filter(run_id=child).order_by("-step").first()
    assert (last.answer["rule"]["limit"]["max_steps"], last.answer["rule"]["scope"]) == (
        10, "run"), last.answer["rule"]
    # The next check: the parent's budget (tree step 14 of 14) is warned of, not the child's.
    answer = check(api, child)
    assert answer["directive"]["code"] == "budget", answer
    assert answer["rule"]["scope"] == root, answer["rule"]


class _Clock:
    """The server's clock (`timezone.now`) held still, moved on by the test."""

    def __init__(self, monkeypatch) -> None:
        from django.utils import timezone

        self.now = timezone.now()
        monkeypatch.setattr("django.utils.timezone.now", lambda: self.now)

    def advance(self, seconds: float) -> None:
        from datetime import timedelta

        self.now += timedelta(seconds=seconds)


def _idle_root_with_patient_child(api, team, monkeypatch) -> tuple[str, str, _Clock]:
    """A root abandoned after 60 s idle, and its child on a policy of an hour's, started on
    a clock held still."""
    set_policy(team, budgets={"max_idle_seconds": 60, "max_seconds": 3600})
    _second_policy(team, "patient", budgets={"max_idle_seconds": 3600, "max_seconds": 3600})
    clock = _Clock(monkeypatch)
    root = start(api)
    return root, start(api, "helper", parent_run_id=root, policy="patient"), clock


def test_an_idle_child_finished_after_its_tree_ended_is_found_abandoned(
        api, team, monkeypatch):
    """Found by a review: the finish asked whether the tree was over before whether the run
    was past its idle deadline, and ended an idle child `parent_stopped` at the finish's time,
    where SPEC 14 and 21 put the deadline first: abandoned, ended at its deadline."""
    set_policy(team, budgets={"max_idle_seconds": 60, "max_seconds": 3600})
    _second_policy(team, "patient", budgets={"max_idle_seconds": 3600, "max_seconds": 3600})
    clock = _Clock(monkeypatch)
    root = start(api, policy="patient")
    child = start(api, "helper", parent_run_id=root, policy="default")  # 60 s idle
    deadline = Run.objects.get(pk=child).idle_deadline
    clock.advance(30)
    assert post(api, f"/api/v1/runs/{root}/finish", {"status": "completed"})["http"] == 200
    clock.advance(60)
    done = post(api, f"/api/v1/runs/{child}/finish", {"status": "completed"})
    assert (done["status"], done["stop_reason"]) == ("stopped", "abandoned"), done
    assert Run.objects.get(pk=child).ended_at == deadline
    assert list(Decision.objects.filter(run_id=child).values_list("reason", flat=True)) == [
        "abandoned"]


def test_no_sub_agent_starts_under_a_run_whose_ancestor_went_idle(api, team, monkeypatch):
    """Found by an attacker: the root past its idle deadline (ended by no look yet), its
    child still running on a patient policy: a grandchild started, then stopped at its
    first check with parent_stopped."""
    _, child, clock = _idle_root_with_patient_child(api, team, monkeypatch)
    clock.advance(61)
    refused = post(api, "/api/v1/runs", {"agent": "bot", "parent_run_id": child})
    assert (refused["http"], refused["error"]["code"]) == (409, "parent_finished"), refused
    assert "(reason: abandoned)" in refused["error"]["message"]


def test_a_child_waiting_for_an_operator_keeps_its_parent_from_idling(api, team, monkeypatch):
    """SPEC 14: time waiting for an approval is not idle, a descendant's wait included.
    Found by an attacker: a parent idle for 60 s was abandoned while its child waited for a
    600 s approval, which cancelled the request. Its idle time starts at the wait's end at
    the latest (the request's expiry)."""
    set_policy(team, budgets={"max_idle_seconds": 60, "max_seconds": 36000})
    _second_policy(team, "asks", budgets={"max_idle_seconds": 3600, "max_seconds": 36000},
                   approvals={"tools": ["payments.*"], "timeout_s": 600})
    clock = _Clock(monkeypatch)
    root = start(api)
    child = start(api, "helper", parent_run_id=root, policy="asks")
    asked = check(api, child, "payments.refund", check_id="refund-1")
    assert asked["decision"] == "pending", asked
    clock.advance(61)
    assert api.get(f"/api/v1/runs/{root}").json()["status"] == "running"
    poll = api.get(f"/api/v1/approvals/{asked['approval']['id']}").json()
    assert poll["status"] == "pending", poll
    clock.advance(600)  # the request expired, and the parent's 60 s passed since
    parent = api.get(f"/api/v1/runs/{root}").json()
    assert (parent["status"], parent["stop_reason"]) == ("stopped", "abandoned"), parent

    # Decided before its expiry, the wait no longer holds the parent: its 60 s count from
    # the decision, not from the request's expiry.
    from runs.approvals.services import approval_decide

    root = start(api)
    child = start(api, "helper", parent_run_id=root, policy="asks")
    asked = check(api, child, "payments.refund", check_id="refund-2")
    clock.advance(10)
    approval_decide(team=team, approval_id=asked["approval"]["id"], decision="approve",
                    note="")
    clock.advance(61)
    parent = api.get(f"/api/v1/runs/{root}").json()
    assert (parent["status"], parent["stop_reason"]) == ("stopped", "abandoned"), parent


def test_a_childs_check_is_no_activity_for_an_abandoned_parent(api, team, monkeypatch):
    """Found by a tester: a child's check found its parent abandoned (past its idle
    deadline, not yet ended by any look) and stopped, but it counted on the parent and
    moved its idle deadline, and the parent's next check was allowed."""
    root, child, clock = _idle_root_with_patient_child(api, team, monkeypatch)
    assert check(api, child)["decision"] == "allow"
    deadline = Run.objects.get(pk=root).idle_deadline
    clock.advance(61)
    stopped = check(api, child)
    assert (stopped["decision"], stopped["reason"]) == ("stop", "parent_stopped")
    assert stopped["rule"]["observed"]["reason"] == "abandoned"
    assert Run.objects.get(pk=root).idle_deadline == deadline
    late = check(api, root)
    assert (late["decision"], late["reason"]) == ("stop", "abandoned")
    parent = Run.objects.get(pk=root)
    assert (parent.status, parent.stop_reason, parent.ended_at) == (
        "stopped", "abandoned", deadline)


def test_a_child_is_warned_before_its_ancestors_budget_stops_it(api, team):
    # SPEC 16 with 20: the step that stops a child may be its parent's; the child's model is
    # warned of that budget as of its own, once, the rule naming the ancestor (scope) and its
    # policy. Before, a parent at 10 of 18 steps stopped its child at the child's step 8
    # without a word.
    set_policy(team, step_limits={"max_steps": 10}, warnings={"budget_fraction": 0.8})
    version = team.policies.get(name="default").current.version
    root = start(api)
    for _ in range(5):
        check(api, root)
    child = start(api, "helper", parent_run_id=root)  # its own budget: 10 steps too
    answers = [check(api, child) for _ in range(5)]
    # The root counts the child's checks: 6, 7, 8, 9 (warned: past 0.8 of 10), 10, then
    # stopped.
    assert [a["directive"] and a["directive"]["code"] for a in answers] == \
        [None, None, None, "budget", None]
    warned = answers[3]
    assert warned["decision"] == "allow"
    assert warned["rule"] == {"name": "budget", "policy": "default", "version": version,
                              "limit": {"max_steps": 10, "warnings.budget_fraction": 0.8},
                              "observed": {"steps": 9}, "scope": root}
    assert f"Ancestor run {root}'s tree is at step 9 of max_steps=10" in \
        warned["directive"]["content"]
    assert api.get(f"/api/v1/decisions/{warned['decision_id']}").json()["rule"] == \
        warned["rule"]
    stopped = check(api, child)
    assert (stopped["decision"], stopped["reason"], stopped["rule"]["scope"]) == \
        ("stop", "max_steps", root)


def test_a_childs_check_waits_for_its_roots_turn_once_the_process_knows_the_tree(api, team):
    """Found by an attacker: every check of a tree locks its root first, and the checks of
    one tree's children each waited for that lock on a thread of the API pool. The ASGI
    application gives a check its tree's root's turn (governance/asgi.py `RunTurns`) once
    this process knows the tree (it started the run, or checked it once)."""
    root = start(api)
    child = start(api, "helper", parent_run_id=root)
    grandchild = start(api, "helper", parent_run_id=child)
    assert lineages.turn_run(grandchild) == lineages.turn_run(child) == root
    assert lineages.turn_run(root) == root
    assert lineages.turn_run(root.upper()) == root  # one run however its id is spelled
    assert lineages.turn_run("not-a-run") == "not-a-run"
    lineages._LINEAGE.clear()  # a process that did not start them: each its own turn, ...
    assert lineages.turn_run(grandchild) == grandchild
    check(api, grandchild)  # ... until it has checked the run once
    assert lineages.turn_run(grandchild) == root


@pytest.mark.parametrize("end", ["finish", "stop"])
def test_a_retried_check_of_a_descendant_answers_the_parents_stop_not_its_first_allow(
        api, team, end):
    """SPEC 4.5 and 20: once an ancestor is over, a descendant's next check answers
    `parent_stopped`, retries included. Found by an attacker: a check_id sent again after the
    parent's finish answered its first allow, as often as it was sent, and the child went
    on running (a kill switch over the parent already stopped the retry)."""
    set_policy(team, step_limits={"max_repeat_action": 1})
    parent = start(api)
    child = start(api, "helper", parent_run_id=parent)
    grandchild = start(api, "helper", parent_run_id=child)
    sent = {"action": {"name": "pay.send", "args": {"amount": 100}}, "check_id": "X"}
    firsts = {run: post(api, f"/api/v1/runs/{run}/check", sent) for run in (child, grandchild)}
    assert {first["decision"] for first in firsts.values()} == {"allow"}
    if end == "finish":
        assert post(api, f"/api/v1/runs/{parent}/finish", {"status": "completed"})["http"] == 200
    else:  # the parent's own limit: the same action again is a loop
        assert post(api, f"/api/v1/runs/{parent}/check", sent)["decision"] == "allow"
        again = {**sent, "check_id": "Y"}
        assert post(api, f"/api/v1/runs/{parent}/check", again)["reason"] == "loop_detected"
    steps = {run: Run.objects.get(pk=run).steps for run in (parent, child, grandchild)}
    for run in (child, grandchild):
        retried = post(api, f"/api/v1/runs/{run}/check", sent)
        assert (retried["decision"], retried["reason"]) == ("stop", "parent_stopped"), retried
        # A check_id seen already counts nothing again (SPEC 5.2), here or on the ancestors.
        assert retried["step"] == steps[run]
        assert {r: Run.objects.get(pk=r).steps for r in steps} == steps
        assert retried["decision_id"] != firsts[run]["decision_id"]  # decided, and audited
        assert Decision.objects.filter(run_id=run, pk=retried["decision_id"],
                                       outcome="stop").exists()
        assert Run.objects.get(pk=run).status == "stopped"
        # Sent again, on a run that is now over: its stop (SPEC 4.5).
        assert post(api, f"/api/v1/runs/{run}/check", sent)["decision"] == "stop"


def test_a_pending_check_of_a_child_sent_again_after_its_parents_finish_is_its_stop(
        api, team):
    """The check sent again settles its request (cancelled, the child stopped
    `parent_stopped`) and answers that final answer: not the pending answer again, nor the
    409 approval_pending ("resend that check") deciding it afresh would give. An operator's
    decision after that is refused: the request is no longer pending."""
    from governance.errors import AppError
    from runs.approvals.services import approval_decide

    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 600})
    parent = start(api)
    child = start(api, "helper", parent_run_id=parent)
    sent = {"action": {"name": "payments.refund", "args": {}, "type": "tool"}, "check_id": "r"}
    asked = post(api, f"/api/v1/runs/{child}/check", sent)
    assert asked["decision"] == "pending", asked
    assert post(api, f"/api/v1/runs/{parent}/finish", {"status": "completed"})["http"] == 200
    again = post(api, f"/api/v1/runs/{child}/check", sent)
    assert (again["http"], again["decision"], again["reason"]) == (
        200, "stop", "parent_stopped"), again
    with pytest.raises(AppError) as refused:
        approval_decide(team=team, approval_id=asked["approval"]["id"], decision="approve",
                        note="")
    assert refused.value.status == 409
    final = post(api, f"/api/v1/runs/{child}/check", sent)
    assert final["decision_id"] == again["decision_id"], final


def test_a_childs_banner_says_its_ancestor_ended_not_that_a_limit_stopped_it(api, team, users):
    """Found by a newcomer: "The rule parent_stopped of policy default v1 (the limit of
    ancestor run X, counted over its tree) stopped this run: its ancestor run X is completed
    (completed)." No limit fired: the ancestor ended (docs/subagents.md)."""
    from django.urls import reverse
    root = start(api)
    child = start(api, "helper", parent_run_id=root)
    check(api, child)
    post(api, f"/api/v1/runs/{root}/finish", {"status": "completed"})
    assert check(api, child)["reason"] == "parent_stopped"
    page = Client()
    page.force_login(users["viewer"])
    html = page.get(reverse("runs:run", args=[team.slug, child])).content.decode()
    assert f"Stopped because its ancestor run {root} had ended (completed)." in html
    assert f"parent_stopped: its ancestor run {root} had ended (completed)" in html
    assert "counted over its tree" not in html and f"the limit of run {root}" not in html
