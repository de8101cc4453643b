"""Controls follow the live state in a real browser (issue 15): a run killed elsewhere loses
its kill button, the kill switch page stops offering what is already engaged and the banner's
release form appears, all without a reload; the runs filters list each value once."""

from __future__ import annotations

from typing import Any

from django.template.loader import render_to_string

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
    # CI's groups share two cores: the confirmation's read may take more than 5 s there.
    expect(page.locator("#killswitch-confirm")).to_contain_text("1 running run", timeout=15_000)

    kill(scope=Scope.RUN, run=Run.objects.get(pk=run_id))

    expect(page.locator("#run-header [data-run-status]")).to_have_text("killed", timeout=15_000)
    expect(page.locator("#kill-run")).to_have_count(0)
    expect(page.locator("#killswitch-confirm")).to_contain_text("no longer running")
    expect(page.locator("#killswitch-confirm button[name=confirm]")).to_have_count(0)
    # Stopped, not finished: still live for the response the agent may report, but not
    # "Live" (found by a newcomer); its finish ends the stream.
    expect(page.locator("[data-live-status]")).to_have_text("Ended, no response yet")
    agent.http.post(f"/api/v1/runs/{run_id}/finish",
                    json={"status": "stopped", "output": "partial"})
    expect(page.locator("[data-live-status]")).to_have_text("Finished", timeout=15_000)
    assert page.evaluate("window.__noReload") is True


def test_a_click_the_server_refuses_or_never_answers_says_so(page: Page, server: Server,
                                                             agent: Agent, team: Team,
                                                             users: Any):
    """htmx leaves an error answer unswapped: without governance/static/failed.js a kill
    button whose confirmation read was cut short (503) looked like a click that did
    nothing."""
    sign_in(page, server, "operator", "pw-operator-123")
    run_id = agent.start()["run_id"]
    page.goto(f"{server.url}/teams/{team.slug}/runs/{run_id}/")
    expect(page.locator("[data-live-status]")).to_have_text("Live")
    slow = render_to_string("503_slow.html", {"seconds": 2})
    def kill_url(url: str) -> bool:
        return f"/runs/{run_id}/kill" in url
    page.route(kill_url, lambda route: route.fulfill(
        status=503, headers={"Content-Type": "text/html; charset=utf-8", "Retry-After": "10"},
        body=slow))
    page.click("#kill-run")
    failed = page.locator("#request-failed[role=alert]")
    expect(failed).to_contain_text("The server answered 503")
    expect(failed).to_contain_text("This page took too long to read: Reading what this page "
                                   "shows took more than 2 seconds")
    expect(failed).to_contain_text("Try again in 10 s.")
    expect(page.locator("#killswitch-confirm")).to_have_count(0)

    page.unroute(kill_url)
    page.route(kill_url, lambda route: route.abort("connectionrefused"))
    page.click("#kill-run")
    expect(failed).to_have_text("The server could not be reached: check the connection and "
                                "try again.")

    page.unroute(kill_url)  # the server answers again: the confirmation, and the message goes
    page.click("#kill-run")
    expect(page.locator("#killswitch-confirm")).to_contain_text("1 running run", timeout=15_000)
    expect(failed).to_have_count(0)


