"""SPEC 16 through the API: `rule` on every answer and every audit record (allows, warnings,
stops, waits, pendings, kills, abandons, deadline expiries, replays as first answered, a
check of an ended run), and GET /api/v1/decisions/{id} with the agent-key scoping of SPEC 10:
another team's or another agent's decision answers 404."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from policies.services import agent_key_create
from runs.approvals.services import approval_decide
from runs.killswitch.services import killswitch_engage, killswitch_release
from runs.models import Decision, Run
from tests.conftest import set_policy

pytestmark = [pytest.mark.django_db, pytest.mark.both_stores]


def start(api: Client, agent: str = "bot") -> str:
    response = api.post("/api/v1/runs", {"agent": agent}, content_type="application/json")
    assert response.status_code == 201, response.content
    return response.json()["run_id"]


def check(api: Client, rid: str, name: str = "search.docs", args: Any = None, **body: Any
          ) -> dict[str, Any]:
    response = api.post(f"/api/v1/runs/{rid}/check",
                        {"action": {"name": name, "args": args}, **body},
                        content_type="application/json")
    assert response.status_code == 200, response.content
    return response.json()


def record(answer: dict[str, Any]) -> Decision:
    return Decision.objects.get(pk=answer["decision_id"])


def assert_rule(answer: dict[str, Any], name: str, *, version: int | None = None,
                **parts: Any) -> None:
    """The answer's rule and its audit record's column agree."""
    rule = answer["rule"]
    assert rule is not None and rule["name"] == name, answer
    assert (rule["policy"], rule["scope"]) == ("default", "run")
    assert isinstance(rule["version"], int) and rule["version"] == (version or rule["version"])
    for part, value in parts.items():
        assert rule[part] == value, (part, rule)
    assert record(answer).rule == rule


def test_a_plain_allow_has_no_rule_and_a_warning_names_its_own(api: Client, team: Any) -> None:
    set_policy(team, step_limits={"max_steps": 18, "max_repeat_action": 3,
                                  "no_progress_window": 4})
    rid = start(api)
    first = check(api, rid, args={"q": 1})
    assert first["rule"] is None and record(first).rule is None
    second = check(api, rid, args={"q": 1})
    assert second["decision"] == "allow"
    assert second["directive"]["code"] == "repeat_action"
    assert "called 2 times" in second["directive"]["content"]
    assert_rule(second, "repeat_action",
                limit={"max_repeat_action": 3, "warnings.repeat_action": 2},
                observed={"repeat_count": 2})
    check(api, rid, args={"q": 1})
    stop = check(api, rid, args={"q": 1})
    assert_rule(stop, "loop_detected", limit={"max_repeat_action": 3},
                observed={"repeat_count": 3})
    # A check of the ended run answers its stop, with the stop's own rule: the limit and
    # the value that ended it, not only that the run is over.
    after = check(api, rid, name="other")
    assert_rule(after, "loop_detected", limit={"max_repeat_action": 3},
                observed={"repeat_count": 3})


def test_the_stops_of_rules_2_to_9_name_their_limit(api: Client, team: Any) -> None:
    set_policy(team, step_limits={"max_steps": 1, "max_repeat_action": 3,
                                  "no_progress_window": 4}, warnings=None)
    rid = start(api)
    check(api, rid)
    assert_rule(check(api, rid, name="x"), "max_steps", version=2,
                limit={"max_steps": 1}, observed={"steps": 2})
    set_policy(team, tools={"deny": ["shell.*"]})
    assert_rule(check(api, start(api), name="shell.exec"), "tool_denied", version=3,
                limit={"deny": "shell.*"}, observed={"action": "shell.exec"})
    set_policy(team, budgets={"max_usd": 0.5})
    assert_rule(check(api, start(api), cost_usd=0.6), "max_usd", version=4,
                limit={"max_usd": 0.5}, observed={"cost_usd": 0.6})


def test_a_wait_and_a_pending_name_their_rule(api: Client, team: Any) -> None:
    set_policy(team, rate_limits=[{"match": "http.*", "per": "run", "max": 1,
                                   "window_s": 60}],
               approvals={"tools": ["pay.*"], "timeout_s": 600}, budgets={"max_seconds": None})
    rid = start(api)
    check(api, rid, name="http.get")
    wait = check(api, rid, name="http.get", args={"n": 2})
    assert wait["decision"] == "wait"
    assert_rule(wait, "rate_limited", limit={"index": 0, "match": "http.*", "per": "run",
                                             "max": 1, "window_s": 60})
    pending = check(api, rid, name="pay.refund", check_id="p1")
    assert pending["decision"] == "pending"
    assert_rule(pending, "approval_required", limit={"approvals.tools": "pay.*",
                                                     "timeout_s": 600},
                observed={"action": "pay.refund"})
    approval_decide(team=team, approval_id=pending["approval"]["id"], decision="deny",
                    note="not today", actor_label="alice")
    final = check(api, rid, name="pay.refund", check_id="p1")
    assert final["reason"] == "approval_denied"
    assert_rule(final, "approval_denied")
    assert final["rule"]["observed"]["note"] == "not today"


def test_a_kill_by_the_check_and_by_the_fan_out_name_the_switch(
        api: Client, team: Any, django_capture_on_commit_callbacks: Any) -> None:
    set_policy(team, mode="shadow")
    checked, idle = start(api), start(api)
    check(api, checked)
    killswitch_engage(scope="team", team=team, reason="runaway", actor_label="ops")
    stop = check(api, checked, name="y")
    assert stop["reason"] == "killed"
    kill = {"scope": "team", "team": "support"}
    seen = {"engaged_by": "ops", "reason": "runaway"}
    assert stop["rule"]["limit"] == kill and stop["rule"]["observed"] == seen
    with django_capture_on_commit_callbacks(execute=True):
        from runs.killswitch.fanout import killswitch_fanout

        switch = Decision.objects.none()  # the fan-out of the engaged switch, run here
        from runs.models import KillSwitch

        switch = KillSwitch.objects.get(active=True)
        killswitch_fanout(switch_id=switch.pk)
    fanned = Decision.objects.filter(run_id=idle, reason="killed").get()
    assert fanned.rule == {"name": "killed", "policy": "default", "version": 2,
                           "limit": kill, "observed": seen, "scope": "run"}
    assert fanned.answer["rule"] == fanned.rule
    # Every later check of a killed run names the switch too, whether the check or the
    # fan-out killed it, and after the switch is released (it answered a generic
    # "status: killed" rule once the fan-out had been there first).
    killswitch_release(scope="team", team=team, reason="calm", actor_label="ops")
    for rid in (idle, checked):
        later = check(api, rid, name="z")
        assert (later["reason"], later["rule"]["name"]) == ("killed", "killed")
        assert later["rule"]["limit"] == kill and later["rule"]["observed"] == seen


def test_an_abandonment_a_replay_and_a_shadow_would_stop(api: Client, team: Any) -> None:
    set_policy(team, budgets={"max_idle_seconds": 60}, mode="shadow",
               step_limits={"max_steps": 1, "max_repeat_action": 3, "no_progress_window": 4})
    rid = start(api)
    first = check(api, rid, check_id="c1")
    assert check(api, rid, check_id="c1") == first  # a replay: the first answer, rule too
    shadow = check(api, rid, name="x")
    assert shadow["decision"] == "allow" and shadow["shadow"]["reason"] == "max_steps"
    assert_rule(shadow, "max_steps", observed={"steps": 2})
    Run.objects.filter(pk=rid).update(idle_deadline=timezone.now() - timedelta(seconds=1))
    late = check(api, rid, name="z")
    assert late["reason"] == "abandoned"
    abandoned = Decision.objects.get(run_id=rid, reason="abandoned", action_name="")
    assert abandoned.rule["limit"] == {"max_idle_seconds": 60}
    assert abandoned.rule["name"] == "abandoned"


def test_the_decision_endpoint_shows_the_decision_and_why(api: Client, team: Any) -> None:
    set_policy(team)
    rid = start(api)
    answer = check(api, rid, args={"q": 1, "token": "s3cret"}, progress="p1", cost_usd=0.01,
                   last_result={"status": "error", "error": "boom", "digest": "d1"})
    again = check(api, rid, args={"q": 1, "token": "s3cret"})
    body = api.get(f"/api/v1/decisions/{again['decision_id']}").json()
    assert body["rule"] == again["rule"] and body["directive"] == again["directive"]
    assert (body["run_id"], body["step"], body["outcome"], body["reason"]) == (
        rid, 2, "allow", "step_ok")
    assert body["policy"] == {"name": "default", "version": 1}
    first = api.get(f"/api/v1/decisions/{answer['decision_id']}").json()
    assert first["action"]["args"] == {"q": 1, "token": "[redacted]"}
    assert first["last_result"] == {"status": "error", "digest": "d1"}
    assert (first["progress"], first["cost_usd"]) == ("p1", 0.01)
    assert first["usage"]["steps"] == 1 and first["rule"] is None
    assert (first["local"], first["policy_violation"], first["violation"]) == (
        False, False, None)


def test_the_decision_endpoint_flags_a_local_allow_that_broke_the_policy(
        api: Client, team: Any) -> None:
    """Found by an attacker: the one-decision read showed a flagged local allow (the list
    said `policy_violation: true`) as a plain allow."""
    set_policy(team, tools={"allow": ["*"], "deny": ["shell.*"]})
    rid = start(api)
    uploaded = api.post(f"/api/v1/runs/{rid}/local-decisions", {"decisions": [
        {"check_id": "l1", "action": {"name": "shell.exec", "args": {}}, "decision": "allow",
         "reason": "step_ok"}]}, content_type="application/json")
    assert uploaded.status_code == 200, uploaded.content
    listed = api.get(f"/api/v1/runs/{rid}/decisions").json()["decisions"][0]
    body = api.get(f"/api/v1/decisions/{listed['id']}").json()
    assert (body["local"], body["policy_violation"]) == (True, True) == (
        listed["local"], listed["policy_violation"])
    assert body["violation"].startswith("tool_denied"), body


def test_the_decision_endpoint_never_shows_another_teams_or_agents(
        api: Client, team: Any, other_team: Any) -> None:
    set_policy(team)
    theirs = check(api, start(api, agent="bot2"))["decision_id"]
    mine_client = Client(HTTP_AUTHORIZATION="Bearer " + agent_key_create(
        team=team, name="bot1-key", agent="bot1").token)
    mine = check(mine_client, start(mine_client, agent="bot1"))["decision_id"]
    other = Client(HTTP_AUTHORIZATION="Bearer " + agent_key_create(
        team=other_team, name="theirs").token)
    for client, decision_id in ((other, theirs), (other, mine), (mine_client, theirs)):
        response = client.get(f"/api/v1/decisions/{decision_id}")
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "not_found"
    assert mine_client.get(f"/api/v1/decisions/{mine}").status_code == 200
    assert api.get(f"/api/v1/decisions/{mine}").status_code == 200  # the team's own key
    for bad in ("0", "abc", "99999999999999999999", str(mine + 1000), "%C2%B2", "%D9%A3"):
        assert api.get(f"/api/v1/decisions/{bad}").status_code == 404
    assert Client().get(f"/api/v1/decisions/{mine}").status_code == 401


def test_a_request_cancelled_by_a_kill_switch_names_the_switch(api: Client, team: Any) -> None:
    set_policy(team, approvals={"tools": ["pay.*"], "timeout_s": 600})
    rid = start(api)
    pending = check(api, rid, name="pay.refund", check_id="p1")
    killswitch_engage(scope="team", team=team, reason="fraud", actor_label="ops")
    final = check(api, rid, name="pay.refund", check_id="p1")
    assert final["reason"] == "killed" and pending["decision"] == "pending"
    assert final["rule"]["limit"] == {"scope": "team", "team": "support"}
    assert final["rule"]["observed"] == {"engaged_by": "ops", "reason": "fraud"}


def test_the_decision_lists_and_the_operators_decision_read_carry_the_rule(
        api: Client, team: Any, other_team: Any, users: Any) -> None:
    """Found by a newcomer: the runs' decision lists (the agent's and the operator's) had no
    `rule`, and an operator token could not read one decision (the agent API refuses it)."""
    from policies.tokens import operator_token_create

    set_policy(team, step_limits={"max_steps": 2})
    rid = start(api)
    answers = [check(api, rid, args={"n": n}) for n in range(3)]
    assert answers[-1]["reason"] == "max_steps"
    listed = api.get(f"/api/v1/runs/{rid}/decisions").json()["decisions"]
    assert [d["rule"] for d in listed] == [a["rule"] for a in answers]
    viewer = Client(HTTP_AUTHORIZATION="Bearer " + operator_token_create(
        user=users["viewer"], name="reader", role="viewer").secret)
    theirs = Client(HTTP_AUTHORIZATION="Bearer " + operator_token_create(
        user=users["outsider"], name="theirs", role="admin").secret)
    listed = viewer.get(f"/api/v1/teams/{team.slug}/runs/{rid}/decisions").json()["decisions"]
    assert [d["rule"] for d in listed] == [a["rule"] for a in answers]
    stop = answers[-1]["decision_id"]
    body = viewer.get(f"/api/v1/teams/{team.slug}/decisions/{stop}").json()
    assert body == api.get(f"/api/v1/decisions/{stop}").json()
    assert body["rule"]["name"] == "max_steps" and body["rule"]["limit"] == {"max_steps": 2}
    for client, path in [
            (theirs, f"/api/v1/teams/{team.slug}/decisions/{stop}"),  # not their team
            (theirs, f"/api/v1/teams/{other_team.slug}/decisions/{stop}"),  # not its decision
            (viewer, f"/api/v1/teams/{team.slug}/decisions/{stop + 1000}"),
            (viewer, f"/api/v1/teams/{team.slug}/decisions/%C2%B2")]:
        answer = client.get(path)
        assert answer.status_code == 404, (path, answer.content)
        assert answer.json()["error"]["code"] == "not_found"
    refused = api.get(f"/api/v1/teams/{team.slug}/decisions/{stop}")
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "wrong_credential_kind"


def test_a_decision_read_writes_progress_and_args_as_stored_whatever_their_numbers(
        api: Client, team: Any) -> None:
    # SPEC 5.2 takes any number as progress and in args: an integer beyond 64 bits, which
    # orjson cannot write, made the read a 500 once its body was built with orjson.
    rid = start(api)
    answer = check(api, rid, args={"n": 10**30}, progress=10**30)
    body = api.get(f"/api/v1/decisions/{answer['decision_id']}")
    assert body.status_code == 200
    assert body.json()["progress"] == 10**30 and body.json()["action"]["args"] == {"n": 10**30}
