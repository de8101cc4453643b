"""The production command serves everything; health endpoints answer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest
from django.core.management.base import CommandError

from runs.management.commands.serve import listen_address
from tests.conftest import ROOT, free_port, server_env, start_server

pytestmark = pytest.mark.django_db(transaction=True)


def test_healthz_and_readyz_answer_json(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["checks"]["database"] == "ok"


def test_readyz_says_redis_is_not_configured_on_the_embedded_default(client, settings):
    # SPEC 9: Redis's state is in the body; without REDIS_URL it was left out.
    settings.REDIS_URL = ""
    ready = client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json() == {"status": "ok",
                            "checks": {"database": "ok", "redis": "not configured"}}


def test_the_openapi_document_is_public_and_names_every_endpoint(client):
    doc = client.get("/api/v1/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    assert set(doc["paths"]) == {
        "/api/v1/runs", "/api/v1/runs/{run_id}", "/api/v1/runs/{run_id}/decisions",
        "/api/v1/runs/{run_id}/check", "/api/v1/runs/{run_id}/finish",
        "/api/v1/approvals/{approval_id}", "/api/v1/runs/{run_id}/local-decisions",
        "/api/v1/decisions/{decision_id}",  # SPEC 16
        # The operator API (SPEC 17)
        "/api/v1/teams", "/api/v1/teams/{slug}/policies", "/api/v1/teams/{slug}/policies/{name}",
        "/api/v1/teams/{slug}/policies/{name}/versions",
        "/api/v1/teams/{slug}/policies/{name}/backtest", "/api/v1/killswitch",
        "/api/v1/teams/{slug}/approvals", "/api/v1/approvals/{approval_id}/decide",
        "/api/v1/teams/{slug}/runs", "/api/v1/teams/{slug}/runs/{run_id}",
        "/api/v1/teams/{slug}/runs/{run_id}/decisions",
        "/api/v1/teams/{slug}/decisions/{decision_id}"}
    check = doc["paths"]["/api/v1/runs/{run_id}/check"]["post"]
    assert {"200", "401", "404", "413", "422", "503"} <= set(check["responses"])
    # SPEC 15: every check answer carries the new fields (null where they do not apply).
    answer = doc["components"]["schemas"]["CheckOut"]
    assert {"approval", "retry_after_s"} <= set(answer["required"])
    assert "pending" in answer["properties"]["decision"]["enum"]


def test_the_openapi_document_is_built_once_per_process(client, monkeypatch):
    """Found by an attacker: the document was rebuilt on every request (150 to 190 ms of a
    thread for 71 KB), anonymous, and two clients looping on it made another team's check
    p99 10 to 20x. It changes only with the code: built on the first request, then served
    as the same bytes."""
    from runs.check import api as agent_api

    monkeypatch.setattr(agent_api, "_documents", {}, raising=False)  # as in a new process
    builds = []
    build = agent_api.api.get_openapi_schema

    def counted(**kwargs):
        builds.append(kwargs)
        return build(**kwargs)

    monkeypatch.setattr(agent_api.api, "get_openapi_schema", counted)
    first = client.get("/api/v1/openapi.json")
    second = client.get("/api/v1/openapi.json", HTTP_AUTHORIZATION="Bearer whatever")
    head = client.head("/api/v1/openapi.json")
    assert len(builds) == 1
    assert first.status_code == second.status_code == head.status_code == 200
    assert first.content == second.content and first.json()["openapi"].startswith("3.")
    assert first["Content-Type"] == second["Content-Type"] == "application/json"
    assert head.content == b"" and head["Content-Type"] == "application/json"


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
            # HEAD through granian: the GET's status and length, no body.
            got, head = (getattr(http, m)(f"/api/v1/runs/{run['run_id']}") for m in ("get", "head"))
            assert head.status_code == 200 and head.content == b""
            assert head.headers["content-length"] == str(len(got.content))
            bad = http.post(f"/api/v1/runs/{run['run_id']}/check", content=b"{nope")
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    finally:
        srv.stop()


def test_a_second_server_on_a_port_in_use_refuses_to_start():
    """granian listens with SO_REUSEPORT: without the check, a second `serve` on the same
    port started and the kernel sent it part of the first one's connections."""
    first = start_server(workers=1)
    try:
        port = first.url.rsplit(":", 1)[1]
        second = subprocess.Popen(
            [sys.executable, "manage.py", "serve", "--port", port, "--workers", "1"],
            cwd=ROOT, env=server_env(), start_new_session=True, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            _, printed = second.communicate(timeout=60)
        finally:
            if second.poll() is None:  # it started: stop it and its workers
                os.killpg(second.pid, signal.SIGKILL)
                second.wait()
        assert second.returncode == 1, printed
        assert f"port {port} on 127.0.0.1 is in use" in printed
        # Every connection still reaches the first server.
        for _ in range(20):
            with httpx.Client(base_url=first.url, timeout=10) as http:
                assert http.get("/healthz").status_code == 200
        assert first.process.poll() is None
    finally:
        first.stop()


@pytest.mark.parametrize("port", [0, -1, 70000])
def test_serve_refuses_a_port_out_of_range(port):
    with pytest.raises(CommandError, match=f"--port must be from 1 to 65535, not {port}"):
        listen_address("127.0.0.1", port)


def test_serve_listens_on_the_address_of_a_host_name_and_refuses_an_unknown_one():
    # granian takes only numeric addresses: a name crashed it with a traceback.
    assert listen_address("localhost", free_port()) in {"127.0.0.1", "::1"}
    with pytest.raises(CommandError, match=r"'nowhere\.invalid' is not an address"):
        listen_address("nowhere.invalid", free_port())


def test_settings_refuse_a_bad_database_url():
    result = subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=ROOT, capture_output=True, text=True,
        env={"PATH": "/usr/bin:/bin", "DATABASE_URL": "mysql://x@y/z"},
    )
    assert result.returncode != 0
    assert "DATABASE_URL" in result.stderr


