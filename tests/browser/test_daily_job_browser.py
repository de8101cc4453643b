"""The daily job in a real browser (issue 15): a long run's timeline pages and filters, the
shadow summary, the runs list's search and would-stop filter."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from policies.models import Team
from runs.models import Decision, Run
from tests.browser.test_dashboard_browser import (  # noqa: F401 (fixtures)
    SCREENSHOTS,
    Page,
    browser,
    expect,
    pytestmark,
    sign_in,
)
from tests.browser.test_dashboard_browser import page as page
from tests.conftest import Agent, Server, set_policy

pytestmark = list(pytestmark)


def test_a_long_timeline_pages_and_filters_without_a_long_page(page: Page, server: Server,
                                                               agent: Agent, team: Team,
                                                               users: Any):
    run_id = agent.start()["run_id"]
    run = Run.objects.get(pk=run_id)
    Decision.objects.bulk_create([
        Decision(run=run, step=i + 1, outcome="allow", reason="step_ok", action_name="t.step",
                 action_type="tool", args={"i": i}, answer={},
                 at=run.started_at + timedelta(seconds=i + 1))
        for i in range(299)
    ])
    Run.objects.filter(pk=run_id).update(steps=299)
    stop = agent.check(run_id, "t.step", {"i": 5})  # the 300th step
    sign_in(page, server, "viewer", "pw-viewer-123")
    page.goto(f"{server.url}/teams/{team.slug}/runs/{run_id}/")
    page.evaluate("window.__noReload = true")
    rows = page.locator("#timeline tr.step")
    expect(rows).to_have_count(50)
    height = page.evaluate("document.documentElement.scrollHeight")
    assert height < 6000, height  # not the 16,500 px of 300 rows
    page.screenshot(path=str(SCREENSHOTS / "timeline.png"))
    page.click("#timeline-earlier a")
    expect(rows).to_have_count(100)
    expect(page.locator("#timeline tr.step").first).to_have_attribute("data-step", "201")
    page.click("#timeline-flagged")
    flagged = page.locator("#timeline tr.step")
    expect(flagged).to_have_count(1 if stop["decision"] == "stop" else 0)
    expect(page.locator("#timeline-flagged")).to_have_attribute("aria-current", "true")


def test_a_shadow_run_shows_where_it_would_have_stopped_live(page: Page, server: Server,
                                                            agent: Agent, team: Team,
                                                            users: Any):
    set_policy(team, mode="shadow", step_limits={"max_repeat_action": 2})
    run_id = agent.start(agent="shadow-bot")["run_id"]
    sign_in(page, server, "viewer", "pw-viewer-123")
    page.goto(f"{server.url}/teams/{team.slug}/runs/{run_id}/")
    expect(page.locator("[data-live-status]")).to_have_text("Live")
    for _ in range(3):
        agent.check(run_id, "search.docs", {"q": "same"})
    summary = page.locator(".shadow-summary")
    expect(summary).to_contain_text("would have stopped at step 3: loop_detected")
    # The enforce message is said as what would have been said (found by a newcomer: "this
    # call was not run and the run is stopped" read as what happened).
    expect(summary).to_contain_text("In shadow mode the call ran and the run went on.")

    page.goto(f"{server.url}/teams/{team.slug}/runs/")
    other = agent.start(agent="plain-bot")["run_id"]
    expect(page.locator(f"#run-{other}")).to_have_count(1)
    page.check("input[name=would_stop]")
    expect(page.locator(f"#run-{other}")).to_have_count(0)
    expect(page.locator(f"#run-{run_id}")).to_contain_text("would stop at step 3")
    page.uncheck("input[name=would_stop]")
    expect(page.locator(f"#run-{other}")).to_have_count(1)
    page.screenshot(path=str(SCREENSHOTS / "runs.png"), full_page=True)
    page.check("input[name=would_stop]")
    expect(page.locator(f"#run-{other}")).to_have_count(0)
    page.fill("input[name=q]", run_id[:8])
    page.wait_for_url(re.compile(f"q={run_id[:8]}"))
    expect(page.locator("#runs-table tbody tr")).to_have_count(1)
    assert "would_stop=1" in page.url and "status=" not in page.url


def test_the_overview_time_range_picker_changes_the_chart_and_stays_live(
        page: Page, server: Server, agent: Agent, team: Team, users: Any):
    old = agent.start(agent="old-bot")["run_id"]
    Run.objects.filter(pk=old).update(started_at=Run.objects.get(pk=old).started_at
                                      - timedelta(days=3))
    sign_in(page, server, "viewer", "pw-viewer-123")
    page.goto(f"{server.url}/teams/{team.slug}/")
    chart = page.locator("#overview-chart")
    expect(chart).to_contain_text("Last 24 hours")
    expect(page.locator("#overview-agents")).not_to_contain_text("old-bot")
    page.click(".range-picker a[data-range='7d']")
    expect(chart).to_contain_text("Last 7 days")
    assert "range=7d" in page.url
    expect(page.locator("#overview-agents")).to_contain_text("old-bot")
    expect(page.locator("[data-live-status]")).to_have_text("Live")
    agent.start(agent="new-bot")  # the chosen range stays live
    expect(page.locator("#overview-agents")).to_contain_text("new-bot", timeout=15_000)
    page.screenshot(path=str(SCREENSHOTS / "overview-7d.png"), full_page=True)
    expect(chart).to_contain_text("Last 7 days")
    page.click(".range-picker a[data-range='1h']")
    expect(chart).to_contain_text("Last hour")
    expect(page.locator("#overview-chart svg rect.started-dot")).to_have_count(12)


def settled(page: Page) -> None:
    """No htmx request, swap or settle in progress on the page."""
    expect(page.locator(".htmx-request, .htmx-swapping, .htmx-settling")).to_have_count(0)


def click_until(page: Page, selector: str, done: Callable[[float], None]) -> None:
    """Click ``selector`` until ``done`` (an expectation, given its timeout in ms) holds.
    Under load (CI runs both suites at once) a click that lands while htmx is still settling
    the last swap was lost, twice, on two different clicks: wait for the swap to settle,
    and click again if nothing happened (and the control is still there)."""
    for attempt in range(3):
        settled(page)
        page.click(selector)
        try:
            done(8000)
            return
        except AssertionError:
            if attempt == 2 or page.locator(selector).count() == 0:
                done(8000)  # a slow answer, not a lost click: it must come now
                return


def test_the_runs_list_pages_forward_and_back(page: Page, server: Server, team: Team,
                                             users: Any):
    """Next, Previous and First page swap the table in place (htmx), keep the address bar
    shareable, and Previous brings back exactly the rows seen before."""
    from django.utils import timezone

    version = team.policies.get(name="default").current
    now = timezone.now()
    Run.objects.bulk_create([
        Run(team=team, agent=f"pager-{i:02d}", policy_version=version, status="completed",
            started_at=now - timedelta(minutes=i), ended_at=now - timedelta(minutes=i))
        for i in range(60)])
    sign_in(page, server, "viewer", "pw-viewer-123")
    page.goto(f"{server.url}/teams/{team.slug}/runs/")
    rows = page.locator("table.runs tbody tr")

    def agents() -> list[str]:
        return rows.locator("td:nth-child(2)").all_inner_texts()

    first_agent = rows.first.locator("td:nth-child(2)")
    expect(rows).to_have_count(25)
    first = agents()
    expect(page.locator("[data-page=previous]")).to_have_count(0)
    # Read once the swap has come (the rows, not the address bar, which may change first).
    click_until(page, "[data-page=next]",
                lambda ms: expect(first_agent).to_have_text("pager-25", timeout=ms))
    expect(page).to_have_url(re.compile(r"after="))
    expect(page.locator("[data-page=previous]")).to_be_visible()
    settled(page)
    second = agents()
    assert len(second) == 25 and not set(first) & set(second)
    click_until(page, "[data-page=next]", lambda ms: expect(rows).to_have_count(10, timeout=ms))
    click_until(page, "[data-page=previous]",
                lambda ms: expect(first_agent).to_have_text("pager-25", timeout=ms))
    expect(page).to_have_url(re.compile(r"before="))
    assert agents() == second
    click_until(page, "[data-page=previous]",
                lambda ms: expect(first_agent).to_have_text("pager-00", timeout=ms))
    assert agents() == first
    expect(page.locator("[data-page=previous]")).to_have_count(0)
    expect(page.locator("[data-page=first]")).to_have_count(0)
    page.go_back()  # the pushed addresses are real pages too
    expect(rows.first.locator("td:nth-child(2)")).to_have_text("pager-25")
