"""Connections that send nothing (SPEC 10, third round), against the real server (`manage.py
serve`, two worker processes), loopback only, bounded in count and time.

Before: granian waited for a connection's first bytes without any deadline (to choose
between HTTP/1 and HTTP/2), so a connection that sent nothing stayed open for good, each one
holding a slot of a worker's backpressure; a few thousand of them and new connections, an
agent's check among them, waited in the kernel's queue. Now such a connection is closed after
``REQUEST_BODY_SECONDS``, and within that time one address holds at most
``MAX_IDLE_CONNECTIONS_PER_ADDRESS`` idle ones per process (``TRUSTED_PROXIES`` excepted).
"""

from __future__ import annotations

import contextlib
import resource
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from governance import connections
from tests.conftest import Server, server_env, start_server

# One suite's attacks at a time on this machine (tests/conftest.py `attack_turn`).
pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True),
              pytest.mark.usefixtures("attack_turn"),
              pytest.mark.skipif(not connections.supported(), reason="Linux only")]

DEADLINE_S = 2.0
WORKERS = 2


@pytest.fixture(autouse=True)
def _room_for_descriptors() -> Iterator[None]:
    """This process holds the attack's connections: a soft limit of 1024 would stop it first."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 8192 if hard == resource.RLIM_INFINITY else min(hard, 8192)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@contextlib.contextmanager
def served(**env: str) -> Iterator[Server]:
    srv = start_server(workers=WORKERS, env=server_env(**env))
    try:
        yield srv
    finally:
        srv.stop()


def address_of(server: Server) -> tuple[str, int]:
    return "127.0.0.1", int(server.url.rsplit(":", 1)[1])


@contextlib.contextmanager
def silent(server: Server, source: str, n: int) -> Iterator[list[socket.socket]]:
    """n connections from ``source`` that send nothing, closed at the end."""
    held: list[socket.socket] = []
    try:
        for _ in range(n):
            sock = socket.socket()
            held.append(sock)
            sock.settimeout(10)
            sock.bind((source, 0))
            sock.connect(address_of(server))
            sock.setblocking(False)  # is_open peeks without waiting
        yield held
    finally:
        for sock in held:
            sock.close()


def is_open(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def wait_closed(sock: socket.socket, within: float) -> float | None:
    """Seconds until the server closed ``sock``, or None if it did not within ``within``."""
    started = time.monotonic()
    sock.settimeout(0.1)
    while time.monotonic() - started < within:
        try:
            if sock.recv(65536) == b"":
                return time.monotonic() - started
        except TimeoutError:
            continue
        except OSError:  # reset
            return time.monotonic() - started
    return None


def answered(server: Server, token: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """One call on a new connection: answered within the deadline, 200 or 201."""
    started = time.monotonic()
    with httpx.Client(base_url=server.url, timeout=DEADLINE_S,
                      headers={"Authorization": f"Bearer {token}"}) as http:
        try:
            response = http.post(path, json=body)
        except httpx.TimeoutException as exc:
            raise AssertionError(f"{path}: no answer within {DEADLINE_S} s ({exc!r})") from exc
    took = time.monotonic() - started
    assert response.status_code in (200, 201), response.text
    assert took < DEADLINE_S, f"{path} took {took:.2f} s"
    return dict(response.json())


def checks_answered(server: Server, token: str, seconds: float) -> int:
    """An agent starting runs and checking them, each call on a new connection, for
    ``seconds``: every answer right and within the deadline. Returns the checks made."""
    made = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        run_id = answered(server, token, "/api/v1/runs", {"agent": "steady-bot"})["run_id"]
        check = answered(server, token, f"/api/v1/runs/{run_id}/check",
                         {"action": {"name": "search.docs"}})
        assert check["decision"] == "allow"
        made += 1
    return made


def test_a_connection_that_sends_nothing_is_closed_after_the_body_deadline():
    """And so is a keep-alive connection idle after its request. Before: the first stayed
    open (one still was after 180 s)."""
    with served(REQUEST_BODY_SECONDS="2") as srv, silent(srv, "127.0.0.1", 1) as (quiet,), \
            socket.create_connection(address_of(srv), timeout=10) as kept:
        kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert kept.recv(65536).startswith(b"HTTP/1.1 200")
        with ThreadPoolExecutor(2) as pool:
            quiet_closed, kept_closed = pool.map(lambda s: wait_closed(s, 2 + 4), (quiet, kept))
    assert quiet_closed is not None, "a connection that sent nothing was still open after 6 s"
    assert kept_closed is not None, "an idle keep-alive connection was still open after 6 s"
    assert min(quiet_closed, kept_closed) >= 1.5  # at the deadline, not at once


def test_a_new_connection_is_answered_while_thousands_of_idle_ones_are_held(agent_token):
    """2,600 connections that send nothing, more than the server's 2,048 slots: 600 from 60
    addresses (10 each, under the cap) and 2,000 from one. The one address's idle connections
    are cut back to the cap; the others are left alone (the body deadline ends them); an
    agent's checks on new connections are answered within 2 s meanwhile. Before: no new
    connection was answered at all."""
    cap = 100
    with served(REQUEST_BODY_SECONDS="30", WEB_MAX_CONNECTIONS="1024",
                MAX_IDLE_CONNECTIONS_PER_ADDRESS=str(cap)) as srv, \
            contextlib.ExitStack() as stack:
        spread = [sock for i in range(60)
                  for sock in stack.enter_context(silent(srv, f"127.0.1.{i + 1}", 10))]
        crowd = stack.enter_context(silent(srv, "127.0.0.9", 2000))
        assert checks_answered(srv, agent_token, 4) >= 3
        assert all(is_open(sock) for sock in spread)
        kept = sum(is_open(sock) for sock in crowd)
        assert kept <= WORKERS * cap, kept


def test_the_cap_spares_requests_in_progress_and_trusted_proxies():
    """Capped at 5 idle connections per address and process: 40 silent ones from an address
    are cut back to at most 10 (two processes), while 8 requests from it that wait 3 s (the
    shape of a long poll) are answered; a trusted proxy's 40 are left alone."""
    def wait_from(url: str, source: str) -> dict[str, Any]:
        with httpx.Client(transport=httpx.HTTPTransport(local_address=source),
                          timeout=20) as http:
            response = http.get(f"{url}/api/bench/wait?s=3")
            assert response.status_code == 200, response.text
            return dict(response.json())

    with served(REQUEST_BODY_SECONDS="30", MAX_IDLE_CONNECTIONS_PER_ADDRESS="5",
                TRUSTED_PROXIES="127.0.0.2", BENCH_URLCONF="bench.urls") as srv, \
            silent(srv, "127.0.0.3", 40) as crowd, silent(srv, "127.0.0.2", 40) as proxy, \
            ThreadPoolExecutor(8) as pool:
        waits = [pool.submit(wait_from, srv.url, "127.0.0.3") for _ in range(8)]
        time.sleep(2)
        kept = sum(is_open(sock) for sock in crowd)
        assert 1 <= kept <= WORKERS * 5, kept
        assert all(is_open(sock) for sock in proxy)
        assert [w.result()["waited_s"] for w in waits] == [3] * 8
