"""Who may call each agent API endpoint: every operation of the OpenAPI document is tried
without a key, with a revoked key, with another team's key, with a dashboard session only, and
with the right key."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from policies.services import agent_key_create, agent_key_revoke

pytestmark = pytest.mark.django_db

BODIES = {
    "start_run": {"agent": "bot"},
    "check": {"action": {"name": "x"}},
    "finish_run": {"status": "completed"},
    "upload_local_decisions": {"decisions": [{"check_id": "l1", "action": {"name": "x"},
                                              "decision": "allow", "reason": "step_ok"}]},
}


def operations(client):
    """The agent API's operations (the operator API's, SPEC 17: tests/test_operator_api.py)."""
    doc = client.get("/api/v1/openapi.json").json()
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            if op.get("security") != [{"OperatorTokenAuth": []}]:
                yield path, method, op["operationId"]


def call(client, path, method, operation, run_id, headers, approval_id="", decision_id=""):
    if not decision_id and "{decision_id}" in path:
        from runs.models import Decision

        # The run's newest decision (SPEC 16's endpoint): made by a check if it has none.
        found = Decision.objects.filter(run_id=run_id).order_by("-id").first()
        decision_id = str(found.pk) if found is not None else "1"
    url = path.replace("{run_id}", run_id).replace("{approval_id}", approval_id).replace(
        "{decision_id}", decision_id)
    if method == "post":
        return client.post(url, json.dumps(BODIES[operation]), content_type="application/json",
                           **headers)
    return client.get(url, **headers)


@pytest.fixture
def run_id(api):
    return api.post("/api/v1/runs", {"agent": "bot"}, content_type="application/json").json()[
        "run_id"]


@pytest.fixture
def approval_id(api, team, run_id):
    """A pending approval (SPEC 11) of another run of the team."""
    from tests.conftest import set_policy

    set_policy(team, approvals={"tools": ["gated.*"], "timeout_s": 600})
    other = api.post("/api/v1/runs", {"agent": "bot"}, content_type="application/json").json()
    answer = api.post(f"/api/v1/runs/{other['run_id']}/check",
                      {"action": {"name": "gated.tool"}, "check_id": "c"},
                      content_type="application/json").json()
    return answer["approval"]["id"]


def test_every_operation_is_documented_and_covered(client):
    assert {op for _, _, op in operations(client)} == {
        "start_run", "list_runs", "get_run", "list_decisions", "check", "finish_run",
        "get_approval", "upload_local_decisions", "get_decision"}


@pytest.mark.parametrize("who", ["anonymous", "revoked", "session-only superuser"])
def test_every_operation_refuses_callers_without_a_live_key(team, users, run_id, approval_id,
                                                             who):
    client = Client()
    headers = {}
    if who == "revoked":
        new = agent_key_create(team=team, name="old")
        agent_key_revoke(key=new.key, actor=None)
        headers = {"HTTP_AUTHORIZATION": f"Bearer {new.token}"}
    elif who == "session-only superuser":
        client.force_login(users["superuser"])
    for path, method, op in operations(client):
        response = call(client, path, method, op, run_id, headers, approval_id)
        assert response.status_code == 401, (who, op)
        assert response.json()["error"]["code"] == "unauthorized"


def test_another_teams_key_sees_none_of_this_teams_runs(other_team, run_id, approval_id):
    token = agent_key_create(team=other_team, name="theirs").token
    client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")
    for path, method, op in operations(client):
        response = call(client, path, method, op, run_id, {}, approval_id)
        if "{run_id}" in path or "{approval_id}" in path or "{decision_id}" in path:
            assert response.status_code == 404, op
        elif op == "list_runs":
            assert run_id not in {r["run_id"] for r in response.json()["runs"]}
        else:
            assert response.status_code == 201, op  # starts a run of its own team


def test_the_right_key_may_call_every_operation(api, run_id, approval_id):
    expected = {"start_run": 201, "list_runs": 200, "get_run": 200, "list_decisions": 200,
                "check": 200, "finish_run": 200, "get_approval": 200,
                "upload_local_decisions": 200, "get_decision": 200}
    # The check first: the decision read is the one it made.
    for path, method, op in sorted(operations(api), key=lambda o: (o[2] == "finish_run",
                                                                   o[2] != "check")):
        response = call(api, path, method, op, run_id, {}, approval_id)
        assert response.status_code == expected[op], op


# --- Agent-bound keys (SPEC 10) ----------------------------------------------------------------

def bound_client(team, agent="bot1"):
    token = agent_key_create(team=team, name=f"{agent}-key", agent=agent).token
    return Client(HTTP_AUTHORIZATION=f"Bearer {token}")


def test_an_agent_bound_key_touches_no_other_agents_run_in_any_operation(team, api):
    """Every operation that names a run answers 404 for another agent's run of the same team,
    exactly as for another team's; the list leaves it out; nothing of it changes."""
    from runs.models import Decision, Run

    bot2_run = api.post("/api/v1/runs", {"agent": "bot2"},
                        content_type="application/json").json()["run_id"]
    bot1 = bound_client(team)
    covered = set()
    for path, method, op in operations(bot1):
        if "{run_id}" in path:
            response = call(bot1, path, method, op, bot2_run, {})
            assert response.status_code == 404, op
            assert response.json()["error"]["code"] == "not_found"
            covered.add(op)
    assert covered == {"get_run", "list_decisions", "check", "finish_run",
                       "upload_local_decisions"}
    assert bot1.get("/api/v1/runs").json()["runs"] == []
    assert bot1.get("/api/v1/runs?agent=bot2").json()["runs"] == []
    run = Run.objects.get(pk=bot2_run)
    assert (run.status, run.steps, run.finished_at) == ("running", 0, None)
    assert not Decision.objects.filter(run=run).exists()


