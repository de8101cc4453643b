"""What the dashboard shows stays true: filter choices listed once, controls re-rendered by the
live streams from the current state (kill, release, engage), the engage confirmation naming
the runs that will stop, policy diffs without spurious changes (issue 15, "wrong or stale")."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from policies.forms import PolicyForm
from policies.models import Policy
from runs.killswitch.fanout import killswitch_fanout
from runs.killswitch.services import killswitch_engage
from runs.models import KillSwitch, Scope
from tests.test_dashboard_runs import _fast, as_user, check, events, read_all, start  # noqa: F401

pytestmark = pytest.mark.django_db


def stream(client: Client, url: str, **params: Any) -> list[dict[str, str]]:
    return events(read_all(client.get(url, params)))


# --- Filters ---------------------------------------------------------------------------------

def test_the_runs_filters_list_each_agent_and_stop_reason_once(team, users,
                                                              django_capture_on_commit_callbacks):
    for _ in range(3):
        start(team, "bot-a")
    start(team, "bot-b")
    for run in [start(team, "bot-a"), start(team, "bot-b")]:
        # The fan-out marks it killed (here, not on a Celery worker, on either stack).
        killswitch_fanout(switch_id=killswitch_engage(scope=Scope.RUN, run=run,
                                                      reason="test").pk)
    html = as_user(users).get(reverse("runs:runs", kwargs={"slug": team.slug})).content.decode()
    assert html.count('<option value="bot-a"') == 1
    assert html.count('<option value="bot-b"') == 1
    assert html.count('<option value="killed"') == 2  # once as a status, once as a reason


# --- The run page's controls -------------------------------------------------------------------

def test_a_run_killed_elsewhere_loses_its_kill_button_on_the_stream(
        team, users, settings, django_capture_on_commit_callbacks):
    settings.DASHBOARD_STREAM_SECONDS = 10
    run = start(team)
    check(team, run)
    operator = as_user(users, "operator")
    page = operator.get(reverse("runs:run", kwargs={"slug": team.slug, "run_id": run.pk}))
    assert 'id="kill-run"' in page.content.decode()
    confirm_box = operator.get(reverse("runs:killswitch-run", kwargs={
        "slug": team.slug, "run_id": run.pk}), HTTP_HX_REQUEST="true").content.decode()
    response = operator.get(reverse("runs:run_stream",
                                    kwargs={"slug": team.slug, "run_id": run.pk}))
    chunks = iter(response.streaming_content)
    next(chunks)
    first = events(next(chunks).decode())
    controls = next(e for e in first if e["event"] == "run-controls")
    assert 'id="kill-run"' in controls["data"]
    killswitch_fanout(switch_id=killswitch_engage(scope=Scope.RUN, run=run,
                                                  reason="someone else").pk)
    later = events(b"".join(chunks).decode())
    controls = [e for e in later if e["event"] == "run-controls"][-1]
    assert 'id="kill-run"' not in controls["data"]
    # An open confirmation is replaced too, so it cannot promise "0 runs": by an event of
    # its own that it listens for, not an out-of-band swap (which logged
    # htmx:oobErrorNoTarget on every page without one open).
    assert "hx-swap-oob" not in controls["data"]
    confirm = [e for e in later if e["event"] == "run-confirm-form"][-1]
    assert "nothing left to kill" in confirm["data"] and ">Close</a>" in confirm["data"]
    # The region it replaces holds what would stop as well as the form (found by a newcomer:
    # "1 running run will stop" stayed above "nothing left to kill").
    assert "killswitch-confirm__effect" in confirm_box.split('id="killswitch-confirm-form"')[1]


def test_a_viewer_never_gets_a_kill_button_from_the_stream(team, users):
    run = start(team)
    frames = stream(as_user(users, "viewer"),
                    reverse("runs:run_stream", kwargs={"slug": team.slug, "run_id": run.pk}))
    controls = next(e for e in frames if e["event"] == "run-controls")
    assert "kill-run" not in controls["data"]


def test_every_stream_carries_the_banner_with_release_forms_for_admins_only(team, users):
    killswitch_engage(scope=Scope.TEAM, team=team, reason="incident 42")
    url = reverse("runs:overview_stream", kwargs={"slug": team.slug})
    chrome = next(e for e in stream(as_user(users, "admin"), url) if e["event"] == "chrome")
    assert 'id="killswitch-banner-slot" hx-swap-oob="true"' in chrome["data"]
    assert "incident 42" in chrome["data"] and "Release" in chrome["data"]
    # The release form comes back to the page, not to the stream's URL.
    assert f'name="next" value="/teams/{team.slug}/"' in chrome["data"]
    chrome = next(e for e in stream(as_user(users, "operator"), url) if e["event"] == "chrome")
    assert "incident 42" in chrome["data"] and "Reason for release" not in chrome["data"]


def test_the_team_stream_serves_pages_without_a_stream_of_their_own(team, users):
    client = as_user(users, "viewer")
    html = client.get(reverse("policies", kwargs={"slug": team.slug})).content.decode()
    assert f'sse-connect="/teams/{team.slug}/live?next=' in html
    killswitch_engage(scope=Scope.TEAM, team=team, reason="incident 43")
    frames = stream(client, reverse("runs:team_stream", kwargs={"slug": team.slug}),
                    next=f"/teams/{team.slug}/policies/")
    chrome = next(e for e in frames if e["event"] == "chrome")
    assert "incident 43" in chrome["data"]
    # Only a path of this site goes into the forms.
    admin = as_user(users, "admin")
    frames = stream(admin, reverse("runs:team_stream", kwargs={"slug": team.slug}),
                    next="//evil.example/")
    chrome = next(e for e in frames if e["event"] == "chrome")
    assert "evil.example" not in chrome["data"]


@pytest.mark.parametrize("name", ["runs:team_stream", "runs:killswitch-stream"])
def test_the_new_streams_follow_the_team_rules(team, other_team, users, name):
    url = reverse(name, kwargs={"slug": team.slug})
    anonymous = Client().get(url)
    assert anonymous.status_code == 302 and "/accounts/login/" in anonymous["Location"]
    assert as_user(users, "outsider").get(url).status_code == 403
    assert as_user(users, "viewer").get(url).status_code == 200


# --- The kill switch page -----------------------------------------------------------------------

def test_the_kill_switch_page_offers_stopping_the_team_only_while_it_is_not_stopped(team, users,
                                                                                     settings):
    settings.DASHBOARD_STREAM_SECONDS = 10
    operator = as_user(users, "operator")
    html = operator.get(reverse("runs:killswitch", kwargs={"slug": team.slug})).content.decode()
    assert "Stop the whole team" in html
    assert "stays stopped when the team's switch is released" not in html
    response = operator.get(reverse("runs:killswitch-stream", kwargs={"slug": team.slug}))
    chunks = iter(response.streaming_content)
    next(chunks), next(chunks)
    killswitch_engage(scope=Scope.TEAM, team=team, reason="incident 44")
    later = events(b"".join(chunks).decode())
    engage = [e for e in later if e["event"] == "killswitch-engage"][-1]
    assert "Stop the whole team" not in engage["data"] and "whole team is stopped" in engage["data"]
    # Still offered (an agent's switch outlives the team's release), and it says so.
    assert "Stop one agent" in engage["data"]
    assert "stays stopped when the team's switch is released" in engage["data"]
    engaged = [e for e in later if e["event"] == "killswitch-engaged"][-1]
    assert "incident 44" in engaged["data"]
    html = operator.get(reverse("runs:killswitch", kwargs={"slug": team.slug})).content.decode()
    assert "Stop the whole team" not in html


def test_a_viewer_gets_no_engage_controls_on_the_kill_switch_stream(team, users):
    frames = stream(as_user(users, "viewer"),
                    reverse("runs:killswitch-stream", kwargs={"slug": team.slug}))
    engage = next(e for e in frames if e["event"] == "killswitch-engage")
    assert "<form" not in engage["data"]


def test_the_engage_confirmation_lists_the_first_runs_and_how_many_more(team, users):
    runs = [start(team, "bot-a") for _ in range(12)]
    html = as_user(users, "operator").post(
        reverse("runs:killswitch-engage", kwargs={"slug": team.slug}),
        {"scope": "team", "reason": ""}).content.decode()
    assert "12 running runs" in html
    listed = [r for r in runs if f"/runs/{r.pk}/" in html]
    assert len(listed) == 10
    assert "and 2 more" in html


def test_an_agent_never_seen_is_accepted_with_a_warning(team, users):
    start(team, "bot-a")
    operator = as_user(users, "operator")
    url = reverse("runs:killswitch-engage", kwargs={"slug": team.slug})
    html = operator.post(url, {"scope": "agent", "agent": "bot-typo"}).content.decode()
    assert "No run of agent <code>bot-typo</code> was ever seen" in html
    html = operator.post(url, {"scope": "agent", "agent": "bot-a"}).content.decode()
    assert "was ever seen" not in html
    done = operator.post(url, {"scope": "agent", "agent": "bot-typo", "confirmed": "1",
                               "reason": "just in case"})
    assert done.status_code == 302
    assert KillSwitch.objects.filter(team=team, agent="bot-typo", active=True).exists()



def test_the_kill_confirmation_promises_a_webhook_only_to_a_team_that_has_one(team, users):
    """Found by a newcomer: after killing a run the page said "...the runs are being marked
    killed and the team's webhook notified" for a team with no webhook URL."""
    operator = as_user(users, "operator")

    def kill(run: Any) -> str:
        return operator.post(reverse("runs:killswitch-run", kwargs={
            "slug": team.slug, "run_id": run.pk}), {"confirmed": "1", "reason": "stuck"},
            HTTP_HX_REQUEST="true").content.decode()

    assert not team.webhook_url
    html = kill(start(team))
    assert "Kill switch engaged" in html and "webhook notified" not in html
    assert "being marked killed" in html
    assert "The team has no webhook URL: no one is notified." in html
    team.webhook_url = "https://hooks.example.com/governance"
    team.save(update_fields=["webhook_url"])
    html = kill(start(team))
    assert "being marked killed and the team's webhook notified" in html
    assert "no webhook URL" not in html
    # The global switch notifies each team that has a webhook URL.
    html = as_user(users, "superuser").post(
        reverse("runs:killswitch-global-engage"), {"confirmed": "1", "reason": "outage"},
        HTTP_HX_REQUEST="true").content.decode()
    assert "every team's webhook, where one is set, notified" in html

