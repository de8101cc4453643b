"""Agent keys, members, the team webhook and the operator audit log, as an admin uses them."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

from policies.models import AgentKey, Membership, OperatorEvent
from policies.services import agent_key_authenticate, agent_key_create, audit

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fast(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def admin(users: dict[str, Any]) -> Client:
    client = Client()
    client.force_login(users["admin"])
    return client


def test_a_new_key_is_shown_once_and_works(team, admin):
    url = reverse("keys", kwargs={"slug": team.slug})
    response = admin.post(url, {"name": "crawler", "agent": "crawler-bot"}, follow=True)
    html = response.content.decode()
    token = html.split("data-new-token>")[1].split("<")[0]
    key = agent_key_authenticate(token)
    assert key is not None and key.team == team and key.agent == "crawler-bot"
    assert token not in admin.get(url).content.decode()  # shown once
    assert OperatorEvent.objects.filter(action="key.create", target="crawler").exists()


def test_a_key_with_an_invalid_agent_name_is_refused(team, admin):
    response = admin.post(reverse("keys", kwargs={"slug": team.slug}),
                          {"name": "x", "agent": "bad name!"})
    assert response.status_code == 422
    assert not AgentKey.objects.filter(name="x").exists()


def test_revoking_a_key_takes_effect_and_the_list_shows_last_use(team, admin):
    new = agent_key_create(team=team, name="old")
    admin.post(reverse("key_revoke", kwargs={"slug": team.slug, "key_id": new.key.pk}))
    assert agent_key_authenticate(new.token) is None
    html = admin.get(reverse("keys", kwargs={"slug": team.slug})).content.decode()
    assert "revoked" in html and "never" in html
    assert OperatorEvent.objects.filter(action="key.revoke", target="old").exists()


def test_members_can_be_added_changed_and_removed(team, admin, users):
    User.objects.create_user("newbie", password="x")
    url = reverse("members", kwargs={"slug": team.slug})
    assert admin.post(url, {"username": "newbie", "role": "operator"}).status_code == 302
    membership = Membership.objects.get(team=team, user__username="newbie")
    assert membership.role == "operator"
    admin.post(reverse("member_role", kwargs={"slug": team.slug,
                                              "membership_id": membership.pk}), {"role": "admin"})
    membership.refresh_from_db()
    assert membership.role == "admin"
    admin.post(reverse("member_remove", kwargs={"slug": team.slug,
                                                "membership_id": membership.pk}))
    assert not Membership.objects.filter(pk=membership.pk).exists()
    actions = set(OperatorEvent.objects.filter(target="newbie").values_list("action", flat=True))
    assert actions == {"member.add", "member.role", "member.remove"}


def test_adding_an_unknown_user_says_so(team, admin):
    response = admin.post(reverse("members", kwargs={"slug": team.slug}),
                          {"username": "ghost", "role": "viewer"})
    assert response.status_code == 422 and "No active user" in response.content.decode()


def test_the_last_admin_cannot_be_demoted_or_removed(team, admin, users):
    mine = Membership.objects.get(team=team, user=users["admin"])
    admin.post(reverse("member_role", kwargs={"slug": team.slug, "membership_id": mine.pk}),
               {"role": "viewer"})
    admin.post(reverse("member_remove", kwargs={"slug": team.slug, "membership_id": mine.pk}))
    mine.refresh_from_db()
    assert mine.role == "admin"


def test_the_webhook_url_is_saved_validated_and_audited(team, admin):
    url = reverse("team_settings", kwargs={"slug": team.slug})
    assert admin.post(url, {"webhook_url": "ftp://example.com/x"}).status_code == 422
    assert admin.post(url, {"webhook_url": "https://hooks.example.com/gov"}).status_code == 302
    team.refresh_from_db()
    assert team.webhook_url == "https://hooks.example.com/gov"
    event = OperatorEvent.objects.get(action="team.webhook")
    assert event.detail == {"before": None, "after": "https://hooks.example.com/gov"}
    admin.post(url, {"webhook_url": ""})
    team.refresh_from_db()
    assert team.webhook_url is None


def test_the_audit_log_shows_who_what_when_with_policy_diffs(team, admin, users):
    admin.post(reverse("policy_save", kwargs={"slug": team.slug, "name": "default"}), {
        "mode": "enforce", "max_steps": "9", "max_repeat_action": "3", "no_progress_window": "4",
        "max_seconds": "45", "max_usd": "1", "error_threshold": "3", "error_action": "nudge",
        "redact_args": "password\napi_key\ntoken\nsecret\nauthorization",
        "note": "tighter"})
    html = admin.get(reverse("audit", kwargs={"slug": team.slug})).content.decode()
    assert "policy.version" in html and "+  max_steps: 9" in html
    assert "member.add" in html


def test_the_audit_log_filters_by_action_and_actor_and_paginates(team, users):
    for i in range(60):
        audit(actor=users["admin"], action="key.create", team=team, target=f"k{i}")
    audit(actor=users["operator"], action="killswitch.engage", team=team, target="team")
    client = Client()
    client.force_login(users["viewer"])
    url = reverse("audit", kwargs={"slug": team.slug})
    html = client.get(url, {"action": "killswitch.engage"}).content.decode()
    assert 'data-action="killswitch.engage"' in html and 'data-action="key.create"' not in html
    html = client.get(url, {"actor": "operator"}).content.decode()
    assert html.count('data-action="') == 1
    first = client.get(url, {"action": "key.create"}).content.decode()
    assert "Page 1 of 2" in first and "action=key.create&amp;page=2" in first


def test_the_audit_log_never_shows_another_teams_events(team, other_team, users):
    audit(actor=users["outsider"], action="key.create", team=other_team, target="secret-key")
    client = Client()
    client.force_login(users["viewer"])
    html = client.get(reverse("audit", kwargs={"slug": team.slug})).content.decode()
    assert "secret-key" not in html and "outsider" not in html


@pytest.mark.parametrize(("release", "said", "not_said"), [
    ("none", "which only admins release", "release the ones they engaged"),
    ("own", "release the ones they engaged", "which only admins release"),
    ("any", "release any of the team's", "release the ones they engaged"),
])
def test_the_members_page_says_what_operators_may_release_as_the_team_is_set(
        team, admin, release, said, not_said):
    """The roles' summary under the members follows the team's release setting: it told the
    admins of a team set to "Only admins" that operators release the switches they engaged."""
    team.operator_release = release
    team.save(update_fields=["operator_release"])
    page = admin.get(reverse("members", args=[team.slug])).content.decode()
    assert said in page and not_said not in page


def test_a_webhook_url_saved_otherwise_than_typed_says_how(team, admin):
    """Found by a newcomer: "hooks.example.com/gov" (no scheme) was saved as
    https://hooks.example.com/gov with only "Webhook saved." to say so."""
    url = reverse("team_settings", kwargs={"slug": team.slug})
    page = admin.post(url, {"webhook_url": "hooks.example.com/gov"}, follow=True)
    assert "Webhook saved as https://hooks.example.com/gov." in page.content.decode()
    page = admin.post(url, {"webhook_url": "https://hooks.example.com/other"}, follow=True)
    assert "Webhook saved." in page.content.decode()
    assert "Webhook saved as" not in page.content.decode()
