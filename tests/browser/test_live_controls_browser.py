"""Controls follow the live state in a real browser (issue 15): a run killed elsewhere loses
its kill button, the kill switch page stops offering what is already engaged and the banner's
release form appears, all without a reload; the runs filters list each value once."""

from __future__ import annotations

from typing import Any

from policies.models import Team
from runs.killswitch.fanout import killswitch_fanout
from runs.killswitch.services import killswitch_engage
from runs.models import Run, Scope
from tests.browser.test_dashboard_browser import (  # noqa: F401 (fixtures)
    SCREENSHOTS,
    Page,
    browser,
    expect,
    pytestmark,
    sign_in,
)
from tests.browser.test_dashboard_browser import page as page
from tests.conftest import Agent, Server

pytestmark = list(pytestmark)


def kill(**target: Any) -> None:
    """Engage as another operator would, then the fan-out (here rather than on a worker)."""
    switch = killswitch_engage(reason="from elsewhere", **target)
    killswitch_fanout(switch_id=switch.pk)


def test_a_run_killed_elsewhere_loses_its_kill_button_live(page: Page, server: Server,
                                                          agent: Agent, team: Team, users: Any):
    sign_in(page, server, "operator", "pw-operator-123")
    run_id = agent.start()["run_id"]
    agent.check(run_id, "search.docs", {"q": 1})
    page.goto(f"{server.url}/teams/{team.slug}/runs/{run_id}/")
    page.evaluate("window.__noReload = true")
    expect(page.locator("[data-live-status]")).to_have_text("Live")
    page.click("#kill-run")  # the operator opens the confirmation, then hesitates
    expect(page.locator("#killswitch-confirm")).to_contain_text("1 running run")

    kill(scope=Scope.RUN, run=Run.objects.get(pk=run_id))

    expect(page.locator("#run-header [data-run-status]")).to_have_text("killed", timeout=15_000)
    expect(page.locator("#kill-run")).to_have_count(0)
    expect(page.locator("#killswitch-confirm")).to_contain_text("no longer running")
    expect(page.locator("#killswitch-confirm button[name=confirm]")).to_have_count(0)
    assert page.evaluate("window.__noReload") is True


def test_the_kill_switch_page_follows_the_team_switch_live(page: Page, server: Server,
                                                           team: Team, users: Any):
    sign_in(page, server, "admin", "pw-admin-123")
    page.goto(f"{server.url}/teams/{team.slug}/killswitch/")
    page.evaluate("window.__noReload = true")
    expect(page.locator("[data-live-status]")).to_have_text("Live")
    expect(page.locator("text=Stop the whole team…")).to_have_count(1)
    expect(page.locator("#killswitch-banner")).to_have_count(0)

    kill(scope=Scope.TEAM, team=team)

    expect(page.locator("text=Stop the whole team…")).to_have_count(0, timeout=15_000)
    expect(page.locator("#killswitch-engage")).to_contain_text("whole team is stopped")
    page.screenshot(path=str(SCREENSHOTS / "killswitch.png"), full_page=True)
    expect(page.locator("#killswitch-engaged")).to_contain_text("from elsewhere")
    banner = page.locator("#killswitch-banner")
    expect(banner).to_contain_text("Kill switch engaged")
    release = banner.locator("form.killswitch-banner__release")
    release.locator("input[name=reason]").fill("all clear")
    release.locator("button[type=submit]").click()
    # The release form, rendered by the stream, comes back to this page.
    expect(page.locator(".message-success")).to_contain_text("Released")
    assert page.url.rstrip("/").endswith("/killswitch")
    expect(page.locator("text=Stop the whole team…")).to_have_count(1)


def test_a_page_without_a_stream_of_its_own_shows_the_banner_live(page: Page, server: Server,
                                                                  team: Team, users: Any):
    sign_in(page, server, "viewer", "pw-viewer-123")
    page.goto(f"{server.url}/teams/{team.slug}/policies/")
    page.evaluate("window.__noReload = true")
    page.wait_for_timeout(500)  # the layout's stream connects
    kill(scope=Scope.TEAM, team=team)
    expect(page.locator("#killswitch-banner")).to_contain_text("from elsewhere", timeout=15_000)
    expect(page.locator("#killswitch-banner form")).to_have_count(0)  # a viewer may not release
    assert page.evaluate("window.__noReload") is True


def test_the_runs_filters_list_each_agent_once(page: Page, server: Server, agent: Agent,
                                               team: Team, users: Any):
    for name in ["bot-a", "bot-a", "bot-a", "bot-b", "bot-b"]:
        agent.start(agent=name)
    sign_in(page, server, "viewer", "pw-viewer-123")
    page.goto(f"{server.url}/teams/{team.slug}/runs/")
    options = page.locator("select[name=agent] option").all_text_contents()
    assert options == ["any", "bot-a", "bot-b"]
