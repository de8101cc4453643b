"""Every answer under /api/ is JSON (SPEC 10), including the ones Django makes before any
view runs: a Host header that is refused, missing or empty, HTTP/1.0 without a Host."""

from __future__ import annotations

import json
import socket
from typing import Any

import pytest
from django.test import Client

from tests.conftest import Server


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/api/v1/runs", "/api/v1/runs/x/check", "/api/v1/nowhere"])
def test_a_refused_host_header_answers_the_json_error(path: str) -> None:
    response = Client(HTTP_HOST="evil.example").post(path, "{}", content_type="application/json")
    assert response.status_code == 400
    assert response["Content-Type"].startswith("application/json")
    assert response.json()["error"]["code"] == "bad_request"
    assert "Host" in response.json()["error"]["message"]


@pytest.mark.django_db
def test_outside_the_api_a_refused_host_stays_a_page() -> None:
    response = Client(HTTP_HOST="evil.example").get("/accounts/login/")
    assert response.status_code == 400
    assert not response["Content-Type"].startswith("application/json")


def raw(server: Server, request: bytes) -> tuple[bytes, dict[str, str], bytes]:
    """Send bytes as they are (no client library would send these), read the whole answer."""
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    if headers.get("transfer-encoding") == "chunked":
        decoded = b""
        while body:
            size, _, rest = body.partition(b"\r\n")
            n = int(size, 16)
            if n == 0:
                break
            decoded, body = decoded + rest[:n], rest[n + 2:]
        body = decoded
    return status.encode(), headers, body


REQUESTS = {
    "refused Host": b"GET /api/v1/runs HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n",
    "no Host": b"GET /api/v1/runs HTTP/1.1\r\nConnection: close\r\n\r\n",
    "empty Host": b"GET /api/v1/runs HTTP/1.1\r\nHost: \r\nConnection: close\r\n\r\n",
    "HTTP/1.0 without Host": b"GET /api/v1/runs HTTP/1.0\r\n\r\n",
    "a check, HTTP/1.0 without Host": (
        b"POST /api/v1/runs/00000000-0000-0000-0000-000000000000/check HTTP/1.0\r\n"
        b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"),
}


@pytest.mark.parametrize("case", sorted(REQUESTS))
def test_the_real_server_answers_json_to_malformed_hosts(server: Server, case: str,
                                                         transactional_db: Any) -> None:
    status, headers, body = raw(server, REQUESTS[case])
    assert b" 400 " in status, (case, status, body)
    assert headers["content-type"].startswith("application/json"), (case, headers)
    assert json.loads(body)["error"]["code"] == "bad_request"
