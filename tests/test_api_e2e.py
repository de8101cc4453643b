"""The agent API end to end: HTTP against the production server (granian, 2 workers) on the
test database. Scenarios from the seeds and SPEC sections 4 and 5."""

from __future__ import annotations

import time

import pytest

from policies.services import agent_key_create, team_ensure
from runs.models import Decision, Run
from tests.conftest import set_policy

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def decisions(agent, run_id):
    return agent.http.get(f"/api/v1/runs/{run_id}/decisions").json()["decisions"]


def test_max_steps_18_stops_step_19(agent):
    run = agent.start()
    answers = [agent.check(run["run_id"], args={"query": f"q{i}"}) for i in range(19)]
    assert all(a["decision"] == "allow" for a in answers[:18])
    last = answers[18]
    assert (last["decision"], last["reason"], last["step"]) == ("stop", "max_steps", 19)
    assert "max_steps=18" in last["message"] and last["next_action"]
    assert agent.http.get(f"/api/v1/runs/{run['run_id']}").json()["stop_reason"] == "max_steps"
    # Every stop names the limit and its value (SPEC 4.4), a later check's too: it said only
    # "The run is already stopped (reason: max_steps)."
    later = agent.check(run["run_id"], args={"query": "one more"})
    assert (later["decision"], later["reason"]) == ("stop", "max_steps")
    assert later["message"] == ("The run is already stopped (reason: max_steps). Its stop: "
                                + last["message"])


def test_the_same_search_with_equivalent_args_is_stopped_at_the_fourth_call(agent):
    run = agent.start()
    spellings = [
        {"query": "refund policy", "lang": "en"},
        {"lang": "en", "query": " refund  policy"},
        {"query": "refund\tpolicy ", "lang": "en"},
        {"lang": "en", "query": "refund policy"},
    ]
    answers = [agent.check(run["run_id"], "search.docs", args) for args in spellings]
    assert [a["decision"] for a in answers] == ["allow", "allow", "allow", "stop"]
    assert answers[3]["reason"] == "loop_detected"
    assert answers[3]["repeat_count"] == 3
    assert len({a["repeat_key"] for a in answers}) == 1
    assert answers[3]["message"] == (
        "search.docs was already called 3 times with the same arguments, all that "
        "max_repeat_action=3 allows: this call was not run and the run is stopped.")
    # SPEC 16: the rule that fired, and the warning the agent had at the 2nd call.
    assert answers[3]["rule"] == {"name": "loop_detected", "policy": "default",
                                  "version": 1, "limit": {"max_repeat_action": 3},
                                  "observed": {"repeat_count": 3}, "scope": "run"}
    assert answers[0]["rule"] is None and answers[0]["directive"] is None
    assert answers[1]["directive"]["code"] == "repeat_action"


def test_a_normal_run_is_allowed_throughout_and_finishes_completed(agent):
    run = agent.start(task="Where is my refund?")
    steps = [("search.docs", {"query": "refund"}), ("crm.lookup", {"customer": 42}),
             ("llm.answer", {"draft": True})]
    for i, (name, args) in enumerate(steps):
        answer = agent.check(run["run_id"], name, args, progress=f"milestone-{i}",
                             cost_usd=0.01)
        assert (answer["decision"], answer["reason"]) == ("allow", "step_ok")
        assert answer["message"] is None and answer["next_action"] is None
    done = agent.http.post(f"/api/v1/runs/{run['run_id']}/finish",
                           json={"status": "completed", "output": "Refund sent."})
    assert done.status_code == 200
    body = done.json()
    assert (body["status"], body["stop_reason"], body["steps"]) == ("completed", None, 3)
    assert body["cost_usd"] == pytest.approx(0.03)
    assert body["output"] == "Refund sent."


def test_a_soft_loop_without_progress_is_stopped_at_the_window(agent):
    run = agent.start()
    first = agent.check(run["run_id"], args={"query": "q0"})
    assert first["decision"] == "allow"
    same = {"status": "ok", "digest": "sha256:nothing-new"}
    # check 2 brings a new signature; checks 3..5 repeat it (streak 1, 2, 3); check 6: streak 4.
    answers = [agent.check(run["run_id"], args={"query": f"q{i}"}, last_result=same)
               for i in range(1, 6)]
    assert [a["decision"] for a in answers] == ["allow"] * 4 + ["stop"]
    assert answers[-1]["reason"] == "no_progress"
    assert answers[-1]["step"] == 6


def test_max_seconds_stops_a_run_that_lasts_too_long(agent, team):
    set_policy(team, budgets={"max_seconds": 1})
    run = agent.start()
    assert agent.check(run["run_id"])["decision"] == "allow"
    time.sleep(1.2)
    answer = agent.check(run["run_id"], args={"other": 1})
    assert (answer["decision"], answer["reason"]) == ("stop", "max_seconds")


