"""The production command serves everything; health endpoints answer."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import start_server

pytestmark = pytest.mark.django_db(transaction=True)


def test_healthz_and_readyz_answer_json(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["checks"]["database"] == "ok"


def test_the_openapi_document_is_public_and_names_every_endpoint(client):
    doc = client.get("/api/v1/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    assert set(doc["paths"]) == {
        "/api/v1/runs", "/api/v1/runs/{run_id}", "/api/v1/runs/{run_id}/decisions",
        "/api/v1/runs/{run_id}/check", "/api/v1/runs/{run_id}/finish",
        "/api/v1/approvals/{approval_id}", "/api/v1/runs/{run_id}/local-decisions"}
    check = doc["paths"]["/api/v1/runs/{run_id}/check"]["post"]
    assert {"200", "401", "404", "413", "422", "503"} <= set(check["responses"])
    # SPEC 15: every check answer carries the new fields (null where they do not apply).
    answer = doc["components"]["schemas"]["CheckOut"]
    assert {"approval", "retry_after_s"} <= set(answer["required"])
    assert "pending" in answer["properties"]["decision"]["enum"]


def test_readyz_is_ready_but_degraded_while_redis_is_refused(client, settings, monkeypatch):
    """SPEC 9: 200 whenever the database answers; Redis's state is only reported."""
    import redis

    from governance import views

    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    refused = redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=0.1)
    monkeypatch.setattr(views, "redis_client", lambda: refused)
    ready = client.get("/readyz")
    assert ready.status_code == 200
    body = ready.json()
    assert body["status"] == "degraded"
    assert body["checks"]["database"] == "ok"
    assert body["checks"]["redis"].startswith("error: ")


def test_readyz_answers_503_when_the_database_does_not(client, monkeypatch):
    from django.db import connection
    from django.db.utils import OperationalError

    def down(*args, **kwargs):
        raise OperationalError("connection refused")

    monkeypatch.setattr(connection, "cursor", down)
    ready = client.get("/readyz")
    assert ready.status_code == 503
    assert ready.json()["status"] == "unavailable"
    assert ready.json()["checks"]["database"] == "error: OperationalError"


@pytest.mark.slow
def test_readyz_answers_200_degraded_when_redis_is_unreachable():
    from tests.conftest import server_env

    env = server_env(REDIS_URL="redis://127.0.0.1:1/0")
    srv = start_server(workers=1, env=env)
    try:
        response = httpx.get(f"{srv.url}/readyz", timeout=10)
        assert response.status_code == 200
        assert response.json()["status"] == "degraded"
        assert response.json()["checks"]["database"] == "ok"
        assert response.json()["checks"]["redis"].startswith("error")
    finally:
        srv.stop()


@pytest.mark.slow
def test_the_production_command_serves_the_check(team, agent_token):
    srv = start_server(workers=2)
    try:
        with httpx.Client(base_url=srv.url, timeout=20,
                          headers={"Authorization": f"Bearer {agent_token}"}) as http:
            run = http.post("/api/v1/runs", json={"agent": "bot"}).json()
            answers = [http.post(f"/api/v1/runs/{run['run_id']}/check",
                                 json={"action": {"name": "x"}}).json() for _ in range(4)]
            assert [a["decision"] for a in answers] == ["allow"] * 3 + ["stop"]
            assert http.get("/readyz").json()["checks"]["database"] == "ok"
            bad = http.post(f"/api/v1/runs/{run['run_id']}/check", content=b"{nope")
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    finally:
        srv.stop()


def test_settings_refuse_a_bad_database_url():
    import subprocess
    import sys

    from tests.conftest import ROOT

    result = subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=ROOT, capture_output=True, text=True,
        env={"PATH": "/usr/bin:/bin", "DATABASE_URL": "mysql://x@y/z"},
    )
    assert result.returncode != 0
    assert "DATABASE_URL" in result.stderr