def test_an_agent_bound_key_may_call_every_operation_on_its_own_agents_runs(team, approval_id):
    bot1 = bound_client(team)
    own = bot1.post("/api/v1/runs", {"agent": "bot1"},
                    content_type="application/json").json()["run_id"]
    expected = {"start_run": 422, "list_runs": 200, "get_run": 200, "list_decisions": 200,
                "check": 200, "finish_run": 200,  # start_run's body names agent "bot"
                "get_approval": 404,  # the approval is agent "bot"'s, not bot1's
                "upload_local_decisions": 200, "get_decision": 200}
    for path, method, op in sorted(operations(bot1), key=lambda o: (o[2] == "finish_run",
                                                                    o[2] != "check")):
        response = call(bot1, path, method, op, own, {}, approval_id)
        assert response.status_code == expected[op], op
    assert [r["run_id"] for r in bot1.get("/api/v1/runs").json()["runs"]] == [own]


def test_a_start_with_another_agents_external_id_is_a_conflict(team, api):
    theirs = api.post("/api/v1/runs", {"agent": "bot2", "external_id": "job-7"},
                      content_type="application/json").json()
    bot1 = bound_client(team)
    response = bot1.post("/api/v1/runs", {"agent": "bot1", "external_id": "job-7"},
                         content_type="application/json")
    assert response.status_code == 409
    body = response.json()["error"]
    assert body["code"] == "external_id_conflict" and "external_id" in body["fields"]
    assert theirs["run_id"] not in response.content.decode()
    # A team key sees every agent's runs: it gets the run back whatever agent it names
    # (SPEC 5.1: the same external_id in the same team answers 200 with the existing run).
    other = api.post("/api/v1/runs", {"agent": "bot3", "external_id": "job-7"},
                     content_type="application/json")
    assert other.status_code == 200 and other.json()["run_id"] == theirs["run_id"]
    assert other.json()["agent"] == "bot2"
    again = api.post("/api/v1/runs", {"agent": "bot2", "external_id": "job-7"},
                     content_type="application/json")
    assert again.status_code == 200 and again.json()["run_id"] == theirs["run_id"]


@pytest.mark.django_db(transaction=True)
def test_an_agent_bound_keys_check_of_another_agents_run_is_404_on_the_server(agent, team):
    """Through the production server: on PostgreSQL the check looks the key and the run up in
    one locking statement (runs/check/check_store.py), which must apply the agent too."""
    import httpx

    bot2_run = agent.start("bot2")["run_id"]
    token = agent_key_create(team=team, name="bot1-key", agent="bot1").token
    with httpx.Client(base_url=str(agent.http.base_url), timeout=30,
                      headers={"Authorization": f"Bearer {token}"}) as bot1:
        refused = bot1.post(f"/api/v1/runs/{bot2_run}/check", json={"action": {"name": "x"}})
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "not_found"
        own = bot1.post("/api/v1/runs", json={"agent": "bot1"}).json()["run_id"]
        allowed = bot1.post(f"/api/v1/runs/{own}/check", json={"action": {"name": "x"}})
        assert allowed.status_code == 200 and allowed.json()["decision"] == "allow"
    assert agent.check(bot2_run)["decision"] == "allow"  # the unbound key still may


def test_an_agent_bound_keys_refused_start_names_its_agent_in_the_message(team):
    """Found by a newcomer: an MCP client's model sees the message alone, which said only
    "its agent", and the key's owner could not tell which agent the key was made for."""
    refused = bound_client(team).post("/api/v1/runs", {"agent": "cursor"},
                                      content_type="application/json")
    assert refused.status_code == 422
    error = refused.json()["error"]
    assert error["code"] == "invalid_request"
    assert error["message"] == "This key may only start runs of its agent, 'bot1'."
    assert error["fields"] == {"agent": "this key is limited to agent 'bot1'"}
