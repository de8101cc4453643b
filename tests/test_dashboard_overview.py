"""The overview's time range, looping tools grouped by tool, per-agent breakdown and the
shadow would-stop count."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from runs.dashboard import selectors as dashboard
from runs.dashboard.presenters import overview_context
from runs.models import Run
from tests.conftest import set_policy
from tests.test_dashboard_runs import _fast, as_user, check, events, read_all, start  # noqa: F401

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(("key", "bars"), [("1h", 12), ("24h", 24), ("7d", 28), ("30d", 30)])
def test_each_range_has_its_own_bars_and_counts_only_its_runs(team, key, bars):
    recent, old = start(team, "a"), start(team, "b")
    Run.objects.filter(pk=old.pk).update(started_at=timezone.now() - timedelta(days=3))
    context = overview_context(team, range_key=key)
    assert context["span"].key == key
    chart = context["chart"]
    assert len(chart.started_dots) == bars
    assert chart.total_started == (2 if key in ("7d", "30d") else 1)
    assert {a["agent"] for a in context["agents"]} == ({"a", "b"} if key in ("7d", "30d")
                                                       else {"a"})
    assert recent


def test_the_overview_page_offers_the_ranges_and_streams_the_chosen_one(team, users):
    client = as_user(users)
    url = reverse("runs:overview", kwargs={"slug": team.slug})
    html = client.get(url, {"range": "7d"}).content.decode()
    assert 'data-range="7d" aria-current="true"' in html and "Last 7 days" in html
    assert "/stream?range=7d" in html
    assert "Last 24 hours" in client.get(url, {"range": "bogus"}).content.decode()
    frames = events(read_all(client.get(reverse("runs:overview_stream", kwargs={"slug": team.slug}),
                                        {"range": "1h"})))
    chart = next(e for e in frames if e["event"] == "overview-chart")
    assert "Last hour" in chart["data"]
    assert any(e["event"] == "overview-agents" for e in frames)


def test_looping_tools_are_grouped_with_their_argument_variants(team, users):
    set_policy(team, step_limits={"max_repeat_action": 1})
    for args in ({"q": "refund"}, {"q": "refund"}, {"q": "address"}):
        run = start(team)
        check(team, run, "search.docs", args)
        check(team, run, "search.docs", args)  # loop_detected
    run = start(team)
    check(team, run, "crm.lookup", {"id": 1})
    check(team, run, "crm.lookup", {"id": 1})
    loops = dashboard.top_loops(team, since=timezone.now() - timedelta(hours=1))
    assert [(t.tool, t.stops, t.runs) for t in loops] == [("search.docs", 3, 3),
                                                          ("crm.lookup", 1, 1)]
    variants = loops[0].variants
    assert [(v.args, v.stops) for v in variants] == [({"q": "refund"}, 2), ({"q": "address"}, 1)]
    html = as_user(users).get(reverse("runs:overview", kwargs={"slug": team.slug})).content.decode()
    assert html.count('class="looping-tool"') == 2
    assert "&#x27;q&#x27;: &#x27;address&#x27;" in html or "address" in html


def test_the_agent_breakdown_and_would_stop_count(team, users):
    set_policy(team, mode="shadow", step_limits={"max_repeat_action": 1})
    shadow = start(team, "shadow-bot")
    check(team, shadow, "same", {})
    check(team, shadow, "same", {})  # would stop
    start(team, "shadow-bot")
    start(team, "other-bot")
    context = overview_context(team)
    rows = {a["agent"]: a for a in context["agents"]}
    assert rows["shadow-bot"]["runs"] == 2 and rows["shadow-bot"]["would_stop"] == 1
    assert rows["shadow-bot"]["running"] == 2 and rows["other-bot"]["would_stop"] == 0
    assert context["would_stop"] == 1
    html = as_user(users).get(reverse("runs:overview", kwargs={"slug": team.slug})).content.decode()
    assert 'data-would-stop-count="1"' in html and 'data-agent="shadow-bot"' in html


def test_the_overview_shows_nothing_of_another_team(team, other_team, users):
    start(other_team, "their-bot")
    html = as_user(users).get(reverse("runs:overview", kwargs={"slug": team.slug})).content.decode()
    assert "their-bot" not in html
    assert as_user(users).get(reverse("runs:overview", kwargs={"slug": other_team.slug}),
                              {"range": "7d"}).status_code == 403


def test_warnings_followed_by_a_change_of_action_or_by_the_stop(team, users):
    """SPEC 16: the overview counts what agents did after a warning."""
    set_policy(team, step_limits={"max_repeat_action": 2, "max_steps": 50},
               warnings={"repeat_action": 1, "budget_fraction": None, "no_progress": None})
    changed = start(team)
    check(team, changed, "search.docs", {"q": 1})  # warned (1 of 2)
    check(team, changed, "crm.lookup", {"id": 1})  # another action: warned again, first time
    stopped = start(team)
    check(team, stopped, "search.docs", {"q": 1})
    check(team, stopped, "search.docs", {"q": 1})  # warned (2 of 2)
    check(team, stopped, "search.docs", {"q": 1})  # loop_detected
    warned = dashboard.warning_outcomes(team, since=timezone.now() - timedelta(hours=1))
    # The first run's two (the first followed by another action, the last by nothing yet),
    # the second's two (the first followed by the same action, the second by the stop).
    assert (warned.warnings, warned.changed, warned.stopped) == (4, 1, 1)
    html = as_user(users).get(reverse("runs:overview", kwargs={"slug": team.slug})).content.decode()
    assert 'data-warned-changed>1<' in html and 'data-warned-stopped>1<' in html
    page = as_user(users).get(reverse("runs:run", kwargs={"slug": team.slug,
                                                           "run_id": stopped.pk})).content
    assert b"loop_detected: repeat_count 2 reached max_repeat_action 2 (policy default v2)" \
        in page
    assert b"The rule loop_detected of policy default v2 stopped this run" in page
