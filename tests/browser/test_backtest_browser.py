"""The policy editor's "Test against recorded runs" in a real browser (Debian's Chromium
through Playwright) against the production server command on the test database."""

from __future__ import annotations

import re
from typing import Any

import pytest

from policies.models import Policy, Team
from tests.browser.test_dashboard_browser import CHROMIUM, browser, page, sign_in  # noqa: F401
from tests.conftest import HAS_REDIS, Agent, Server, set_policy
from tests.workers import Worker, new_worker, workers_fixture  # noqa: F401 (fixture)

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
]

try:
    from playwright.sync_api import Page, expect
except ImportError:  # pragma: no cover
    pytestmark.append(pytest.mark.skip(reason="needs the playwright package"))


def test_an_admin_tests_a_draft_against_recorded_runs_before_saving(
        page: Page, server: Server, agent: Agent, team: Team, users: Any,  # noqa: F811
        workers: list[Worker]) -> None:
    if HAS_REDIS:
        new_worker(workers)  # the production stack: a Celery worker runs the backtest
    set_policy(team, step_limits={"max_steps": 50, "max_repeat_action": 1000},
               budgets={"max_seconds": None, "max_usd": None})
    looping = agent.start()["run_id"]
    for _ in range(10):
        agent.check(looping, "search.docs", {"query": "refund"})
    agent.http.post(f"/api/v1/runs/{looping}/finish", json={"status": "completed"})
    fine = agent.start()["run_id"]
    for i in range(3):
        agent.check(fine, "search.docs", {"query": f"q{i}"})
    agent.http.post(f"/api/v1/runs/{fine}/finish", json={"status": "completed"})
    version = Policy.objects.get(team=team, name="default").current.version

    sign_in(page, server, "admin", "pw-admin-123")
    page.goto(f"{server.url}/teams/{team.slug}/policies/default/")
    page.fill("#id_max_repeat_action", "3")  # the draft: not saved
    page.click("#backtest-button")
    report = page.locator("#backtest-result .backtest-report")
    expect(report).to_be_visible()
    expect(report.locator("[data-runs]")).to_have_text("2")
    expect(report.locator("[data-changed]")).to_have_text("1")
    expect(report.locator("[data-reason=loop_detected]")).to_contain_text("loop_detected 1")
    row = report.locator("table.backtest-changes tbody tr")
    expect(row).to_have_count(1)
    expect(row).to_contain_text("completed, 10 steps")
    expect(row).to_contain_text("stopped (loop_detected) at step 4")
    # Nothing was saved; the form still holds the draft.
    assert Policy.objects.get(team=team, name="default").current.version == version
    expect(page.locator("#id_max_repeat_action")).to_have_value("3")

    row.locator("a").click()
    page.wait_for_url(re.compile(rf"/runs/{looping}/$"))
    expect(page.locator("#run-header")).to_be_visible()
