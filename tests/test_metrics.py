"""/metrics is served only when METRICS_TOKEN is set, and only to a scraper that sends it."""

from __future__ import annotations

import pytest
from django.test import Client, override_settings

pytestmark = pytest.mark.django_db

TOKEN = "scrape-token-for-tests"


@override_settings(METRICS_TOKEN="")
def test_it_is_not_served_when_metrics_are_off(client: Client) -> None:
    assert client.get("/metrics").status_code == 404
    assert client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 404


@override_settings(METRICS_TOKEN=TOKEN)
@pytest.mark.parametrize("header", [None, "Bearer wrong-token", f"Basic {TOKEN}", "Bearer"])
def test_it_requires_the_token(client: Client, header: str | None) -> None:
    extra = {"HTTP_AUTHORIZATION": header} if header else {}
    response = client.get("/metrics", **extra)
    assert response.status_code == 401
    assert response["WWW-Authenticate"].startswith("Bearer")
    assert b"governance_" not in response.content


@override_settings(METRICS_TOKEN=TOKEN)
def test_it_serves_the_metrics_to_the_scraper(client: Client) -> None:
    response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    text = response.content.decode()
    assert 'governance_kill_switches_engaged{scope="team"} 0.0' in text
    assert "governance_check_seconds" in text
