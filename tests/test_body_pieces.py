"""A request body's pieces are bounded, not only its bytes (SPEC 10, bounded work per
request): each ASGI message costs the event loop the same whatever its size, so a body sent
in chunks of one byte (a 64 KiB check, a 1 MiB upload or page form) kept a core busy for the
whole REQUEST_BODY_SECONDS, with no key at all (found by an attacker)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from governance import asgi
from governance.asgi import BodyTooFragmented, application, read_body


def _pieces(body: bytes, size: int) -> tuple[Any, list[int]]:
    """A receive() handing over ``body`` ``size`` bytes a message, and its call count."""
    calls = [0]
    chunks = [body[i:i + size] for i in range(0, len(body), size)] or [b""]

    async def receive() -> dict[str, Any]:
        calls[0] += 1
        i = calls[0] - 1
        return {"type": "http.request", "body": chunks[i], "more_body": i < len(chunks) - 1}

    return receive, calls


def test_a_body_in_one_byte_pieces_is_refused_early() -> None:
    body = b"x" * (1024 * 1024)
    receive, calls = _pieces(body, 1)
    with pytest.raises(BodyTooFragmented):
        asyncio.run(read_body(receive, 1024 * 1024))
    assert calls[0] <= asgi.BODY_PIECES_FREE + 1  # not a million messages


@pytest.mark.parametrize("size", [65536, 4096, 1024, 256])
def test_a_body_in_pieces_any_client_sends_is_read_whole(size: int) -> None:
    body = bytes(range(256)) * 256  # 64 KiB
    receive, _ = _pieces(body, size)
    assert asyncio.run(read_body(receive, 65536)) == body


def test_a_small_body_in_tiny_pieces_is_still_read() -> None:
    body = json.dumps({"action": {"name": "search.docs", "args": {"q": "x" * 1500}}}).encode()
    receive, _ = _pieces(body, 10)  # about 150 pieces
    assert asyncio.run(read_body(receive, 65536)) == body


def test_the_application_answers_a_json_400_for_a_body_in_one_byte_pieces() -> None:
    path = "/api/v1/runs/00000000-0000-0000-0000-000000000001/local-decisions"
    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "scheme": "http", "http_version": "1.1",
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                         (b"transfer-encoding", b"chunked")],
             "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 5000)}
    receive, calls = _pieces(b"{" + b" " * 500_000 + b"}", 1)
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(application(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = json.loads(b"".join(m.get("body", b"") for m in sent
                               if m["type"] == "http.response.body"))
    assert start["status"] == 400 and body["error"]["code"] == "bad_request"
    assert calls[0] <= asgi.BODY_PIECES_FREE + 1
