"""In a real browser (issue 26): a save that would stop most recent runs at their first step
shows the backtest's numbers and a box to tick; unticked nothing changes, ticked it saves."""

from __future__ import annotations

from typing import Any

from policies.models import Policy, Team
from tests.browser.test_dashboard_browser import (  # noqa: F401 (fixtures)
    Page,
    browser,
    expect,
    pytestmark,
    sign_in,
)
from tests.browser.test_dashboard_browser import page as page
from tests.conftest import Agent, Server

pytestmark = list(pytestmark)


def test_a_save_stopping_most_runs_asks_with_the_numbers(page: Page, server: Server,
                                                         agent: Agent, team: Team, users: Any):
    for i in range(3):
        run_id = agent.start()["run_id"]
        assert agent.check(run_id, "search.docs", {"q": i})["decision"] == "allow"
        response = agent.http.post(f"/api/v1/runs/{run_id}/finish", json={"status": "completed"})
        assert response.status_code == 200, response.text
    before = Policy.objects.get(team=team, name="default").current.version
    sign_in(page, server, "admin", "pw-admin-123")
    page.goto(f"{server.url}/teams/{team.slug}/policies/default/")
    page.fill("#id_tools_deny", "search.*")
    page.fill("#id_note", "no more searching")
    page.click(f"text=Save as version {before + 1}")
    panel = page.locator("#confirm-stops")
    expect(panel).to_contain_text("would stop 3 of its 3 most recent ended runs")
    expect(panel).to_contain_text("tool_denied 3")
    assert Policy.objects.get(team=team, name="default").current.version == before
    panel.locator("input[name=confirm_stops]").check()
    page.click(f"text=Save as version {before + 1}")
    expect(page.locator(".message-success")).to_contain_text(f"version {before + 1}")
    assert Policy.objects.get(team=team, name="default").current.document[
        "tools"]["deny"] == ["search.*"]
