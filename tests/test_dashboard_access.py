"""RBAC of every dashboard URL (SPEC 7): anonymous is sent to sign in, an outsider gets 403,
a role too low gets 403, a superuser may do everything; and nothing of another team leaks."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

from policies.models import AgentKey, Invitation, Membership, OperatorEvent
from policies.services import agent_key_create, member_invite
from runs.models import Run

pytestmark = pytest.mark.django_db

VIEWER, OPERATOR, ADMIN = "viewer", "operator", "admin"
RANK = {VIEWER: 1, OPERATOR: 2, ADMIN: 3}


def make_run(team: Any) -> Run:
    from django.utils import timezone

    policy = team.policies.get(name="default")
    return Run.objects.create(team=team, agent="support-bot", policy_version=policy.current,
                              started_at=timezone.now())


@pytest.fixture
def world(users: dict[str, Any], team: Any) -> dict[str, Any]:
    run = make_run(team)
    key = agent_key_create(team=team, name="k1").key
    viewer_membership = Membership.objects.get(team=team, user=users["viewer"])
    member_invite(team=team, username="someone-invited", role="viewer", actor=None)
    invitation = Invitation.objects.get(team=team, user__username="someone-invited")
    return {"run": run, "key": key, "membership": viewer_membership, "invitation": invitation}


def urls(team: Any, world: dict[str, Any]) -> list[tuple[str, str, str, dict[str, Any]]]:
    """(method, url, role needed, POST data) for every dashboard URL of a team."""
    s = team.slug
    run = world["run"].pk

    def u(url_name: str, /, **kw: Any) -> str:
        return reverse(url_name, kwargs={"slug": s, **kw})

    policy_post = {"mode": "enforce", "max_steps": "7", "max_repeat_action": "3",
                   "no_progress_window": "4", "max_seconds": "45", "max_usd": "1",
                   "error_threshold": "3", "error_action": "nudge", "redact_args": "password",
                   "note": "an edit"}
    return [
        ("GET", u("runs:overview"), VIEWER, {}),
        ("GET", u("runs:runs"), VIEWER, {}),
        ("GET", u("runs:run", run_id=run), VIEWER, {}),
        ("GET", u("policies"), VIEWER, {}),
        ("GET", u("policies_export"), VIEWER, {}),
        ("GET", u("policy", name="default"), VIEWER, {}),
        ("GET", u("policy_history", name="default"), VIEWER, {}),
        ("GET", u("runs:run_timeline", run_id=run), VIEWER, {}),
        ("GET", u("audit"), VIEWER, {}),
        ("GET", u("policy_new"), ADMIN, {}),
        ("GET", u("policies_import"), ADMIN, {}),
        ("GET", u("keys"), ADMIN, {}),
        ("GET", u("members"), ADMIN, {}),
        ("GET", u("team_settings"), ADMIN, {}),
        ("GET", u("key_revoke", key_id=world["key"].pk), ADMIN, {}),
        ("GET", u("webhook_secret_rotate"), ADMIN, {}),
        ("GET", u("member_remove", membership_id=world["membership"].pk), ADMIN, {}),
        ("GET", u("invitation_cancel", invitation_id=world["invitation"].pk), ADMIN, {}),
        ("POST", u("policy_save", name="default"), ADMIN, policy_post),
        ("POST", u("policy_validate", name="default"), ADMIN, policy_post),
        ("POST", u("policy_new"), ADMIN, {**policy_post, "name": "fresh"}),
        ("POST", u("policy_restore", name="default", version=1), ADMIN, {}),
        ("POST", u("policies_import"), ADMIN,
         {"document": f"teams:\n  - slug: {s}\n    name: Renamed\n"}),
        ("POST", u("keys"), ADMIN, {"name": "made-by-test"}),
        ("POST", u("key_revoke", key_id=world["key"].pk), ADMIN, {}),
        ("POST", u("members"), ADMIN, {"username": "superuserless", "role": "viewer"}),
        ("POST", u("member_role", membership_id=world["membership"].pk), ADMIN,
         {"role": "operator"}),
        ("POST", u("member_remove", membership_id=world["membership"].pk), ADMIN, {}),
        ("POST", u("member_invite"), ADMIN, {"username": "invited-by-test", "role": "viewer"}),
        ("POST", u("invitation_cancel", invitation_id=world["invitation"].pk), ADMIN, {}),
        ("POST", u("team_settings"), ADMIN, {"webhook_url": "https://example.com/hook"}),
    ]


STREAMS = ["runs:overview_stream", "runs:runs_stream", "runs:run_stream", "runs:team_stream",
           "runs:killswitch-stream"]


@pytest.fixture(autouse=True)
def _fast_hashing(settings: Any) -> None:
    # Autouse runs before `users` hashes five passwords; the real hasher is tested elsewhere.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def signed_in(name: str) -> Client:
    client = Client()
    username = "root" if name == "superuser" else name
    client.force_login(User.objects.get(username=username))
    return client


def test_anonymous_is_sent_to_sign_in_everywhere(team, world):
    client = Client()
    for method, url, _, data in urls(team, world):
        response = client.post(url, data) if method == "POST" else client.get(url)
        assert response.status_code == 302, (method, url)
        assert response["Location"].startswith(reverse("login")), (method, url)


@pytest.mark.parametrize("who", ["viewer", "operator", "admin", "superuser"])
def test_members_get_exactly_what_their_role_allows(who, team, world):
    role = ADMIN if who == "superuser" else who
    for method, url, needed, data in urls(team, world):
        client = signed_in(who)
        before = OperatorEvent.objects.count()
        response = client.post(url, data) if method == "POST" else client.get(url)
        if RANK[role] >= RANK[needed]:
            assert response.status_code in (200, 302, 422), (who, method, url,
                                                             response.status_code)
        else:
            assert response.status_code == 403, (who, method, url, response.status_code)
            assert b"Not allowed" in response.content
            # A refused write changes nothing and audits nothing.
            assert OperatorEvent.objects.count() == before, (who, method, url)


def test_an_outsider_gets_403_and_changes_nothing(team, world, users):
    """SPEC 7: every refusal is a 403 page, and nothing of another team is shown."""
    client = signed_in("outsider")  # admin of another team
    events = OperatorEvent.objects.filter(team=team).count()
    keys = AgentKey.objects.filter(team=team, revoked_at__isnull=True).count()
    for method, url, _, data in urls(team, world):
        response = client.post(url, data) if method == "POST" else client.get(url)
        assert response.status_code == 403, (method, url)
        assert b"Customer support" not in response.content
    assert OperatorEvent.objects.filter(team=team).count() == events
    assert AgentKey.objects.filter(team=team, revoked_at__isnull=True).count() == keys
    assert Membership.objects.filter(team=team, user=users["viewer"], role="viewer").exists()


def test_a_run_of_another_team_is_404_even_under_my_team(team, other_team, users):
    foreign = make_run(other_team)
    client = signed_in("admin")
    for name in ("runs:run", "runs:run_stream"):
        url = reverse(name, kwargs={"slug": team.slug, "run_id": foreign.pk})
        assert client.get(url).status_code == 404


def test_another_teams_key_and_membership_cannot_be_reached_through_my_team(
        team, other_team, users):
    foreign_key = agent_key_create(team=other_team, name="theirs").key
    foreign_membership = Membership.objects.get(team=other_team, user=users["outsider"])
    client = signed_in("admin")
    assert client.post(reverse("key_revoke", kwargs={"slug": team.slug,
                                                     "key_id": foreign_key.pk})).status_code == 404
    assert client.post(reverse("member_remove", kwargs={
        "slug": team.slug, "membership_id": foreign_membership.pk})).status_code == 404
    foreign_key.refresh_from_db()
    assert foreign_key.revoked_at is None
    assert Membership.objects.filter(pk=foreign_membership.pk).exists()


def stream_url(name: str, team: Any, world: dict[str, Any]) -> str:
    kwargs: dict[str, Any] = {"slug": team.slug}
    if name == "runs:run_stream":
        kwargs["run_id"] = world["run"].pk
    return reverse(name, kwargs=kwargs)


@pytest.mark.parametrize("name", STREAMS)
def test_streams_follow_the_same_rules(name, team, world, settings):
    settings.DASHBOARD_STREAM_SECONDS = 0
    url = stream_url(name, team, world)
    assert Client().get(url).status_code == 302
    assert signed_in("outsider").get(url).status_code == 403
    response = signed_in("viewer").get(url)
    assert response.status_code == 200
    assert response["Content-Type"] == "text/event-stream"
    response.close()


@pytest.mark.parametrize("name", STREAMS)
def test_a_head_to_a_stream_answers_its_headers_without_a_stream(name, team, world):
    """A HEAD has no body: under WSGI a stream's body would be iterated all the same,
    holding a thread for the stream's lifetime."""
    url = stream_url(name, team, world)
    assert Client().head(url).status_code == 302
    assert signed_in("outsider").head(url).status_code == 403
    response = signed_in("viewer").head(url)
    assert response.status_code == 200 and not response.streaming
    assert response["Content-Type"] == "text/event-stream" and response.content == b""


