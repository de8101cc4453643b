"""Single sign-on (SPEC 17) against a real OpenID Connect provider (oidc-provider-mock on a
thread): the redirect flow with the Django test client, groups mapped to roles and
recomputed at each sign-in, hand-given memberships untouched, and each refusal."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import jwt
import pytest
import requests
from cryptography.hazmat.primitives.asymmetric import rsa
from django.contrib.auth.models import User
from django.test import Client, override_settings

from policies import oidc_provider
from policies.models import Membership, OperatorEvent, Role, SsoIdentity
from policies.services import membership_set, team_ensure
from policies.sso_views import SsoBackend, forget_provider
from runs.models import KillSwitch
from tests.sso_provider import Provider, authorize, path_of, query_of, running_provider

ROLE_MAP = [
    {"group": "support-ops", "team": "support", "role": "operator"},
    {"group": "support-leads", "team": "support", "role": "admin"},
    {"group": "staff", "team": "*", "role": "viewer"},
]


@pytest.fixture(scope="module")
def provider() -> Iterator[Provider]:
    with running_provider() as running:
        yield running


def sso_settings(provider: Provider, **extra: Any) -> Any:
    return override_settings(**{
        "OIDC_ISSUER": provider.issuer, "OIDC_CLIENT_ID": "governance",
        "OIDC_CLIENT_SECRET": "not-a-secret", "OIDC_ROLE_MAP": json.dumps(ROLE_MAP),
        "OIDC_PASSWORD_LOGIN": "superusers", **extra})


@pytest.fixture
def sso(provider: Provider, db: Any) -> Iterator[Provider]:
    team_ensure(slug="support", name="Support")
    team_ensure(slug="billing", name="Billing")
    forget_provider()
    provider.token_requests.clear()
    provider.token_host = None
    with sso_settings(provider):
        yield provider
    forget_provider()


def start(client: Client, next_url: str = "") -> str:
    """"Sign in with SSO": the provider's authorization URL the browser is sent to."""
    response = client.get("/accounts/sso/login/" + (f"?next={next_url}" if next_url else ""))
    assert response.status_code == 302, response.content
    return response["Location"]


def sign_in(client: Client, sub: str, next_url: str = "") -> Any:
    """The whole round trip: our redirect, the provider's sign-in, the callback."""
    return client.get(path_of(authorize(start(client, next_url), sub)))


def roles(user: User) -> dict[str, tuple[str, bool]]:
    return {m.team.slug: (m.role, m.from_sso)
            for m in Membership.objects.filter(user=user).select_related("team")}


def test_a_person_signs_in_with_their_groups_as_roles(sso: Provider):
    sso.set_user("alice-sub", preferred_username="alice", email="alice@example.com",
                 groups=["support-ops", "staff", "unmapped"])
    client = Client()
    authorize_url = start(client, next_url="/teams/support/policies/")
    asked = query_of(authorize_url)
    assert authorize_url.startswith(sso.issuer + "/oauth2/authorize?")
    assert asked["code_challenge_method"] == "S256" and asked["nonce"] and asked["state"]
    callback = authorize(authorize_url, "alice-sub")
    response = client.get(path_of(callback))
    assert response.status_code == 302 and response["Location"] == "/teams/support/policies/"
    # PKCE: the token request carried the verifier whose S256 is the challenge sent.
    verifier = sso.token_requests[-1]["code_verifier"]
    digest = hashlib.sha256(verifier.encode()).digest()
    assert base64.urlsafe_b64encode(digest).rstrip(b"=").decode() == asked["code_challenge"]

    identity = SsoIdentity.objects.get(issuer=sso.issuer, subject="alice-sub")
    user = identity.user
    assert user.username == "alice" and not user.has_usable_password()
    # Per team the highest mapped role wins; "*" reaches every team.
    assert roles(user) == {"support": (Role.OPERATOR, True), "billing": (Role.VIEWER, True)}
    assert client.get("/teams/support/policies/").status_code == 200
    events = OperatorEvent.objects.filter(actor=user, action="member.add")
    assert {(e.team.slug, e.detail["role"]) for e in events} == {
        ("support", "operator"), ("billing", "viewer")}
    assert all(e.actor_label == "sso" and e.detail["source"] == "sso" for e in events)


