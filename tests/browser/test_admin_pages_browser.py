"""Admin pages in a real browser (issue 15): restoring a policy version; webhook secret
rotation; confirmations for destructive one-click actions."""

from __future__ import annotations

from typing import Any

from policies.models import Policy, Team
from policies.services import policy_save
from tests.browser.test_dashboard_browser import (  # noqa: F401 (fixtures)
    SCREENSHOTS,
    Page,
    browser,
    expect,
    pytestmark,
    sign_in,
)
from tests.browser.test_dashboard_browser import page as page
from tests.conftest import Server

pytestmark = list(pytestmark)


def test_an_admin_restores_an_old_policy_version(page: Page, server: Server, team: Team,
                                                 users: Any):
    policy = Policy.objects.get(team=team, name="default")
    original = policy.current.document
    edited = {**original, "step_limits": {**original["step_limits"], "max_steps": 30}}
    policy_save(team=team, document=edited, actor=None, source="dashboard", note="more room")
    sign_in(page, server, "admin", "pw-admin-123")
    page.goto(f"{server.url}/teams/{team.slug}/policies/default/history")
    expect(page.locator("tr[data-version='2'] .version-note")).to_have_text("more room")
    # A restore asks first (issue 26): what it changes, a note, a backtest of the old version.
    page.click("a:has-text('Restore v1')")
    expect(page.locator("pre.diff")).to_contain_text("-  max_steps: 30")
    page.click("#backtest-button")
    expect(page.locator("#backtest-result")).not_to_be_empty(timeout=15_000)
    page.fill("input[name=note]", "30 let loops run")
    page.click("button:has-text('Restore as version 3')")
    expect(page.locator(".message-success")).to_contain_text("Restored version 1 as version 3")
    expect(page.locator("tr[data-version='3'] .version-note")).to_have_text(
        "restored version 1: 30 let loops run")
    assert Policy.objects.get(team=team, name="default").current.document == original
    # Any two versions: 2 against 3 shows the limit going back down.
    page.check("input[name=a][value='2']")
    page.check("input[name=b][value='3']")
    page.click("#compare-form button:has-text('Compare')")
    expect(page.locator("pre.diff")).to_contain_text("-  max_steps: 30")
    expect(page.locator("pre.diff")).to_contain_text("+  max_steps: 18")
    page.screenshot(path=str(SCREENSHOTS / "policy-history.png"), full_page=True)


def test_revoking_a_key_and_removing_a_member_ask_first(page: Page, server: Server,
                                                        team: Team, users: Any):
    from policies.models import AgentKey, Membership

    sign_in(page, server, "admin", "pw-admin-123")
    page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=server.url)
    page.goto(f"{server.url}/teams/{team.slug}/keys/")
    page.fill("input[name=name]", "ci-bot")
    page.click("button:has-text('Create key')")
    token = page.locator("#new-token").inner_text().strip()
    page.click("button[data-copy='#new-token']")
    expect(page.locator("button[data-copy='#new-token']")).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == token

    page.click("tr:has-text('ci-bot') a:has-text('Revoke')")
    expect(page.locator(".confirm")).to_contain_text("Revoke key ci-bot?")
    assert AgentKey.objects.get(name="ci-bot").revoked_at is None  # asking changed nothing
    page.click(".confirm button[name=confirm]")
    expect(page.locator(".message-success")).to_contain_text("Revoked key ci-bot")
    assert AgentKey.objects.get(name="ci-bot").revoked_at is not None

    page.goto(f"{server.url}/teams/{team.slug}/members/")
    page.click("tr[data-member=viewer] a:has-text('Remove')")
    expect(page.locator(".confirm")).to_contain_text("Remove viewer from")
    page.click(".confirm a:has-text('Cancel')")
    assert Membership.objects.filter(team=team, user=users["viewer"]).exists()
    page.click("tr[data-member=viewer] a:has-text('Remove')")
    page.click(".confirm button[name=confirm]")
    expect(page.locator(".message-success")).to_contain_text("Removed viewer")
    assert not Membership.objects.filter(team=team, user=users["viewer"]).exists()


def test_an_admin_rotates_the_webhook_secret_and_copies_it_once(page: Page, server: Server,
                                                                team: Team, users: Any):
    from policies.services import webhook_secret_id

    old = team.webhook_secret
    sign_in(page, server, "admin", "pw-admin-123")
    page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=server.url)
    page.goto(f"{server.url}/teams/{team.slug}/settings/")
    expect(page.locator("[data-secret-id]")).to_have_text(webhook_secret_id(old))
    page.click("a:has-text('Rotate the secret')")
    expect(page.locator(".confirm")).to_contain_text("Receivers that verify with the old one")
    page.click(".confirm button[name=confirm]")
    secret = page.locator("#new-secret").inner_text().strip()
    team.refresh_from_db()
    assert secret == team.webhook_secret != old
    expect(page.locator("[data-secret-id]")).to_have_text(webhook_secret_id(secret))
    page.click("button[data-copy='#new-secret']")
    assert page.evaluate("navigator.clipboard.readText()") == secret
    page.reload()
    expect(page.locator("#new-secret")).to_have_count(0)  # shown once


def test_an_admin_shows_the_secret_the_team_was_made_with_and_copies_it_once(
        page: Page, server: Server, team: Team, users: Any):
    from policies.services import webhook_secret_id

    secret = team.webhook_secret
    sign_in(page, server, "admin", "pw-admin-123")
    page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=server.url)
    page.goto(f"{server.url}/teams/{team.slug}/settings/")
    expect(page.locator("[data-secret-id]")).to_have_text(webhook_secret_id(secret))
    page.screenshot(path=str(SCREENSHOTS / "settings.png"), full_page=True)
    page.click("button[data-show-secret]")
    expect(page.locator("#new-secret")).to_have_text(secret)
    page.click("button[data-copy='#new-secret']")
    assert page.evaluate("navigator.clipboard.readText()") == secret
    expect(page.locator("[data-show-secret]")).to_have_count(0)
    page.reload()
    expect(page.locator("#new-secret")).to_have_count(0)  # shown once
    expect(page.locator("[data-secret-shown]")).to_contain_text("Shown")
    team.refresh_from_db()
    assert team.webhook_secret == secret  # receivers keep verifying with it
