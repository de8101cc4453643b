"""SPEC 17 in process (both stacks): operator tokens and the operator API.

Every operator endpoint against every credential (a token of a viewer, an operator, an admin,
a superuser, an admin of another team, an agent key, an expired and a revoked token), in the
Django test client: the roles of SPEC 7 exactly as the dashboard's, 404 for another team,
403 `wrong_credential_kind` both ways, 401 with a code for an expired or revoked token; then
what each endpoint does: the same services and audit events as the pages, the same 409s."""

from __future__ import annotations

import io
import re
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.test import Client
from django.utils import timezone

from governance.middleware import api_key_throttle
from policies.models import OperatorEvent, OperatorToken, Team
from policies.services import agent_key_create
from policies.tokens import operator_token_create, operator_token_revoke
from runs.models import Approval, KillSwitch
from tests.conftest import set_policy

pytestmark = pytest.mark.django_db

CREDENTIALS = ["viewer", "operator", "admin", "superuser", "other_team", "agent_key",
               "expired", "revoked"]
RANK = {"viewer": 1, "operator": 2, "admin": 3, "superuser": 4}
PAY = {"name": "payments.refund", "args": {"order": 42}}


@pytest.fixture
def world(team: Team, other_team: Team, users: dict[str, User]) -> dict[str, Any]:
    """The team with a run, its decisions and a pending approval; a token per credential."""
    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 600})
    key = agent_key_create(team=team, name="agent").token
    agent = Client(HTTP_AUTHORIZATION=f"Bearer {key}")
    run_id = agent.post("/api/v1/runs", {"agent": "support-bot"},
                        content_type="application/json").json()["run_id"]
    answer = agent.post(f"/api/v1/runs/{run_id}/check", {"action": PAY, "check_id": "p1"},
                        content_type="application/json").json()
    assert answer["decision"] == "pending", answer
    approval = Approval.objects.get(run_id=run_id)
    tokens = {name: operator_token_create(user=users[name], name=f"ci-{name}", role="admin"
                                          ).secret
              for name in ("viewer", "operator", "admin", "superuser")}
    tokens["other_team"] = operator_token_create(user=users["outsider"], name="ci-other_team",
                                                 role="admin").secret
    tokens["agent_key"] = key
    expired = operator_token_create(user=users["admin"], name="old", role="admin",
                                    expires_days=1)
    OperatorToken.objects.filter(pk=expired.token.pk).update(
        expires_at=timezone.now() - timedelta(seconds=1))
    tokens["expired"] = expired.secret
    revoked = operator_token_create(user=users["admin"], name="gone", role="admin")
    operator_token_revoke(token=revoked.token, actor=None)
    tokens["revoked"] = revoked.secret
    return {"tokens": tokens, "run_id": run_id, "approval": str(approval.pk), "agent": agent,
            "decision": answer["decision_id"]}


def call(world: dict[str, Any], who: str, method: str, path: str, body: Any = None
         ) -> Any:
    client = Client(HTTP_AUTHORIZATION=f"Bearer {world['tokens'][who]}")
    path = path.format(run=world["run_id"], approval=world["approval"],
                       decision=world["decision"])
    if method == "GET":
        return client.get(path)
    return getattr(client, method.lower())(path, body, content_type="application/json")


DRAFT = {"step_limits": {"max_steps": 40, "max_repeat_action": 3, "no_progress_window": 4},
         "approvals": {"tools": ["payments.*"], "timeout_s": 600}}

# (method, path, body, the least role, what the other team's admin gets)
ENDPOINTS = [
    ("GET", "/api/v1/teams", None, "viewer", 200),
    ("GET", "/api/v1/teams/support/policies", None, "viewer", 404),
    ("GET", "/api/v1/teams/support/policies/default", None, "viewer", 404),
    ("GET", "/api/v1/teams/support/policies/default?version=1", None, "viewer", 404),
    ("GET", "/api/v1/teams/support/policies/default/versions", None, "viewer", 404),
    ("PUT", "/api/v1/teams/support/policies/default", {**DRAFT, "note": "more steps"},
     "admin", 404),
    ("POST", "/api/v1/teams/support/policies/default/backtest", DRAFT, "viewer", 404),
    ("POST", "/api/v1/killswitch", {"action": "engage", "scope": "team", "team": "support",
                                    "reason": "test"}, "operator", 404),
    ("POST", "/api/v1/killswitch", {"action": "engage", "scope": "agent", "team": "support",
                                    "agent": "support-bot", "reason": "test"},
     "operator", 404),
    ("POST", "/api/v1/killswitch", {"action": "engage", "scope": "run", "run": "{run}",
                                    "reason": "test"}, "operator", 404),
    ("POST", "/api/v1/killswitch", {"action": "engage", "scope": "global", "reason": "test"},
     "superuser", 403),
    ("GET", "/api/v1/teams/support/approvals?status=pending", None, "viewer", 404),
    ("POST", "/api/v1/approvals/{approval}/decide", {"decision": "approve", "note": "ok"},
     "operator", 404),
    ("GET", "/api/v1/teams/support/runs", None, "viewer", 404),
    ("GET", "/api/v1/teams/support/runs/{run}", None, "viewer", 404),
    ("GET", "/api/v1/teams/support/runs/{run}/decisions", None, "viewer", 404),
    ("GET", "/api/v1/teams/support/decisions/{decision}", None, "viewer", 404),
]


