"""The policy editor's "Test against recorded runs" (SPEC 13): the same numbers as the
command, the changed runs linked, progress while it runs, RBAC, the per-team bound."""

from __future__ import annotations

import json
from collections.abc import Iterator
from io import StringIO
from typing import Any

import pytest
import yaml
from django.core.management import call_command
from django.test import Client

from backtests import services
from backtests.models import Backtest
from governance.celery import app as celery_app
from policies.models import Team
from runs.models import Decision, Run
from tests.conftest import set_policy
from tests.test_backtest import record

pytestmark = pytest.mark.django_db
HX = {"HTTP_HX_REQUEST": "true"}


@pytest.fixture(autouse=True)
def _fast(settings: Any) -> Iterator[None]:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    before = celery_app.conf.task_always_eager
    celery_app.conf.task_always_eager = True
    yield
    celery_app.conf.task_always_eager = before


@pytest.fixture
def commit(django_capture_on_commit_callbacks: Any) -> Any:
    """Run the on_commit callbacks (the task's enqueue) as a real commit would."""
    return lambda: django_capture_on_commit_callbacks(execute=True)


def client_of(user: Any) -> Client:
    client = Client()
    client.force_login(user)
    return client


def form_data(**changes: str) -> dict[str, str]:
    data = {"mode": "enforce", "max_steps": "50", "max_repeat_action": "1000",
            "no_progress_window": "4", "max_seconds": "", "max_usd": "", "max_tool_calls": "",
            "tools_deny": "", "ignore_args": "", "error_threshold": "3", "error_action": "nudge",
            "redact_args": "token"}
    return {**data, **changes}


@pytest.fixture
def recorded(api: Any, team: Team) -> list[str]:
    """Two runs that loop (10 and 6 identical calls) and one that does not."""
    set_policy(team, step_limits={"max_steps": 50, "max_repeat_action": 1000},
               budgets={"max_seconds": None, "max_usd": None})
    return [record(api, [{"args": {"q": "same"}}] * 10),
            record(api, [{"args": {"q": "same"}}] * 6),
            record(api, [{"args": {"q": i}} for i in range(5)])]


def url(team: Team) -> str:
    return f"/teams/{team.slug}/policies/default/backtest"


def command_json(team: Team, tmp_path: Any, document: dict[str, Any]) -> dict[str, Any]:
    path = tmp_path / "draft.yaml"
    path.write_text(yaml.safe_dump({"teams": [{"slug": team.slug, "policies": [document]}]}))
    out = StringIO()
    call_command("backtest", "--team", team.slug, "--policy", "default", "--file", str(path),
                 "--json", stdout=out)
    return json.loads(out.getvalue().splitlines()[-1])


def test_the_editor_tests_the_unsaved_form_with_the_commands_numbers(team, users, recorded,
                                                                     tmp_path, commit):
    admin = client_of(users["admin"])
    versions = team.policies.get(name="default").versions.count()
    with commit():
        response = admin.post(url(team), form_data(max_repeat_action="3"), **HX)
    assert response.status_code == 200
    job = Backtest.objects.get()
    assert job.status == "done"
    [result] = job.results
    document = {**team.policies.get(name="default").current.document}
    document["step_limits"] = {**document["step_limits"], "max_repeat_action": 3}
    assert result["report"] == command_json(team, tmp_path, document)
    assert result["report"]["changed"] == 2
    # (Here the task ran when the test's capture of on_commit ended, after the answer; with
    # a real commit it runs before, eagerly: the poll shows what the answer would.)
    html = admin.get(f"/teams/{team.slug}/backtests/{job.pk}/", **HX).content.decode()
    assert 'data-changed="2"' in html and 'data-runs="3"' in html
    for run_id in recorded[:2]:
        assert f'href="/teams/{team.slug}/runs/{run_id}/"' in html
    assert recorded[2] not in html
    assert "stopped (loop_detected) at step 4" in html and "completed, 10 steps" in html
    # Nothing was saved: no new version, no run or decision changed.
    assert team.policies.get(name="default").versions.count() == versions


def test_a_viewer_tests_the_current_version(team, users, recorded, commit):
    viewer = client_of(users["viewer"])
    page = viewer.get(f"/teams/{team.slug}/policies/default/").content.decode()
    assert 'id="backtest-button"' in page
    # A viewer's fieldset is disabled: the browser sends no policy fields.
    with commit():
        response = viewer.post(url(team), {"since": "7d"}, **HX)
    assert response.status_code == 200
    job = Backtest.objects.get()
    assert job.since_s == 7 * 86400 and job.results[0]["report"]["changed"] == 0


def test_outsiders_and_anonymous_are_refused(team, users, recorded):
    assert client_of(users["outsider"]).post(url(team), form_data(), **HX).status_code == 403
    assert Client().post(url(team), form_data()).status_code == 302
    job_url = None
    client_of(users["admin"]).post(url(team), form_data())
    job_url = f"/teams/{team.slug}/backtests/{Backtest.objects.get().pk}/"
    assert client_of(users["outsider"]).get(job_url).status_code == 403
    assert client_of(users["viewer"]).get(job_url).status_code == 200
    other = f"/teams/billing/backtests/{Backtest.objects.get().pk}/"
    assert client_of(users["outsider"]).get(other).status_code == 404


def test_without_htmx_it_redirects_to_the_backtests_page(team, users, recorded, commit):
    with commit():
        response = client_of(users["admin"]).post(url(team), form_data(max_repeat_action="3"))
    job = Backtest.objects.get()
    assert response.status_code == 302
    assert response["Location"] == f"/teams/{team.slug}/backtests/{job.pk}/"
    page = client_of(users["admin"]).get(response["Location"]).content.decode()
    assert 'data-changed="2"' in page


