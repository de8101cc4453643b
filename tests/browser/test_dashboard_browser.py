"""The dashboard in a real browser (Debian's Chromium through Playwright) against the
production server (granian, 2 worker processes) on the test database."""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from policies.models import Policy, Team
from tests.conftest import ROOT, Agent, Server, server_env, start_server

CHROMIUM = "/usr/bin/chromium"
# The README's screenshots are refreshed with `UPDATE_SCREENSHOTS=1 make test`; an ordinary
# run writes them aside so that testing never dirties the work tree.
SCREENSHOTS = (ROOT / "docs" / "screenshots" if os.environ.get("UPDATE_SCREENSHOTS")
               else Path(tempfile.gettempdir()) / "governance-screenshots")
SCREENSHOTS.mkdir(parents=True, exist_ok=True)

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian's chromium"),
]

try:
    from playwright.sync_api import Browser, Page, expect, sync_playwright
except ImportError:  # pragma: no cover
    pytestmark.append(pytest.mark.skip(reason="needs the playwright package"))


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    # Playwright's sync API runs an event loop in this thread; the ORM calls the tests make
    # between browser steps are plain blocking calls, which Django would otherwise refuse.
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    with sync_playwright() as p:
        instance = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"])
        yield instance
        instance.close()
    os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1360, "height": 900})
    page = context.new_page()
    page.set_default_timeout(10_000)
    yield page
    context.close()


def sign_in(page: Page, server: Server, username: str, password: str) -> None:
    page.goto(f"{server.url}/accounts/login/")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", password)
    page.click("button[type=submit]")
    page.wait_for_url(re.compile(r"/teams/"))


def test_an_admin_edits_a_policy_and_watches_a_run_live(page: Page, server: Server,
                                                        agent: Agent, team: Team, users: Any):
    sign_in(page, server, "admin", "pw-admin-123")
    page.goto(f"{server.url}/teams/{team.slug}/policies/default/")
    # Inline validation: the YAML's own message, without submitting.
    page.fill("#id_max_steps", "0")
    expect(page.locator("#err-max_steps")).to_contain_text("greater than or equal to 1")
    page.fill("#id_max_steps", "6")
    expect(page.locator("#err-max_steps")).to_be_empty()
    expect(page.locator("#form-status")).to_contain_text("Valid.")
    page.fill("#id_note", "fewer steps for support")
    page.click("text=Save as version 2")
    expect(page.locator(".message-success")).to_contain_text("version 2")
    assert Policy.objects.get(team=team, name="default").current.document[
        "step_limits"]["max_steps"] == 6

    run = agent.start(task="Find the refund policy")
    assert run["policy"]["version"] == 2 and run["policy"]["step_limits"]["max_steps"] == 6
    run_id = run["run_id"]
    page.goto(f"{server.url}/teams/{team.slug}/runs/{run_id}/")
    page.evaluate("window.__noReload = true")
    expect(page.locator("[data-live-status]")).to_have_text("Live")

    first = agent.check(run_id, "search.docs", {"query": "refund policy", "token": "s3cr3t"},
                        cost_usd=0.12)
    row = page.locator(f"#step-{first['decision_id']}")
    expect(row).to_contain_text("search.docs")
    expect(row).to_contain_text("[redacted]")
    expect(row).not_to_contain_text("s3cr3t")
    expect(page.locator("[data-counter=steps]")).to_contain_text("1 / 6")
    second = agent.check(run_id, "crm.lookup", {"customer": 42},
                         last_result={"status": "ok", "summary": "3 documents found"},
                         cost_usd=0.3)
    expect(page.locator(f"#step-{second['decision_id']}")).to_contain_text("3 documents found")
    expect(page.locator("[data-counter=cost]")).to_contain_text("$0.42 / $1.00")

    answers = [agent.check(run_id, "crm.lookup", {"customer": 7}) for _ in range(4)]
    assert answers[-1]["decision"] == "stop" and answers[-1]["reason"] == "loop_detected"
    banner = page.locator("#run-banner .banner")
    expect(banner).to_contain_text("Stopped: loop_detected")
    expect(banner).to_contain_text(answers[-1]["message"])
    expect(page.locator("#run-header [data-run-status]")).to_have_text("stopped")
    expect(page.locator("#timeline tr")).to_have_count(6)

    agent.http.post(f"/api/v1/runs/{run_id}/finish",
                    json={"status": "stopped", "output": "Refunds within 30 days (partial)."})
    expect(banner).to_contain_text("Refunds within 30 days (partial).")
    expect(page.locator("[data-live-status]")).to_have_text("Finished")
    assert page.evaluate("window.__noReload") is True  # all of it without a reload
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "run.png"), full_page=True)