def _expected(who: str, least: str, other: int) -> tuple[int, str | None]:
    if who == "agent_key":
        return 403, "wrong_credential_kind"
    if who == "expired":
        return 401, "token_expired"
    if who == "revoked":
        return 401, "token_revoked"
    if who == "other_team":
        return other, {200: None, 404: "not_found"}.get(other, "forbidden")
    if RANK[who] < RANK[least]:
        return 403, "forbidden"
    return 200, None


def _body(body: Any, world: dict[str, Any]) -> Any:
    if isinstance(body, dict):
        return {k: (v.format(run=world["run_id"]) if isinstance(v, str) else v)
                for k, v in body.items()}
    return body


@pytest.mark.parametrize("who", CREDENTIALS)
def test_every_endpoint_answers_each_credential_as_the_dashboard_would(world, who):
    for method, path, body, least, other in ENDPOINTS:
        api_key_throttle.forget()
        before = OperatorEvent.objects.count()
        response = call(world, who, method, path, _body(body, world))
        status, code = _expected(who, least, other)
        assert response.status_code == status, (method, path, response.content)
        assert response["Content-Type"].startswith("application/json")
        if code is not None:
            assert response.json()["error"]["code"] == code, (path, response.content)
        else:
            # Every use of a token is in the audit log, naming the token.
            event = OperatorEvent.objects.order_by("-id").first()
            assert OperatorEvent.objects.count() > before, (method, path)
            assert event.detail["token"]["name"] == f"ci-{who}", event.detail
            assert f"(token ci-{who})" in event.actor_label
        if path.endswith("/decide") and status == 200:
            assert response.json()["status"] == "approved"
        if body and body.get("scope") and status == 200:
            # Released again, so the next endpoint's run is not killed by it.
            KillSwitch.objects.update(active=False)


def test_an_operator_token_on_the_agent_api_is_the_wrong_kind(world):
    op = Client(HTTP_AUTHORIZATION=f"Bearer {world['tokens']['admin']}")
    for method, path in [("GET", "/api/v1/runs"), ("GET", f"/api/v1/runs/{world['run_id']}"),
                         ("POST", f"/api/v1/runs/{world['run_id']}/check"),
                         ("POST", "/api/v1/runs")]:
        response = (op.get(path) if method == "GET" else
                    op.post(path, {"action": {"name": "x"}, "agent": "a"},
                            content_type="application/json"))
        assert response.status_code == 403, (path, response.content)
        assert response.json()["error"]["code"] == "wrong_credential_kind"


def test_missing_and_unknown_tokens_are_401_and_failures_are_throttled(world, settings):
    assert Client().get("/api/v1/teams").json()["error"]["code"] == "unauthorized"
    fake = "gov_op_0123456789ab_" + "x" * 43
    bad = Client(HTTP_AUTHORIZATION=f"Bearer {fake}")
    limit = settings.THROTTLE_API_KEY_FAILURES
    for _ in range(limit):
        assert bad.get("/api/v1/teams").status_code == 401
    refused = bad.get("/api/v1/teams")
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "too_many_failures"
    assert int(refused["Retry-After"]) > 0
    # Another token from the same address is another bucket: a valid one still works.
    assert call(world, "admin", "GET", "/api/v1/teams").status_code == 200


def test_a_team_token_sees_its_team_only_and_the_lesser_role_wins(world, users, other_team):
    from policies.services import membership_set

    membership_set(team=other_team, user=users["admin"], role="admin", actor=None)
    bound = operator_token_create(user=users["admin"], name="bound", role="viewer",
                                  team=Team.objects.get(slug="support")).secret
    client = Client(HTTP_AUTHORIZATION=f"Bearer {bound}")
    teams = client.get("/api/v1/teams").json()["teams"]
    assert teams == [{"slug": "support", "name": "Customer support", "role": "viewer"}]
    assert client.get("/api/v1/teams/billing/policies").status_code == 404
    refused = client.put("/api/v1/teams/support/policies/default",
                         {**DRAFT, "note": "x"}, content_type="application/json")
    assert refused.status_code == 403
    # The owner's role bounds the token's: a viewer's admin token is a viewer.
    client = Client(HTTP_AUTHORIZATION=f"Bearer {world['tokens']['viewer']}")
    assert client.get("/api/v1/teams").json()["teams"][0]["role"] == "viewer"


