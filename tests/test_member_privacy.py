"""Issue 24: an admin's Members page (and `invite_member`) answered differently for a username
that exists in another team and one that exists nowhere, so any admin could learn who the
other teams' people are. Now adding answers alike, and an invitation is made, answered, listed,
audited and followed alike; an existing account joins only by its owner signing in."""

from __future__ import annotations

import re
from io import StringIO
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client
from django.urls import reverse

from policies.models import Invitation, Membership, OperatorEvent, Role, Team
from policies.services import membership_set

pytestmark = pytest.mark.django_db

LINK = re.compile(r'id="invitation-link" data-invitation>([^<]+)<')


def signed_in(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def field_error(html: str) -> str:
    return html.split('<div class="field-error">')[1].split("</div>")[0]


def without(html: str, *words: str) -> str:
    """The page with what must differ (the username typed, a link, a CSRF token) taken out."""
    html = re.sub(r'name="csrfmiddlewaretoken" value="[^"]+"', "", html)
    html = re.sub(r'"X-CSRFToken": "[^"]+"', "", html)
    html = re.sub(r"(/|%2F)accounts\1reset\1[\w-]+\1[\w-]+\1", "/accounts/reset/KEY/TOKEN/", html)
    for word in words:
        html = html.replace(word, "NAME")
    return html


# --- Adding ----------------------------------------------------------------------------------

def test_adding_an_account_of_another_team_answers_as_for_a_username_nobody_has(
        team: Team, users: dict[str, Any]) -> None:
    admin = signed_in(users["admin"])
    url = reverse("members", kwargs={"slug": team.slug})
    elsewhere = admin.post(url, {"username": "outsider", "role": "viewer"})
    nowhere = admin.post(url, {"username": "nobody-at-all", "role": "viewer"})
    assert elsewhere.status_code == nowhere.status_code == 422
    assert field_error(elsewhere.content.decode()) == field_error(nowhere.content.decode())
    assert without(elsewhere.content.decode(), "outsider") == \
        without(nowhere.content.decode(), "nobody-at-all")
    assert not Membership.objects.filter(team=team, user=users["outsider"]).exists()


def test_an_admin_of_both_teams_or_a_superuser_adds_across_teams(
        team: Team, other_team: Team, users: dict[str, Any]) -> None:
    url = reverse("members", kwargs={"slug": team.slug})
    membership_set(team=other_team, user=users["admin"], role=Role.ADMIN, actor=None)
    assert signed_in(users["admin"]).post(
        url, {"username": "outsider", "role": "viewer"}).status_code == 302
    other = User.objects.create_user("billing-person")
    membership_set(team=other_team, user=other, role=Role.VIEWER, actor=None)
    assert signed_in(users["superuser"]).post(
        url, {"username": "billing-person", "role": "operator"}).status_code == 302
    assert Membership.objects.get(team=team, user=other).role == "operator"


def test_a_viewer_of_the_other_team_may_not_pull_its_people(team: Team, other_team: Team,
                                                            users: dict[str, Any]) -> None:
    # Only an admin of the other team sees its members: a viewer there does not.
    membership_set(team=other_team, user=users["admin"], role=Role.VIEWER, actor=None)
    response = signed_in(users["admin"]).post(reverse("members", kwargs={"slug": team.slug}),
                                              {"username": "outsider", "role": "viewer"})
    assert response.status_code == 422


# --- Inviting --------------------------------------------------------------------------------

def invite(client: Client, team: Team, username: str, role: str = "operator") -> tuple[Any, str]:
    """The answer to the invitation, and the Members page it leads to."""
    response = client.post(reverse("member_invite", kwargs={"slug": team.slug}),
                           {"username": username, "role": role})
    page = client.get(reverse("members", kwargs={"slug": team.slug})) \
        if response.status_code == 302 else response
    return response, page.content.decode()


def test_a_fullwidth_spelling_of_another_teams_account_is_that_account(
        team: Team, users: dict[str, Any]) -> None:
    """Found by an attacker: "outsider" in fullwidth letters was looked up as typed, found
    nobody, and making its account (NFKC: "outsider") collided with the existing one, which
    was answered "an invitation for this username is waiting" where a new name was invited:
    the account's existence told. It is the account's own name now, invited as any existing
    account is."""
    admin = signed_in(users["admin"])
    existing, _ = invite(admin, team, "\uff4f\uff55\uff54\uff53\uff49\uff44\uff45\uff52")
    new, _ = invite(admin, team, "\uff4e\uff45\uff57\uff50\uff45\uff52\uff53\uff4f\uff4e")
    assert existing.status_code == new.status_code == 302
    invited = Invitation.objects.filter(team=team).values_list("user__username", "new_account")
    assert sorted(invited) == [("newperson", True), ("outsider", False)]
    assert sorted(OperatorEvent.objects.filter(team=team, action="member.invite")
                  .values_list("target", flat=True)) == ["newperson", "outsider"]
    assert not Membership.objects.filter(team=team, user=users["outsider"]).exists()


def test_inviting_an_account_of_another_team_answers_as_for_a_new_username(
        team: Team, users: dict[str, Any]) -> None:
    admin = signed_in(users["admin"])
    existing, existing_page = invite(admin, team, "outsider")
    new, new_page = invite(admin, team, "brand-new-person")
    assert existing.status_code == new.status_code == 302
    # The same card, link shape, waiting list (both are in it) and members table.
    links = [LINK.search(page).group(1) for page in (existing_page, new_page)]  # type: ignore[union-attr]
    shape = re.compile(r"^http://testserver/accounts/reset/[\w-]{22}/[0-9a-z]+-[0-9a-f]+/$")
    assert all(shape.match(link) for link in links), links
    assert len(links[0]) == len(links[1])
    card = re.compile(r'<section class="card token-once".*?</section>', re.S)
    assert without(card.search(existing_page).group(0), "outsider") == \
        without(card.search(new_page).group(0), "brand-new-person")  # type: ignore[union-attr]
    members = admin.get(reverse("members", kwargs={"slug": team.slug})).content.decode()
    assert 'data-invitation="outsider"' in members
    assert 'data-invitation="brand-new-person"' in members
    assert 'data-member="outsider"' not in members
    assert 'data-member="brand-new-person"' not in members
    # The audit log, which the team's viewers read, says the same of both.
    events = OperatorEvent.objects.filter(team=team, target__in=["outsider", "brand-new-person"])
    assert sorted(events.values_list("action", "target", "detail")) == [
        ("member.invite", "brand-new-person", {"role": "operator"}),
        ("member.invite", "outsider", {"role": "operator"})]
    # Nothing was given to the existing account.
    assert not Membership.objects.filter(team=team, user=users["outsider"]).exists()


def test_the_links_first_page_is_the_same_for_both(team: Team, users: dict[str, Any]) -> None:
    admin = signed_in(users["admin"])
    pages = []
    for username in ("outsider", "brand-new-person"):
        _, members = invite(admin, team, username)
        link = LINK.search(members).group(1)  # type: ignore[union-attr]
        opened = Client().get("/" + link.split("/", 3)[3], follow=True)
        assert opened.status_code == 200 and "Choose a password" in opened.content.decode()
        # The page names the username the invitation is for, which the admin typed.
        pages.append(without(opened.content.decode(), username))
    assert pages[0] == pages[1]


def test_an_existing_account_joins_by_signing_in_never_by_a_new_password(
        team: Team, users: dict[str, Any]) -> None:
    _, members = invite(signed_in(users["admin"]), team, "outsider")
    path = "/" + LINK.search(members).group(1).split("/", 3)[3]  # type: ignore[union-attr]
    stranger = Client()
    form = stranger.get(path, follow=True)
    url = form.redirect_chain[-1][0]
    tried = stranger.post(url, {"new_password1": "a-long-new-passphrase-42",
                                "new_password2": "a-long-new-passphrase-42"})
    assert "outsider has a password already: sign in as outsider" in tried.content.decode()
    assert Client().login(username="outsider", password="pw-outsider-123")  # unchanged
    assert not Client().login(username="outsider", password="a-long-new-passphrase-42")
    assert not Membership.objects.filter(team=team, user=users["outsider"]).exists()

    owner = Client()
    assert owner.login(username="outsider", password="pw-outsider-123")
    join = owner.get(path, follow=True)
    assert "Join Customer support" in join.content.decode()
    joined = owner.post(join.redirect_chain[-1][0])
    assert joined.status_code == 302 and joined["Location"] == f"/teams/{team.slug}/"
    assert Membership.objects.get(team=team, user=users["outsider"]).role == "operator"
    assert OperatorEvent.objects.filter(action="member.join", target="outsider",
                                        actor=users["outsider"]).exists()
    assert Invitation.objects.get(user=users["outsider"]).accepted_at is not None
    again = owner.get(path, follow=True).content.decode()
    assert "has been used or has expired" in again


def test_a_new_accounts_invitation_is_answered_by_choosing_its_password(
        team: Team, users: dict[str, Any]) -> None:
    admin = signed_in(users["admin"])
    _, members = invite(admin, team, "brand-new-person")
    client = Client()
    form = client.get("/" + LINK.search(members).group(1).split("/", 3)[3], follow=True)  # type: ignore[union-attr]
    done = client.post(form.redirect_chain[-1][0], {"new_password1": "a-long-new-passphrase-42",
                                                    "new_password2": "a-long-new-passphrase-42"})
    assert done.status_code == 302
    page = admin.get(reverse("members", kwargs={"slug": team.slug})).content.decode()
    assert 'data-member="brand-new-person"' in page
    assert 'data-invitation="brand-new-person"' not in page
    assert OperatorEvent.objects.filter(action="member.join", target="brand-new-person").exists()


def test_the_command_answers_alike(team: Team, users: dict[str, Any]) -> None:
    outputs = []
    for username in ("outsider", "cli-new-person"):
        out = StringIO()
        call_command("invite_member", "--team", team.slug, "--username", username,
                     "--base-url", "https://gov.example.com", stdout=out)
        outputs.append(re.sub(r"/accounts/reset/\S+", "LINK",
                              out.getvalue().replace(username, "NAME")))
    assert outputs[0] == outputs[1]
    assert not Membership.objects.filter(team=team, user=users["outsider"]).exists()


# --- Cancelling ------------------------------------------------------------------------------

def test_a_cancelled_invitation_leaves_nothing_behind_and_its_link_stops(
        team: Team, users: dict[str, Any]) -> None:
    admin = signed_in(users["admin"])
    links = {}
    for username in ("outsider", "brand-new-person"):
        _, members = invite(admin, team, username)
        links[username] = "/" + LINK.search(members).group(1).split("/", 3)[3]  # type: ignore[union-attr]
    for invitation in Invitation.objects.filter(team=team):
        url = reverse("invitation_cancel", kwargs={"slug": team.slug,
                                                   "invitation_id": invitation.pk})
        assert "Cancel the invitation" in admin.get(url).content.decode()
        assert admin.post(url).status_code == 302
    assert not Invitation.objects.exists()
    assert not User.objects.filter(username="brand-new-person").exists()
    assert User.objects.filter(username="outsider").exists()
    assert not Membership.objects.filter(team=team).exclude(
        user__in=[users["admin"], users["operator"], users["viewer"]]).exists()
    assert OperatorEvent.objects.filter(action="member.invite.cancel").count() == 2
    for path in links.values():
        assert "has been used or has expired" in Client().get(path, follow=True).content.decode()


def test_an_invited_admin_is_not_counted_as_the_teams_other_admin(
        team: Team, users: dict[str, Any]) -> None:
    admin = signed_in(users["admin"])
    invite(admin, team, "future-admin", role="admin")
    mine = Membership.objects.get(team=team, user=users["admin"])
    admin.post(reverse("member_role", kwargs={"slug": team.slug, "membership_id": mine.pk}),
               {"role": "viewer"})
    mine.refresh_from_db()
    assert mine.role == "admin"