def test_get_only_pages_refuse_post_and_post_only_endpoints_refuse_get(team, world):
    client = signed_in("admin")
    assert client.post(reverse("runs:overview", kwargs={"slug": team.slug})).status_code == 405
    # key_revoke, member_remove and (issue 26) policy_restore answer GET with their
    # confirmation; the policy editor's save saves on POST only: a GET is sent to the editor
    # (the address a refused save leaves in the browser's bar), any other method is a 405.
    save = reverse("policy_save", kwargs={"slug": team.slug, "name": "default"})
    assert client.get(save).status_code == 302
    assert client.put(save).status_code == client.delete(save).status_code == 405
    # Found by a security tryout: five form pages rendered for any method (PUT, DELETE, FOO).
    for name in ("keys", "members", "team_settings", "policies_import", "policy_new"):
        url = reverse(name, kwargs={"slug": team.slug})
        for method in ("put", "delete", "patch"):
            response = getattr(client, method)(url)
            assert response.status_code == 405, (name, method)
            assert set(response["Allow"].split(", ")) == {"GET", "POST"}
        assert client.generic("FOO", url).status_code == 405, name


def test_posts_without_a_csrf_token_are_refused(team, world):
    client = Client(enforce_csrf_checks=True)
    client.force_login(User.objects.get(username="admin"))
    response = client.post(reverse("keys", kwargs={"slug": team.slug}), {"name": "x"})
    assert response.status_code == 403
    assert not AgentKey.objects.filter(name="x").exists()


