"""The on-call's pages on a phone (issue 26): the overview, a run page, the approvals and the
kill switch pages fit a 390-pixel screen, long unbroken text (a kill reason, a result, a
username) wraps instead of widening the page, and no page logs a console error, a kill and
an approval included."""

from __future__ import annotations

from typing import Any

from policies.models import Team
from runs.killswitch.fanout import killswitch_fanout
from runs.killswitch.services import killswitch_engage
from runs.models import KillSwitch, Run
from tests.browser.test_dashboard_browser import (  # noqa: F401 (fixtures)
    SCREENSHOTS,
    Browser,
    Page,
    browser,
    expect,
    pytestmark,
    sign_in,
)
from tests.browser.test_dashboard_browser import page as page
from tests.conftest import Agent, Server, set_policy

pytestmark = list(pytestmark)

PHONE = {"width": 390, "height": 844}
LONG = "x" * 400  # no space to break at


def console_errors(page: Page) -> list[str]:
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    return errors


def page_width(page: Page) -> int:
    return int(page.evaluate("document.documentElement.scrollWidth"))


def too_wide(page: Page, width: int) -> list[str]:
    """The innermost elements reaching past the screen's right edge, for the failure's
    message."""
    return list(page.evaluate("""(width) => {
      const out = [];
      for (const el of document.querySelectorAll("body *")) {
        const r = el.getBoundingClientRect();
        if (r.right > width + 1 && ![...el.children].some(
              c => c.getBoundingClientRect().right > width + 1)) {
          out.push(el.tagName.toLowerCase() + (el.id ? "#" + el.id : "")
                   + (el.className && typeof el.className === "string"
                      ? "." + el.className.split(" ").join(".") : "")
                   + " " + Math.round(r.right));
        }
      }
      return out.slice(0, 12);
    }""", width))


def test_the_on_calls_pages_fit_a_phone_and_log_no_errors(
        browser: Browser, server: Server, agent: Agent, team: Team, users: Any):  # noqa: F811
    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 600})
    waiting = agent.start(task="Refund " + LONG)
    pending = agent.check(waiting["run_id"], check_id="refund-long",
                          action={"name": "payments.refund", "args": {"order": LONG}})
    assert pending["decision"] == "pending"
    done = agent.start(task=LONG)
    agent.check(done["run_id"])
    killswitch_engage(scope="run", team=team, run=Run.objects.get(pk=done["run_id"]),
                      reason="stop " + LONG, actor=users["operator"])

    context = browser.new_context(viewport=PHONE, is_mobile=True)
    page = context.new_page()
    page.set_default_timeout(10_000)
    errors = console_errors(page)
    try:
        sign_in(page, server, "operator", "pw-operator-123")
        for path in (f"/teams/{team.slug}/", f"/teams/{team.slug}/runs/{done['run_id']}/",
                     f"/teams/{team.slug}/runs/{waiting['run_id']}/",
                     f"/teams/{team.slug}/approvals/", f"/teams/{team.slug}/killswitch/",
                     f"/teams/{team.slug}/runs/"):
            page.goto(server.url + path)
            page.wait_for_load_state("networkidle")
            assert page_width(page) <= PHONE["width"], (path, page_width(page),
                                                        too_wide(page, PHONE["width"]))
            name = path.strip("/").replace("/", "-").replace(team.slug, "phone")[:40]
            page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)
    finally:
        context.close()
    assert errors == []


def test_a_kill_and_an_approval_from_the_run_page_log_no_console_error(
        page: Page, server: Server, agent: Agent, team: Team, users: Any):
    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 600})
    errors = console_errors(page)
    sign_in(page, server, "admin", "pw-admin-123")

    waiting = agent.start(task="Refund")
    pending = agent.check(waiting["run_id"], check_id="refund-1",
                          action={"name": "payments.refund", "args": {"order": 1}})
    assert pending["decision"] == "pending"
    page.goto(f"{server.url}/teams/{team.slug}/runs/{waiting['run_id']}/")
    page.click("button:has-text('Approve')")
    approval = f"/api/v1/approvals/{pending['approval']['id']}"
    for _ in range(100):
        if agent.http.get(approval).json()["status"] == "approved":
            break
        page.wait_for_timeout(100)
    assert agent.http.get(approval).json()["status"] == "approved"
    page.wait_for_timeout(1500)  # the live stream's frames after the decision

    running = agent.start(task="Kill me")
    agent.check(running["run_id"])
    page.goto(f"{server.url}/teams/{team.slug}/runs/{running['run_id']}/")
    page.click("#kill-run")
    page.fill("textarea[name=reason]", "enough")
    page.click("button[name=confirm]")
    expect(page.locator(".killswitch-done")).to_be_visible(timeout=10_000)
    # The fan-out, here rather than by a worker (none runs in this test on the production
    # stack; the embedded default has run it already, and a second pass changes nothing).
    killswitch_fanout(switch_id=KillSwitch.objects.get(run_id=running["run_id"]).pk)
    expect(page.locator(".banner-killed")).to_be_visible(timeout=10_000)
    page.wait_for_timeout(1500)  # the live stream's frames after the kill
    assert errors == []