def test_put_validates_saves_and_says_when_nothing_changed(world, users):
    path = "/api/v1/teams/support/policies/default"
    bad = call(world, "admin", "PUT", path, {"step_limits": {"max_steps": -1}, "mode": "x",
                                              "note": "bad"})
    assert bad.status_code == 422
    fields = bad.json()["error"]["fields"]
    assert "step_limits.max_steps" in fields and "mode" in fields, fields
    assert call(world, "admin", "PUT", path, DRAFT).json()["error"]["fields"] == {
        "note": "Field required"} or "note" in call(world, "admin", "PUT", path, DRAFT
                                                    ).json()["error"]["fields"]
    wrong = call(world, "admin", "PUT", path, {**DRAFT, "name": "other", "note": "x"})
    assert wrong.status_code == 422 and "name" in wrong.json()["error"]["fields"]
    saved = call(world, "admin", "PUT", path, {**DRAFT, "note": "more steps"}).json()
    assert saved["changed"] is True and saved["document"]["step_limits"]["max_steps"] == 40
    again = call(world, "admin", "PUT", path, {**DRAFT, "note": "again"}).json()
    assert again["changed"] is False and again["version"] == saved["version"]
    event = OperatorEvent.objects.filter(action="policy.version").order_by("-id").first()
    assert event.detail["source"] == "api" and event.detail["token"]["name"] == "ci-admin"
    browser = Client()
    browser.force_login(users["admin"])
    assert "admin (token ci-admin)" in browser.get("/teams/support/audit/").content.decode()
    versions = call(world, "admin", "GET", path + "/versions").json()["versions"]
    assert [v["version"] for v in versions][:2] == [saved["version"], saved["version"] - 1]
    old = call(world, "admin", "GET", path + "?version=1").json()
    assert old["version"] == 1
    assert call(world, "admin", "GET", path + "?version=99").status_code == 404
    assert call(world, "admin", "GET", path + "/../nope").status_code == 404


def test_a_422_names_the_requests_and_the_policys_bad_fields_together(world):
    """SPEC 17: a PUT is "422 naming each bad field": a body without its note and with a bad
    limit named the note alone, and the limit only at the next try."""
    path = "/api/v1/teams/support/policies/default"
    bad = call(world, "admin", "PUT", path, {"step_limits": {"max_steps": 0,
                                                             "max_repeat_action": 3},
                                             "confirm_stops": "maybe", "bogus": 1})
    assert bad.status_code == 422
    fields = bad.json()["error"]["fields"]
    assert {"note", "confirm_stops", "step_limits.max_steps",
            "step_limits.no_progress_window", "bogus"} <= set(fields), fields
    assert fields["bogus"] == "unknown field"
    # A backtest's draft too, with its own bad field; without a draft the current version
    # is replayed, so only the request's own field is named.
    tested = call(world, "viewer", "POST", path + "/backtest",
                  {"limit": 0, "step_limits": {"max_steps": 0, "max_repeat_action": 3,
                                               "no_progress_window": 4}})
    assert tested.status_code == 422
    assert set(tested.json()["error"]["fields"]) == {"limit", "step_limits.max_steps"}
    alone = call(world, "viewer", "POST", path + "/backtest", {"limit": 0})
    assert alone.json()["error"]["fields"] == {
        "limit": "Input should be greater than or equal to 1"}
    assert not OperatorEvent.objects.filter(action="policy.version", detail__source="api"
                                            ).exists()


def test_a_dry_run_put_answers_what_the_save_would_and_saves_nothing(world):
    path = "/api/v1/teams/support/policies/default"
    current = call(world, "admin", "GET", path).json()
    would = call(world, "admin", "PUT", path, {**DRAFT, "note": "try", "dry_run": True}).json()
    assert would["dry_run"] is True and would["changed"] is True, would
    assert would["version"] == current["version"] + 1
    assert would["document"]["step_limits"]["max_steps"] == 40
    assert call(world, "admin", "GET", path).json()["version"] == current["version"]
    new = call(world, "admin", "PUT", "/api/v1/teams/support/policies/fresh",
               {**DRAFT, "note": "try", "dry_run": True}).json()
    assert new["version"] == 1 and new["changed"] is True
    assert call(world, "admin", "GET", "/api/v1/teams/support/policies/fresh").status_code == 404
    bad = call(world, "admin", "PUT", path, {"step_limits": {"max_steps": -1}, "note": "x",
                                              "dry_run": True})
    assert bad.status_code == 422 and "step_limits.max_steps" in bad.json()["error"]["fields"]
    # A dry run asks what the save asks: the admin role.
    assert call(world, "viewer", "PUT", path, {**DRAFT, "note": "x", "dry_run": True}
                ).status_code == 403
    assert OperatorEvent.objects.filter(action="token.dry_run").exists()