def test_max_usd_counts_this_checks_cost(agent, team):
    set_policy(team, budgets={"max_usd": 0.05})
    run = agent.start()
    answers = [agent.check(run["run_id"], args={"i": i}, cost_usd=0.02) for i in range(3)]
    assert [a["decision"] for a in answers] == ["allow", "allow", "stop"]
    assert answers[2]["reason"] == "max_usd"
    assert answers[2]["usage"]["cost_usd"] == pytest.approx(0.06)


def test_max_tool_calls_counts_only_tool_actions(agent, team):
    set_policy(team, budgets={"max_tool_calls": 2})
    run = agent.start()
    rid = run["run_id"]
    assert agent.check(rid, "a", {})["decision"] == "allow"
    assert agent.check(rid, "b", {})["decision"] == "allow"
    assert agent.check(rid, "think", {}, action={"type": "llm"})["decision"] == "allow"
    stop = agent.check(rid, "c", {})
    assert (stop["decision"], stop["reason"], stop["usage"]["tool_calls"]) == (
        "stop", "max_tool_calls", 2)


def test_a_denied_tool_is_stopped(agent, team):
    set_policy(team, tools={"allow": ["search.*", "shell.*"], "deny": ["shell.*"]})
    run = agent.start()
    assert agent.check(run["run_id"], "search.docs")["decision"] == "allow"
    stop = agent.check(run["run_id"], "shell.exec", {"cmd": "rm -rf /"})
    assert (stop["decision"], stop["reason"]) == ("stop", "tool_denied")


def test_a_repeated_error_gets_a_nudge_naming_the_count(agent):
    run = agent.start()
    error = {"status": "error", "error": "no matches  found"}
    answers = [agent.check(run["run_id"], "edit_file", {"attempt": i}, last_result=error)
               for i in range(4)]
    assert [a["directive"] is not None for a in answers] == [False, False, True, True]
    assert answers[2]["directive"] == {
        "type": "inject_message", "role": "user", "code": "repeated_error",
        "content": "The error 'no matches found' occurred 3 times. "
                   "Change approach radically or abandon this subtask."}
    assert "occurred 4 times" in answers[3]["directive"]["content"]
    assert all(a["decision"] == "allow" for a in answers)


def test_a_repeated_error_stops_when_the_policy_says_stop(agent, team):
    set_policy(team, on_repeated_error={"threshold": 2, "action": "stop"},
               step_limits={"no_progress_window": 100})
    run = agent.start()
    error = {"status": "error", "error": "file not found"}
    answers = [agent.check(run["run_id"], "read", {"i": i}, last_result=error) for i in range(2)]
    assert [a["decision"] for a in answers] == ["allow", "stop"]
    assert answers[1]["reason"] == "repeated_error"


def test_shadow_mode_allows_a_would_be_stop_and_audits_it(agent, team):
    set_policy(team, mode="shadow")
    run = agent.start()
    answers = [agent.check(run["run_id"], args={"q": 1}) for _ in range(5)]
    assert all(a["decision"] == "allow" for a in answers)
    assert answers[3]["shadow"]["reason"] == "loop_detected"
    assert answers[3]["reason"] == "step_ok"
    outcomes = [d["outcome"] for d in decisions(agent, run["run_id"])]
    assert outcomes == ["allow", "allow", "allow", "would_stop", "would_stop"]
    assert agent.http.get(f"/api/v1/runs/{run['run_id']}").json()["status"] == "running"


def test_a_stopped_run_keeps_its_reason_and_stores_the_partial_response(agent):
    run = agent.start()
    rid = run["run_id"]
    for _ in range(4):
        agent.check(rid, args={"q": "same"})
    finished = agent.http.post(f"/api/v1/runs/{rid}/finish",
                               json={"status": "completed", "output": "Partial: found 2 docs."})
    assert finished.status_code == 200
    body = finished.json()
    assert (body["status"], body["stop_reason"], body["output"]) == (
        "stopped", "loop_detected", "Partial: found 2 docs.")
    again = agent.http.post(f"/api/v1/runs/{rid}/finish", json={"status": "completed"})
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "run_finished"
    late = agent.check(rid, "other.tool")
    assert (late["decision"], late["reason"], late["step"]) == ("stop", "loop_detected", 4)