def test_a_refusal_is_said_when_the_stream_replaced_the_button_meanwhile(
        page: Page, server: Server, agent: Agent, team: Team, users: Any):
    """Found by a CI run: the run page's first full look renders its controls again, and a
    kill button clicked just before it was no longer in the page when the 503 came back;
    htmx fires the refusal on that element, and nothing was said. Here the request is held
    while the controls are replaced as the stream replaces them."""
    sign_in(page, server, "operator", "pw-operator-123")
    run_id = agent.start()["run_id"]
    page.goto(f"{server.url}/teams/{team.slug}/runs/{run_id}/")
    expect(page.locator("[data-live-status]")).to_have_text("Live")
    held: list[Any] = []
    def kill_url(url: str) -> bool:
        return f"/runs/{run_id}/kill" in url
    page.route(kill_url, lambda route: held.append(route))
    failed = page.locator("#request-failed[role=alert]")
    replace_controls = """() => { const controls = document.getElementById("run-controls");
        controls.innerHTML = controls.innerHTML; htmx.process(controls); }"""
    for outcome in ("refused", "unreached"):
        page.click("#kill-run")
        for _ in range(100):
            if held:
                break
            page.wait_for_timeout(50)
        route = held.pop()
        clicked = page.locator("#kill-run").element_handle()
        page.evaluate(replace_controls)
        assert not clicked.evaluate("el => el.isConnected")
        if outcome == "refused":
            route.fulfill(status=503, headers={"Content-Type": "application/json",
                                               "Retry-After": "10"},
                          body='{"error": {"code": "unavailable", "message": "Busy."}}')
            expect(failed).to_contain_text("The server answered 503")
            expect(failed).to_contain_text("Busy. Try again in 10 s.")
        else:
            route.abort("connectionrefused")
            expect(failed).to_have_text("The server could not be reached: check the "
                                        "connection and try again.")
    page.unroute(kill_url)
    page.click("#kill-run")
    expect(page.locator("#killswitch-confirm")).to_contain_text("1 running run", timeout=15_000)
    expect(failed).to_have_count(0)


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


def test_a_half_typed_release_reason_outlives_the_banners_live_updates(
        page: Page, server: Server, team: Team, users: Any):
    """Found by a newcomer: the stream sends the banner again whenever it changes ("just
    now" becomes "1 minute ago", another switch is engaged), and the swap emptied the
    release reason being typed."""
    sign_in(page, server, "admin", "pw-admin-123")
    kill(scope=Scope.AGENT, team=team, agent="bot-a")
    page.goto(f"{server.url}/teams/{team.slug}/policies/")
    page.evaluate("window.__noReload = true")
    expect(page.locator("#killswitch-banner [data-switch]")).to_have_count(1)
    page.wait_for_timeout(1000)  # the layout's stream connects and sends the banner
    reason = page.locator("#killswitch-banner input[name=reason]")
    reason.fill("the receiver is back, checked by")

    kill(scope=Scope.AGENT, team=team, agent="bot-b")  # the banner changes: a second line

    expect(page.locator("#killswitch-banner [data-switch]")).to_have_count(2, timeout=15_000)
    expect(page.locator("#killswitch-banner input[name=reason]").first).to_have_value(
        "the receiver is back, checked by")
    assert page.evaluate("window.__noReload") is True


def test_what_is_typed_in_the_engage_forms_outlives_the_pages_live_updates(
        page: Page, server: Server, agent: Agent, team: Team, users: Any):
    """Found by a newcomer on the demo: the engage card is live (its count of running runs),
    and each swap emptied the reason and the agent being typed, within seconds while agents
    ran."""
    sign_in(page, server, "operator", "pw-operator-123")
    page.goto(f"{server.url}/teams/{team.slug}/killswitch/")
    page.evaluate("window.__noReload = true")
    expect(page.locator("[data-live-status]")).to_have_text("Live")
    expect(page.locator("#killswitch-engage [data-running]")).to_have_attribute(
        "data-running", "0")
    team_reason = page.locator("#killswitch-engage form.engage-team [name=reason]")
    agent_name = page.locator("#killswitch-engage form.engage-agent [name=agent]")
    agent_reason = page.locator("#killswitch-engage form.engage-agent [name=reason]")
    team_reason.fill("refunds looping, INC-7")
    agent_name.fill("bot-a")
    agent_reason.fill("bot-a only")

    agent.start()  # the card changes: 1 run running

    expect(page.locator("#killswitch-engage [data-running]")).to_have_attribute(
        "data-running", "1", timeout=15_000)
    expect(team_reason).to_have_value("refunds looping, INC-7")
    expect(agent_name).to_have_value("bot-a")
    expect(agent_reason).to_have_value("bot-a only")
    assert page.evaluate("window.__noReload") is True
