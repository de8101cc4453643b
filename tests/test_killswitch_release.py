"""Kill switch for the on-call (issue 26): a team setting lets operators release switches
(by default none: SPEC 7 gives release to admins; a team may let operators release the ones
they engaged themselves, or any); no page tells a reader to do what they cannot; a run
switch does not stay "engaged" in the history once its run has ended."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from policies.models import OperatorEvent
from runs.killswitch.fanout import RUN_ENDED, killswitch_fanout
from runs.killswitch.services import killswitch_engage
from runs.models import KillSwitch
from tests.test_dashboard_runs import check, start

RELEASE = {"scope": "team", "reason": "all clear"}


@pytest.fixture
def commit(django_capture_on_commit_callbacks: Any) -> Any:
    return lambda: django_capture_on_commit_callbacks(execute=True)


def signed_in(user: Any) -> Client:
    client = Client()
    client.force_login(user)
    return client


def release(user: Any, slug: str = "support") -> int:
    return signed_in(user).post(reverse("runs:killswitch-release", args=[slug]),
                                RELEASE).status_code


def engaged() -> bool:
    return KillSwitch.objects.filter(active=True).exists()


def test_by_default_only_admins_release_even_the_switch_an_operator_engaged(team, users):
    """SPEC 7: releasing a team or agent switch is the admins'."""
    assert team.operator_release == "none"
    killswitch_engage(scope="team", team=team, reason="incident", actor=users["operator"])
    page = signed_in(users["operator"]).get(reverse("runs:killswitch", args=[team.slug]))
    assert b"Release</button>" not in page.content
    assert b"its team&#x27;s admins" in page.content or b"its team's admins" in page.content
    assert release(users["operator"]) == 403
    assert engaged()
    assert release(users["admin"]) == 302
    assert not engaged()


def test_a_team_may_let_an_operator_release_the_switch_they_engaged(team, users):
    team.operator_release = "own"
    team.save()
    killswitch_engage(scope="team", team=team, reason="incident", actor=users["operator"])
    page = signed_in(users["operator"]).get(reverse("runs:killswitch", args=[team.slug]))
    assert b"Release</button>" in page.content
    assert b"Release forms are in the banner above." in page.content
    assert release(users["operator"]) == 302
    assert not engaged()


def test_an_operator_may_not_release_someone_elses_switch_under_own(team, users):
    team.operator_release = "own"
    team.save()
    killswitch_engage(scope="team", team=team, reason="incident", actor=users["admin"])
    page = signed_in(users["operator"]).get(reverse("runs:killswitch", args=[team.slug]))
    html = page.content.decode()
    assert "Release</button>" not in html
    # No instruction the reader cannot follow: it says who can.
    assert "release it in the banner above" not in html
    assert "Release forms are in the banner above" not in html
    assert "the operator who engaged it" in html
    assert release(users["operator"]) == 403
    assert engaged()


def test_a_team_may_let_operators_release_any_switch_or_none(team, users):
    killswitch_engage(scope="team", team=team, reason="incident", actor=users["admin"])
    team.operator_release = "any"
    team.save()
    assert release(users["operator"]) == 302
    assert not engaged()
    killswitch_engage(scope="team", team=team, reason="again", actor=users["operator"])
    team.operator_release = "none"
    team.save()
    assert release(users["operator"]) == 403
    assert release(users["viewer"]) == 403
    assert release(users["outsider"]) == 403
    assert engaged()
    assert release(users["admin"]) == 302
    assert not engaged()


def test_an_admin_sets_it_in_the_team_settings_and_it_is_audited(team, users):
    url = reverse("team_settings", args=[team.slug])
    assert signed_in(users["operator"]).post(url, {"operator_release": "any"}).status_code == 403
    admin = signed_in(users["admin"])
    assert b'name="operator_release"' in admin.get(url).content
    assert admin.post(url, {"operator_release": "bogus"}).status_code == 422
    assert admin.post(url, {"operator_release": "any"}).status_code == 302
    team.refresh_from_db()
    assert team.operator_release == "any"
    event = OperatorEvent.objects.get(action="team.operator_release")
    assert event.detail == {"before": "none", "after": "any"}