def test_a_running_run_finished_as_stopped_gets_agent_stopped(agent):
    run = agent.start()
    body = agent.http.post(f"/api/v1/runs/{run['run_id']}/finish",
                           json={"status": "stopped", "output": "user cancelled"}).json()
    assert (body["status"], body["stop_reason"]) == ("stopped", "agent_stopped")
    late = agent.check(run["run_id"])
    assert (late["decision"], late["reason"]) == ("stop", "agent_stopped")


def test_a_completed_run_answers_run_finished(agent):
    run = agent.start()
    agent.http.post(f"/api/v1/runs/{run['run_id']}/finish", json={"status": "completed"})
    late = agent.check(run["run_id"])
    assert (late["decision"], late["reason"], late["step"]) == ("stop", "run_finished", 0)


def test_the_same_external_id_answers_the_existing_run(agent):
    first = agent.http.post("/api/v1/runs", json={"agent": "bot", "external_id": "req-1"})
    again = agent.http.post("/api/v1/runs", json={"agent": "bot", "external_id": "req-1"})
    other = agent.http.post("/api/v1/runs", json={"agent": "bot", "external_id": "req-2"})
    assert (first.status_code, again.status_code, other.status_code) == (201, 200, 201)
    assert first.json()["run_id"] == again.json()["run_id"] != other.json()["run_id"]


def test_a_check_id_replay_is_not_counted_and_returns_the_first_answer(agent):
    run = agent.start()
    rid = run["run_id"]
    first = agent.check(rid, args={"q": 1}, check_id="c-1")
    again = agent.check(rid, args={"q": 1}, check_id="c-1")
    assert again == first
    assert agent.check(rid, args={"q": 2})["step"] == 2
    assert Decision.objects.filter(run_id=rid).count() == 2


def test_a_check_id_replay_after_a_stop_answers_the_stop(agent):
    run = agent.start()
    rid = run["run_id"]
    allowed = agent.check(rid, args={"q": 1}, check_id="c-1")
    assert allowed["decision"] == "allow"
    for _ in range(3):
        agent.check(rid, args={"q": 1})
    replay = agent.check(rid, args={"q": 1}, check_id="c-1")
    assert (replay["decision"], replay["reason"]) == ("stop", "loop_detected")


def test_redacted_args_are_stored_redacted_but_keyed_raw(agent):
    run = agent.start(metadata={"user": {"Authorization": "Bearer x", "plan": "pro"}})
    a = agent.check(run["run_id"], "login", {"user": "ann", "Password": "hunter2"})
    b = agent.check(run["run_id"], "login", {"user": "ann", "Password": "other"})
    assert a["repeat_key"] != b["repeat_key"]
    shown = decisions(agent, run["run_id"])[0]["action"]["args"]
    assert shown == {"user": "ann", "Password": "[redacted]"}
    stored = Run.objects.get(pk=run["run_id"]).metadata
    assert stored == {"user": {"Authorization": "[redacted]", "plan": "pro"}}


def test_a_key_for_one_agent_cannot_start_another(agent, team):
    token = agent_key_create(team=team, name="bot-only", agent="support-bot").token
    headers = {"Authorization": f"Bearer {token}"}
    ok = agent.http.post("/api/v1/runs", json={"agent": "support-bot"}, headers=headers)
    renamed = agent.http.post("/api/v1/runs", json={"agent": "other-bot"}, headers=headers)
    assert ok.status_code == 201
    assert renamed.status_code == 422
    assert "agent" in renamed.json()["error"]["fields"]


def test_another_teams_run_is_a_404_and_counts_nothing(agent):
    run = agent.start()
    other = team_ensure(slug="billing")[0]
    token = agent_key_create(team=other, name="k").token
    headers = {"Authorization": f"Bearer {token}"}
    for method, path in [("GET", ""), ("GET", "/decisions"), ("POST", "/check"),
                         ("POST", "/finish")]:
        body = {"action": {"name": "x"}} if path == "/check" else {"status": "completed"}
        response = agent.http.request(method, f"/api/v1/runs/{run['run_id']}{path}",
                                      json=body if method == "POST" else None, headers=headers)
        assert response.status_code == 404, path
        assert response.json()["error"]["code"] == "not_found"
    assert Run.objects.get(pk=run["run_id"]).steps == 0


def test_listing_runs_filters_and_limits(agent):
    ids = [agent.start(agent=f"bot-{i % 2}")["run_id"] for i in range(4)]
    agent.http.post(f"/api/v1/runs/{ids[0]}/finish", json={"status": "completed"})
    listed = agent.http.get("/api/v1/runs", params={"agent": "bot-0", "limit": 1}).json()["runs"]
    assert [r["run_id"] for r in listed] == [ids[2]]
    done = agent.http.get("/api/v1/runs", params={"status": "completed"}).json()["runs"]
    assert [r["run_id"] for r in done] == [ids[0]]