def test_an_sso_accounts_password_page_says_it_has_none_instead_of_a_form(sso: Provider):
    """The top bar hides "Password" from an SSO account (it has none), but its address gave
    a form asking for an old password nobody has, which refused every try."""
    sso.set_user("ivy-sub", preferred_username="ivy", groups=["staff"])
    client = Client()
    assert sign_in(client, "ivy-sub").status_code == 302
    page = client.get("/accounts/password/")
    assert page.status_code == 200
    assert b"signs in with single sign-on" in page.content
    assert b'name="old_password"' not in page.content
    password_account = User.objects.create_user("june", password="a-long-passw0rd")
    client.force_login(password_account)
    assert b'name="old_password"' in client.get("/accounts/password/").content


def test_a_deactivated_accounts_sso_session_signs_in_nobody(sso: Provider):
    """docs/sso.md: deactivating the account cuts its person off at once. Found by an
    attacker: the SSO backend's session lookup (the library's) did not look at `is_active`,
    so a deactivated operator still engaged a kill switch from the session they had."""
    sso.set_user("alice-sub", preferred_username="alice", groups=["support-ops"])
    client = Client()
    assert sign_in(client, "alice-sub").status_code == 302
    assert client.get("/teams/support/").status_code == 200
    User.objects.filter(username="alice").update(is_active=False)
    page = client.get("/teams/support/")
    assert page.status_code == 302 and page["Location"].startswith("/accounts/login/")
    engaged = client.post("/teams/support/killswitch/engage", {
        "scope": "agent", "agent": "ghost-agent", "reason": "x", "confirmed": "1"})
    assert engaged.status_code in (302, 403) and not KillSwitch.objects.exists()


def test_one_persons_answer_too_large_refuses_their_sign_in_only(sso: Provider):
    """Found by an attacker: a person whose groups filled the token answer past 1 MiB got the
    503 page (right), and so did everyone's sign-in for the next 30 s, as if the provider
    were down: an answer about one person is not the provider failing."""
    sso.set_user("big-sub", preferred_username="big",
                 groups=["support-ops", *(f"group-{i:06d}-" + "x" * 80 for i in range(12000))])
    refused = sign_in(Client(), "big-sub")
    assert refused.status_code == 503
    assert b"more than 1048576 bytes" in refused.content
    sso.set_user("alice-sub", preferred_username="alice", groups=["support-ops"])
    assert sign_in(Client(), "alice-sub").status_code == 302


def test_one_persons_failing_token_answer_refuses_their_sign_in_only(sso: Provider):
    """Found by an attacker: a person whose claims the provider cannot issue (here a lone
    surrogate in their e-mail: the provider's token endpoint answers 500 for them alone) got
    the 503 page, and so did everyone's sign-in for the next 30 s, again at each of their
    tries: an answer about one person, even a 5xx, is not the provider failing."""
    sso.set_user("broken-sub", preferred_username="broken", email="\ud800@example.com",
                 groups=["support-ops"])
    refused = sign_in(Client(), "broken-sub")
    assert refused.status_code == 503, refused.content
    assert b"answered 500" in refused.content
    sso.set_user("alice-sub", preferred_username="alice", groups=["support-ops"])
    assert sign_in(Client(), "alice-sub").status_code == 302


