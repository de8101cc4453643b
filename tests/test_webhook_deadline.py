"""Each webhook attempt ends by a wall-clock deadline (runs/webhooks/delivery.py TIMEOUT_S),
whatever the receiver does: trickling its answer a byte at a time, answering headers and then
an endless body, or sitting behind a DNS server that does not answer. A worker process is
held for at most that long per attempt (SPEC 10, docs/reliability.md "Worker pools")."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from policies import egress
from runs.models import WebhookAttempt, WebhookDelivery
from runs.webhooks import delivery as webhooks

pytestmark = pytest.mark.django_db

# What the attempt may take beyond its deadline: recording it, and a loaded machine.
SLACK_S = 2.0


@contextlib.contextmanager
def raw_receiver(answer: Callable[[socket.socket, threading.Event], None]
                 ) -> Iterator[str]:
    """A loopback HTTP endpoint that reads the request's head and then lets ``answer`` write
    whatever it likes, until the test ends (``stop`` is set)."""
    stop = threading.Event()
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(30)
                with contextlib.suppress(OSError):
                    head = b""
                    while b"\r\n\r\n" not in head:
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        head += chunk
                    answer(conn, stop)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}/hook"
    finally:
        stop.set()
        thread.join(timeout=35)
        server.close()


def trickle(conn: socket.socket, stop: threading.Event) -> None:
    """A status line and then a header that never ends, one byte a second (for 20 s at most:
    without a deadline the attempt lasts as long as this does)."""
    conn.sendall(b"HTTP/1.1 200 OK\r\n")
    for _ in range(20):
        if stop.wait(1.0):
            return
        conn.sendall(b"X")


def endless_body(conn: socket.socket, stop: threading.Event) -> None:
    """A 200 and its headers at once, then a body announced huge that never comes."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000\r\n\r\nok")
    stop.wait(20)


@pytest.fixture
def hook(team: Any, settings: Any) -> Callable[[str], WebhookDelivery]:
    settings.WEBHOOK_ALLOWED_HOSTS = ["127.0.0.1"]  # the receivers listen on loopback

    def make(url: str) -> WebhookDelivery:
        # The team's URL, as when the product makes a delivery (a retry follows the team's).
        type(team).objects.filter(pk=team.pk).update(webhook_url=url)
        return WebhookDelivery.objects.create(team=team, event=webhooks.TEST_EVENT, url=url,
                                              payload={"event": webhooks.TEST_EVENT})

    return make


def attempt(delivery: WebhookDelivery) -> tuple[WebhookAttempt, float]:
    started = time.monotonic()
    webhooks.attempt_delivery(delivery_id=delivery.pk, number=1)
    return WebhookAttempt.objects.get(delivery=delivery, number=1), time.monotonic() - started


def test_a_receiver_that_trickles_a_byte_a_second_is_cut_off_at_the_deadline(hook):
    """Before: each byte restarted the 5 s read timeout, so the attempt lasted as long as the
    receiver kept trickling (and held the worker process all that time)."""
    with raw_receiver(trickle) as url:
        row, took = attempt(hook(url))
    assert took < webhooks.TIMEOUT_S + SLACK_S, f"the attempt took {took:.1f} s"
    assert (row.status_code, row.error) == (None, webhooks.TIMED_OUT)
    assert row.duration_ms < (webhooks.TIMEOUT_S + SLACK_S) * 1000


def test_the_receivers_body_is_never_read(hook):
    """The status line and headers decide; a huge or endless body costs nothing. Before: the
    attempt read the body until the read timeout and recorded a timeout."""
    with raw_receiver(endless_body) as url:
        delivery = hook(url)
        row, took = attempt(delivery)
    assert (row.status_code, row.error) == (200, "")
    assert took < webhooks.TIMEOUT_S - 1, f"the attempt took {took:.1f} s"
    delivery.refresh_from_db()
    assert delivery.status == webhooks.DELIVERED


def test_a_dns_server_that_does_not_answer_counts_against_the_deadline(
        hook, monkeypatch: pytest.MonkeyPatch):
    """getaddrinfo has no timeout of its own: the resolver's (several times 5 s) held the
    worker beyond the attempt's deadline."""
    released = threading.Event()

    def hanging(*args: Any, **kwargs: Any) -> Any:
        released.wait(30)
        raise socket.gaierror(socket.EAI_AGAIN, "no answer")

    monkeypatch.setattr(egress.socket, "getaddrinfo", hanging)
    try:
        row, took = attempt(hook("http://receiver.example/hook"))
    finally:
        released.set()
    assert took < webhooks.TIMEOUT_S + SLACK_S, f"the attempt took {took:.1f} s"
    assert row.error == webhooks.TIMED_OUT


def test_a_claimed_attempt_is_not_called_lost_before_its_deadline() -> None:
    assert webhooks.LEASE_S > webhooks.TIMEOUT_S
