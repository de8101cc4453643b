"""SPEC 16 in a real browser: the run page shows each timeline row's "why", the warning
before the stop, and the stop banner's rule in one sentence."""

from __future__ import annotations

from typing import Any

import pytest

from policies.models import Team
from tests.browser.test_dashboard_browser import CHROMIUM, browser, page, sign_in  # noqa: F401
from tests.conftest import Agent, Server

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

try:
    from playwright.sync_api import Page, expect
except ImportError:  # pragma: no cover
    pytestmark.append(pytest.mark.skip(reason="needs the playwright package"))


def test_the_run_page_says_why_a_loop_was_stopped(page: Page, server: Server, agent: Agent,  # noqa: F811
                                                  team: Team, users: Any) -> None:
    from pathlib import Path

    if not Path(CHROMIUM).exists():
        pytest.skip("needs Debian's chromium")
    run_id = agent.start()["run_id"]
    for _ in range(4):
        agent.check(run_id, "search.docs", {"q": "refund"})
    sign_in(page, server, "viewer", "pw-viewer-123")
    page.goto(f"{server.url}/teams/{team.slug}/runs/{run_id}/")
    stop_row = page.locator("tr.step.outcome-stop")
    expect(stop_row.locator("[data-why]")).to_contain_text(
        "loop_detected: repeat_count 3 reached max_repeat_action 3 (policy default v1)")
    warned = page.locator("tr.step[data-warning=repeat_action]")
    expect(warned.first.locator("[data-directive]")).to_contain_text(
        "search.docs was called 2 times with the same arguments")
    expect(warned.first.locator("[data-why]")).to_contain_text(
        "repeat_action warning: repeat_count 2 of max_repeat_action 3, warnings.repeat_action 2")
    expect(page.locator(".banner [data-rule]")).to_have_text(
        "The rule loop_detected of policy default v1 stopped this run: repeat_count 3 "
        "reached max_repeat_action 3.")
