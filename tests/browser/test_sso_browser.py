"""Single sign-on in a real browser (SPEC 17): "Sign in with SSO" on the login page, the
provider's page (oidc-provider-mock, on a thread of this process), and back to the
dashboard with the role the person's groups map to."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from policies.models import Membership, Role, SsoIdentity, Team
from policies.services import team_ensure
from tests.browser.test_dashboard_browser import (  # noqa: F401 (fixtures)
    SCREENSHOTS,
    Page,
    browser,
    expect,
    pytestmark,
)
from tests.browser.test_dashboard_browser import page as page
from tests.conftest import Server, server_env, start_server
from tests.sso_provider import Provider, running_provider

pytestmark = list(pytestmark)


@pytest.fixture(scope="module")
def provider() -> Iterator[Provider]:
    with running_provider() as running:
        yield running


@pytest.fixture(scope="module")
def sso_server(provider: Provider, django_db_setup: Any, django_db_blocker: Any
               ) -> Iterator[Server]:
    """The production server with single sign-on at the provider."""
    role_map = [{"group": "support-ops", "team": "support", "role": "operator"}]
    # `serve` refuses a map naming a team that does not exist (SPEC 17): the team is there
    # when it starts (the test's transactional database is flushed after it, as always).
    with django_db_blocker.unblock():
        team_ensure(slug="support")
    srv = start_server(workers=1, env=server_env(
        OIDC_ISSUER=provider.issuer, OIDC_CLIENT_ID="governance",
        OIDC_CLIENT_SECRET="not-a-secret", OIDC_ROLE_MAP=json.dumps(role_map)))
    yield srv
    srv.stop()


def test_sign_in_with_sso_lands_on_the_dashboard_with_the_mapped_role(
        page: Page, sso_server: Server, provider: Provider, team: Team):
    provider.set_user("olga-sub", preferred_username="olga", groups=["support-ops"])
    page.goto(f"{sso_server.url}/accounts/login/")
    expect(page.locator(".card")).to_contain_text("Password sign-in is for superusers only")
    page.click("#sso-sign-in")
    page.wait_for_url(f"{provider.issuer}/oauth2/authorize**")
    page.fill("input[name=sub]", "olga-sub")
    page.click("button:has-text('Authorize')")
    page.wait_for_url(f"{sso_server.url}/teams/{team.slug}/")
    expect(page.locator(".switcher summary")).to_contain_text("(operator)")
    expect(page.locator(".account")).to_contain_text("olga")
    expect(page.locator("nav.nav a:has-text('Members')")).to_have_count(0)  # not an admin
    page.screenshot(path=str(SCREENSHOTS / "sso-signed-in.png"), full_page=True)
    user = SsoIdentity.objects.get(issuer=provider.issuer, subject="olga-sub").user
    assert Membership.objects.get(user=user, team=team).role == Role.OPERATOR