def test_a_change_that_stops_most_recent_runs_needs_confirm_stops(world):
    agent = world["agent"]
    for _ in range(3):
        run_id = agent.post("/api/v1/runs", {"agent": "support-bot"},
                            content_type="application/json").json()["run_id"]
        agent.post(f"/api/v1/runs/{run_id}/check", {"action": {"name": "search.docs"}},
                   content_type="application/json")
        agent.post(f"/api/v1/runs/{run_id}/finish", {"status": "completed"},
                   content_type="application/json")
    deny_all = {**DRAFT, "tools": {"allow": []}, "note": "lock down"}
    path = "/api/v1/teams/support/policies/default"
    asked = call(world, "admin", "PUT", path, deny_all)
    assert asked.status_code == 409, asked.content
    error = asked.json()["error"]
    assert error["code"] == "confirmation_required"
    assert error["impacts"][0]["policy"] == "default"
    assert error["impacts"][0]["stopped_at_once"] == error["impacts"][0]["runs"] >= 3
    saved = call(world, "admin", "PUT", path, {**deny_all, "confirm_stops": True})
    assert saved.status_code == 200 and saved.json()["changed"] is True


def test_backtest_answers_the_output_of_section_13(world):
    agent = world["agent"]
    run_id = agent.post("/api/v1/runs", {"agent": "support-bot"},
                        content_type="application/json").json()["run_id"]
    for _ in range(3):
        agent.post(f"/api/v1/runs/{run_id}/check", {"action": {"name": "search.docs"}},
                   content_type="application/json")
    agent.post(f"/api/v1/runs/{run_id}/finish", {"status": "completed"},
               content_type="application/json")
    draft = {**DRAFT, "step_limits": {**DRAFT["step_limits"], "max_steps": 1}}
    report = call(world, "viewer", "POST", "/api/v1/teams/support/policies/default/backtest",
                  draft).json()
    assert "policy" in report, report
    assert report["policy"] == "default" and report["changed"] == 1, report
    assert report["by_reason"] == {"max_steps": 1}
    assert {"runs", "changes", "not_simulated", "summary"} <= set(report)
    bad = call(world, "viewer", "POST", "/api/v1/teams/support/policies/default/backtest",
               {"since": "forever"})
    assert bad.status_code == 422 and "since" in bad.json()["error"]["fields"]
    # The API's field, not the command line's option (the message said "--since must be").
    assert bad.json()["error"]["message"].startswith("since must be a whole number from 1")
    # A count past the form's six digits, or not whole, is told so, not "positive".
    for since in ("1.5d", "9999999d"):
        told = call(world, "viewer", "POST",
                    "/api/v1/teams/support/policies/default/backtest", {"since": since})
        assert told.status_code == 422, told.content
        assert "whole number from 1 to 999999" in told.json()["error"]["message"]
    assert "--" not in bad.json()["error"]["fields"]["since"]
    # No body at all (`curl -X POST`), like {}: the current version, which changes nothing
    # it recorded. (An empty body sent as JSON is not JSON: 400 invalid_json.)
    client = Client(HTTP_AUTHORIZATION=f"Bearer {world['tokens']['viewer']}")
    current = client.generic("POST", "/api/v1/teams/support/policies/default/backtest")
    assert current.status_code == 200, current.content
    assert current.json()["changed"] == 0


def test_a_backtest_past_the_teams_bound_or_its_wait_says_so(world, settings, monkeypatch):
    from operator_api import api as operator_api

    path = "/api/v1/teams/support/policies/default/backtest"
    settings.BACKTEST_MAX_PER_TEAM = 0
    busy = call(world, "viewer", "POST", path, {})
    assert busy.status_code == 429 and busy.json()["error"]["code"] == "too_many_backtests"
    assert busy["Retry-After"]
    settings.BACKTEST_MAX_PER_TEAM = 2
    # No worker took it within the wait: 503, naming the page where it finishes.
    monkeypatch.setattr(operator_api, "backtest_wait", lambda job, seconds: job)
    waited = call(world, "viewer", "POST", path, {})
    assert waited.status_code == 503, waited.content
    assert "/teams/support/backtests/" in waited.json()["error"]["message"]


