"""A team, not each of its keys, shares the API's threads (runs/check/callers.py, governance/
pools.py `FairPool`): found by an attacker, one team's flood over 8 keys, each under a key's
share, made another team's check p99 10.8x. A key joins its team's line once it is found
right, by a check or by any other call of the agent API; a wrong one never does."""

from __future__ import annotations

import hashlib

from django.test import Client

from policies.services import agent_key_create
from runs.check import callers


def credential(token: str) -> str:
    # As governance/asgi.py `_credential` names a bearer token.
    return "token:" + hashlib.sha256(token.encode()).hexdigest()


def test_a_key_found_right_shares_its_teams_line(team, other_team) -> None:
    callers._TEAMS.clear()
    first = agent_key_create(team=team, name="one").token
    second = agent_key_create(team=team, name="two").token
    theirs = agent_key_create(team=other_team, name="three").token
    assert callers.caller_of(credential(first)) == credential(first)  # not known yet
    one = Client(HTTP_AUTHORIZATION=f"Bearer {first}")
    run = one.post("/api/v1/runs", {"agent": "bot"}, content_type="application/json")
    assert run.status_code == 201
    answer = one.post(f"/api/v1/runs/{run.json()['run_id']}/check",
                      {"action": {"name": "search.docs"}}, content_type="application/json")
    assert answer.status_code == 200
    assert Client(HTTP_AUTHORIZATION=f"Bearer {second}").get("/api/v1/runs").status_code == 200
    assert Client(HTTP_AUTHORIZATION=f"Bearer {theirs}").get("/api/v1/runs").status_code == 200
    assert callers.caller_of(credential(first)) == callers.caller_of(credential(second)) \
        == f"team:{team.pk}"
    assert callers.caller_of(credential(theirs)) == f"team:{other_team.pk}"
    # A wrong secret with a right key's prefix is refused and stays a caller of its own.
    forged = first[:-4] + ("0000" if not first.endswith("0000") else "1111")
    assert Client(HTTP_AUTHORIZATION=f"Bearer {forged}").get("/api/v1/runs").status_code == 401
    assert callers.caller_of(credential(forged)) == credential(forged)
    assert callers.caller_of("header:abc") == "header:abc"