def test_a_visitors_unfinished_sign_in_keeps_no_session_and_expired_ones_are_purged(
        sso: Provider, settings: Any):
    """Found by an attacker: every anonymous press of "Sign in with SSO" made a session row
    (to hold the sign-in's state) kept two weeks, and nothing ever deleted an expired one: a
    row per request, for good. A visitor's session now lives as long as the sign-in's state
    (10 minutes), a sign-in gives it the full age, and beat purges expired sessions."""
    from django.contrib.sessions.models import Session
    from django.utils import timezone

    from policies.sso_views import STATE_MAX_AGE_S

    visitor = Client()
    start(visitor)
    row = Session.objects.get(session_key=visitor.session.session_key)
    assert row.expire_date <= timezone.now() + timedelta(seconds=STATE_MAX_AGE_S + 5)
    # A finished sign-in is a session of the full age.
    sso.set_user("alice-sub", preferred_username="alice", groups=["support-ops"])
    person = Client()
    assert sign_in(person, "alice-sub").status_code == 302
    signed_in = Session.objects.get(session_key=person.session.session_key)
    assert signed_in.expire_date >= timezone.now() + timedelta(
        seconds=settings.SESSION_COOKIE_AGE - 60)
    # So is a password sign-in from a session that started an SSO sign-in first.
    User.objects.create_superuser("root", "root@example.com", "pw-root-123")
    start(visitor)
    assert visitor.post("/accounts/login/", {"username": "root", "password": "pw-root-123"}
                        ).status_code == 302
    again = Session.objects.get(session_key=visitor.session.session_key)
    assert again.expire_date >= timezone.now() + timedelta(
        seconds=settings.SESSION_COOKIE_AGE - 60)
    # Expired sessions are deleted by the beat's task; live ones stay.
    idle = Client()
    start(idle)
    row = Session.objects.get(session_key=idle.session.session_key)
    assert Session.objects.filter(pk=row.pk).update(
        expire_date=timezone.now() - timedelta(seconds=1)) == 1
    assert "clear-sessions" in settings.CELERY_BEAT_SCHEDULE
    from policies.tasks import clear_sessions

    clear_sessions()
    assert not Session.objects.filter(pk=row.pk).exists()
    assert Session.objects.filter(pk=signed_in.pk).exists()


def test_the_next_sign_in_recomputes_and_leaves_hand_given_memberships(sso: Provider):
    research = team_ensure(slug="research", name="Research")[0]
    sso.set_user("bob-sub", preferred_username="bob", groups=["support-leads", "support-ops"])
    assert sign_in(Client(), "bob-sub").status_code == 302
    user = SsoIdentity.objects.get(subject="bob-sub").user
    assert roles(user) == {"support": (Role.ADMIN, True)}
    membership_set(team=research, user=user, role=Role.ADMIN, actor=None)  # by hand

    sso.set_user("bob-sub", preferred_username="bob", groups=["support-ops"])  # a group gone
    before = OperatorEvent.objects.count()
    assert sign_in(Client(), "bob-sub").status_code == 302
    assert roles(user) == {"support": (Role.OPERATOR, True), "research": (Role.ADMIN, False)}
    change = OperatorEvent.objects.filter(action="member.role").latest("id")
    assert change.detail == {"source": "sso", "groups": ["support-ops"], "before": "admin",
                             "after": "operator"}
    assert OperatorEvent.objects.count() == before + 1  # one change, one event

    sso.set_user("bob-sub", preferred_username="bob", groups=["staff"])
    assert sign_in(Client(), "bob-sub").status_code == 302
    # "*" now gives viewer in every team, except where a hand-given membership is.
    assert roles(user) == {"support": (Role.VIEWER, True), "billing": (Role.VIEWER, True),
                           "research": (Role.ADMIN, False)}

    sso.set_user("bob-sub", preferred_username="bob", groups=["gone"])
    client = Client()
    refused = sign_in(client, "bob-sub")
    assert refused.status_code == 403 and b"none of your groups" in refused.content
    assert roles(user) == {"research": (Role.ADMIN, False)}  # SSO's revoked, the hand's kept
    assert "_auth_user_id" not in client.session
    assert OperatorEvent.objects.filter(action="member.remove", target="bob").count() == 2


def test_identity_is_issuer_and_sub_never_email_or_username(sso: Provider):
    local = User.objects.create_user("carol", "carol@example.com", "pw-carol-123")
    sso.set_user("carol-1", preferred_username="carol", email="carol@example.com",
                 groups=["staff"])
    sso.set_user("carol-2", preferred_username="carol", email="carol@example.com",
                 groups=["staff"])
    sign_in(Client(), "carol-1")
    sign_in(Client(), "carol-2")
    first = SsoIdentity.objects.get(subject="carol-1").user
    second = SsoIdentity.objects.get(subject="carol-2").user
    assert len({local.pk, first.pk, second.pk}) == 3
    assert not Membership.objects.filter(user=local).exists()
    sign_in(Client(), "carol-1")  # the same person again: the same account
    assert SsoIdentity.objects.get(subject="carol-1").user == first


