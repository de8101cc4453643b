"""The API's own middleware chain (governance/middleware.py ApiRouteMiddleware): the pages keep
every browser protection (CSRF, the session sign-in, frame options, the security headers),
and an /api/ answer neither needs nor sets a session or CSRF cookie. Checked under each
server interface that loads the middleware: the test client, WSGI (`runserver`, any WSGI
host) and `manage.py serve`'s ASGI application on a real server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from django.test import Client

from policies.models import AgentKey
from tests.on_this_thread import keeps_the_test_connection

LOGIN = "/accounts/login/"


def _csrf_token(http: httpx.Client) -> str:
    page = http.get(LOGIN)
    assert page.status_code == 200
    assert page.headers["X-Frame-Options"] == "DENY"
    assert "frame-ancestors 'none'" in page.headers["Content-Security-Policy"]
    return http.cookies["csrftoken"]


def pages_keep_their_protections(http: httpx.Client, team: Any) -> None:
    token = _csrf_token(http)
    credentials = {"username": "admin", "password": "pw-admin-123"}
    # A form POST without the CSRF token is refused, credentials or not.
    refused = http.post(LOGIN, data=credentials)
    assert refused.status_code == 403
    assert "sessionid" not in http.cookies
    signed_in = http.post(LOGIN, data={**credentials, "csrfmiddlewaretoken": token})
    assert signed_in.status_code == 302
    assert "sessionid" in http.cookies
    # The session signs the next page in; without it the page sends to the sign-in.
    page = http.get(f"/teams/{team.slug}/keys/")
    assert page.status_code == 200 and b"test-key" in page.content
    assert "no-store" in page.headers["Cache-Control"]
    anonymous = httpx.Client(transport=http._transport, base_url=http.base_url)
    assert anonymous.get(f"/teams/{team.slug}/keys/").status_code == 302
    # Signed in, a form POST still needs its token.
    create = http.post(f"/teams/{team.slug}/keys/", data={"name": "no-token"})
    assert create.status_code == 403
    assert not AgentKey.objects.filter(name="no-token").exists()


def api_needs_no_session(http: httpx.Client, agent_token: str) -> None:
    """Called with the session of a signed-in admin still in the client's cookies."""
    assert "sessionid" in http.cookies
    bearer = {"Authorization": f"Bearer {agent_token}"}
    # The session is no credential for the API: no bearer key, no answer.
    unauthorized = http.get("/api/v1/runs")
    assert unauthorized.status_code == 401
    assert unauthorized.json()["error"]["code"] == "unauthorized"
    # No CSRF token needed for a key's POST, and no cookie comes back.
    started = http.post("/api/v1/runs", json={"agent": "bot"}, headers=bearer)
    assert started.status_code == 201, started.text
    check = http.post(f"/api/v1/runs/{started.json()['run_id']}/check",
                      json={"action": {"name": "search"}}, headers=bearer)
    assert check.status_code == 200 and check.json()["decision"] == "allow"
    for answer in (unauthorized, started, check):
        assert "set-cookie" not in answer.headers
        assert "Cookie" not in answer.headers.get("Vary", "")
        # Frame options are a page's header: their absence shows the API's own chain ran.
        assert "X-Frame-Options" not in answer.headers
        # The API's own headers stay: nosniff, the CSP (frame-ancestors 'none').
        assert answer.headers["X-Content-Type-Options"] == "nosniff"
        assert "frame-ancestors 'none'" in answer.headers["Content-Security-Policy"]
        assert answer.headers["Content-Type"].startswith("application/json")
    # A refused Host stays a JSON 400 (CommonMiddleware is in the API's chain).
    bad_host = http.get("/api/v1/runs", headers={**bearer, "Host": "evil.example"})
    assert bad_host.status_code == 400 and bad_host.json()["error"]["code"] == "bad_request"


@pytest.fixture
def wsgi() -> Iterator[httpx.Client]:
    from governance.wsgi import application

    with keeps_the_test_connection(), httpx.Client(
            transport=httpx.WSGITransport(app=application), base_url="http://127.0.0.1") as http:
        yield http


@pytest.mark.django_db
def test_under_wsgi(wsgi: httpx.Client, users: Any, team: Any, agent_token: str) -> None:
    pages_keep_their_protections(wsgi, team)
    api_needs_no_session(wsgi, agent_token)


@pytest.mark.django_db(transaction=True)
def test_under_the_production_server(server: Any, users: Any, team: Any, agent_token: str
                                     ) -> None:
    with httpx.Client(base_url=server.url, timeout=20) as http:
        pages_keep_their_protections(http, team)
        api_needs_no_session(http, agent_token)


@pytest.mark.django_db
def test_under_the_test_client(users: Any, team: Any, agent_token: str) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(users["admin"])
    assert client.post(f"/teams/{team.slug}/keys/", {"name": "x"}).status_code == 403
    started = client.post("/api/v1/runs", {"agent": "bot"}, content_type="application/json",
                          HTTP_AUTHORIZATION=f"Bearer {agent_token}")
    assert started.status_code == 201
    assert not started.cookies
    assert "X-Frame-Options" not in started
    page = client.get(f"/teams/{team.slug}/keys/")
    assert page.status_code == 200 and page["X-Frame-Options"] == "DENY"
