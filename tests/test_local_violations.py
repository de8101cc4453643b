"""SPEC 10, "Uploaded local decisions": a fail-open client's uploaded allow of an action the
run's policy forbids (a denied tool, an action needing approval) is kept, since the action
ran, but flagged `policy_violation: true` in the decisions API (and its OpenAPI document)
and shown so on the run's timeline. Both stacks."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from policies.models import Team
from runs.models import Decision, Run
from tests.conftest import set_policy

pytestmark = pytest.mark.django_db


@pytest.fixture
def strict(team: Team) -> Team:
    set_policy(team, tools={"deny": ["shell.*"]},
               approvals={"tools": ["payments.*"], "timeout_s": 600})
    return team


def start(api: Client) -> str:
    response = api.post("/api/v1/runs", {"agent": "support-bot"},
                        content_type="application/json")
    assert response.status_code == 201, response.content
    return response.json()["run_id"]


def entry(check_id: str, name: str, decision: str = "allow",
          reason: str = "step_ok") -> dict[str, Any]:
    return {"check_id": check_id, "action": {"name": name}, "decision": decision,
            "reason": reason}


def upload(api: Client, run_id: str, *entries: dict[str, Any]) -> None:
    response = api.post(f"/api/v1/runs/{run_id}/local-decisions",
                        json.dumps({"decisions": list(entries)}),
                        content_type="application/json")
    assert response.status_code == 200, response.content


def flags(api: Client, run_id: str) -> list[tuple[str, str, bool]]:
    decisions = api.get(f"/api/v1/runs/{run_id}/decisions").json()["decisions"]
    return [(d["action"]["name"], d["outcome"], d["policy_violation"]) for d in decisions]


def test_allows_of_a_denied_tool_and_of_an_action_needing_approval_are_flagged(api, strict):
    run_id = start(api)
    upload(api, run_id, entry("l-1", "search.docs"), entry("l-2", "shell.exec"),
           entry("l-3", "payments.refund"), entry("l-4", "shell.rm", "stop", "tool_denied"))

    assert flags(api, run_id) == [("search.docs", "allow", False),
                                  ("shell.exec", "allow", True),
                                  ("payments.refund", "allow", True),
                                  ("shell.rm", "stop", False)]
    # Kept all the same: the actions ran, and the counters say so.
    run = Run.objects.get(pk=run_id)
    assert (run.steps, run.tool_calls, run.status) == (4, 3, "stopped")
    answer = Decision.objects.get(run_id=run_id, check_id="l-2").answer
    assert answer["policy_violation"] is True and "shell.*" in answer["violation"]
    # What it broke, in words, in the list as in the one-decision read (SPEC 16).
    listed = api.get(f"/api/v1/runs/{run_id}/decisions").json()["decisions"]
    assert "shell.*" in listed[1]["violation"] and listed[0]["violation"] is None
    one = api.get(f"/api/v1/decisions/{listed[1]['id']}").json()
    assert one["violation"] == listed[1]["violation"]


def test_decisions_the_service_made_are_never_flagged(api, strict):
    run_id = start(api)
    api.post(f"/api/v1/runs/{run_id}/check", {"action": {"name": "search.docs"}},
             content_type="application/json")
    api.post(f"/api/v1/runs/{run_id}/check", {"action": {"name": "shell.exec"}},
             content_type="application/json")
    assert flags(api, run_id) == [("search.docs", "allow", False),
                                  ("shell.exec", "stop", False)]


def test_a_shadow_policy_is_broken_by_nothing(api, team):
    set_policy(team, mode="shadow", tools={"deny": ["shell.*"]})
    run_id = start(api)
    upload(api, run_id, entry("l-1", "shell.exec"))
    assert flags(api, run_id) == [("shell.exec", "allow", False)]


def test_a_decision_uploaded_before_the_flag_existed_is_judged_when_read(api, strict):
    """The audit log is append-only: an older upload is never rewritten, but read with the
    same rule against its run's policy version."""
    run_id = start(api)
    for name in ("shell.exec", "search.docs"):
        Decision.objects.create(run_id=run_id, step=1, outcome="allow", reason="step_ok",
                                action_name=name, action_type="tool", args={},
                                answer={"decision": "allow", "local": True},
                                at=timezone.now())
    assert flags(api, run_id) == [("shell.exec", "allow", True),
                                  ("search.docs", "allow", False)]


def test_the_timeline_marks_them(api, strict, users):
    run_id = start(api)
    upload(api, run_id, entry("l-1", "search.docs"), entry("l-2", "shell.exec"),
           entry("l-3", "payments.refund"))
    viewer = Client()
    viewer.force_login(users["viewer"])
    page = viewer.get(f"/teams/{strict.slug}/runs/{run_id}/").content.decode()
    assert page.count("data-policy-violation") == 2
    assert "policy violation" in page and "matches the deny pattern" in page
    # "Stops and warnings only" keeps them.
    flagged = viewer.get(f"/teams/{strict.slug}/runs/{run_id}/?only=flagged").content.decode()
    assert flagged.count("data-policy-violation") == 2
    assert "search.docs" not in flagged.split("<tbody", 1)[-1]


def test_the_openapi_document_says_so(client):
    document = client.get("/api/v1/openapi.json").json()
    decision = document["components"]["schemas"]["DecisionOut"]["properties"]
    assert decision["policy_violation"]["type"] == "boolean"
    assert "policy" in decision["policy_violation"]["description"]
    assert "violation" in decision
    check = document["components"]["schemas"]["CheckOut"]["properties"]
    assert "policy_violation" in check