def _asgi_request(path: str, headers: list[tuple[bytes, bytes]] = ()) -> object:
    import io

    from django.core.handlers.asgi import ASGIRequest

    scope = {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "scheme": "http",
             "headers": [(b"host", b"127.0.0.1"), *headers],
             "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 5000)}
    return ASGIRequest(scope, io.BytesIO(b""))


@pytest.mark.postgres
@pytest.mark.parametrize("path", ["/healthz", "/api/v1/runs"])
def test_an_api_request_closes_a_connection_past_its_age(path, agent_token):
    """The API's requests skip Django's request signals (governance/asgi.py `respond_sync`)
    but not their housekeeping: a pool thread's connection past CONN_MAX_AGE is closed, as
    `close_old_connections` does around every request under WSGI."""
    import time

    from django.db import connection

    from governance.asgi import application

    connection.ensure_connection()
    old = connection.connection
    connection.close_at = time.monotonic() - 1  # past its age
    request = _asgi_request(path, [(b"authorization", f"Bearer {agent_token}".encode())])
    response = application.respond_sync(request)
    assert response.status_code == 200
    assert connection.connection is not old and old.closed


def test_serve_lifts_the_open_files_limit_to_the_hard_one():
    """Every connection is a descriptor: under a soft limit of 1024 a thousand idle
    connections stopped a process from accepting any more, below its --max-connections."""
    code = ("import resource\n"
            "from runs.management.commands.serve import raise_open_files_limit\n"
            "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
            "raise_open_files_limit()\n"
            "print(*resource.getrlimit(resource.RLIMIT_NOFILE))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, check=True)
    soft, hard = (int(n) for n in result.stdout.split())
    assert soft > 256
    assert soft == hard or hard == -1  # -1: unlimited, lifted to the kernel's usual ceiling