def test_killswitch_engage_release_and_who_may_release(world):
    engage = {"action": "engage", "scope": "team", "team": "support", "reason": "incident"}
    first = call(world, "admin", "POST", "/api/v1/killswitch", engage).json()
    assert first["engaged"] is True and first["changed"] is True
    assert first["message"] == "The kill switch over team support is engaged."
    started = world["agent"].post("/api/v1/runs", {"agent": "support-bot"},
                                  content_type="application/json")
    assert started.status_code == 409  # the switch covers the team from its commit on
    again = call(world, "operator", "POST", "/api/v1/killswitch", engage).json()
    assert again["changed"] is False
    assert again["message"] == ("The kill switch over team support was already engaged: "
                                "nothing changed.")
    # A use that changed nothing is in the audit log too, naming the token.
    noop = OperatorEvent.objects.order_by("-id").first()
    assert noop.action == "token.unchanged" and noop.detail["token"]["name"] == "ci-operator"
    release = {**engage, "action": "release", "reason": "over"}
    # SPEC 7, the team's default: only admins release a team switch.
    refused = call(world, "operator", "POST", "/api/v1/killswitch", release)
    assert refused.status_code == 403
    done = call(world, "admin", "POST", "/api/v1/killswitch", release).json()
    assert done["engaged"] is False and done["changed"] is True
    nothing = call(world, "admin", "POST", "/api/v1/killswitch", release).json()
    # SPEC 6: releasing a switch that is not engaged says so and succeeds.
    assert nothing["changed"] is False and nothing["engaged"] is False
    assert nothing["message"] == ("The kill switch over team support is not engaged: "
                                  "nothing to release.")
    event = OperatorEvent.objects.filter(action="killswitch.release").get()
    assert event.detail["token"]["name"] == "ci-admin"
    bad = call(world, "admin", "POST", "/api/v1/killswitch",
               {"action": "engage", "scope": "team", "reason": "x"})
    assert bad.status_code == 422 and "team" in bad.json()["error"]["fields"]
    unknown = call(world, "admin", "POST", "/api/v1/killswitch",
                   {"action": "explode", "scope": "team", "team": "support", "reason": "x"})
    assert unknown.status_code == 422 and "action" in unknown.json()["error"]["fields"]


def test_a_viewer_refused_a_release_is_told_the_role_that_releases_here(world):
    # A viewer was told "This needs the Operator role." of a release only admins may make.
    engage = {"action": "engage", "scope": "team", "team": "support", "reason": "incident"}
    assert call(world, "admin", "POST", "/api/v1/killswitch", engage).status_code == 200
    release = {**engage, "action": "release", "reason": "over"}
    refused = call(world, "viewer", "POST", "/api/v1/killswitch", release)
    assert refused.status_code == 403
    assert refused.json()["error"]["message"] == "This needs the Admin role."
    engaging = call(world, "viewer", "POST", "/api/v1/killswitch",
                    {**engage, "scope": "agent", "agent": "support-bot"})
    assert engaging.json()["error"]["message"] == "This needs the Operator role."
    # Where the team lets operators release, an operator would: that is the role named.
    Team.objects.filter(slug="support").update(operator_release="any")
    refused = call(world, "viewer", "POST", "/api/v1/killswitch", release)
    assert refused.json()["error"]["message"] == "This needs the Operator role."
    assert KillSwitch.objects.get(scope="team").released_at is None


def test_a_switch_missing_an_option_names_it_in_fields(world):
    for body, field in [
        ({"scope": "agent", "team": "support"}, "agent"),
        ({"scope": "team", "team": "support", "agent": "bot"}, "agent"),
        ({"scope": "team", "team": "support", "reason": "  "}, "reason"),
    ]:
        refused = call(world, "admin", "POST", "/api/v1/killswitch",
                       {"action": "engage", "reason": "incident", **body})
        assert refused.status_code == 422, refused.content
        assert field in refused.json()["error"]["fields"], refused.json()
    assert not KillSwitch.objects.exists()


def test_a_run_given_to_a_team_or_agent_switch_is_refused_not_dropped(world):
    # Dropped, it engaged the switch of the whole team for a caller who meant one run.
    for scope, extra in (("team", {}), ("agent", {"agent": "support-bot"})):
        refused = call(world, "operator", "POST", "/api/v1/killswitch",
                       {"action": "engage", "scope": scope, "team": "support",
                        "run": world["run_id"], "reason": "this run loops", **extra})
        assert refused.status_code == 422, refused.content
        assert "run" in refused.json()["error"]["fields"]
        article = "An" if scope == "agent" else "A"
        assert refused.json()["error"]["message"].startswith(f"{article} {scope} switch ")
    assert not KillSwitch.objects.exists()
    # "An agent switch", not "A agent switch" (found by a reviewer).
    refused = call(world, "operator", "POST", "/api/v1/killswitch",
                   {"action": "engage", "scope": "agent", "agent": "support-bot",
                    "reason": "x"})
    assert refused.json()["error"]["message"] == "An agent switch needs the team."


@pytest.mark.parametrize("path", [
    "/api/v1/teams/%00/policies", "/api/v1/teams/sup%00port/runs",
    "/api/v1/teams/%00/approvals", "/api/v1/teams/support/policies/%00",
    "/api/v1/teams/support/policies/de%00fault/versions",
])
def test_a_path_no_team_or_policy_can_have_is_not_found(world, path):
    # A NUL reached PostgreSQL, which refuses it in a query: a 503 "store refused" for a
    # caller's typo (or probe) instead of the 404 of any other missing team or policy.
    response = call(world, "admin", "GET", path)
    assert response.status_code == 404, response.content
    assert response.json()["error"]["code"] == "not_found"