def test_new_runs_appear_in_the_runs_list_without_reload(page: Page, server: Server,
                                                         agent: Agent, team: Team, users: Any):
    sign_in(page, server, "viewer", "pw-viewer-123")
    page.goto(f"{server.url}/teams/{team.slug}/runs/")
    page.evaluate("window.__noReload = true")
    expect(page.locator("[data-live-status]")).to_have_text("Live")
    run = agent.start(agent="late-bot")
    row = page.locator(f"#run-{run['run_id']}")
    expect(row).to_contain_text("late-bot")
    expect(row).to_contain_text("running")
    agent.http.post(f"/api/v1/runs/{run['run_id']}/finish", json={"status": "completed"})
    expect(row).to_contain_text("completed")
    # A filter swaps the region (and its stream) in place.
    page.select_option("select[name=status]", "running")
    expect(page.locator(f"#run-{run['run_id']}")).to_have_count(0)
    assert "status=running" in page.url
    assert page.evaluate("window.__noReload") is True


def test_a_viewer_sees_no_edit_controls_and_a_forged_post_is_refused(
        page: Page, server: Server, team: Team, users: Any):
    sign_in(page, server, "viewer", "pw-viewer-123")
    page.goto(f"{server.url}/teams/{team.slug}/policies/default/")
    expect(page.locator("text=Read only")).to_be_visible()
    expect(page.locator("button[type=submit]:has-text('Save')")).to_have_count(0)
    expect(page.locator("#id_max_steps")).to_be_disabled()
    expect(page.locator("nav.nav >> text=Agent keys")).to_have_count(0)
    expect(page.locator("text=New policy")).to_have_count(0)

    token = page.locator("input[name=csrfmiddlewaretoken]").first.get_attribute("value")
    assert token
    forged = page.request.post(
        f"{server.url}/teams/{team.slug}/policies/default/save",
        form={"csrfmiddlewaretoken": token, "mode": "enforce", "max_steps": "1000",
              "max_repeat_action": "3", "no_progress_window": "4"},
    )
    assert forged.status == 403
    assert "Not allowed" in forged.text()
    keys = page.request.post(f"{server.url}/teams/{team.slug}/keys/",
                             form={"csrfmiddlewaretoken": token, "name": "stolen"})
    assert keys.status == 403
    assert Policy.objects.get(team=team, name="default").current.version == 1
    response = page.goto(f"{server.url}/teams/{team.slug}/keys/")
    assert response is not None and response.status == 403


@pytest.fixture(scope="module")
def short_stream_server(django_db_setup: Any, django_db_blocker: Any) -> Iterator[Server]:
    """A server whose streams end every 3 s, so reconnections happen during a test."""
    srv = start_server(env=server_env(DASHBOARD_STREAM_SECONDS="3"))
    yield srv
    srv.stop()


