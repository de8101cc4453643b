"""The run page's timeline for long runs: paging, "stops and warnings only", per-step
durations, the reported progress (also in the decisions API), the kill row, and the shadow
mode summary."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.urls import reverse

from runs.dashboard import selectors as dashboard
from runs.killswitch.fanout import killswitch_fanout
from runs.killswitch.services import killswitch_engage
from runs.models import Decision, Run, Scope
from tests.conftest import set_policy
from tests.test_dashboard_runs import _fast, as_user, check, start  # noqa: F401

pytestmark = pytest.mark.django_db


def steps_of(html: str) -> list[int]:
    return [int(part.split('"')[0]) for part in html.split('<tr id="step-')[1:]]


def long_run(team, n: int) -> tuple[Run, list[Decision]]:
    run = start(team)
    Decision.objects.bulk_create([
        Decision(run=run, step=i + 1, outcome="allow", reason="step_ok", action_name="t.step",
                 action_type="tool", args={"i": i}, answer={}, at=run.started_at
                 + timedelta(seconds=2 * i + 1))
        for i in range(n)
    ])
    Run.objects.filter(pk=run.pk).update(steps=n)
    return run, list(run.decisions.order_by("id"))


def test_a_300_step_run_shows_its_last_50_steps_and_loads_earlier_ones(team, users):
    run, decisions = long_run(team, 300)
    client = as_user(users)
    html = client.get(reverse("runs:run", kwargs={"slug": team.slug, "run_id": run.pk})
                      ).content.decode()
    shown = steps_of(html)
    assert shown == [d.pk for d in decisions[-50:]]
    assert 'id="timeline-earlier"' in html
    assert f"?after={decisions[-1].pk}" in html  # the stream resumes after the newest
    url = reverse("runs:run_timeline", kwargs={"slug": team.slug, "run_id": run.pk})
    seen, before = list(shown), shown[0]
    for _ in range(10):
        fragment = client.get(url, {"before": before}, HTTP_HX_REQUEST="true").content.decode()
        page = steps_of(fragment)
        assert len(page) <= dashboard.TIMELINE_PAGE
        seen = page + seen
        if 'id="timeline-earlier"' not in fragment:
            break
        before = page[0]
    assert seen == [d.pk for d in decisions]  # every step once, in order, in 6 pages


def test_each_step_shows_how_long_it_took_since_the_previous_check(team, users):
    run, _ = long_run(team, 3)
    html = as_user(users).get(reverse("runs:run", kwargs={"slug": team.slug, "run_id": run.pk})
                              ).content.decode()
    assert html.count("+2.0 s") == 2 and "+1.0 s" in html  # the first: since the run started


def test_stops_and_warnings_only_keeps_stops_nudges_and_would_stops(team, users):
    # No SPEC 16 warnings but the nudge: each of them would be kept too.
    set_policy(team, step_limits={"max_repeat_action": 2}, on_repeated_error={"threshold": 2},
               warnings=None)
    run = start(team)
    fail = {"status": "error", "error": "timeout"}
    ids = [check(team, run, "a", {"n": 1})["decision_id"],
           check(team, run, "b", {"n": 2}, last_result=fail)["decision_id"],
           check(team, run, "c", {"n": 3}, last_result=fail)["decision_id"]]  # a nudge
    ids.append(check(team, run, "c", {"n": 3})["decision_id"])
    ids.append(check(team, run, "c", {"n": 3})["decision_id"])  # loop: stop
    html = as_user(users).get(reverse("runs:run", kwargs={"slug": team.slug, "run_id": run.pk}),
                              {"only": "flagged"}).content.decode()
    assert Decision.objects.get(pk=ids[2]).answer.get("directive")  # the nudge
    assert Decision.objects.get(pk=ids[4]).outcome == "stop"
    assert steps_of(html) == [ids[2], ids[4]]
    assert "only=flagged" in html.split("sse-connect=")[1].split(">")[0]  # the stream too


def test_the_reported_progress_is_shown_and_in_the_decisions_api(team, users):
    run = start(team)
    response = Client().post(f"/api/v1/runs/{run.pk}/check",
                             {"action": {"name": "x"}, "progress": "page-7"},
                             content_type="application/json",
                             HTTP_AUTHORIZATION=f"Bearer {run.token}")
    assert response.status_code == 200
    check(team, run, "y", {})
    api = Client().get(f"/api/v1/runs/{run.pk}/decisions",
                       HTTP_AUTHORIZATION=f"Bearer {run.token}").json()["decisions"]
    assert [d["progress"] for d in api] == ["page-7", None]
    html = as_user(users).get(reverse("runs:run", kwargs={"slug": team.slug, "run_id": run.pk})
                              ).content.decode()
    assert "progress: <code>&quot;page-7&quot;</code>" in html


def test_the_kill_row_does_not_repeat_the_previous_step_number(
        team, users, django_capture_on_commit_callbacks):
    run = start(team)
    check(team, run)
    killswitch_fanout(switch_id=killswitch_engage(scope=Scope.RUN, run=run,
                                                  reason="stop it").pk)
    html = as_user(users).get(reverse("runs:run", kwargs={"slug": team.slug, "run_id": run.pk})
                              ).content.decode()
    kill_row = html.split('class="step outcome-stop kill"')[1].split("</tr>")[0]
    assert 'title="after step 1: a kill adds no step">—' in kill_row
    # The banner says once which switch stopped the run, by whom and why (found by a
    # newcomer: its rule's sentence, then the kill's message saying the same again).
    banner = html.split('class="banner banner-killed"')[1].split("</section>")[0]
    assert "A kill switch stopped this run: the run kill switch" in banner
    assert banner.count("stop it") == 1, banner


def test_a_shadow_run_says_where_it_would_have_stopped(team, users):
    set_policy(team, mode="shadow", step_limits={"max_repeat_action": 2})
    run = start(team)
    for _ in range(4):
        check(team, run, "same", {"q": 1})
    html = as_user(users).get(reverse("runs:run", kwargs={"slug": team.slug, "run_id": run.pk})
                              ).content.decode()
    assert "would have stopped at step 3: <strong>loop_detected</strong>" in html
    assert "(2 checks would have been stopped)" in html


def test_the_timeline_fragment_follows_the_team_rules(team, other_team, users):
    run = start(team)
    url = reverse("runs:run_timeline", kwargs={"slug": team.slug, "run_id": run.pk})
    assert Client().get(url).status_code == 302
    assert as_user(users, "outsider").get(url).status_code == 403
    assert as_user(users, "viewer").get(url).status_code == 200
    theirs = start(other_team)
    assert as_user(users, "viewer").get(reverse(
        "runs:run_timeline", kwargs={"slug": team.slug, "run_id": theirs.pk})).status_code == 404
    assert as_user(users).get(url, {"before": "junk"}).status_code == 200