def test_decide_lists_and_answers_409_as_section_11(world):
    pending = call(world, "viewer", "GET",
                   "/api/v1/teams/support/approvals?status=pending").json()["approvals"]
    assert [a["id"] for a in pending] == [world["approval"]]
    path = "/api/v1/approvals/{approval}/decide"
    no_note = call(world, "operator", "POST", path, {"decision": "deny"})
    assert no_note.status_code == 422 and "note" in no_note.json()["error"]["fields"]
    done = call(world, "operator", "POST", path, {"decision": "approve", "note": "ok"})
    assert done.status_code == 200 and done.json()["status"] == "approved"
    twice = call(world, "admin", "POST", path, {"decision": "deny", "note": "no"})
    assert twice.status_code == 409 and twice.json()["error"]["code"] == "approval_decided"
    assert call(world, "admin", "POST", "/api/v1/approvals/nope/decide",
                {"decision": "approve"}).status_code == 404


def test_create_operator_token_prints_the_token_alone_on_the_last_line(world, users):
    out = io.StringIO()
    call_command("create_operator_token", "--user", "operator", "--team", "support",
                 "--role", "operator", "--expires-days", "7", stdout=out)
    token = out.getvalue().strip().splitlines()[-1]
    assert token.startswith("gov_op_")
    client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")
    assert client.get("/api/v1/teams").json()["teams"][0]["role"] == "operator"
    with pytest.raises(Exception, match="not a member"):
        call_command("create_operator_token", "--user", "viewer", "--team", "billing",
                     "--role", "viewer", stdout=io.StringIO())
    # A role above the owner's is allowed (the token acts with the lesser) and said at once,
    # not at the automation's first 403; the token is still alone on the last line.
    out, err = io.StringIO(), io.StringIO()
    call_command("create_operator_token", "--user", "operator", "--team", "support",
                 "--role", "admin", stdout=out, stderr=err)
    assert err.getvalue().strip() == ("Note: operator is an operator of team support, so "
                                      "this token acts there as an operator, not as an admin.")
    assert out.getvalue().strip().splitlines()[-1].startswith("gov_op_")
    quiet = io.StringIO()
    call_command("create_operator_token", "--user", "operator", "--team", "support",
                 "--role", "viewer", stdout=io.StringIO(), stderr=quiet)
    assert quiet.getvalue() == ""
    # For every team of the owner, the same note names each team where it acts with less.
    err = io.StringIO()
    call_command("create_operator_token", "--user", "operator", "--role", "admin",
                 stdout=io.StringIO(), stderr=err)
    assert err.getvalue().strip() == ("Note: operator is an operator of team support, so "
                                      "this token acts there with that role, not as an admin.")


def test_the_account_page_creates_shows_once_lists_and_revokes(world, users):
    browser = Client()
    browser.force_login(users["operator"])
    page = browser.get("/accounts/tokens/")
    assert page.status_code == 200
    made = browser.post("/accounts/tokens/", {"name": "chatops", "role": "operator",
                                              "team": "support", "expires_days": "30"},
                        follow=True)
    text = made.content.decode()
    assert "gov_op_" in text and "chatops" in text
    assert "data-new-token" not in browser.get("/accounts/tokens/").content.decode()
    # An operator's admin token acts as an operator: the list says so (found by a newcomer).
    browser.post("/accounts/tokens/", {"name": "ci-bot", "role": "admin", "team": "support"})
    listed = browser.get("/accounts/tokens/").content.decode()
    assert 'data-acts-as="operator">(acts as operator, your role)' in listed
    assert listed.count("data-acts-as=") == 1  # the operator token acts as itself
    token = OperatorToken.objects.get(name="chatops")
    assert token.team.slug == "support" and token.expires_at is not None
    refused = browser.post("/accounts/tokens/", {"name": "x", "role": "admin",
                                                 "team": "billing"})
    assert refused.status_code == 422
    other = Client()
    other.force_login(users["viewer"])
    assert other.post(f"/accounts/tokens/{token.pk}/revoke").status_code == 404
    browser.post(f"/accounts/tokens/{token.pk}/revoke")
    token.refresh_from_db()
    assert token.revoked_at is not None


