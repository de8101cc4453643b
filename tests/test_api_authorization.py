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
    doc = client.get("/api/v1/openapi.json").json()
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            yield path, method, op["operationId"]


def call(client, path, method, operation, run_id, headers):
    url = path.replace("{run_id}", run_id)
    if method == "post":
        return client.post(url, json.dumps(BODIES[operation]), content_type="application/json",
                           **headers)
    return client.get(url, **headers)


@pytest.fixture
def run_id(api):
    return api.post("/api/v1/runs", {"agent": "bot"}, content_type="application/json").json()[
        "run_id"]


def test_every_operation_is_documented_and_covered(client):
    assert {op for _, _, op in operations(client)} == {
        "start_run", "list_runs", "get_run", "list_decisions", "check", "finish_run",
        "upload_local_decisions"}


@pytest.mark.parametrize("who", ["anonymous", "revoked", "session-only superuser"])
def test_every_operation_refuses_callers_without_a_live_key(team, users, run_id, who):
    client = Client()
    headers = {}
    if who == "revoked":
        new = agent_key_create(team=team, name="old")
        agent_key_revoke(key=new.key, actor=None)
        headers = {"HTTP_AUTHORIZATION": f"Bearer {new.token}"}
    elif who == "session-only superuser":
        client.force_login(users["superuser"])
    for path, method, op in operations(client):
        response = call(client, path, method, op, run_id, headers)
        assert response.status_code == 401, (who, op)
        assert response.json()["error"]["code"] == "unauthorized"


def test_another_teams_key_sees_none_of_this_teams_runs(other_team, run_id):
    token = agent_key_create(team=other_team, name="theirs").token
    client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")
    for path, method, op in operations(client):
        response = call(client, path, method, op, run_id, {})
        if "{run_id}" in path:
            assert response.status_code == 404, op
        elif op == "list_runs":
            assert run_id not in {r["run_id"] for r in response.json()["runs"]}
        else:
            assert response.status_code == 201, op  # starts a run of its own team


def test_the_right_key_may_call_every_operation(api, run_id):
    expected = {"start_run": 201, "list_runs": 200, "get_run": 200, "list_decisions": 200,
                "check": 200, "finish_run": 200, "upload_local_decisions": 200}
    for path, method, op in sorted(operations(api), key=lambda o: o[2] == "finish_run"):
        assert call(api, path, method, op, run_id, {}).status_code == expected[op], op