# --- Policy history ----------------------------------------------------------------------------

def test_a_form_save_does_not_show_a_spurious_money_change(team, users):
    admin = as_user(users, "admin")
    policy = Policy.objects.get(team=team, name="default")
    data = {k: v for k, v in PolicyForm.initial_from(policy.current.document).items()
            if v not in (None, False)}
    data["max_steps"] = "7"
    data["note"] = "fewer steps"
    response = admin.post(reverse("policy_save", kwargs={"slug": team.slug, "name": "default"}),
                          data)
    assert response.status_code == 302
    policy.refresh_from_db()
    assert policy.current.version == 2
    assert policy.current.document["budgets"]["max_usd"] == 1.0
    assert isinstance(policy.current.document["budgets"]["max_usd"], float)
    html = admin.get(reverse("policy_history", kwargs={"slug": team.slug, "name": "default"})
                     ).content.decode()
    changed = re.findall(r'<span class="diff-(?:add|del)">([^<]*)</span>', html)
    assert any("max_steps: 7" in line for line in changed)
    assert not any("max_usd" in line for line in changed)
    assert "</span>\n<span" not in html  # one line per span, not double-spaced


# --- Who the stream still sends to -----------------------------------------------------------

@pytest.mark.parametrize("how", ["removed", "signed_out", "deactivated"])
def test_an_open_stream_ends_once_its_viewer_no_longer_sees_the_team(
        team, users, settings, monkeypatch, how):
    """Found by an attacker: a member removed from the team (or signed out, or deactivated)
    kept receiving the run's new steps, args included, on the stream opened before, until its
    lifetime's end (60 s), while every page already answered 403. Its next look asks again
    (at most every VIEWER_LOOK_S) and ends the stream; the browser's reconnect is refused."""
    import time

    from policies.models import Membership
    from runs.dashboard import stream as live

    settings.DASHBOARD_STREAM_SECONDS = 10
    monkeypatch.setattr(live, "VIEWER_LOOK_S", 0.0, raising=False)
    run = start(team)
    check(team, run)
    viewer = as_user(users, "viewer")
    response = viewer.get(reverse("runs:run_stream", kwargs={"slug": team.slug,
                                                             "run_id": run.pk}))
    chunks = iter(response.streaming_content)
    next(chunks)
    assert "run-header" in next(chunks).decode()  # the first look: the viewer's to see
    if how == "removed":
        Membership.objects.filter(user=users["viewer"], team=team).delete()
    elif how == "signed_out":
        viewer.logout()
    else:
        users["viewer"].is_active = False
        users["viewer"].save(update_fields=["is_active"])
    check(team, run, "secret.tool", {"q": "confidential"})
    began = time.monotonic()
    rest = b"".join(chunks).decode()
    assert "confidential" not in rest and "secret.tool" not in rest
    assert time.monotonic() - began < 5  # at its next look, not at its lifetime's end
    assert viewer.get(reverse("runs:run", kwargs={"slug": team.slug, "run_id": run.pk})
                      ).status_code in (302, 403)


def test_a_viewers_streams_ask_once_per_look_interval_whether_it_still_sees_the_team(
        monkeypatch):
    """Asked by each stream, the question was 3 to 4 queries per open page every 5 s (1,000
    pages: 800 queries a second on the look lane, whose batched looks make 7 per 100 pages).
    A viewer's streams share one answer for VIEWER_LOOK_S."""
    from runs.dashboard import stream as live

    asked: list[tuple[str, str]] = []
    monkeypatch.setattr(live, "session_sees_team", lambda key, slug: asked.append((key, slug))
                        or True)
    monkeypatch.setattr(live, "_viewers_seen", {})
    monkeypatch.setattr(live, "VIEWER_LOOK_S", 60.0)
    for _ in range(10):  # ten pages of one viewer, then another team's page of it
        assert live._viewer_sees("k" * 32, "alpha")
    assert live._viewer_sees("k" * 32, "bravo")
    assert asked == [("k" * 32, "alpha"), ("k" * 32, "bravo")]
    monkeypatch.setattr(live, "VIEWER_LOOK_S", 0.0)  # the answer is now older than that
    assert live._viewer_sees("k" * 32, "alpha")
    assert len(asked) == 3