def test_a_person_has_a_bounded_number_of_live_tokens_and_their_page_is_bounded(
        team, users, django_assert_max_num_queries):
    """Found by an attacker: any signed-in person (a viewer) could make tokens without end
    (100 a second at the form), and the account page, of no team and so paced with none,
    listed every one with a query each: 10,000 tokens made it 6.6 MB and 10 s, and four tabs
    of it held every dashboard thread and slowed another team's checks 30x. A person has at
    most MAX_LIVE_TOKENS live tokens; the page lists them and the latest ended ones, in a
    bounded number of queries."""
    from policies import tokens

    viewer = users["viewer"]
    for i in range(tokens.MAX_LIVE_TOKENS):
        operator_token_create(user=viewer, name=f"t{i}", role="viewer",
                              team=team if i % 2 else None)
    browser = Client()
    browser.force_login(viewer)
    refused = browser.post("/accounts/tokens/", {"name": "one-more", "role": "viewer"})
    assert refused.status_code == 422
    assert "as many as a person may" in refused.content.decode()
    assert not OperatorToken.objects.filter(name="one-more").exists()
    # An ended token (revoked, expired) is not a live one: making one is possible again.
    first = OperatorToken.objects.get(user=viewer, name="t0")
    operator_token_revoke(token=first, actor=None)
    OperatorToken.objects.filter(user=viewer, name="t1").update(
        expires_at=timezone.now() - timedelta(seconds=1))
    assert browser.post("/accounts/tokens/", {"name": "again", "role": "viewer"}
                        ).status_code == 302
    # Ended tokens pile up (made and revoked over years): the page lists the latest only.
    now = timezone.now()
    OperatorToken.objects.bulk_create([
        OperatorToken(user=viewer, name=f"old{i}", team=team, role="viewer",
                      prefix=f"{i:012x}", token_hash="0" * 64, revoked_at=now)
        for i in range(300)])
    # A few queries whatever the tokens (12 on SQLite, 13 on PostgreSQL), not one a token.
    with django_assert_max_num_queries(16):
        page = browser.get("/accounts/tokens/")
    text = page.content.decode()
    assert page.status_code == 200
    live = tokens.MAX_LIVE_TOKENS - 1  # two ended, one made again
    assert text.count("<code>gov_op_") == live + tokens.ENDED_TOKENS_SHOWN
    left_out = 302 - tokens.ENDED_TOKENS_SHOWN  # t0, t1 and the 300 old ones ended
    assert f'data-left-out="{left_out}"' in text
    # The command line keeps the bound too.
    operator_token_create(user=viewer, name="the-last", role="viewer")
    with pytest.raises(CommandError, match="as many as a person may"):
        call_command("create_operator_token", "--user", "viewer", "--role", "viewer",
                     stdout=io.StringIO())


def test_the_operator_api_is_in_the_openapi_document_with_its_own_scheme(client):
    doc = client.get("/api/v1/openapi.json").json()
    schemes = doc["components"]["securitySchemes"]
    assert {"AgentKeyAuth", "OperatorTokenAuth"} <= set(schemes)
    put = doc["paths"]["/api/v1/teams/{slug}/policies/{name}"]["put"]
    assert put["security"] == [{"OperatorTokenAuth": []}]
    assert "/api/v1/killswitch" in doc["paths"]


def test_operator_paths_run_on_their_own_pool_never_the_checks():
    from governance.pools import pool_name

    assert pool_name("/api/v1/runs/x/check") == "api"
    assert pool_name("/api/v1/approvals/abc") == "api"
    for path in ("/api/v1/teams", "/api/v1/teams/a/policies/b",
                 "/api/v1/approvals/abc/decide"):
        assert pool_name(path) == "operator"
    # A kill switch has a pool of its own: no read stands before it
    # (tests/test_operator_fair_share.py).
    assert pool_name("/api/v1/killswitch") == pool_name("/api/v1/killswitch/") == "killswitch"
    # A backtest waits for its replay on a pool of its own: it never holds a kill switch's
    # thread (tests/test_operator_backtest_isolation.py).
    assert pool_name("/api/v1/teams/a/policies/b/backtest") == "backtest"
    assert pool_name("/api/v1/teams/a/policies/backtest") == "operator"


def test_the_matrix_covers_every_operator_operation(client):
    doc = client.get("/api/v1/openapi.json").json()
    documented = {(method.upper(), path) for path, methods in doc["paths"].items()
                  for method, op in methods.items()
                  if op.get("security") == [{"OperatorTokenAuth": []}]}
    covered = {(method, path.split("?")[0].replace("support", "{slug}")
                .replace("/default", "/{name}").replace("{run}", "{run_id}")
                .replace("{approval}", "{approval_id}")
                .replace("{decision}", "{decision_id}"))
               for method, path, *_ in ENDPOINTS}
    assert documented == covered


def test_a_run_read_by_an_operator_is_the_run_the_agent_reads_with_its_tree(world):
    """SPEC 17's runs are "as 5.1": with SPEC 20's children and tree usage, as the agent's
    own read has them (found by a newcomer: automation could not walk a tree)."""
    agent = world["agent"]
    child = agent.post("/api/v1/runs", {"agent": "helper", "parent_run_id": world["run_id"]},
                       content_type="application/json")
    assert child.status_code == 201, child.content
    read = call(world, "viewer", "GET", "/api/v1/teams/support/runs/{run}")
    assert read.status_code == 200, read.content
    theirs = agent.get(f"/api/v1/runs/{world['run_id']}").json()
    assert read.json()["children"] == theirs["children"] == [child.json()["run_id"]]
    assert read.json()["tree_usage"] == theirs["tree_usage"]
    assert set(read.json()) == set(theirs)


@pytest.mark.parametrize("who", ["expired", "revoked"])
def test_a_dead_token_is_told_where_to_get_a_new_one(world, who):
    """A CI job whose token expired or was revoked is told what to do, not only what
    happened: the message named the token and stopped there."""
    message = call(world, who, "GET", "/api/v1/teams", None).json()["error"]["message"]
    assert "/accounts/tokens/" in message and "create_operator_token" in message, message


