"""SPEC 20 in a real browser: the tree on a parent's run page updates live when a child
stops (Debian's Chromium through Playwright, against the production server)."""

from __future__ import annotations

import contextlib
from typing import Any

from policies.models import Team
from tests.browser.test_dashboard_browser import browser, page, pytestmark, sign_in  # noqa: F401
from tests.conftest import Agent, Server, set_policy

with contextlib.suppress(ImportError):  # skipped by pytestmark without it
    from playwright.sync_api import Page, expect

__all__ = ["pytestmark"]


def test_the_tree_on_the_run_page_updates_live_when_a_child_stops(
        page: Page, server: Server, agent: Agent, team: Team, users: Any) -> None:  # noqa: F811
    set_policy(team, step_limits={"max_steps": 3, "max_repeat_action": 10,
                                  "no_progress_window": 10})
    parent = agent.start("planner")["run_id"]
    child = agent.start("researcher", parent_run_id=parent)["run_id"]
    sign_in(page, server, "viewer", "pw-viewer-123")
    page.goto(f"{server.url}/teams/{team.slug}/runs/{parent}/")
    page.evaluate("window.__noReload = true")
    expect(page.locator("[data-live-status]")).to_have_text("Live")
    row = page.locator(f'[data-child-run="{child}"]')
    expect(row).to_have_attribute("data-status", "running")

    for i in range(3):
        assert agent.check(child, "search", {"q": i})["decision"] == "allow"
    # The root's own counters are its tree's, shown once (not again as "Tree usage").
    expect(page.locator("#run-counters [data-counter=steps]")).to_contain_text("3 / 3")
    expect(page.locator("[data-counter=tree-steps]")).to_have_count(0)
    expect(page.locator("[data-tree-counted]")).to_be_visible()
    stop = agent.check(child, "search", {"q": "one more"})
    assert (stop["decision"], stop["reason"]) == ("stop", "max_steps")
    expect(row).to_have_attribute("data-status", "stopped")
    expect(row).to_contain_text("max_steps")
    # The parent itself goes on (a child's stop does not stop its parent).
    expect(page.locator("#run-header [data-run-status]")).to_have_text("running")
    assert page.evaluate("window.__noReload") is True
