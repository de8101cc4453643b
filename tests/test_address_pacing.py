"""Cheap answers paced per client address (governance/pacing.py, governance/asgi.py
`paced_send`); the flood it answers is tests/test_address_flood.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from governance import pacing
from governance.asgi import Application, _cheap, _client
from governance.pacing import AddressPacing
from runs.check import callers


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(pacing.time, "monotonic", clock)
    return clock


def test_a_burst_is_answered_at_once_then_one_answer_per_token(clock):
    paced = AddressPacing(rate=10, burst=5, most_wait_s=10)
    assert [paced.wait_s("198.51.100.7") for _ in range(5)] == [0.0] * 5
    assert [round(paced.wait_s("198.51.100.7"), 3) for _ in range(3)] == [0.1, 0.2, 0.3]
    # Another address has its own bucket.
    assert paced.wait_s("198.51.100.8") == 0.0
    clock.now += 0.3  # the three tokens owed are paid back
    assert paced.wait_s("198.51.100.7") == pytest.approx(0.1)


def test_a_wait_is_never_longer_than_the_most_and_owes_no_more_past_it(clock):
    paced = AddressPacing(rate=10, burst=1, most_wait_s=0.5)
    waits = [paced.wait_s("198.51.100.7") for _ in range(20)]
    assert max(waits) == 0.5 and waits.count(0.5) >= 14
    clock.now += 0.6  # what was owed is paid back: no debt piled up past the most
    assert paced.wait_s("198.51.100.7") == pytest.approx(0.0, abs=0.11)


def test_the_table_of_addresses_is_bounded(clock):
    paced = AddressPacing(rate=1, burst=1, most_wait_s=10, most_addresses=100)
    for n in range(1000):
        paced.wait_s(f"10.0.{n // 256}.{n % 256}")
    assert len(paced) == 100


def scope(path: str, *, key: str | None = None, client: str = "198.51.100.7",
          forwarded: str | None = None) -> dict[str, Any]:
    headers = [(b"host", b"testserver")]
    if key is not None:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    if forwarded is not None:
        headers.append((b"x-forwarded-for", forwarded.encode()))
    return {"type": "http", "path": path, "headers": headers, "client": (client, 50000)}


@pytest.mark.parametrize(("path", "key", "status", "cheap"), [
    ("/healthz", None, 200, True),
    ("/readyz", "gov_x", 200, True),
    ("/api/v1/runs/x/check", "gov_wrong", 401, True),
    ("/api/v1/runs/x/check", "gov_valid", 404, True),
    ("/api/v1/nothing-here", None, 404, True),
    ("/api/v1/openapi.json", None, 200, True),
    ("/api/v1/runs/x/check", "gov_wrong", 429, True),
    ("/api/v1/runs/x/check", "gov_valid", 200, False),
    ("/api/v1/runs/x/check", "gov_valid", 422, False),
    ("/api/v1/runs/x/check", "gov_valid", 503, False),
    ("/api/v1/runs", "gov_valid", 429, False),  # a known key's refusal (a pool's cap)
    ("/teams/support/", None, 200, False),  # pages: paced by their own rules
    ("/accounts/login/", None, 404, False),
])
def test_what_is_cheap(path, key, status, cheap, monkeypatch):
    monkeypatch.setattr(callers, "_TEAMS", {})
    callers.remember(_digest("gov_valid"), 7)
    assert _cheap(scope(path, key=key), status) is cheap


def _digest(token: str) -> str:
    import hashlib

    return hashlib.sha256(token.encode()).hexdigest()


def test_the_client_is_the_peer_unless_a_trusted_proxy_forwards_it(settings):
    forwarded = scope("/healthz", client="127.0.0.1", forwarded="203.0.113.9")
    assert _client(forwarded) == "127.0.0.1"  # no TRUSTED_PROXIES: the header is ignored
    settings.TRUSTED_PROXIES = [__import__("ipaddress").ip_network("127.0.0.1/32")]
    assert _client(forwarded) == "203.0.113.9"
    assert _client(scope("/healthz", client="2001:db8:1:2::7")) == "2001:db8:1:2::/64"


def test_a_cheap_answer_past_the_burst_waits_but_a_valid_keys_never_does(
        monkeypatch, settings):
    monkeypatch.setattr(callers, "_TEAMS", {})
    callers.remember(_digest("gov_valid"), 7)
    application = Application.__new__(Application)  # only its pacing is used here
    application.cheap = AddressPacing(rate=10, burst=2, most_wait_s=10)
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def answer(path: str, key: str | None, status: int) -> None:
        send_paced = application.paced_send(scope(path, key=key), send)
        await send_paced({"type": "http.response.start", "status": status, "headers": []})
        await send_paced({"type": "http.response.body", "body": b"{}"})

    async def flood() -> None:
        for _ in range(4):
            await answer("/api/v1/runs/x/check", "gov_wrong", 401)
        for _ in range(3):
            await answer("/api/v1/runs/x/check", "gov_valid", 200)
        await answer("/healthz", None, 200)

    asyncio.run(flood())
    assert [round(s, 2) for s in slept] == [0.1, 0.2, 0.3]  # the 3rd and 4th 401, the probe
    assert len(sent) == 16  # every answer sent whole
