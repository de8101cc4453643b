"""The operator API's calls of one team take turns within their share of a server process's
time (`WEB_OPERATOR_SHARE`, governance/asgi.py `_paced_caller`), as the agents' bulk calls
do. Not an attack module: one reader at a time, nothing flooded."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from policies.models import Team
from policies.tokens import operator_token_create
from tests.conftest import server_env, start_server
from tests.test_agent_bulk_fair_share import DEADLINE_S, upload_body

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_one_teams_operator_calls_take_turns_within_their_share_of_the_process(
        team: Team, other_team: Team, agent_token: str, users: Any,
        attack_turn: None) -> None:
    """The operator API's calls of one team (the team their path names) are paced as the
    agents' bulk calls, whatever token sends them: found by an attacker, 16 viewer tokens
    of one team reading a run's decisions of 55 MB over and over from 16 addresses made
    another team's check p99 10 to 50x. Another team's operator calls, the team's checks
    and any kill switch never wait for that turn. Timed with the machine to itself
    (`attack_turn`): SPEC 10's 2 s, not what CI's other groups beside it cost."""
    # At a thousandth, a read past the quiet burst owes more than 10 s at once: refused.
    server = start_server(workers=1, env=server_env(WEB_OPERATOR_SHARE="0.001"))
    viewers = [operator_token_create(user=users["viewer"], name=f"reader-{i}", role="viewer"
                                     ).secret for i in range(4)]
    theirs = operator_token_create(user=users["outsider"], name="billing", role="viewer").secret
    operator = operator_token_create(user=users["operator"], name="on-call",
                                     role="operator").secret
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            def auth(token: str) -> dict[str, str]:
                return {"Authorization": f"Bearer {token}"}

            run_id = http.post("/api/v1/runs", json={"agent": "support-bot"},
                               headers=auth(agent_token)).json()["run_id"]
            assert http.post(f"/api/v1/runs/{run_id}/local-decisions", json=upload_body(),
                             headers=auth(agent_token)).status_code == 200
            page = f"/api/v1/teams/{team.slug}/runs/{run_id}/decisions?limit=1000"
            # Each token is under its own caps: only the team's share refuses them.
            answers = []
            for i in range(40):
                answers.append(http.get(page, headers=auth(viewers[i % len(viewers)])))
                if answers[-1].status_code == 429:
                    break
            refused = [a for a in answers if a.status_code == 429]
            assert refused, [a.status_code for a in answers]
            assert answers[0].status_code == 200
            error = refused[0].json()["error"]
            assert error["code"] == "too_many_requests"
            assert "share of this server process's time" in error["message"]
            assert int(refused[0].headers["Retry-After"]) >= 10
            # A running run to kill (the upload above ended its run: nothing to kill there).
            running = http.post("/api/v1/runs", json={"agent": "support-bot"},
                                headers=auth(agent_token)).json()["run_id"]
            for method, path, token, body, status in [
                    ("GET", f"/api/v1/teams/{other_team.slug}/runs", theirs, None, 200),
                    ("POST", f"/api/v1/runs/{run_id}/check", agent_token,
                     {"action": {"name": "search.docs", "args": {"q": "x"}}}, 200),
                    ("POST", "/api/v1/killswitch", operator,
                     {"action": "engage", "scope": "run", "run": running,
                      "reason": "paced reads must not hold this"}, 200)]:
                began = time.monotonic()
                answer = http.request(method, path, json=body, headers=auth(token))
                assert answer.status_code == status, (path, answer.text)
                assert time.monotonic() - began < DEADLINE_S, path
    finally:
        server.stop()


def test_only_a_token_found_right_for_a_team_is_paced_as_that_team() -> None:
    """Found by an attacker: bogus tokens naming a team were billed to that team's share
    (its own calls waited up to 8 s), and a new slug on every call was a new share each,
    never paced. A call is its team's once its token was answered for that team in this
    process; every other is one caller with all the calls not known yet."""
    from governance.asgi import _paced_caller
    from runs.check import callers

    good, bogus = "token:" + "a" * 64, "token:" + "b" * 64
    path = "/api/v1/teams/Alpha/runs/1/decisions"
    assert _paced_caller("operator", path, good) == "operator: not known yet"
    callers.remember_operator(good, "alpha")
    assert _paced_caller("operator", path, good) == "slug:alpha"
    assert _paced_caller("operator", "/api/v1/teams/beta/runs", good) == \
        "operator: not known yet"  # found right for alpha only
    for slug in ("alpha", "zzz", "a1b2c3d4"):
        assert _paced_caller("operator", f"/api/v1/teams/{slug}/runs", bogus) == \
            "operator: not known yet"
    assert _paced_caller("operator", "/api/v1/teams", good) == "operator: not known yet"
    callers.remember_operator(good, "")
    assert _paced_caller("operator", "/api/v1/teams", good) == good


def test_a_path_naming_no_possible_team_is_a_json_refusal_not_a_500(users: Any) -> None:
    """Found by an attacker: with a live token, `/api/v1/teams/%00/runs` answered 500 in
    plain text (PostgreSQL refuses a NUL in a query) from the lookup that learns whether the
    token sees the team, which runs before the request's own checks. A slug no team can
    have is answered "does not see it" without a query, and the call then gets the JSON
    refusal every other bad path gets."""
    from policies.tokens import sees_team

    token = operator_token_create(user=users["viewer"], name="fuzz", role="viewer").secret
    assert not sees_team(token, "\x00")
    assert not sees_team(token, "a\x00b")
    server = start_server(workers=1, env=server_env())
    try:
        with httpx.Client(base_url=server.url, timeout=30,
                          headers={"Authorization": f"Bearer {token}"}) as http:
            for method, path in [("GET", "/api/v1/teams/%00/runs"),
                                 ("GET", "/api/v1/teams/a%00b/approvals"),
                                 ("POST", "/api/v1/teams/%00/policies"),
                                 ("GET", "/api/v1/teams/sup%00port/runs")]:
                answer = http.request(method, path, json={} if method == "POST" else None)
                assert 400 <= answer.status_code < 500, (path, answer.status_code, answer.text)
                assert answer.headers["content-type"].startswith("application/json"), path
                assert answer.json()["error"]["code"], path
    finally:
        server.stop()
