"""Text that cannot be stored (NUL, a lone surrogate: governance/text.py) is refused as the
caller's error on every input surface, and nothing changes. PostgreSQL refuses NUL in text
and jsonb, so before this a NUL in a dashboard filter, a decision's note or a YAML import
reached the database as a 500 there (and was stored as given on SQLite)."""

from __future__ import annotations

import pytest
from django.test import Client

from policies.models import Team
from runs.models import Approval
from tests.conftest import set_policy
from tests.test_approvals_api import PAY, check, start

pytestmark = pytest.mark.django_db


@pytest.fixture
def approving(team: Team) -> Team:
    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 600})
    return team


def signed_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.mark.parametrize("path", [
    "runs/?q=%00", "runs/?agent=a%00b", "runs/?stop_reason=%00", "audit/?action=%00",
    "audit/?actor=%00",
])
def test_a_page_filter_that_cannot_be_stored_is_a_400(team, users, path):
    viewer = signed_in(users["viewer"])
    response = viewer.get(f"/teams/{team.slug}/{path}")
    assert response.status_code == 400
    assert b"nothing was changed" in response.content
    assert viewer.get(f"/teams/{team.slug}/runs/?q=ok").status_code == 200


@pytest.mark.parametrize("path", ["/accounts/reset/%00/abc/",
                                  "/accounts/reset/a%00b/set-password/"])
def test_a_path_that_cannot_be_stored_is_a_400_without_signing_in(db, path):
    # Found by an attacker: an invitation's key is a free-text path segment, and a NUL in it
    # reached PostgreSQL as a 500 for anyone.
    response = Client().get(path)
    assert response.status_code == 400
    assert b"nothing was changed" in response.content


def test_a_decision_note_with_nul_is_refused_and_the_approval_stays_pending(
        api, approving, users):
    run_id = start(api)
    answer = check(api, run_id, PAY, check_id="pay-1")
    approval_id = answer["approval"]["id"]
    operator = signed_in(users["operator"])
    url = f"/teams/{approving.slug}/approvals/{approval_id}/decide"
    response = operator.post(url, {"decision": "deny", "note": "a\x00b"})
    assert response.status_code == 400
    assert Approval.objects.get(pk=approval_id).status == "pending"
    assert operator.post(url, {"decision": "deny", "note": "no"}).status_code == 302
    assert Approval.objects.get(pk=approval_id).note == "no"


def test_a_policy_import_with_a_nul_escape_is_a_field_error_and_changes_nothing(team, users):
    admin = signed_in(users["admin"])
    document = f'teams:\n- slug: {team.slug}\n  name: "a\\0b"\n'
    response = admin.post(f"/teams/{team.slug}/policies-import", {"document": document})
    assert response.status_code == 422
    assert b"teams.0.name" in response.content and b"NUL" in response.content
    assert Team.objects.get(pk=team.pk).name == team.name


def test_the_api_still_names_the_field(api):
    run_id = start(api)
    response = api.post(f"/api/v1/runs/{run_id}/check", {"action": {"name": "a\x00b"}},
                        content_type="application/json")
    assert response.status_code == 422
    assert "action.name" in response.json()["error"]["fields"]
