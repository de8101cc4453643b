"""The cap on idle connections per address (governance/connections.py), in this process: a
listening socket of the test's own stands for granian's, so the kernel's answers (sock_diag,
TCP_INFO) are real. The server-level proofs are in tests/test_idle_connections.py."""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from governance import connections
from governance.connections import Connection, IdleCap
from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(not connections.supported(), reason="Linux only")


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(512)
        yield sock


def connect(listener: socket.socket, source: str, n: int
            ) -> tuple[list[socket.socket], list[socket.socket]]:
    """n connections from ``source``: the client's ends and the accepted ones."""
    clients, accepted = [], []
    for _ in range(n):
        client = socket.socket()
        client.bind((source, 0))
        client.connect(listener.getsockname())
        clients.append(client)
        accepted.append(listener.accept()[0])
    return clients, accepted


def is_open(client: socket.socket) -> bool:
    try:
        return client.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


@contextlib.contextmanager
def closing(*groups: list[socket.socket]) -> Iterator[None]:
    try:
        yield
    finally:
        for group in groups:
            for sock in group:
                sock.close()


def test_an_address_over_the_cap_keeps_its_cap_of_idle_connections_the_longest_silent_cut(
        listener):
    old, old_ends = connect(listener, "127.0.0.5", 10)
    time.sleep(0.3)
    young, young_ends = connect(listener, "127.0.0.5", 20)
    trusted, trusted_ends = connect(listener, "127.0.0.6", 30)
    few, few_ends = connect(listener, "127.0.0.7", 3)
    with closing(old, old_ends, young, young_ends, trusted, trusted_ends, few, few_ends):
        time.sleep(connections.IDLE_AFTER_MS / 1000 + 0.1)
        # One has its request in the application (a long poll, say: granian gives the port
        # as text); one just sent a request.
        waiting = young[0]
        connections.in_flight.add(("127.0.0.5", str(waiting.getsockname()[1])))
        active = young[1]
        active.sendall(b"GET / HTTP/1.1\r\n")
        young_ends[1].recv(100)
        try:
            cap = IdleCap(5, [ipaddress.ip_network("127.0.0.6/32")])
            # 28 idle: 23 over the cap.
            assert cap.sweep() == 23
            assert cap.sweep() == 0  # at its cap now
        finally:
            connections.in_flight.clear()
        assert not any(is_open(c) for c in old)  # the longest silent went first
        assert is_open(waiting) and is_open(active)
        assert sum(is_open(c) for c in young) == 5 + 2
        assert all(is_open(c) for c in trusted) and all(is_open(c) for c in few)
        # Its request answered, the waiting one is idle too: one over the cap (the active
        # one speaks again, so that a slow machine does not make it idle meanwhile).
        active.sendall(b"Host: x\r\n")
        young_ends[1].recv(100)
        assert cap.sweep() == 1
        assert is_open(active)


def test_connections_silent_for_less_than_the_idle_time_are_not_cut(listener):
    clients, ends = connect(listener, "127.0.0.5", 20)
    with closing(clients, ends):
        assert IdleCap(5, []).sweep() == 0
        assert all(is_open(c) for c in clients)


def test_under_the_cap_in_descriptors_the_sweep_looks_at_nothing_else(listener, monkeypatch):
    def never(*args: object) -> None:
        raise AssertionError("the kernel was asked")

    monkeypatch.setattr(connections, "established", never)
    clients, ends = connect(listener, "127.0.0.5", 3)
    with closing(clients, ends):
        assert IdleCap(10_000, []).sweep() == 0


def test_an_ipv4_client_of_an_ipv6_listener_counts_as_its_ipv4_address():
    """A dual-stack listener's IPv4 clients are IPv6 sockets, their addresses mapped
    (::ffff:a.b.c.d): counted, and matched against TRUSTED_PROXIES, as the IPv4 address."""
    def message(peer: str, port: int, inode: int) -> bytes:
        body = connections._DIAG_MESSAGE.pack(
            socket.AF_INET6, 1, 0, 0, (8000).to_bytes(2, "big"), port.to_bytes(2, "big"),
            bytes(16), ipaddress.ip_address(peer).packed, 0, 0, 0, 0, 0, inode)
        return connections._NLMSG_HEADER.pack(16 + len(body), 20, 2, 7, 0) + body

    done = connections._NLMSG_HEADER.pack(20, 3, 2, 7, 0) + bytes(4)
    data = b"".join(message("::ffff:127.0.0.5", 1000 + i, i) for i in range(4))
    peers, over = connections.parse_diag(data + message("2001:db8::1", 9, 9) + done, seq=7)
    assert over
    assert peers[0] == (ipaddress.ip_address("127.0.0.5").packed, 1000, 0)
    assert peers[-1] == (ipaddress.ip_address("2001:db8::1").packed, 9, 9)
    assert list(connections.crowded(peers, 3, [])) == [ipaddress.ip_address("127.0.0.5")]
    assert connections.crowded(peers, 3, [ipaddress.ip_network("127.0.0.0/8")]) == {}
    assert connections.normal("::ffff:127.0.0.5") == ipaddress.ip_address("127.0.0.5")


def test_to_cut_spares_requests_in_progress_and_data_on_its_way():
    def made(port: int, silent_ms: int, *, awaiting: bool = False, pending: bool = False
             ) -> Connection:
        return Connection(fd=port, inode=port, port=port, silent_ms=silent_ms,
                          awaiting=awaiting, pending=pending)

    held = [made(1, 9000), made(2, 8000, pending=True), made(3, 7000), made(4, 100),
            made(5, 6000), made(6, 800, awaiting=True), made(7, 1200, awaiting=True)]
    # 2 is sending, 3 is in the application, 4 spoke just now, 6 sent a request 0.8 s ago.
    assert [c.port for c in connections.to_cut(held, 1, busy={3})] == [1, 5]
    assert connections.to_cut(held, 3, busy={3}) == []


def test_one_byte_and_no_more_is_idle_after_a_longer_silence(listener, monkeypatch):
    """Headers that stop after a byte are capped too, given longer: the same silence as a
    whole request that a busy process has not yet handed to the application."""
    monkeypatch.setattr(connections, "AWAITING_AFTER_MS", 3000)  # room for a slow machine
    clients, ends = connect(listener, "127.0.0.5", 12)
    with closing(clients, ends):
        for client in clients[:6]:
            client.sendall(b"G")
        spoke = time.monotonic()
        time.sleep(connections.IDLE_AFTER_MS / 1000 + 0.1)
        cap = IdleCap(2, [])
        assert cap.sweep() == 6 - 2  # the silent ones only
        assert all(is_open(c) for c in clients[:6])
        time.sleep(max(0.0, spoke + 3.1 - time.monotonic()))
        assert cap.sweep() == 6
        assert sum(is_open(c) for c in clients) == 2


@pytest.mark.parametrize("value", ["many", "0", "-3"])
def test_settings_refuse_a_bad_cap(value):
    result = subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=ROOT, capture_output=True, text=True,
        env={"PATH": "/usr/bin:/bin", "MAX_IDLE_CONNECTIONS_PER_ADDRESS": value})
    assert result.returncode != 0
    assert "MAX_IDLE_CONNECTIONS_PER_ADDRESS" in result.stderr
