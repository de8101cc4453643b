"""The API's edge says each thing once (runs/check/edge.py): the body limit and its 413, the
bearer token, the JSON error. The ASGI application's early refusal and the API middleware's
are the same answer, and the throttle, the check and /metrics read the same token."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from runs.check import edge


@pytest.mark.parametrize(("header", "token"), [
    (None, None),
    ("", None),
    ("Bearer abc", "abc"),
    ("bearer abc", "abc"),
    ("BEARER abc", "abc"),
    ("Bearer  abc ", " abc "),  # as ninja's HttpBearer: the rest as it came
    ("Bearer", ""),
    ("Basic abc", None),
    ("Bearerabc", None),
])
def test_a_bearer_header_gives_its_token_as_ninja_reads_it(header: str | None,
                                                           token: str | None) -> None:
    assert edge.bearer_token(header) == token


def test_the_body_limit_is_the_checks_64_kib_and_the_upload_limit_elsewhere(settings) -> None:
    assert edge.body_limit("/api/v1/runs/x/check") == settings.CHECK_MAX_BODY_BYTES == 65536
    assert edge.body_limit("/api/v1/runs/x/finish") == settings.DATA_UPLOAD_MAX_MEMORY_SIZE


def test_an_error_is_the_spec_envelope() -> None:
    response = edge.error(409, "conflict", "No.", {"check_id": "taken"})
    assert response.status_code == 409
    assert response["Content-Type"] == "application/json"
    assert json.loads(response.content) == {
        "error": {"code": "conflict", "message": "No.", "fields": {"check_id": "taken"}}}


def _asgi_refusal(path: str, declared: int) -> tuple[int, dict[str, Any]]:
    """What the ASGI application answers a body declared over the limit, before Django."""
    from governance.asgi import application

    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
             "query_string": b"", "headers": [(b"content-length", str(declared).encode())],
             "http_version": "1.1", "scheme": "http", "server": ("testserver", 80)}
    asyncio.run(application(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(body)


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/api/v1/runs/{run}/check", "/api/v1/runs/{run}/finish"])
def test_the_asgi_refusal_and_the_middlewares_are_the_same_413(api, path: str) -> None:
    run = api.post("/api/v1/runs", {"agent": "bot"},
                   content_type="application/json").json()["run_id"]
    path = path.format(run=run)
    limit = edge.body_limit(path)
    status, early = _asgi_refusal(path, limit + 1)
    late = api.post(path, "x" * (limit + 1), content_type="application/json")
    assert status == late.status_code == 413
    assert early == late.json() == {"error": {
        "code": "payload_too_large", "message": f"The body is over {limit // 1024} KiB.",
        "fields": {}}}


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/api/v1/runs", "/api/v1/runs/{run}/check"])
def test_a_chunked_body_a_wsgi_server_cannot_read_is_refused_not_read_as_empty(
        api, path: str) -> None:
    # Django's WSGI request reads CONTENT_LENGTH bytes, none without it: under `make demo`'s
    # runserver (or any WSGI server) a chunked body reached the view empty and the agent was
    # told 422 "a JSON object body is required" for a body it did send.
    run = api.post("/api/v1/runs", {"agent": "bot"},
                   content_type="application/json").json()["run_id"]
    body = {"agent": "bot"} if path == "/api/v1/runs" else {"action": {"name": "search"}}
    response = api.post(path.format(run=run), body, content_type="application/json",
                        HTTP_TRANSFER_ENCODING="chunked", CONTENT_LENGTH="")
    assert response.status_code == 411
    assert response.json()["error"]["code"] == "length_required"
    assert "Content-Length" in response.json()["error"]["message"]
    # With its length the same body is read as always.
    assert api.post(path.format(run=run), body, content_type="application/json",
                    HTTP_TRANSFER_ENCODING="chunked").status_code in (200, 201)


@pytest.mark.django_db
@pytest.mark.parametrize("length", ["abc", "1e3", "12, 12", "²"])
def test_a_content_length_that_is_not_a_number_is_a_400_not_a_500(api, client,
                                                                   length: str) -> None:
    # Django reads the header with int() when a body is read (request.body): under a WSGI
    # server (`make demo`) the API, the pages and the health views answered 500.
    response = api.post("/api/v1/runs", {"agent": "bot"}, content_type="application/json",
                        CONTENT_LENGTH=length)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "bad_request"
    assert "Content-Length" in response.json()["error"]["message"]
    page = client.post("/accounts/login/", "username=a",
                       content_type="application/x-www-form-urlencoded", CONTENT_LENGTH=length)
    assert page.status_code == 400 and b"Content-Length" in page.content
