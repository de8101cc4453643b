"""One click in the browser (SPEC 6): an operator kills a run from its page and the live
timeline shows the stop, without a reload. Debian's chromium through Playwright; never a
downloaded browser."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.test import Client

from runs.models import Decision, Run
from tests.conftest import HAS_REDIS
from tests.workers import Worker, new_worker, workers_fixture  # noqa: F401 (fixture)

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium (Debian)"),
]


def session_cookie(user: Any) -> str:
    client = Client()
    client.force_login(user)
    return client.cookies[settings.SESSION_COOKIE_NAME].value


@contextmanager
def signed_in_page(server: Any, cookie: str) -> Iterator[Any]:
    """A page of Debian's chromium on `server`, signed in with a session cookie
    (`session_cookie`). No ORM while it is open: Playwright's event loop runs in this
    thread."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(base_url=server.url)
            context.add_cookies([{"name": settings.SESSION_COOKIE_NAME, "value": cookie,
                                  "url": server.url}])
            yield context.new_page()
        finally:
            browser.close()


def test_an_operator_kills_a_run_from_its_page_and_the_timeline_shows_it_live(
        server, agent, team, users, workers: list[Worker]):
    from playwright.sync_api import expect

    if HAS_REDIS:
        new_worker(workers)  # the fan-out that marks the run killed runs on Celery
    run_id = agent.start()["run_id"]
    for i in range(2):
        agent.check(run_id, args={"page": i})
    cookie = session_cookie(users["operator"])

    # No ORM below while Playwright's event loop runs in this thread.
    with signed_in_page(server, cookie) as page:
        page.goto(f"/teams/{team.slug}/runs/{run_id}/")
        expect(page.locator("#timeline tr")).to_have_count(2)
        page.evaluate("window.__sameDocument = true")  # gone if the page reloads

        page.click("#kill-run")
        confirm = page.locator("#killswitch-confirm")
        expect(confirm).to_contain_text(f"run {run_id[:8]} of team {team.slug}")
        expect(confirm).to_contain_text("1 running run")
        confirm.locator("textarea[name=reason]").fill("stuck in a loop")
        confirm.locator("button[type=submit]").click()
        expect(page.locator(".killswitch-done")).to_contain_text("Kill switch engaged")
        expect(page.locator("#kill-run")).to_have_count(0)  # HX-Trigger: killswitch-changed

        kill_row = page.locator("#timeline tr.outcome-stop")
        expect(kill_row).to_have_count(1, timeout=15_000)
        expect(kill_row).to_contain_text("killed")
        expect(kill_row).to_contain_text("stuck in a loop")
        assert page.evaluate("window.__sameDocument") is True

    run = Run.objects.get(pk=run_id)
    assert (run.status, run.stop_reason) == ("killed", "killed")
    row = Decision.objects.get(run_id=run_id, reason="killed")
    assert (row.outcome, row.action_name, row.step) == ("stop", "", 2)
