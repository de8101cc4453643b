"""The check served without Django's handler (governance/direct.py) answers as the API's
middleware chain does: the same status, headers and error bodies, the same refusals handed
to the chain, the failed-key throttle counting its 401s.

Django's test client (the other API tests) goes through the chain; `manage.py serve` takes
the direct path, so each case here is sent both ways."""

from __future__ import annotations

import asyncio
import io
import json
from typing import Any

import pytest
from django.core.handlers.asgi import ASGIRequest
from django.http.response import HttpResponseBase

from governance.asgi import application
from governance.handlers import Answer
from runs.check import edge

pytestmark = pytest.mark.django_db(transaction=True)

CHECK = {"action": {"name": "search.docs", "args": {"q": "x"}}}


def _scope(path: str, headers: dict[str, str], *, scheme: str = "http") -> dict[str, Any]:
    return {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
            "query_string": b"", "root_path": "", "scheme": scheme, "http_version": "1.1",
            "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
            "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 5000)}


def _request(path: str, body: bytes, headers: dict[str, str], **kw: Any) -> ASGIRequest:
    return ASGIRequest(_scope(path, {"Host": "127.0.0.1", **headers}, **kw), io.BytesIO(body))


def _as_sent(made: Answer | HttpResponseBase) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    if isinstance(made, Answer):
        return made.status, made.headers, made.body
    headers = [(k.encode("ascii"), v.encode("latin1")) for k, v in made.items()]
    return made.status_code, headers, made.content


def both_ways(path: str, body: bytes, headers: dict[str, str], **kw: Any
              ) -> tuple[Any, Any]:
    """(the chain's answer, the direct path's), each to its own copy of the request; the
    direct path's None (handed to the chain) as None."""
    chain = application.sync_handler.get_response(_request(path, body, headers, **kw))
    direct_request = _request(path, body, headers, **kw)
    view = application.direct_view(direct_request)
    assert view is edge.direct_views["api:check"]
    assert application.direct is not None
    made = application.direct.respond(direct_request, view,
                                      direct_request.resolver_match.kwargs)
    return _as_sent(chain), None if made is None else _as_sent(made)


@pytest.fixture
def run_path(agent_token: str) -> str:
    from django.test import Client

    started = Client().post("/api/v1/runs", {"agent": "bot"}, content_type="application/json",
                            HTTP_AUTHORIZATION=f"Bearer {agent_token}").json()
    return f"/api/v1/runs/{started['run_id']}/check"


def _json_headers(body: bytes) -> dict[str, str]:
    return {"Content-Type": "application/json", "Content-Length": str(len(body))}


def _without_length(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k, b"" if k.lower() == b"content-length" else v) for k, v in headers]


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_an_allowed_check_has_the_chains_headers(run_path: str, agent_token: str,
                                                 scheme: str) -> None:
    # HSTS (SECURE_HSTS_SECONDS is set) is sent on HTTPS only: the headers differ by scheme.
    body = json.dumps(CHECK).encode()
    headers = {**_json_headers(body), "Authorization": f"Bearer {agent_token}"}
    (status, chain_headers, chain_body), direct = both_ways(run_path, body, headers,
                                                            scheme=scheme)
    assert direct is not None
    d_status, d_headers, d_body = direct
    assert status == d_status == 200
    assert _without_length(d_headers) == _without_length(chain_headers)
    assert dict(d_headers)[b"Content-Length"] == str(len(d_body)).encode()
    assert json.loads(d_body)["decision"] == json.loads(chain_body)["decision"] == "allow"
    names = {k.lower() for k, _ in d_headers}
    assert (b"strict-transport-security" in names) == (scheme == "https")
    assert {b"content-security-policy", b"x-content-type-options",
            b"referrer-policy"} <= names


def _error_cases(token: str, operator: str) -> list[tuple[str, bytes, dict[str, str]]]:
    good = json.dumps(CHECK).encode()
    bad_schema = json.dumps({"action": {"name": ""}}).encode()
    return [
        ("no key", good, {}),
        ("unknown key", good, {"Authorization": "Bearer gov_nothing_of_the_kind"}),
        ("operator token", good, {"Authorization": f"Bearer {operator}"}),
        ("not JSON", b"{nope", {"Authorization": f"Bearer {token}"}),
        ("no body", b"", {"Authorization": f"Bearer {token}"}),
        ("schema", bad_schema, {"Authorization": f"Bearer {token}"}),
    ]