def test_claims_no_account_can_hold_are_left_out_never_a_500(sso: Provider):
    """A NUL or a lone surrogate in a provider's claims (PostgreSQL holds neither): the
    names and groups of that kind are left out and the person signs in; a subject of that
    kind is refused with a page, no account made."""
    sso.set_user("odd-sub", preferred_username="bo\x00b", email="b\x00@example.com",
                 given_name="B\x00", groups=["support-ops", "x\x00"])
    response = sign_in(Client(), "odd-sub")
    assert response.status_code == 302, response.content
    user = SsoIdentity.objects.get(subject="odd-sub").user
    assert (user.username, user.email, user.first_name, user.last_name) == ("sso", "", "", "")
    assert roles(user)["support"] == (Role.OPERATOR, True)
    from policies.sso import sign_in as sso_sign_in

    # A lone surrogate (which the test provider cannot even put in a token) alike.
    odd = sso_sign_in(issuer=sso.issuer, subject="odd-2", claims={
        "family_name": "\ud800", "groups": ["staff", "\udfff"]})
    assert odd.user is not None and odd.user.last_name == ""
    refused = sso_sign_in(issuer=sso.issuer, subject="a\x00b", claims={"groups": ["staff"]})
    assert refused.user is None and refused.refusal is not None
    assert refused.refusal.status == 400
    assert not SsoIdentity.objects.filter(subject__startswith="a").exists()
    # OpenID Connect caps the subject at 255 characters: a longer one was a 500.
    assert sso_sign_in(issuer=sso.issuer, subject="s" * 255,
                       claims={"groups": ["staff"]}).user is not None
    refused = sso_sign_in(issuer=sso.issuer, subject="s" * 256, claims={"groups": ["staff"]})
    assert refused.user is None and refused.refusal is not None
    assert refused.refusal.status == 400 and "255" in refused.refusal.message


def test_no_mapped_group_is_a_403_page_an_event_and_no_user(sso: Provider):
    sso.set_user("dave-sub", preferred_username="dave", groups=["marketing"])
    users = User.objects.count()
    response = sign_in(Client(), "dave-sub")
    assert response.status_code == 403
    assert b"none of your groups gives a role" in response.content
    assert User.objects.count() == users and not SsoIdentity.objects.exists()
    event = OperatorEvent.objects.get(action="sso.refused")
    assert event.target == "dave" and event.detail["reason"] == "no_mapped_group"
    assert event.detail["groups"] == ["marketing"]


def refused(response: Any, status: int, words: bytes) -> None:
    assert response.status_code == status, response.content
    assert words in response.content, response.content
    assert not SsoIdentity.objects.exists()
    assert User.objects.filter(username="eve").count() == 0


def test_a_replayed_callback_is_refused(sso: Provider):
    sso.set_user("eve-sub", preferred_username="eve", groups=["staff"])
    client = Client()
    callback = path_of(authorize(start(client), "eve-sub"))
    assert client.get(callback).status_code == 302
    SsoIdentity.objects.all().delete()
    User.objects.filter(username="eve").delete()
    refused(client.get(callback), 400, b"used already (unknown state)")
    refused(Client().get(callback), 400, b"unknown state")  # another browser


def test_a_forged_callback_and_a_wrong_state_are_refused(sso: Provider):
    sso.set_user("eve-sub", preferred_username="eve", groups=["staff"])
    refused(Client().get("/accounts/sso/callback/?code=forged&state=forged"), 400,
            b"unknown state")
    client = Client()
    state = query_of(start(client))["state"]
    # A code the provider never issued, with the sign-in's own state.
    refused(client.get(f"/accounts/sso/callback/?code=forged&state={state}"), 400,
            b"refused this sign-in&#x27;s code")
    # A real code with another state.
    callback = query_of(authorize(start(client), "eve-sub"))
    refused(client.get(f"/accounts/sso/callback/?code={callback['code']}&state=wrong"), 400,
            b"unknown state")
    refused(client.get("/accounts/sso/callback/?state=x"), 400, b"incomplete")
    refused(client.get("/accounts/sso/callback/?error=access_denied&state=x"), 403,
            b"did not sign you in")