def test_the_timeline_survives_a_dropped_stream_and_says_it_was_disconnected(
        page: Page, short_stream_server: Server, agent: Agent, team: Team, users: Any):
    server = short_stream_server
    agent.http.base_url = server.url
    sign_in(page, server, "operator", "pw-operator-123")
    run_id = agent.start()["run_id"]
    first = agent.check(run_id, "step.one", {})
    page.goto(f"{server.url}/teams/{team.slug}/runs/{run_id}/")
    expect(page.locator("[data-live-status]")).to_have_text("Live")
    streams: list[Any] = []
    page.on("request", lambda r: streams.append(r) if "/stream" in r.url else None)
    live = agent.check(run_id, "step.live", {})
    expect(page.locator(f"#step-{live['decision_id']}")).to_be_visible()
    # The server ends each stream after 3 s; the browser comes back with the last id it saw:
    # the last step it showed, then "~" and the digest of what its page shows (the resume id).
    # How soon depends on the load of the machine, so look until a generous deadline.
    after: list[str] = []
    for _ in range(60):
        page.wait_for_timeout(250)
        sent = [r.all_headers().get("last-event-id") for r in streams]
        after = [value.split("~")[0] for value in sent if value]
        if str(live["decision_id"]) in after:
            break
    assert str(live["decision_id"]) in after, after

    page.route("**/stream*", lambda route: route.abort())  # the network goes away
    expect(page.locator("[data-live-status]")).to_have_text("Disconnected, reconnecting…",
                                                           timeout=15_000)
    missed = [agent.check(run_id, "step.missed", {"n": i}) for i in range(2)]
    page.unroute("**/stream*")
    expect(page.locator("[data-live-status]")).to_have_text("Live", timeout=15_000)
    for answer in missed:
        expect(page.locator(f"#step-{answer['decision_id']}")).to_be_visible()
    expect(page.locator("#timeline tr")).to_have_count(4)  # nothing missed, nothing twice
    assert first["decision_id"] < live["decision_id"]


def test_a_running_run_s_time_counter_ticks_without_its_stream(
        page: Page, server: Server, agent: Agent, team: Team, users: Any):
    """The stream sends the counters when a check changes them, not every second: the
    browser ticks the Time counter on from what the server rendered."""
    agent.http.base_url = server.url
    sign_in(page, server, "viewer", "pw-viewer-123")
    run_id = agent.start()["run_id"]
    agent.check(run_id, "step.one", {})
    page.route("**/stream*", lambda route: route.abort())  # nothing comes from the server
    page.goto(f"{server.url}/teams/{team.slug}/runs/{run_id}/")
    time = page.locator("[data-counter=time] .counter-head strong")
    shown = int(time.inner_text().split(" s")[0])
    page.wait_for_timeout(3_000)
    assert int(time.inner_text().split(" s")[0]) >= shown + 2
    page.unroute("**/stream*")


def test_screenshot_of_the_overview(page: Page, server: Server, agent: Agent, team: Team,
                                   users: Any):
    """Fills the last 24 hours with history so the chart has something to show."""
    from runs.models import Decision, Run

    version = Policy.objects.get(team=team, name="default").current
    now = timezone.now()
    reasons = ["loop_detected", "max_steps", "max_usd", "no_progress", "loop_detected",
               "tool_denied", "max_seconds", "loop_detected"]
    for hour in range(24):
        for i in range((hour * 7) % 5 + 1):
            started = now - timedelta(hours=hour, minutes=10 + i)
            reason = reasons[(hour + i) % len(reasons)] if (hour + i) % 3 else None
            run = Run.objects.create(
                team=team, agent=["support-bot", "billing-bot", "triage"][i % 3],
                policy_version=version, started_at=started,
                status="stopped" if reason else "completed", stop_reason=reason,
                ended_at=started + timedelta(minutes=2), steps=5 + i)
            if reason == "loop_detected":
                name = ["search.docs", "crm.lookup", "web.fetch"][hour % 3]
                Decision.objects.create(run=run, step=4, outcome="stop", reason=reason,
                                        action_name=name, repeat_key=f"{name}:{hour % 3:016x}",
                                        at=started + timedelta(minutes=2))
    for name in ("support-bot", "triage"):
        run_id = agent.start(agent=name)["run_id"]
        agent.check(run_id, "search.docs", {"q": name}, cost_usd=0.05)
    sign_in(page, server, "admin", "pw-admin-123")
    page.goto(f"{server.url}/teams/{team.slug}/")
    expect(page.locator("[data-live-status]")).to_have_text("Live")
    expect(page.locator("[data-running-count]")).to_have_text("2")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "overview.png"), full_page=True)