def test_a_run_switch_is_released_once_its_run_has_ended(team, users, commit):
    run = start(team)
    check(team, run)
    with commit():
        switch = killswitch_engage(scope="run", run=run, reason="runaway",
                                   actor=users["operator"])
    # The fan-out itself (on the production stack the commit only published it to a worker).
    killswitch_fanout(switch_id=switch.pk)
    run.refresh_from_db()
    switch.refresh_from_db()
    assert run.status == "killed"
    assert not switch.active and switch.release_reason == RUN_ENDED
    history = signed_in(users["viewer"]).get(
        reverse("runs:killswitch", args=[team.slug])).content.decode()
    assert RUN_ENDED in history
    assert "<strong>engaged</strong>" not in history
    # The killed run's checks still answer killed.
    answer = check(team, run)
    assert (answer["decision"], answer["reason"]) == ("stop", "killed")


@pytest.mark.parametrize("setting", ["none", "own"])
def test_a_refused_release_says_why_and_whom_to_ask(team, users, setting):
    """The 403 an operator meets, from the API (a paging tool's script) or the dashboard,
    says what the team's setting allows and whom to ask: it said "operators: as the team's
    setting says", which an operator cannot read (the settings page is the admins')."""
    from policies.tokens import operator_token_create

    team.operator_release = setting
    team.save()
    killswitch_engage(scope="team", team=team, reason="incident", actor=users["admin"])
    token = operator_token_create(user=users["operator"], name="pager", role="operator").secret
    answer = Client(HTTP_AUTHORIZATION=f"Bearer {token}").post(
        "/api/v1/killswitch", {"action": "release", "scope": "team", "team": team.slug,
                               "reason": "all clear"}, content_type="application/json")
    assert answer.status_code == 403
    message = answer.json()["error"]["message"]
    page = signed_in(users["operator"]).post(
        reverse("runs:killswitch-release", args=[team.slug]), RELEASE).content.decode()
    for said in (message, page):
        assert "ask an admin of the team" in said, said
        assert "as the team's setting says" not in said
    if setting == "own":
        assert "engaged by admin" in message and "only the switches they engaged" in message
    else:
        assert "operators of this team release none" in message
    assert engaged()


def _admin_engaged_in_between(team: Any, users: Any, monkeypatch: Any) -> KillSwitch:
    """The race: a team whose operators release the switches they engaged; the operator's
    switch, which an admin released and replaced with their own after the operator's request
    read it (what `engaged_switch` still answers). Returns the admin's switch."""
    from runs.killswitch import selectors
    from runs.killswitch.services import killswitch_release

    team.operator_release = "own"
    team.save()
    theirs = killswitch_engage(scope="team", team=team, reason="incident",
                               actor=users["operator"])
    killswitch_release(scope="team", team=team, reason="mine now", actor=users["admin"])
    admins = killswitch_engage(scope="team", team=team, reason="a worse one",
                               actor=users["admin"])
    monkeypatch.setattr(selectors, "engaged_switch", lambda target: theirs)
    return admins


def test_an_operator_cannot_release_a_switch_an_admin_engaged_after_their_check(
        team, users, monkeypatch):
    """Found by an attacker: who may release was asked of the switch engaged before the
    release's transaction, and the release then took whichever switch was engaged at that
    moment. Between the two an admin released the operator's switch and engaged one of
    their own: the operator's release (allowed for the switches they engaged) released the
    admin's. It is asked again of the switch under its lock."""
    admins = _admin_engaged_in_between(team, users, monkeypatch)
    assert release(users["operator"]) == 403
    assert KillSwitch.objects.get(pk=admins.pk).active


def test_the_operator_api_asks_again_under_the_lock_too(team, users, monkeypatch):
    """The same race through `POST /api/v1/killswitch` with an operator's token."""
    from policies.tokens import operator_token_create

    token = operator_token_create(user=users["operator"], name="oncall", role="operator").secret
    admins = _admin_engaged_in_between(team, users, monkeypatch)
    answer = Client(HTTP_AUTHORIZATION=f"Bearer {token}").post(
        "/api/v1/killswitch", {"action": "release", "scope": "team", "team": team.slug,
                               "reason": "all clear"}, content_type="application/json")
    assert answer.status_code == 403, answer.content
    assert answer.json()["error"]["code"] == "forbidden"
    assert "ask an admin" in answer.json()["error"]["message"]
    assert KillSwitch.objects.get(pk=admins.pk).active
