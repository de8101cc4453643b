"""The few lines the async client (aio.py) and the sync one (client.py) cannot share.

client.py is generated from aio.py (scripts/unasync_client.py): ``async`` and ``await`` are
stripped and each async name below becomes its sync twin (``asend_once`` becomes
``send_once``, ``async_sleep`` becomes ``sync_sleep``, ``AsyncSleep`` becomes ``Sleep``). What
differs beyond that lives here, written by hand, once per flavour.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeAlias

import httpx

AsyncSleep: TypeAlias = Callable[[float], Awaitable[None]]
Sleep: TypeAlias = Callable[[float], None]

# The clients' default sleeps (between attempts, and between waits for a rate limit).
async_sleep: AsyncSleep = asyncio.sleep
sync_sleep: Sleep = time.sleep


class SendTrace:
    """httpx's ``trace`` extension for one attempt: whether it was still connecting when it
    was cut short. asyncio's timeout (the async client's bound on a whole attempt) says only
    "timed out"; an attempt that never got past its connection was never sent, so it is
    retried like a refused connection. No event at all (another transport) counts as sent."""

    def __init__(self) -> None:
        self.connecting = False
        self.sent = False

    async def __call__(self, name: str, info: Mapping[str, Any]) -> None:
        if name.endswith(".send_request_headers.started"):
            self.sent = True
        elif name.endswith(".connect_tcp.started"):
            self.connecting = True

    def timeout(self, detail: str) -> httpx.TimeoutException:
        if self.connecting and not self.sent:
            return httpx.ConnectTimeout(detail)
        return httpx.ReadTimeout(detail)


async def asend_once(
    http: httpx.AsyncClient, method: str, url: str, timeout: float, **request: Any
) -> httpx.Response:
    """One attempt of the async client. httpx's timeouts bound each read; this bounds the
    attempt as a whole, so a server that trickles its answer cannot stretch it past the
    deadline. Cut short, it raises httpx's timeout (a connect timeout if it was never sent)."""
    trace = SendTrace()
    try:
        async with asyncio.timeout(timeout):
            return await http.request(method, url, timeout=httpx.Timeout(timeout),
                                      extensions={"trace": trace}, **request)
    except TimeoutError as exc:
        raise trace.timeout("deadline reached") from exc


def send_once(
    http: httpx.Client, method: str, url: str, timeout: float, **request: Any
) -> httpx.Response:
    """One attempt of the sync client: httpx's timeouts bound each read. A blocking call has
    no outside bound on the whole (a thread cannot be cut short); the deadline still bounds
    how many attempts start."""
    return http.request(method, url, timeout=httpx.Timeout(timeout), **request)