def test_an_invalid_form_is_refused_and_starts_nothing(team, users, recorded):
    response = client_of(users["admin"]).post(url(team), form_data(max_steps="0"), **HX)
    assert "The form has errors" in response.content.decode()
    assert not Backtest.objects.exists()


def test_a_team_runs_a_bounded_number_of_backtests_at_once(team, users, recorded, settings,
                                                          monkeypatch):
    from backtests.tasks import backtest_run_task

    monkeypatch.setattr(backtest_run_task, "delay", lambda job_id: None)  # no worker
    settings.BACKTEST_MAX_PER_TEAM = 2
    admin = client_of(users["admin"])
    for _ in range(2):
        admin.post(url(team), form_data(), **HX)
    refused = admin.post(url(team), form_data(), **HX)
    assert "already runs as many backtests" in refused.content.decode()
    assert Backtest.objects.count() == 2
    # A backtest whose task stopped reporting no longer counts.
    settings.BACKTEST_STALE_SECONDS = 0
    assert admin.post(url(team), form_data(), **HX).status_code == 200
    assert Backtest.objects.count() == 3


def test_the_page_polls_the_progress_until_the_result(team, users, recorded, monkeypatch,
                                                     commit):
    from backtests.tasks import backtest_run_task

    queued: list[str] = []
    monkeypatch.setattr(backtest_run_task, "delay", queued.append)
    admin = client_of(users["admin"])
    with commit():
        response = admin.post(url(team), form_data(max_repeat_action="3"), **HX)
    response = response.content.decode()
    job = Backtest.objects.get()
    poll = f'hx-get="/teams/{team.slug}/backtests/{job.pk}/"'
    assert poll in response and 'hx-trigger="every 1s"' in response and "<progress" in response
    services.backtest_run(job_id=queued[0])
    done = admin.get(f"/teams/{team.slug}/backtests/{job.pk}/", **HX).content.decode()
    assert "hx-trigger" not in done and 'data-changed="2"' in done
    # Running it again (a redelivered task) changes nothing.
    services.backtest_run(job_id=queued[0])
    assert Backtest.objects.get().results == Backtest.objects.get(pk=job.pk).results


def test_it_reports_progress_as_it_goes(team, recorded, monkeypatch):
    from backtests import selectors

    monkeypatch.setattr(selectors, "CHUNK_RUNS", 1)
    seen: list[int] = []
    original = Backtest.objects.filter

    job = Backtest.objects.create(team=team, created_at=Run.objects.first().started_at,
                                  source="editor", since_s=86400 * 30, limit=1000,
                                  heartbeat_at=Run.objects.first().started_at,
                                  drafts=[{"policy": "default", "document":
                                           team.policies.get(name="default").current.document}])

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(Backtest.objects.values_list("done", flat=True).get(pk=job.pk))
        return original(*args, **kwargs)

    monkeypatch.setattr(Backtest.objects, "filter", spy)
    services.backtest_run(job_id=job.pk)
    assert Backtest.objects.get(pk=job.pk).done == 3
    assert {1, 2} <= set(seen)


def test_an_imported_document_is_tested_before_it_is_applied(team, users, recorded, commit):
    admin = client_of(users["admin"])
    document = {**team.policies.get(name="default").current.document}
    document["step_limits"] = {**document["step_limits"], "max_repeat_action": 3}
    text = yaml.safe_dump({"teams": [{"slug": team.slug, "policies": [
        document, {**document, "name": "brand-new"}]}]})
    decisions = Decision.objects.count()
    with commit():
        response = admin.post(f"/teams/{team.slug}/policies-import/backtest",
                              {"document": text})
    assert response.status_code == 302
    page = admin.get(response["Location"]).content.decode()
    assert 'data-policy="default"' in page and 'data-changed="2"' in page
    assert not team.policies.filter(name="brand-new").exists()  # nothing applied
    assert Decision.objects.count() == decisions
    import_page = admin.get(f"/teams/{team.slug}/policies-import").content.decode()
    assert 'id="backtest-import-button"' in import_page


@pytest.mark.parametrize(("text", "message"), [
    ("", "Paste a YAML document"),
    ("teams: [", "not valid YAML"),
    ("teams:\n  - slug: billing\n", "for team &#x27;support&#x27; only"),
    ("teams:\n  - slug: support\n    policies: []\n", "names no policy this team has"),
])
def test_an_import_that_cannot_be_tested_says_why(team, users, text, message):
    response = client_of(users["admin"]).post(
        f"/teams/{team.slug}/policies-import/backtest", {"document": text}, **HX)
    assert message in response.content.decode()
    assert not Backtest.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_simultaneous_starts_never_exceed_the_teams_bound(team, settings, monkeypatch):
    """Twelve starts at once, from threads with their own connections: exactly the bound
    get a backtest, the others are told the team is busy."""
    import threading
    from datetime import timedelta

    from django.db import connection

    from backtests.tasks import backtest_run_task

    monkeypatch.setattr(backtest_run_task, "delay", lambda job_id: None)  # no worker
    settings.BACKTEST_MAX_PER_TEAM = 2
    document = team.policies.get(name="default").current.document
    barrier = threading.Barrier(12)
    outcomes: list[str] = []

    def start() -> None:
        try:
            barrier.wait(timeout=30)
            services.backtest_start(team=team, user=None, source="editor",
                                    drafts=[{"policy": "default", "document": document}],
                                    since=timedelta(days=1), limit=10)
            outcomes.append("started")
        except services.Busy:
            outcomes.append("busy")
        finally:
            connection.close()

    threads = [threading.Thread(target=start) for _ in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(outcomes) == ["busy"] * 10 + ["started"] * 2
    assert Backtest.objects.filter(team=team).count() == 2