def test_an_id_token_signed_with_another_key_is_refused(sso: Provider, monkeypatch: Any):
    sso.set_user("eve-sub", preferred_username="eve", groups=["staff"])
    other_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    real_get_token = SsoBackend.get_token

    def resigned(self: SsoBackend, payload: dict[str, Any]) -> dict[str, Any]:
        tokens = real_get_token(self, payload)  # the provider's real answer
        token = tokens["id_token"]
        claims = jwt.decode(token, options={"verify_signature": False})
        header = jwt.get_unverified_header(token)
        tokens["id_token"] = jwt.encode(claims, other_key, algorithm="RS256", headers=header)
        return tokens

    monkeypatch.setattr(SsoBackend, "get_token", resigned)
    refused(sign_in(Client(), "eve-sub"), 400, b"signature could not be verified")


def test_a_token_without_key_id_after_a_key_rotation_is_verified_with_the_new_key(
        sso: Provider):
    """The mock provider's ID tokens carry no key id, so the keys kept cannot show that it
    rotated them: a signature the kept key does not verify asks the provider again."""
    sso.set_user("carol-sub", preferred_username="carol", groups=["staff"])
    assert sign_in(Client(), "carol-sub").status_code == 302
    [(jwks_uri, (_, keys))] = oidc_provider._keys.items()
    retired = jwt.algorithms.RSAAlgorithm.to_jwk(
        rsa.generate_private_key(public_exponent=65537, key_size=2048).public_key(),
        as_dict=True)
    # The key kept is the one before a rotation, fetched longer ago than the refetch bound.
    oidc_provider._keys[jwks_uri] = (time.monotonic() - oidc_provider.JWKS_REFETCH_S - 1,
                                     [{**retired, "use": "sig", "kid": "before"}])
    assert sign_in(Client(), "carol-sub").status_code == 302
    assert oidc_provider._keys[jwks_uri][1] == keys

    # A token signed with a key the provider does not have is still refused, and asks the
    # provider again at most once per the refetch bound.
    fetched_at = oidc_provider._keys[jwks_uri][0]
    other_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    real_get_token = SsoBackend.get_token

    def resigned(self: SsoBackend, payload: dict[str, Any]) -> dict[str, Any]:
        tokens = real_get_token(self, payload)
        claims = jwt.decode(tokens["id_token"], options={"verify_signature": False})
        tokens["id_token"] = jwt.encode(claims, other_key, algorithm="RS256")
        return tokens

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SsoBackend, "get_token", resigned)
        response = sign_in(Client(), "carol-sub")
    assert response.status_code == 400
    assert b"signature could not be verified" in response.content
    assert oidc_provider._keys[jwks_uri][0] == fetched_at


def test_an_expired_id_token_is_refused(db: Any):
    team_ensure(slug="support", name="Support")
    with running_provider(token_max_age=timedelta(hours=-1)) as stale:
        stale.set_user("eve-sub", preferred_username="eve", groups=["staff"])
        forget_provider()
        with sso_settings(stale):
            refused(sign_in(Client(), "eve-sub"), 400, b"has expired")
    forget_provider()


def test_an_issuer_mismatch_is_refused(sso: Provider):
    sso.set_user("eve-sub", preferred_username="eve", groups=["staff"])
    sso.token_host = "impostor.example"  # its ID tokens now name http://impostor.example
    refused(sign_in(Client(), "eve-sub"), 400, b"another issuer")