def test_the_team_switcher_lists_only_my_teams(team, other_team, users):
    page = signed_in("viewer").get(reverse("runs:overview", kwargs={"slug": team.slug}))
    assert b"Customer support" in page.content
    assert b"Billing" not in page.content
    page = signed_in("superuser").get(reverse("runs:overview", kwargs={"slug": team.slug}))
    assert b"Billing" in page.content


def test_an_unknown_team_is_refused_like_another_teams(users, team):
    """The same 403 as for a team the user is not in, so that no team's existence shows; a
    superuser, who sees every team, gets 404."""
    import re

    def page(url: str) -> tuple[int, str]:
        response = signed_in("outsider").get(url)
        # Each page masks the CSRF token anew: the rest must be the same, byte for byte.
        return response.status_code, re.sub(r"[A-Za-z0-9]{64}", "", response.content.decode())

    assert page("/teams/nope/") == page(f"/teams/{team.slug}/")
    assert page("/teams/nope/")[0] == 403
    assert signed_in("superuser").get("/teams/nope/").status_code == 404


def test_every_authenticated_dashboard_answer_is_marked_no_store(users, team, world):
    """No browser or proxy cache keeps a signed-in page (SPEC 10 issue: a new key's token,
    the audit log), whatever the role and whether it is the page or a refusal."""
    for username in ("superuser", "viewer"):
        client = Client()
        client.force_login(users[username])
        for method, url, _, _data in urls(team, world):
            if method != "GET":
                continue
            response = client.get(url)
            assert "no-store" in response.get("Cache-Control", ""), (username, url)
            assert "private" in response["Cache-Control"], (username, url)


def test_the_page_showing_a_new_keys_token_is_marked_no_store(users, team):
    admin = Client()
    admin.force_login(users["admin"])
    response = admin.post(reverse("keys", kwargs={"slug": team.slug}), {"name": "fresh"},
                          follow=True)
    assert b"data-new-token>gov_" in response.content
    assert "no-store" in response["Cache-Control"]
