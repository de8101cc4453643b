"""A policy change that would stop most recent runs at once asks for an explicit confirmation
showing the backtest's numbers (issue 26): on save, import and restore; without it nothing
changes, with it the change is made, and a harmless change never asks."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from backtests import impact as backtest_impact
from backtests.selectors import Change, Report
from governance.celery import app as celery_app
from policies import impact
from policies.models import Policy, Team
from tests.conftest import set_policy
from tests.test_backtest import check, finish, start
from tests.test_dashboard_policies import form_data

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def eager_celery() -> Iterator[None]:
    before = celery_app.conf.task_always_eager
    celery_app.conf.task_always_eager = True
    yield
    celery_app.conf.task_always_eager = before


def record(api: Any, names: list[str]) -> str:
    run_id = start(api)
    for i, name in enumerate(names):
        assert check(api, run_id, name=name, args={"q": i})["decision"] == "allow"
    finish(api, run_id)
    return run_id


@pytest.fixture
def recorded(api: Any, team: Team) -> list[str]:
    """Three ended runs of `default`: two start with search.docs, one with web.fetch."""
    return [record(api, ["search.docs", "web.fetch"]),
            record(api, ["search.docs", "search.docs"]),
            record(api, ["web.fetch", "search.docs", "web.fetch"])]


@pytest.fixture
def admin(users: dict[str, Any]) -> Client:
    client = Client()
    client.force_login(users["admin"])
    return client


def current(team: Team) -> dict[str, Any]:
    return Policy.objects.get(team=team, name="default").current.document


def token_in(html: str) -> str:
    match = re.search(r'name="confirm_stops" value="([0-9a-f]+)"', html)
    assert match, "no confirmation box on the page"
    return match.group(1)


def save(client: Client, team: Team, **changes: str) -> Any:
    return client.post(reverse("policy_save", args=[team.slug, "default"]), form_data(**changes))


# --- The rule, pure ---------------------------------------------------------------------------

def test_most_means_more_than_half_of_at_least_one_run():
    assert not impact.needs_confirmation(runs=0, stopped_at_once=0)
    assert not impact.needs_confirmation(runs=4, stopped_at_once=2)
    assert impact.needs_confirmation(runs=4, stopped_at_once=3)
    assert impact.needs_confirmation(runs=1, stopped_at_once=1)


def test_the_token_names_the_drafts_whatever_their_order():
    a, b = {"name": "a", "mode": "enforce"}, {"name": "b", "mode": "shadow"}
    assert impact.confirmation_token([a, b]) == impact.confirmation_token([b, a])
    assert impact.confirmation_token([a]) != impact.confirmation_token([{**a, "mode": "x"}])
    assert not impact.confirmed(None, [a]) and not impact.confirmed("", [a])
    assert impact.confirmed(impact.confirmation_token([a]), [a])


def test_only_the_drafts_own_stops_at_step_one_count():
    def change(status: str | None, step: int | None, reason: str | None) -> Change:
        return Change(run_id="r", recorded={"status": "completed"},
                      draft={"status": status, "stop_reason": reason, "step": step})
    report = Report(policy="default", runs=5, changes=[
        change("stopped", 1, "tool_denied"), change("stopped", 1, "tool_denied"),
        change("stopped", 1, "max_usd"), change("stopped", 2, "tool_denied"),
        change("killed", 1, "killed"), change(None, None, None)])
    assert backtest_impact.stopped_at_once(report) == (3, {"tool_denied": 2, "max_usd": 1})


def test_an_import_of_many_policies_shares_the_backtests_bound():
    assert backtest_impact.runs_per_draft(1) == backtest_impact.IMPACT_RUNS
    assert backtest_impact.runs_per_draft(100) * 100 <= 1000


def test_the_replay_inside_a_save_reads_each_runs_first_decisions_only(
        api, team, monkeypatch):
    # Found by an attacker: 200 runs of 1,000 steps made a dry-run PUT take 6 to 8 s of an
    # operator thread (the whole runs read and replayed); a stop at once is decided at the
    # first step, so the save's replay reads each run's first decisions.
    from backtests import selectors as backtest_reads

    set_policy(team, step_limits={"max_steps": 100, "max_repeat_action": 100,
                                  "no_progress_window": 100})
    record(api, [f"search.docs{i}" for i in range(12)])
    monkeypatch.setattr(backtest_impact, "IMPACT_DECISIONS", 5)
    read: list[int] = []
    real = backtest_reads.replay_runs

    def counted(*args: Any, **kwargs: Any) -> Report:
        report = real(*args, **kwargs)
        read.append(report.decisions)
        return report

    monkeypatch.setattr(backtest_reads, "replay_runs", counted)
    draft = {**current(team), "tools": {"allow": None, "deny": ["search.*"]}}
    with CaptureQueriesContext(connection) as queries:
        (found,) = backtest_impact.recent_impacts(team, [draft])
    assert read == [5]
    # ...without their args and results (up to 64 KiB each; 200 MB for 200 runs).
    assert not [q for q in queries if '"runs_decision"."args"' in q["sql"]
                or '"runs_decision"."last_result"' in q["sql"]]
    assert (found.runs, found.stopped_at_once) == (1, 1)


# --- Save -------------------------------------------------------------------------------------

def test_a_save_that_stops_most_runs_at_once_asks_with_the_numbers(team, admin, recorded):
    before = current(team)
    refused = save(admin, team, tools_deny="search.*")
    html = refused.content.decode()
    assert refused.status_code == 422
    assert "would stop 2 of its 3 most recent ended runs (started within 30 days) at their " \
           "first step: tool_denied 2." in html
    assert 'data-runs="3" data-stopped="2"' in html
    assert current(team) == before  # nothing saved
    # The box confirms this draft only: another draft is asked about again.
    token = token_in(html)
    again = save(admin, team, tools_deny="search.docs", confirm_stops=token)
    assert again.status_code == 422 and 'id="confirm-stops"' in again.content.decode()
    assert current(team) == before
    assert save(admin, team, tools_deny="search.*", confirm_stops=token).status_code == 302
    assert current(team)["tools"]["deny"] == ["search.*"]


def test_a_deny_all_save_shows_every_run_stopped(team, admin, recorded):
    refused = save(admin, team, restrict_tools="on", tools_allow="", deny_every_tool="on")
    assert refused.status_code == 422
    assert "would stop 3 of its 3 most recent ended runs" in refused.content.decode()
    assert current(team)["tools"]["allow"] is None


def test_a_rate_limit_whose_waits_outlast_the_runs_time_asks_too(team, admin, recorded):
    # One action a day for the whole team: every run after the first would wait about a day
    # at its first check, longer than its 45 s, and the check answers stop / max_seconds at
    # once (issue 26). The replay of one run does not see rate limits; the estimate does.
    before = current(team)
    refused = save(admin, team, rate_limits="* team 1 86400", max_seconds="45")
    assert refused.status_code == 422
    assert "would stop 2 of its 3 most recent ended runs (started within 30 days) at their " \
           "first step: max_seconds 2." in refused.content.decode()
    assert current(team) == before


def test_runs_a_rate_limit_already_stopped_out_of_time_do_not_ask_again(team, admin, api):
    # Under that policy already, its runs were stopped so when they ran: a harmless edit of
    # it (another max_steps) never asks.
    day = [{"match": "*", "per": "team", "max": 1, "window_s": 86400}]
    set_policy(team, rate_limits=day)
    answers = []
    for _ in range(3):
        run_id = start(api)
        answers.append(check(api, run_id, name="search.docs")["reason"])
        finish(api, run_id)
    assert answers == ["step_ok", "max_seconds", "max_seconds"]
    response = save(admin, team, rate_limits="* team 1 86400", max_steps="30")
    assert response.status_code == 302, response.content.decode()[:2000]


def test_a_harmless_change_or_a_minority_never_asks(team, admin, recorded):
    assert save(admin, team, max_steps="30").status_code == 302
    assert current(team)["step_limits"]["max_steps"] == 30
    # One run of three starts with web.fetch: not most of them.
    response = save(admin, team, tools_deny="web.fetch")
    assert response.status_code == 302, response.content.decode()[:2000]
    assert current(team)["tools"]["deny"] == ["web.fetch"]


def test_a_policy_without_recent_runs_never_asks(team, admin):
    assert save(admin, team, restrict_tools="on", tools_allow="", deny_every_tool="on",
                ).status_code == 302


# --- Import -----------------------------------------------------------------------------------

def import_post(client: Client, team: Team, document: dict[str, Any], **extra: str) -> Any:
    text = yaml.safe_dump({"teams": [{"slug": team.slug, "policies": [document]}]})
    return client.post(reverse("policies_import", args=[team.slug]),
                       {"document": text, **extra})


def test_an_import_that_stops_most_runs_at_once_asks_with_the_numbers(team, admin, recorded):
    before = current(team)
    draft = {**before, "tools": {**before["tools"], "deny": ["search.*"]}}
    refused = import_post(admin, team, draft)
    html = refused.content.decode()
    assert refused.status_code == 422
    assert "would stop 2 of its 3 most recent ended runs" in html
    assert current(team) == before
    accepted = import_post(admin, team, draft, confirm_stops=token_in(html))
    assert accepted.status_code == 302
    assert current(team)["tools"]["deny"] == ["search.*"]


def test_a_harmless_import_never_asks(team, admin, recorded):
    before = current(team)
    draft = {**before, "step_limits": {**before["step_limits"], "max_steps": 40}}
    assert import_post(admin, team, draft).status_code == 302
    assert current(team)["step_limits"]["max_steps"] == 40


# --- Restore ----------------------------------------------------------------------------------

def restore_url(team: Team, version: int) -> str:
    return reverse("policy_restore", kwargs={"slug": team.slug, "name": "default",
                                             "version": version})


def test_a_restore_that_stops_most_runs_at_once_asks_with_the_numbers(team, admin, api):
    set_policy(team, tools={"allow": None, "deny": ["search.*"]})
    strict = Policy.objects.get(team=team, name="default").current.version
    set_policy(team, tools={"allow": None, "deny": []})
    for _ in range(3):
        record(api, ["search.docs"])
    before = current(team)
    refused = admin.post(restore_url(team, strict), {"note": "back to strict"})
    html = refused.content.decode()
    assert refused.status_code == 422
    assert "would stop 3 of its 3 most recent ended runs" in html
    assert current(team) == before
    accepted = admin.post(restore_url(team, strict), {"note": "back to strict",
                                                      "confirm_stops": token_in(html)})
    assert accepted.status_code == 302
    assert current(team)["tools"]["deny"] == ["search.*"]


def test_a_harmless_restore_never_asks(team, admin, api):
    first = Policy.objects.get(team=team, name="default").current.version
    set_policy(team, step_limits={"max_steps": 40})
    record(api, ["search.docs"])
    assert admin.post(restore_url(team, first), {"note": "undo"}).status_code == 302