def test_a_wrong_client_secret_says_so_not_that_the_code_was_forged(db: Any, caplog: Any):
    """A provider refusing this server's client (RFC 6749 5.2 ``invalid_client``) is the
    configuration's fault: the page and the log name the settings, and never tell the
    person to sign in again (found by a newcomer: "forged, used already or has expired")."""
    team_ensure(slug="support", name="Support")
    with running_provider(require_client_registration=True) as strict:
        client = requests.post(
            f"{strict.issuer}/oauth2/clients", timeout=5,
            json={"redirect_uris": ["http://testserver/accounts/sso/callback/"],
                  "token_endpoint_auth_method": "client_secret_post"}).json()
        strict.set_user("eve-sub", preferred_username="eve", groups=["staff"])
        forget_provider()
        with sso_settings(strict, OIDC_CLIENT_ID=client["client_id"],
                          OIDC_CLIENT_SECRET="not-its-secret"):
            response = sign_in(Client(), "eve-sub")
            refused(response, 503, b"did not accept this server&#x27;s client credentials")
            assert b"OIDC_CLIENT_SECRET" in response.content
            assert b"Sign in again" not in response.content
            assert b"forged" not in response.content
            assert "check OIDC_CLIENT_ID and OIDC_CLIENT_SECRET" in caplog.text
        forget_provider()
        with sso_settings(strict, OIDC_CLIENT_ID=client["client_id"],
                          OIDC_CLIENT_SECRET=client["client_secret"]):
            assert sign_in(Client(), "eve-sub").status_code == 302  # the right one signs in
    forget_provider()


def test_an_unreachable_provider_is_a_page_not_a_500(db: Any):
    forget_provider()
    with override_settings(OIDC_ISSUER="http://127.0.0.1:9", OIDC_CLIENT_ID="governance",
                           OIDC_TIMEOUT=1.0):
        response = Client().get("/accounts/sso/login/")
        assert response.status_code == 503
        assert b"identity provider cannot be reached" in response.content
    forget_provider()


def test_a_role_map_naming_a_missing_team_or_not_parsing_refuses_the_sign_in(sso: Provider):
    sso.set_user("eve-sub", preferred_username="eve", groups=["staff"])
    with override_settings(OIDC_ROLE_MAP=json.dumps(
            [{"group": "staff", "team": "support", "role": "viewer"},
             {"group": "staff", "team": "nowhere", "role": "viewer"}])):
        refused(sign_in(Client(), "eve-sub"), 503, b"entry 2 names the team &#x27;nowhere&#x27;")
    with override_settings(OIDC_ROLE_MAP="not json"):  # a server started with --skip-checks
        refused(sign_in(Client(), "eve-sub"), 503, b"OIDC_ROLE_MAP is not JSON")


def test_the_login_page_and_the_password_policy(sso: Provider, db: Any):
    User.objects.create_user("frank", "", "pw-frank-123")
    User.objects.create_superuser("root", "", "pw-root-123")
    client = Client()
    page = client.get("/accounts/login/")
    assert b"Sign in with SSO" in page.content and b"superusers only" in page.content
    # A right password of an account that is not a superuser reads as a wrong one (the form
    # never tells whose password was right), and both say who signs in here.
    for password in ("pw-frank-123", "wrong"):
        answer = client.post("/accounts/login/", {"username": "frank", "password": password})
        assert answer.status_code == 200 and b"Please enter a correct username" in answer.content
        assert b"Only a superuser signs in with a password here" in answer.content
    assert client.post("/accounts/login/", {"username": "root",
                                            "password": "pw-root-123"}).status_code == 302
    with override_settings(OIDC_PASSWORD_LOGIN="off"):
        page = Client().get("/accounts/login/")
        assert b"Sign in with SSO" in page.content and b'name="password"' not in page.content
        answer = Client().post("/accounts/login/", {"username": "root",
                                                    "password": "pw-root-123"})
        assert answer.status_code == 200 and b"Password sign-in is off" in answer.content
    with override_settings(OIDC_PASSWORD_LOGIN="all"):
        assert Client().post("/accounts/login/", {"username": "frank",
                                                  "password": "pw-frank-123"}).status_code == 302


@override_settings(OIDC_ISSUER="", OIDC_PASSWORD_LOGIN="all")
def test_without_an_issuer_everything_is_as_before(db: Any):
    page = Client().get("/accounts/login/")
    assert b"Sign in with SSO" not in page.content and b'name="password"' in page.content
    assert Client().get("/accounts/sso/login/").status_code == 404
    assert Client().get("/accounts/sso/callback/?code=x&state=y").status_code == 404