def test_refusals_are_the_chains(run_path: str, agent_token: str) -> None:
    operator = "gov_op_" + "x" * 40  # told by its shape, nothing looked up
    for label, body, auth in _error_cases(agent_token, operator):
        headers = {**_json_headers(body), **auth}
        for path in (run_path, "/api/v1/runs/not-a-uuid/check",
                     "/api/v1/runs/00000000-0000-0000-0000-000000000000/check"):
            chain, direct = both_ways(path, body, headers)
            assert direct is not None, label
            assert direct[0] == chain[0] >= 400, (label, path, chain, direct)
            assert direct[1] == chain[1], (label, path)
            assert json.loads(direct[2]) == json.loads(chain[2]), (label, path)


@pytest.mark.parametrize("headers", [
    {"Host": "evil.example"},  # ALLOWED_HOSTS: the chain's 400
    {"Content-Length": "12x"},  # not a number: the chain's 400
    {"Content-Length": str(10 ** 7)},  # over the limit: the chain's 413
])
def test_what_the_chain_refuses_before_the_view_is_left_to_it(run_path: str, agent_token: str,
                                                              headers: dict[str, str]) -> None:
    body = json.dumps(CHECK).encode()
    sent = {**_json_headers(body), "Authorization": f"Bearer {agent_token}", **headers}
    chain, direct = both_ways(run_path, body, sent)
    assert direct is None
    assert chain[0] in (400, 413) and json.loads(chain[2])["error"]


def test_an_https_redirect_is_left_to_the_chain(run_path: str, agent_token: str,
                                                settings: Any) -> None:
    # (The chain's SecurityMiddleware read the setting when the application was made, as
    # every Django middleware does: only the hand-over is seen here.)
    settings.SECURE_SSL_REDIRECT = True
    body = json.dumps(CHECK).encode()
    _, direct = both_ways(run_path, body, {**_json_headers(body),
                                           "Authorization": f"Bearer {agent_token}"})
    assert direct is None


def test_another_middleware_chain_turns_the_direct_path_off(run_path: str, agent_token: str,
                                                            settings: Any) -> None:
    settings.API_MIDDLEWARE = [*settings.API_MIDDLEWARE,
                               "django.middleware.clickjacking.XFrameOptionsMiddleware"]
    body = json.dumps(CHECK).encode()
    _, direct = both_ways(run_path, body, {**_json_headers(body),
                                           "Authorization": f"Bearer {agent_token}"})
    assert direct is None


def test_failed_keys_are_counted_on_the_direct_path(run_path: str, settings: Any) -> None:
    settings.THROTTLE_API_KEY_FAILURES = 3
    from governance import middleware
    from governance.throttle import Throttle

    throttle = Throttle("api-key", limit=3, window=settings.THROTTLE_WINDOW_SECONDS)
    original = middleware.api_key_throttle
    middleware.api_key_throttle = throttle
    try:
        body = json.dumps(CHECK).encode()
        headers = {**_json_headers(body), "Authorization": "Bearer gov_nothing_of_the_kind"}
        statuses = []
        for _ in range(5):
            request = _request(run_path, body, headers)
            view = application.direct_view(request)
            made = application.direct.respond(request, view, request.resolver_match.kwargs)
            statuses.append(made.status_code)
        assert statuses[:3] == [401] * 3 and statuses[3:] == [429, 429]
        assert made["Retry-After"].isdigit()
    finally:
        middleware.api_key_throttle = original


def test_the_application_serves_the_check_on_its_pool(run_path: str, agent_token: str) -> None:
    """Through the whole ASGI application: the body read, the pool, the answer sent."""
    body = json.dumps(CHECK).encode()
    scope = _scope(run_path, {"Host": "127.0.0.1", **_json_headers(body),
                              "Authorization": f"Bearer {agent_token}"})
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def serve() -> None:
        await application(scope, receive, send)
        # The pool thread's connection is closed before the test's database goes.
        from django.db import connections

        from governance import pools
        await asyncio.get_running_loop().run_in_executor(pools.pool("api"),
                                                         connections.close_all)

    asyncio.run(serve())
    start = next(m for m in sent if m["type"] == "http.response.start")
    answer = json.loads(b"".join(m.get("body", b"") for m in sent
                                 if m["type"] == "http.response.body"))
    assert start["status"] == 200 and answer["decision"] == "allow"
    assert (b"Content-Length", str(len(json.dumps(answer, separators=(",", ":"),
                                                   ensure_ascii=False).encode())).encode()
            ) in start["headers"]
