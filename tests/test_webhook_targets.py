"""Webhook targets (SPEC 10, issue 10's SSRF): only public addresses, when a URL is saved and
again at delivery, after DNS, connecting to the address that was vetted; operators see a
status code or a fixed phrase, never what answered."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from policies.document import DocumentError, parse_document
from policies.egress import RefusedTarget, check_webhook_url, is_public, literal_address
from runs.models import KillSwitch, WebhookDelivery
from runs.webhooks import delivery as webhooks
from tests.workers import Receiver

NOT_PUBLIC = [
    # loopback, in every spelling the resolver accepts
    "http://127.0.0.1:8000/x", "http://127.5.6.7/", "http://2130706433/", "http://0x7f000001/",
    "http://0177.0.0.1/", "http://127.1/", "http://[::1]:9000/", "http://0.0.0.0/",
    "http://[::]/",
    # private networks
    "http://10.0.0.5/", "https://172.16.3.4/", "http://192.168.1.1/", "http://100.64.0.1/",
    # link-local and the cloud metadata endpoints
    "http://169.254.169.254/latest/meta-data/", "http://169.254.1.1/", "http://[fe80::1]/",
    "http://100.100.100.200/", "http://192.0.0.192/", "http://[fd00:ec2::254]/",
    # unique-local, reserved, broadcast, multicast, documentation, benchmarking
    "http://[fc00::1]/", "http://[fd12:3456::1]/", "http://240.0.0.1/",
    "http://255.255.255.255/", "http://224.0.0.1/", "http://[ff02::1]/", "http://192.0.2.1/",
    "http://198.18.0.1/", "http://[2001:db8::1]/",
    # IPv6 forms carrying a private IPv4 address: mapped, 6to4, NAT64; a Teredo tunnel
    "http://[::ffff:127.0.0.1]/", "http://[::ffff:169.254.169.254]/", "http://[2002:7f00:1::]/",
    "http://[64:ff9b::a00:5]/", "http://[2001:0:4136:e378:8000:63bf:3fff:fdd2]/",
    # IPv4-compatible and IPv4-translated, which `is_global` calls global (found by an attacker)
    "http://[::127.0.0.1]/", "http://[::ffff:0:127.0.0.1]/", "http://[::ffff:0:a00:5]/",
    # local names
    "http://localhost:8000/", "http://LOCALHOST/", "http://api.localhost/",
    "http://metadata.google.internal/", "http://printer.local/", "http://router.home.arpa/",
]
PUBLIC = ["https://93.184.215.14/hook", "http://8.8.8.8:8080/x", "https://[2606:4700::1111]/",
          "http://[::ffff:8.8.8.8]/", "https://hooks.example.com/governance"]


@pytest.mark.parametrize("url", NOT_PUBLIC)
def test_a_non_public_target_is_refused_when_saved(url: str, settings: Any) -> None:
    settings.WEBHOOK_ALLOWED_HOSTS = []
    with pytest.raises(RefusedTarget):
        check_webhook_url(url)
    with pytest.raises(DocumentError) as refused:
        parse_document({"teams": [{"slug": "s", "webhook_url": url}]})
    assert "teams[0].webhook_url" in str(refused.value.errors)


@pytest.mark.parametrize("url", PUBLIC)
def test_a_public_target_is_accepted(url: str, settings: Any) -> None:
    settings.WEBHOOK_ALLOWED_HOSTS = []
    check_webhook_url(url)


def test_every_numeric_spelling_of_loopback_is_read_as_the_resolver_reads_it() -> None:
    for host in ["2130706433", "0x7f000001", "0177.0.0.1", "127.1", "[::ffff:127.0.0.1]"]:
        address = literal_address(host)
        assert address is not None and not is_public(address), host
        resolved = socket.getaddrinfo(host.strip("[]"), 80, type=socket.SOCK_STREAM)
        assert all(not is_public(literal_address(i[4][0])) for i in resolved), host  # type: ignore[arg-type]


def test_a_name_that_resolves_to_a_private_address_is_refused_when_saved(monkeypatch,
                                                                        settings) -> None:
    settings.WEBHOOK_ALLOWED_HOSTS = []
    fake_dns(monkeypatch, {"hooks.example.net": "10.1.2.3"})
    with pytest.raises(RefusedTarget, match="resolves to a non-public address"):
        check_webhook_url("https://hooks.example.net/x")


def test_listed_internal_hosts_and_networks_are_allowed(settings) -> None:
    settings.WEBHOOK_ALLOWED_HOSTS = ["hooks.corp.internal", "10.20.0.0/16", "::1"]
    check_webhook_url("https://hooks.corp.internal/x")
    check_webhook_url("http://10.20.3.4:8080/x")
    check_webhook_url("http://[::1]:9000/x")
    with pytest.raises(RefusedTarget):
        check_webhook_url("http://10.21.0.1/x")  # outside the listed network
    with pytest.raises(RefusedTarget):
        check_webhook_url("http://169.254.169.254/")


@pytest.mark.django_db
def test_the_dashboard_form_refuses_a_non_public_target(team, users, settings) -> None:
    settings.WEBHOOK_ALLOWED_HOSTS = []
    admin = Client()
    admin.force_login(users["admin"])
    url = reverse("team_settings", kwargs={"slug": team.slug})
    for target in ["http://169.254.169.254/latest", "http://[::1]:8000/", "http://10.0.0.5/"]:
        response = admin.post(url, {"webhook_url": target})
        assert response.status_code == 422, target
        assert b"non-public" in response.content, target
    # Django's URLField already refuses the integer spelling as no URL at all.
    assert admin.post(url, {"webhook_url": "http://2130706433/"}).status_code == 422
    team.refresh_from_db()
    assert team.webhook_url is None


# --- At delivery ---------------------------------------------------------------------------

def fake_dns(monkeypatch: Any, names: dict[str, str]) -> list[str]:
    """Resolve the given names to the given addresses (other hosts as usual); returns the
    hosts asked for, in order."""
    real = socket.getaddrinfo
    asked: list[str] = []

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        asked.append(str(host))
        return real(names.get(str(host), host), port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return asked


@pytest.fixture
def receiver(team: Any) -> Iterator[Receiver]:
    rec = Receiver(secrets={team.slug: team.webhook_secret}).start()
    yield rec
    rec.stop()


def delivery_to(team: Any, url: str) -> WebhookDelivery:
    # The team's URL, as when the product makes a delivery (a retry follows the team's).
    type(team).objects.filter(pk=team.pk).update(webhook_url=url)
    switch = KillSwitch.objects.create(scope="team", team=team, target=f"team:{team.pk}",
                                       reason="r", engaged_by_label="x",
                                       engaged_at=timezone.now())
    return WebhookDelivery.objects.create(switch=switch, team=team, url=url,
                                          payload={"id": switch.pk})


def only_attempt(delivery: WebhookDelivery) -> Any:
    [attempt] = delivery.tries.all()
    return attempt


@pytest.mark.django_db(transaction=True)
def test_a_name_that_now_resolves_to_loopback_is_refused_at_delivery(team, receiver,
                                                                    monkeypatch, settings):
    """Saved while it was public; DNS changed since (rebinding): nothing is sent."""
    settings.WEBHOOK_ALLOWED_HOSTS = []
    port = receiver.url.rsplit(":", 1)[1]
    fake_dns(monkeypatch, {"hooks.example.net": "127.0.0.1"})
    delivery = delivery_to(team, f"http://hooks.example.net:{port}/{team.slug}")
    webhooks.attempt_delivery(delivery_id=delivery.pk, number=1)
    attempt = only_attempt(delivery)
    assert (attempt.status_code, attempt.error) == (None, webhooks.REFUSED)
    assert not receiver.bodies


@pytest.mark.django_db(transaction=True)
def test_a_literal_private_address_saved_before_the_guard_is_refused_at_delivery(
        team, receiver, settings):
    settings.WEBHOOK_ALLOWED_HOSTS = []
    delivery = delivery_to(team, f"{receiver.url}/{team.slug}")
    webhooks.attempt_delivery(delivery_id=delivery.pk, number=1)
    assert only_attempt(delivery).error == webhooks.REFUSED
    assert not receiver.bodies


@pytest.mark.django_db(transaction=True)
def test_the_delivery_connects_to_the_address_it_vetted(team, receiver, monkeypatch,
                                                        settings):
    """One resolution of the name, then a connection to that address: a second answer of
    the DNS (rebinding between the check and the connection) is never asked for."""
    settings.WEBHOOK_ALLOWED_HOSTS = ["127.0.0.0/8"]
    port = receiver.url.rsplit(":", 1)[1]
    asked = fake_dns(monkeypatch, {"hooks.example.net": "127.0.0.1"})
    delivery = delivery_to(team, f"http://hooks.example.net:{port}/{team.slug}")
    assert webhooks.attempt_delivery(delivery_id=delivery.pk, number=1) is None
    assert only_attempt(delivery).status_code == 200
    assert receiver.valid[team.slug] == 1
    assert asked.count("hooks.example.net") == 1
    assert all(literal_address(host) is not None for host in asked
               if host != "hooks.example.net")


@pytest.mark.django_db(transaction=True)
def test_operators_see_the_status_code_never_the_receivers_body(team, users, settings):
    """A 500 page of an internal service, or its connection error, is not shown to the
    team's members: the attempt says "HTTP 500" or a fixed phrase."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Leaky(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"INTERNAL-SECRET-PAGE")

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Leaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    settings.WEBHOOK_ALLOWED_HOSTS = ["127.0.0.1"]
    try:
        delivery = delivery_to(team, f"http://127.0.0.1:{server.server_address[1]}/x")
        webhooks.attempt_delivery(delivery_id=delivery.pk, number=1)
    finally:
        server.shutdown()
        server.server_close()
    attempt = only_attempt(delivery)
    assert (attempt.status_code, attempt.error) == (500, "HTTP 500")
    viewer = Client()
    viewer.force_login(users["viewer"])
    page = viewer.get(reverse("runs:killswitch", kwargs={"slug": team.slug}))
    assert page.status_code == 200
    assert b"HTTP 500" in page.content and b"INTERNAL-SECRET-PAGE" not in page.content
    # Said once (found by a newcomer: each attempt line read "HTTP 503 HTTP 503").
    assert page.content.count(b"HTTP 500") == 1