def test_a_token_of_a_deactivated_account_is_said_so_when_made_and_when_used(world, users):
    """A token made for a deactivated account never works: the command said nothing and the
    API answered "A valid operator token is required", as for a mistyped one."""
    owner = users["operator"]
    owner.is_active = False
    owner.save(update_fields=["is_active"])
    out, err = io.StringIO(), io.StringIO()
    call_command("create_operator_token", "--user", "operator", "--team", "support",
                 "--role", "operator", stdout=out, stderr=err)
    assert "operator's account is deactivated" in err.getvalue(), err.getvalue()
    token = out.getvalue().strip().splitlines()[-1]
    answer = Client(HTTP_AUTHORIZATION=f"Bearer {token}").get("/api/v1/teams")
    assert answer.status_code == 401
    assert answer.json()["error"]["code"] == "unauthorized"
    assert "deactivated account" in answer.json()["error"]["message"], answer.content
    # Someone without the whole secret learns nothing of the account.
    wrong = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
    answer = Client(HTTP_AUTHORIZATION=f"Bearer {wrong}").get("/api/v1/teams")
    assert answer.status_code == 401
    assert "deactivated" not in answer.json()["error"]["message"]
    owner.is_active = True
    owner.save(update_fields=["is_active"])
    assert Client(HTTP_AUTHORIZATION=f"Bearer {token}").get("/api/v1/teams").status_code == 200


def test_a_superusers_token_for_every_team_says_what_it_may_do(world, users):
    """A superuser is a member of no team: "every team of the owner" read as none. The
    command says every team, and whether the token is a superuser's (the global switch)."""
    out = io.StringIO()
    call_command("create_operator_token", "--user", "root", "--role", "admin",
                 stdout=out, stderr=io.StringIO())
    assert ("every team, as a superuser (the global kill switch too)"
            in out.getvalue().splitlines()[0]), out.getvalue()
    out = io.StringIO()
    call_command("create_operator_token", "--user", "root", "--role", "operator",
                 stdout=out, stderr=io.StringIO())
    assert ("every team, as an operator (a superuser's token acts as a superuser only with "
            "the admin role)" in out.getvalue().splitlines()[0]), out.getvalue()



@pytest.mark.django_db(transaction=True)
def test_a_backtest_start_never_publishes_on_the_request_thread(world, settings, monkeypatch):
    """With a broker, the backtest's task goes to the process's publisher thread: the request
    never waits for Redis (SPEC 10). Published on the request's thread, a Redis that hangs
    held it about 2.5 s (the publish's timeouts and retries), then kombu's OperationalError
    was raised out of the commit: a 500 (found by an attacker). While the broker is down the
    job waits, queued, within the team's bound."""
    from kombu.exceptions import OperationalError

    from backtests.models import Backtest, Status
    from backtests.tasks import backtest_run_task
    from governance.celery import app as celery_app
    from operator_api import api as operator_api
    from runs.publisher import publisher

    def on_this_thread(*args: Any, **kwargs: Any) -> None:
        raise OperationalError("Timeout reading from 127.0.0.1:6379")

    submitted: list[tuple[Any, ...]] = []
    monkeypatch.setattr(backtest_run_task, "delay", on_this_thread)
    monkeypatch.setattr(backtest_run_task, "apply_async", on_this_thread)
    monkeypatch.setattr(publisher, "submit", lambda task, *args, **kw: submitted.append(
        (task, *args)))
    monkeypatch.setattr(operator_api, "backtest_wait", lambda job, seconds: job)
    settings.BACKTEST_MAX_PER_TEAM = 1
    path = "/api/v1/teams/support/policies/default/backtest"
    eager = celery_app.conf.task_always_eager
    celery_app.conf.task_always_eager = False  # a broker: the production stack
    try:
        waited = call(world, "viewer", "POST", path, {})
        busy = call(world, "viewer", "POST", path, {})
    finally:
        celery_app.conf.task_always_eager = eager
    assert waited.status_code == 503, waited.content
    assert waited.json()["error"]["code"] == "unavailable"
    job = Backtest.objects.get()
    assert job.status == Status.QUEUED
    assert submitted == [(backtest_run_task.name, str(job.pk))]
    # The queued job holds the team's one slot until it runs or grows stale.
    assert busy.status_code == 429 and busy.json()["error"]["code"] == "too_many_backtests"


def test_the_token_forms_team_hint_names_the_choice_it_has(world, users):
    """Found by a newcomer: the hint said "Empty: every team you are in." beside a list with
    no empty choice, whose first one reads "every team"."""
    browser = Client()
    browser.force_login(users["operator"])
    page = browser.get("/accounts/tokens/").content.decode()
    assert re.search(r'<option value=""[^>]*>\s*every team</option>', page)
    assert "Empty: every team" not in page
    assert "&quot;every team&quot;: each team you are a member of" in page
