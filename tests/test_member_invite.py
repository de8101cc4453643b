"""Adding a person who has no account (issue 15): an invitation link from the Members page or
`manage.py invite_member`, which lets them choose a password once."""

from __future__ import annotations

from io import StringIO

import pytest
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.test import Client
from django.urls import reverse

from policies.models import Membership, OperatorEvent
from tests.test_dashboard_runs import as_user

pytestmark = pytest.mark.django_db


def choose_password(link: str, password: str) -> Client:
    client = Client()
    path = "/" + link.split("/", 3)[3] if link.startswith("http") else link
    form = client.get(path, follow=True)  # Django swaps the token for a session, then redirects
    assert form.status_code == 200 and "Choose a password" in form.content.decode()
    url = form.redirect_chain[-1][0] if form.redirect_chain else path
    done = client.post(url, {"new_password1": password, "new_password2": password})
    assert done.status_code == 302
    return client


def test_an_admin_invites_someone_who_then_sets_a_password_and_signs_in(team, users):
    admin = as_user(users, "admin")
    response = admin.post(reverse("member_invite", kwargs={"slug": team.slug}),
                          {"username": "newcomer", "role": "operator"})
    assert response.status_code == 302
    page = admin.get(response["Location"]).content.decode()
    link = page.split('id="invitation-link" data-invitation>')[1].split("<")[0]
    assert link.startswith("http://testserver/accounts/reset/")
    assert "invitation-link" not in admin.get(response["Location"]).content.decode()  # once
    user = User.objects.get(username="newcomer")
    assert not user.has_usable_password()
    assert Membership.objects.get(team=team, user=user).role == "operator"
    assert OperatorEvent.objects.filter(action="member.invite", target="newcomer").exists()
    choose_password(link, "a-long-new-passphrase-42")
    assert Client().login(username="newcomer", password="a-long-new-passphrase-42")
    # The link works once.
    again = Client().get("/" + link.split("/", 3)[3], follow=True).content.decode()
    assert "has been used or has expired" in again


def test_an_invitation_for_a_taken_username_is_refused(team, users):
    response = as_user(users, "admin").post(reverse("member_invite", kwargs={"slug": team.slug}),
                                            {"username": "viewer", "role": "admin"})
    assert response.status_code == 422 and "username is taken" in response.content.decode()
    assert Membership.objects.get(team=team, user=users["viewer"]).role == "viewer"


@pytest.mark.parametrize("who", ["viewer", "operator", "outsider"])
def test_only_admins_invite(team, users, who):
    response = as_user(users, who).post(reverse("member_invite", kwargs={"slug": team.slug}),
                                        {"username": "sneaky", "role": "admin"})
    assert response.status_code == 403
    assert not User.objects.filter(username="sneaky").exists()


def test_the_command_prints_the_link_alone_on_its_last_line(team):
    out = StringIO()
    call_command("invite_member", "--team", team.slug, "--username", "cli-person",
                 "--role", "viewer", "--base-url", "https://gov.example.com", stdout=out)
    link = out.getvalue().strip().splitlines()[-1]
    assert link.startswith("https://gov.example.com/accounts/reset/")
    choose_password(link, "another-long-passphrase-7")
    assert Client().login(username="cli-person", password="another-long-passphrase-7")
    with pytest.raises(CommandError, match="taken"):
        call_command("invite_member", "--team", team.slug, "--username", "cli-person")
    with pytest.raises(CommandError, match="No team"):
        call_command("invite_member", "--team", "nope", "--username", "x")


@pytest.mark.parametrize("mode", ["superusers", "off"])
def test_under_sso_an_invitation_never_sets_a_password_that_cannot_sign_in(
        team, users, settings, mode):
    """With single sign-on and password sign-in for superusers only (the default once
    OIDC_ISSUER is set), the link offered a password, said "Sign in with your username and
    this password", and the sign-in then refused it. It now says to sign in with SSO and
    open the link again (how an account that exists joins), and sets no password."""
    settings.OIDC_ISSUER = "https://login.example.com/realms/staff"
    settings.OIDC_PASSWORD_LOGIN = mode
    admin = as_user(users, "admin")
    members = admin.get(reverse("members", kwargs={"slug": team.slug})).content.decode()
    assert "signed in here with SSO" in members
    response = admin.post(reverse("member_invite", kwargs={"slug": team.slug}),
                          {"username": "newcomer", "role": "operator"})
    page = admin.get(response["Location"]).content.decode()
    link = page.split('id="invitation-link" data-invitation>')[1].split("<")[0]
    client = Client()
    form = client.get("/" + link.split("/", 3)[3], follow=True)
    html = form.content.decode()
    assert "single sign-on" in html and 'name="new_password1"' not in html
    url = form.redirect_chain[-1][0]
    refused = client.post(url, {"new_password1": "a-long-new-passphrase-42",
                                "new_password2": "a-long-new-passphrase-42"})
    assert refused.status_code == 200 and "single sign-on" in refused.content.decode()
    assert not User.objects.get(username="newcomer").has_usable_password()


def test_the_invitation_page_names_the_username_the_team_and_the_role(team, users):
    """Found by a newcomer: the link's page asked for a password and the next one said "Sign
    in with your username and this password", and no page had said which username."""
    admin = as_user(users, "admin")
    response = admin.post(reverse("member_invite", kwargs={"slug": team.slug}),
                          {"username": "newcomer", "role": "operator"})
    page = admin.get(response["Location"]).content.decode()
    link = page.split('id="invitation-link" data-invitation>')[1].split("<")[0]
    form = Client().get("/" + link.split("/", 3)[3], follow=True).content.decode()
    assert "Choose a password" in form
    assert "<strong data-username>newcomer</strong>" in form
    assert f"join <strong>{team.name}</strong> as operator" in form
