"""The minimal durable check served the fastest way the stack allows (issue 33): granian's
WSGI interface, no framework, one statement (bench/minimal/fast.py). The ladder's first rung
(bench/ladder.py); bench-only."""

from __future__ import annotations

from typing import Any

from bench.minimal import fast

_HEADERS = [("content-type", "application/json")]
_STATUS = {200: "200 OK", 401: "401 Unauthorized", 404: "404 Not Found"}
_NO_SUCH = b'{"error":{"code":"not_found"}}'


def application(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    path = environ["PATH_INFO"]
    if path == "/readyz":
        start_response("200 OK", _HEADERS)
        return [b'{"ok":true}']
    parts = path.split("/")
    length = int(environ.get("CONTENT_LENGTH") or 0)
    # Where a slow body would hold this thread, if granian handed the request over before
    # its body had arrived (bench/ladder.py `interface_attacks` measures whether it does).
    body = environ["wsgi.input"].read(length)
    if len(parts) != 4 or parts[1] != "runs" or parts[3] not in ("durable", "durable2", "decided"):
        status, answer = 404, _NO_SUCH
    elif parts[3] == "durable2":  # the ladder's wsgi-2trips rung
        status, answer = fast.durable_two_trips(fast.thread_connection(), parts[2], body)
    elif parts[3] == "decided":  # the ladder's wsgi-rules rung
        status, answer = fast.durable_decided(fast.thread_connection(), parts[2], body)
    else:
        status, answer = fast.durable(fast.thread_connection(), parts[2], body)
    start_response(_STATUS[status], [*_HEADERS, ("content-length", str(len(answer)))])
    return [answer]