def test_a_long_upload_is_recorded_whole_in_chunks_with_its_stop_where_it_fell(api, team,
                                                                          monkeypatch):
    # An upload is recorded CHUNK entries a transaction, so that the run's lock is never held
    # for a whole upload (found by an attacker): the result is the one transaction's.
    from runs.check import local

    monkeypatch.setattr(local, "CHUNK", 7)
    set_policy(team, step_limits={"max_steps": 100, "max_repeat_action": 100,
                                  "no_progress_window": 100})
    run_id = start(api)
    entries = [entry(f"c-{i}", f"search.docs{i}") for i in range(20)]
    entries.append(entry("c-stop", "search.docs", decision="stop", reason="max_steps"))
    response = api.post(f"/api/v1/runs/{run_id}/local-decisions",
                        json.dumps({"decisions": entries + entries[:3]}),
                        content_type="application/json")
    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["recorded"], body["skipped"]) == (21, 3)
    assert (body["run"]["steps"], body["run"]["status"]) == (21, "stopped")  # as whole
    assert Decision.objects.filter(run_id=run_id).count() == 21


def test_allows_past_the_runs_limits_or_an_ancestors_are_flagged(api, team):
    """Found by an attacker: 40 uploaded allows on a run whose max_steps is 18 were all
    recorded unflagged (a client whose local rules were looser than the policy), and a
    child's the same past its parent's limit. Each allow the service would have stopped is
    flagged, saying by which limit; the actions ran, so every one is still counted."""
    set_policy(team, step_limits={"max_steps": 3, "max_repeat_action": 100,
                                  "no_progress_window": 100})
    run_id = start(api)
    upload(api, run_id, *(entry(f"own-{i}", f"search.docs{i}") for i in range(5)))
    assert [flag for _, _, flag in flags(api, run_id)] == [False, False, False, True, True]
    fourth = Decision.objects.get(run_id=run_id, check_id="own-3")
    assert fourth.answer["violation"].startswith(
        "max_steps: the run's policy would have stopped this action (steps 4; max_steps 3)")
    assert Run.objects.get(pk=run_id).steps == 5

    # The parent's max_steps bounds its tree (SPEC 20); the child's own policy is roomier.
    from policies.document import parse_policy
    from policies.services import policy_save

    set_policy(team, step_limits={"max_steps": 2, "max_repeat_action": 100,
                                  "no_progress_window": 100})
    document = {**team.policies.get(name="default").current.document, "name": "helpers"}
    document["step_limits"] = {**document["step_limits"], "max_steps": 50}
    document.pop("warnings", None)
    policy_save(team=team, document=parse_policy(document), actor=None, source="test")
    parent = start(api)
    made = api.post("/api/v1/runs", {"agent": "helper", "parent_run_id": parent,
                                     "policy": "helpers"}, content_type="application/json")
    assert made.status_code == 201, made.content
    child = made.json()["run_id"]
    upload(api, child, *(entry(f"kid-{i}", f"search.docs{i}") for i in range(3)))
    assert [flag for _, _, flag in flags(api, child)] == [False, False, True]
    third = Decision.objects.get(run_id=child, check_id="kid-2")
    assert f"ancestor run {parent}'s policy would have stopped" in third.answer["violation"]


def test_an_ancestor_that_ended_after_the_client_decided_did_not_stop_it(api, team):
    """Found by an attacker: an allow decided 0.5 s before its parent's finish, uploaded
    after it, was flagged parent_stopped. An ancestor is read as it was at the entry's `at`;
    one that had ended by then is a violation still."""
    parent = start(api)
    made = api.post("/api/v1/runs", {"agent": "helper", "parent_run_id": parent},
                    content_type="application/json")
    assert made.status_code == 201, made.content
    child = made.json()["run_id"]
    before = timezone.now().isoformat()
    finished = api.post(f"/api/v1/runs/{parent}/finish", {"status": "completed"},
                        content_type="application/json")
    assert finished.status_code == 200, finished.content
    after = timezone.now().isoformat()
    upload(api, child, {**entry("then", "search.docs1"), "at": before},
           {**entry("later", "search.docs2"), "at": after})
    assert [flag for _, _, flag in flags(api, child)] == [False, True]
    later = Decision.objects.get(run_id=child, check_id="later")
    assert later.answer["violation"].startswith("parent_stopped: ")


def test_the_timeline_shows_when_the_client_decided_not_when_it_uploaded(api, strict, users):
    """Found by a newcomer: the actions of an outage all read as run at the upload's second,
    "+0 ms" apart; the client's `at` was kept only in the answer's `decided_at`."""
    import re
    from datetime import timedelta

    run_id = start(api)
    now = timezone.now()
    Run.objects.filter(pk=run_id).update(started_at=now - timedelta(seconds=120))
    first, second = now - timedelta(seconds=90), now - timedelta(seconds=50)
    upload(api, run_id, {**entry("l-1", "search.docs"), "at": first.isoformat()},
           {**entry("l-2", "search.web"), "at": second.isoformat()})
    viewer = Client()
    viewer.force_login(users["viewer"])
    page = viewer.get(f"/teams/{strict.slug}/runs/{run_id}/").content.decode()
    rows = page.split("<tbody", 1)[1]
    shown = re.findall(r'<time datetime="[^"]+" title="decided by the client at [^"]+"'
                       r' data-uploaded-at="[^"]+">([0-9:]+)</time>', rows)
    assert shown == [first.strftime("%H:%M:%S"), second.strftime("%H:%M:%S")]
    assert "+0 ms" not in rows
