"""Policy history: a change note on every save, "restore this version", diffs between any
two versions (issue 15)."""

from __future__ import annotations

import pytest
from django.urls import reverse

from policies.models import OperatorEvent, Policy
from tests.test_dashboard_policies import admin, form_data  # noqa: F401 (fixture)
from tests.test_dashboard_runs import as_user

pytestmark = pytest.mark.django_db


def policy(team) -> Policy:
    return Policy.objects.get(team=team, name="default")


def test_a_save_needs_a_change_note_which_the_history_shows(team, admin):  # noqa: F811
    save = reverse("policy_save", kwargs={"slug": team.slug, "name": "default"})
    refused = admin.post(save, form_data(max_steps="9", note="  "))
    assert refused.status_code == 422 and "Say what changed and why" in refused.content.decode()
    assert policy(team).current.version == 1
    assert admin.post(save, form_data(max_steps="9", note="loops end sooner")).status_code == 302
    current = policy(team).current
    assert (current.version, current.note) == (2, "loops end sooner")
    event = OperatorEvent.objects.get(action="policy.version", detail__version=2)
    assert event.detail["note"] == "loops end sooner"
    html = admin.get(reverse("policy_history", kwargs={"slug": team.slug, "name": "default"})
                     ).content.decode()
    assert '<td class="version-note">loops end sooner</td>' in html


def test_restoring_an_old_version_adds_a_new_equal_version(team, admin, users):  # noqa: F811
    save = reverse("policy_save", kwargs={"slug": team.slug, "name": "default"})
    admin.post(save, form_data(max_steps="9", note="v2"))
    admin.post(save, form_data(max_steps="30", note="v3"))
    first = policy(team).versions.get(version=1).document
    restore = reverse("policy_restore", kwargs={"slug": team.slug, "name": "default",
                                                "version": 1})
    response = admin.post(restore, {"note": "v3 let a loop run too long"})
    assert response.status_code == 302
    current = policy(team).current
    assert current.version == 4 and current.document == first
    assert current.source == "restore"
    assert current.note == "restored version 1: v3 let a loop run too long"
    assert policy(team).versions.count() == 4  # nothing rewritten
    # Restoring what is already current changes nothing.
    assert admin.post(restore).status_code == 302 and policy(team).current.version == 4
    missing = reverse("policy_restore", kwargs={"slug": team.slug, "name": "default",
                                                "version": 99})
    assert admin.post(missing).status_code == 404
    assert as_user(users, "operator").post(restore).status_code == 403
    assert policy(team).current.version == 4


def test_history_compares_any_two_versions_either_way(team, admin):  # noqa: F811
    save = reverse("policy_save", kwargs={"slug": team.slug, "name": "default"})
    admin.post(save, form_data(max_steps="10", note="a"))
    admin.post(save, form_data(max_steps="12", mode="shadow", note="b"))
    url = reverse("policy_history", kwargs={"slug": team.slug, "name": "default"})
    backwards = admin.get(url, {"a": 3, "b": 1}).content.decode()
    assert "v3 → v1" in backwards
    assert "-  max_steps: 12" in backwards and "+  max_steps: 18" in backwards
    assert "Restore v1" in backwards and "Restore v3" not in backwards  # v3 is current
    same = admin.get(url, {"a": 2, "b": 2}).content.decode()
    assert "No difference." in same


def test_viewers_see_history_without_restore_buttons(team, users):
    html = as_user(users, "viewer").get(
        reverse("policy_history", kwargs={"slug": team.slug, "name": "default"})).content.decode()
    assert "Restore v" not in html


def test_a_restore_asks_first_with_the_diff_a_note_and_a_backtest(team, admin):  # noqa: F811
    """Issue 26: a restore was one click with no note, confirmation or backtest."""
    save = reverse("policy_save", kwargs={"slug": team.slug, "name": "default"})
    admin.post(save, form_data(max_steps="30", note="v2"))
    restore = reverse("policy_restore", kwargs={"slug": team.slug, "name": "default",
                                                "version": 1})
    page = admin.get(restore).content.decode()
    assert "-  max_steps: 30" in page and "+  max_steps: 18" in page
    assert 'name="note"' in page and "backtest-button" in page
    assert reverse("backtest_policy", kwargs={"slug": team.slug, "name": "default"}) in page
    refused = admin.post(restore, {"note": ""})
    assert refused.status_code == 422 and b"Say why you restore it" in refused.content
    assert policy(team).current.version == 2


def test_restoring_a_deny_every_tool_version_must_say_so(team, admin):  # noqa: F811
    save = reverse("policy_save", kwargs={"slug": team.slug, "name": "default"})
    admin.post(save, form_data(restrict_tools="on", tools_allow="", deny_every_tool="on",
                               note="lockdown"))
    admin.post(save, form_data(note="open again"))
    restore = reverse("policy_restore", kwargs={"slug": team.slug, "name": "default",
                                                "version": 2})
    assert b"every tool of every run is denied" in admin.get(restore).content
    assert admin.post(restore, {"note": "lock it"}).status_code == 422
    assert policy(team).current.version == 3
    assert admin.post(restore, {"note": "lock it", "deny_every_tool": "on"}).status_code == 302
    assert policy(team).current.document["tools"]["allow"] == []


def test_a_long_history_lists_its_newest_versions_and_compares_any(
        team, admin, monkeypatch, client):  # noqa: F811
    """A policy saved by a CI job every few minutes has thousands of versions: the page and
    the operator API list the newest, without reading every document (SPEC 10)."""
    from policies import views
    from policies.services import policy_save
    from policies.tokens import operator_token_create

    monkeypatch.setattr(views, "HISTORY_LISTED", 3)
    document = policy(team).current.document
    for steps in range(20, 26):  # versions 2 to 7
        policy_save(team=team, document={**document, "step_limits": {
            **document["step_limits"], "max_steps": steps}}, actor=None, source="test")
    url = reverse("policy_history", kwargs={"slug": team.slug, "name": "default"})
    html = admin.get(url).content.decode()
    assert 'data-version="7"' in html and 'data-version="5"' in html
    assert 'data-version="4"' not in html and "The newest 3 versions are listed" in html
    older = admin.get(url, {"a": 1, "b": 2}).content.decode()
    assert "v1 → v2" in older and "+  max_steps: 20" in older

    from policies.models import Membership
    user = Membership.objects.filter(team=team, role="admin").first().user
    token = operator_token_create(user=user, name="ci", role="viewer").secret
    path = "/api/v1/teams/support/policies/default/versions"
    auth = {"HTTP_AUTHORIZATION": f"Bearer {token}"}
    first = client.get(path, {"limit": 4}, **auth).json()
    assert [v["version"] for v in first["versions"]] == [7, 6, 5, 4] and first["more"] is True
    rest = client.get(path, {"limit": 4, "before": 4}, **auth).json()
    assert [v["version"] for v in rest["versions"]] == [3, 2, 1] and rest["more"] is False
    assert client.get(path, {"limit": 201}, **auth).status_code == 422


def test_a_version_nobody_saved_reads_as_from_its_source_not_by_it(team, users):
    """Found by a newcomer: the demo's policy read "saved 1 minute ago by demo" on its page,
    "from demo" on the list and "—" (by) beside source "demo" in the history: "demo" is how
    it was made, not who made it."""
    viewer = as_user(users, "viewer")
    page = viewer.get(reverse("policy", args=[team.slug, "default"])).content.decode()
    version = Policy.objects.get(team=team, name="default").current
    assert version.created_by is None
    assert f"from {version.source}." in page and f"by {version.source}" not in page
