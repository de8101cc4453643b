"""The minimal durable check under granian's ASGI interface, no framework (issue 33): the
ladder's second and third rungs (bench/ladder.py). `/runs/<id>/inline` runs the statement
on the event loop (what the interface alone costs against WSGI); `/runs/<id>/pool` hands it
to a thread pool of `WEB_THREADS` threads and back, as the product's application does (what
the hand-off costs). Bench-only."""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.minimal import fast

_pool: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:  # made in the worker process, after granian's fork
        _pool = ThreadPoolExecutor(max_workers=int(os.environ.get("WEB_THREADS", "4")))
    return _pool


def _work(run_id: str, body: bytes) -> tuple[int, bytes]:
    return fast.durable(fast.thread_connection(), run_id, body)


async def application(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    parts = []
    while True:
        message = await receive()
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    path = scope["path"]
    if path == "/readyz":
        status, answer = 200, b'{"ok":true}'
    else:
        _, _, run_id, how = path.split("/")
        body = b"".join(parts)
        if how == "pool":
            loop = asyncio.get_running_loop()
            status, answer = await loop.run_in_executor(_executor(), _work, run_id, body)
        else:
            status, answer = _work(run_id, body)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(answer)).encode())]})
    await send({"type": "http.response.body", "body": answer})