def test_a_bad_role_map_is_a_system_check_error_naming_the_entry(db: Any):
    from governance.checks import sso_role_map_teams, sso_settings

    cases = {
        "not json": "is not JSON",
        '{"group": "a"}': "must be a JSON list",
        '[{"group": "a", "team": "support", "role": "boss"}]':
            "entry 1 ({\"group\": \"a\", \"team\": \"support\", \"role\": \"boss\"}): "
            "unknown role 'boss'",
        '[{"group": "a", "team": "*", "role": "viewer"}, {"group": "b", "role": "admin"}]':
            "entry 2",
    }
    for raw, words in cases.items():
        with override_settings(OIDC_ROLE_MAP=raw):
            errors = sso_settings()
            assert len(errors) == 1 and words in errors[0].msg, (raw, errors)
            assert errors[0].id == "governance.E001"
    team_ensure(slug="support", name="Support")
    with override_settings(OIDC_ROLE_MAP=json.dumps(
            [{"group": "a", "team": "support", "role": "admin"},
             {"group": "b", "team": "nowhere", "role": "viewer"}])):
        assert sso_settings() == []
        assert sso_role_map_teams(databases=None) == []  # only where the database is checked
        errors = sso_role_map_teams(databases=["default"])
        assert [e.msg for e in errors] == [
            "OIDC_ROLE_MAP entry 2 names the team 'nowhere', which does not exist."]


@pytest.mark.django_db(transaction=True)
def test_serve_refuses_to_start_with_a_role_map_naming_an_unknown_team() -> None:
    # SPEC 17: a bad OIDC_ROLE_MAP makes the server refuse to start. The team part needs the
    # database, which Django's checks before a command leave out: `serve` started and
    # answered /healthz with a map naming a team that does not exist.
    from tests.conftest import free_port, server_env

    env = server_env(OIDC_ISSUER="http://127.0.0.1:9", OIDC_CLIENT_ID="a",
                     OIDC_CLIENT_SECRET="b", OIDC_ROLE_MAP=json.dumps(
                         [{"group": "g", "team": "no-such-team", "role": "viewer"}]))
    process = subprocess.Popen([sys.executable, "manage.py", "serve", "--port",
                                str(free_port())], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        pytest.fail("serve started with a role map naming a team that does not exist")
    assert process.returncode != 0
    assert b"governance.E004" in out and b"'no-such-team', which does not exist" in out


def test_an_sso_role_changed_by_an_admin_is_kept_from_then_on(sso: Provider):
    sso.set_user("gina-sub", preferred_username="gina", groups=["support-ops"])
    sign_in(Client(), "gina-sub")
    user = SsoIdentity.objects.get(subject="gina-sub").user
    support = Membership.objects.get(user=user).team
    membership_set(team=support, user=user, role=Role.VIEWER, actor=None)  # the members page
    sign_in(Client(), "gina-sub")
    assert roles(user) == {"support": (Role.VIEWER, False)}


def test_groups_missing_from_the_id_token_are_read_from_userinfo(sso: Provider,
                                                                 monkeypatch: Any):
    sso.set_user("hal-sub", preferred_username="hal", groups=["support-leads"])
    real = SsoBackend._verify_jws

    def without_groups(self: SsoBackend, payload: str, key: Any) -> dict[str, Any]:
        claims = real(self, payload, key)
        claims.pop("groups")
        return claims

    monkeypatch.setattr(SsoBackend, "_verify_jws", without_groups)
    assert sign_in(Client(), "hal-sub").status_code == 302
    user = SsoIdentity.objects.get(subject="hal-sub").user
    assert roles(user) == {"support": (Role.ADMIN, True)}


def test_the_other_settings_checks():
    from governance.checks import sso_over_https, sso_settings

    with override_settings(OIDC_ISSUER="login.example.com", OIDC_CLIENT_ID=""):
        assert [e.id for e in sso_settings()] == ["governance.E002", "governance.E003"]
    with override_settings(OIDC_ISSUER="http://login.example.com", OIDC_CLIENT_ID="x"):
        assert [w.id for w in sso_over_https()] == ["governance.W002"]
    with override_settings(OIDC_ISSUER="https://login.example.com", OIDC_CLIENT_ID="x"):
        assert sso_settings() == [] and sso_over_https() == []
