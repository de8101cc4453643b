"""Where the server may send webhooks: public addresses only (SPEC 10, docs/killswitch.md).

A team admin chooses the webhook URL, and the server POSTs to it: without a guard that is a
way to reach what only the server can (loopback services, the cloud metadata endpoint, the
private network) and to scan it. So a URL is vetted twice: when it is saved (a literal
address, or a name that resolves, must be public), and at every delivery, after DNS
resolution, where the connection goes to the vetted address itself (``VettedBackend``), so a
name cannot resolve to something else between the check and the connection (DNS rebinding).

Public means `ipaddress`'s ``is_global`` and not multicast; IPv6 forms that carry an IPv4
address (mapped, 6to4, NAT64) are judged by that address. Receivers on an internal network
are allowed by name or by network in ``WEBHOOK_ALLOWED_HOSTS``.

The same backend ends everything it opens by a deadline (``DeadlineStream``): httpcore's
timeouts are per operation, and a receiver answering a byte at a time would renew them for
ever. Its unvetted parent, ``DeadlineBackend``, bounds the calls to the identity provider
(policies/oidc_provider.py) the same way.

No library: the candidates (advocate, for requests; a few young httpx wrappers) are either
unmaintained or new; this is the standard library's classification and one httpcore hook.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import ssl
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import httpcore
from django.conf import settings
from django.utils.encoding import iri_to_uri

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
NAT64 = ipaddress.ip_network("64:ff9b::/96")
# Forms that carry an IPv4 address in their last 32 bits as well, which `is_global` calls
# global: IPv4-compatible (::a.b.c.d, deprecated) and IPv4-translated (::ffff:0:a.b.c.d).
# Found by an attacker: http://[::127.0.0.1]/ and http://[::ffff:0:127.0.0.1]/ passed.
EMBEDDING_IPV4 = (NAT64, ipaddress.ip_network("::/96"), ipaddress.ip_network("::ffff:0:0:0/96"))
# Not public, whatever the Python version's `is_global` says (its tables changed in 3.11.x
# and 3.12): IETF protocol assignments (Oracle's metadata at 192.0.0.192), carrier-grade NAT,
# benchmarking, local-use NAT64, documentation, deprecated site-local.
NOT_PUBLIC = [ipaddress.ip_network(n) for n in (
    "192.0.0.0/24", "100.64.0.0/10", "198.18.0.0/15", "64:ff9b:1::/48", "2001:db8::/32",
    "fec0::/10")]
LOCAL_SUFFIXES = (".localhost", ".local", ".localdomain", ".internal", ".home.arpa")
SAVE_RESOLVE_TIMEOUT_S = 3.0


class RefusedTarget(ValueError):
    """A webhook target the server will not connect to; the message is for the admin."""


class UnresolvedHost(RefusedTarget):
    """The host name has no address (today): a DNS failure, not a refused address, so the
    operator is sent to the right fix."""


# A team's webhook URL as saved (policies.Team.webhook_url) and delivered
# (runs.WebhookDelivery.url): at most this many characters once written in ASCII.
MAX_URL_CHARS = 500


def ascii_url(url: str) -> str:
    """``url`` as HTTP and DNS carry it: an internationalised host name in its IDNA (punycode)
    form, "https://例え.jp/hook" becoming "https://xn--r8jz45g.jp/hook", and any other
    character outside ASCII (in the path, the query, the fragment) percent-encoded as UTF-8,
    escapes already written left alone. Saved that way, every delivery connects to the name
    the admin meant and sends the path they typed (a path with "é" failed every delivery).
    Raises RefusedTarget for a host that has no IDNA form (an empty label, a label over 63
    characters) and for a URL longer than MAX_URL_CHARS once written so."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError:
        raise RefusedTarget("must be an http:// or https:// URL with a host") from None
    if host and not host.isascii():
        try:
            encoded = host.encode("idna").decode("ascii")
        except UnicodeError:
            raise RefusedTarget("has a host name that is not a valid internationalised "
                                "domain name") from None
        netloc = parts.netloc
        # Replace the host inside netloc and keep any credentials and port as written;
        # urlsplit lowercases `hostname`, so find it case-insensitively.
        at = netloc.rfind("@") + 1
        start = netloc.lower().find(host, at)
        netloc = netloc[:start] + encoded + netloc[start + len(host):] if start >= 0 \
            else encoded
        url = parts._replace(netloc=netloc).geturl()
    if not url.isascii():
        url = iri_to_uri(url)
    if len(url) > MAX_URL_CHARS:
        raise RefusedTarget(f"must be at most {MAX_URL_CHARS} characters once written as "
                            "HTTP carries it (characters outside ASCII take 6 to 12)")
    return url


def is_public(address: Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is None and any(address in net for net in EMBEDDING_IPV4):
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if embedded is not None:
            return is_public(embedded)
        if address.teredo is not None:
            return False  # a tunnel to anywhere: nobody's webhook receiver
    return (address.is_global and not address.is_multicast
            and not any(address in n for n in NOT_PUBLIC if n.version == address.version))


def literal_address(host: str) -> Address | None:
    """The address a URL's host denotes when it is numeric, in any form the resolver takes
    ("127.0.0.1", "2130706433", "0x7f.1", "[::1]"), else None."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    try:  # inet_aton reads the legacy forms (one number, octal, hex) as getaddrinfo does
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        return None


def _allowed_entries() -> tuple[set[str], list[ipaddress.IPv4Network | ipaddress.IPv6Network]]:
    names: set[str] = set()
    networks = []
    for entry in settings.WEBHOOK_ALLOWED_HOSTS:
        try:
            networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
        except ValueError:
            names.add(entry.lower().rstrip("."))
    return names, networks


def _acceptable(address: Address, networks: list[Any]) -> bool:
    return is_public(address) or any(address in n for n in networks
                                     if n.version == address.version)


def vetted_addresses(host: str, port: int) -> list[str]:
    """The addresses to connect to for ``host``: resolved, each one public or allowed.
    Raises RefusedTarget when any is not (a name with one private answer is refused whole)."""
    names, networks = _allowed_entries()
    by_name = host.lower().rstrip(".") in names
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise UnresolvedHost("the host name does not resolve") from exc
    addresses: list[str] = []
    for info in infos:
        text = str(info[4][0]).partition("%")[0]  # no IPv6 zone: a scoped address is local
        address = ipaddress.ip_address(text)
        if not by_name and not _acceptable(address, networks):
            raise RefusedTarget("the host is not a public address")
        if text not in addresses:
            addresses.append(text)
    return addresses


def _within(resolve: Any, host: str, timeout: float) -> list[str]:
    """``resolve()`` with a deadline (getaddrinfo has none: the resolver's own retries can
    take half a minute). Raises TimeoutError when DNS is slower; the lookup then finishes in
    a daemon thread whose result nobody reads. Whatever ``resolve`` raises is raised."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["addresses"] = resolve()
        except Exception as exc:  # handed to the caller's thread below
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(max(0.0, timeout))
    if "error" in outcome:
        raise outcome["error"]
    if "addresses" not in outcome:
        raise TimeoutError(f"no DNS answer for {host} within {timeout:.1f} s")
    return list(outcome["addresses"])


def vetted_addresses_within(host: str, port: int, timeout: float) -> list[str]:
    """vetted_addresses with a deadline (``_within``)."""
    return _within(lambda: vetted_addresses(host, port), host, timeout)


def addresses_within(host: str, port: int, timeout: float) -> list[str]:
    """Every address of ``host``, unvetted (a server the operator named), with a deadline.
    Raises OSError when the name does not resolve."""
    def resolve() -> list[str]:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
        return list(dict.fromkeys(str(info[4][0]) for info in infos))

    return _within(resolve, host, timeout)


def _resolves_within(host: str, port: int, timeout: float) -> list[str] | None:
    """The save's check: None when DNS is slow or the name unknown today (not set up yet?);
    the delivery-time check guards."""
    try:
        return vetted_addresses_within(host, port, timeout)
    except (UnresolvedHost, TimeoutError):
        return None


def check_webhook_url(url: str) -> None:
    """Raise RefusedTarget unless ``url`` may be saved as a team's webhook: http(s), a host,
    and a host that is public (or allowed) as written and as it resolves now. An
    internationalised host is judged in its IDNA form (``ascii_url``), the one saved."""
    url = ascii_url(url)
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        raise RefusedTarget("must be an http:// or https:// URL with a host") from None
    if parts.scheme not in {"http", "https"} or not host:
        raise RefusedTarget("must be an http:// or https:// URL with a host")
    names, networks = _allowed_entries()
    if host.rstrip(".") in names:
        return
    address = literal_address(host)
    if address is not None:
        if not _acceptable(address, networks):
            raise RefusedTarget(
                "must not point at a loopback, private, link-local or other non-public "
                "address (list internal receivers in WEBHOOK_ALLOWED_HOSTS)")
        return
    if host == "localhost" or host.endswith(LOCAL_SUFFIXES):
        raise RefusedTarget("must not point at a local host name "
                            "(list internal receivers in WEBHOOK_ALLOWED_HOSTS)")
    try:
        _resolves_within(host, port or (443 if parts.scheme == "https" else 80),
                         SAVE_RESOLVE_TIMEOUT_S)
    except RefusedTarget:
        raise RefusedTarget(
            "resolves to a non-public address (list internal receivers in "
            "WEBHOOK_ALLOWED_HOSTS)") from None


MASK = "•••"


# A path segment shown as it is: a plain lowercase word ("services", "hooks", "catch",
# "governance"). Everything else may be a credential: Slack's /services/T0/B0/XXXX, Discord's
# /api/webhooks/ID/TOKEN, Zapier's /hooks/catch/1234567/abcd123/, a key like sk_live_...,
# a path an admin made up. (Masking only the segments that looked like tokens showed
# Zapier's and short or uppercase secrets whole.)
_PLAIN_WORD = re.compile(r"[a-z][a-z-]{0,15}")


def _secret_looking(segment: str) -> bool:
    return bool(segment) and _PLAIN_WORD.fullmatch(segment) is None


def masked_url(url: str | None) -> str:
    """The webhook URL as shown to those who may not see its credentials (everyone but the
    team's admins): user and password, query values, fragment and path segments that look
    like tokens replaced by "•••"; scheme, host, port and plain path words kept, so a
    viewer can still tell which receiver it is."""
    if not url:
        return ""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port
    except ValueError:
        return MASK
    netloc = ("[" + host + "]" if ":" in host else host) + (f":{port}" if port else "")
    if parts.username is not None or parts.password is not None:
        netloc = f"{MASK}@{netloc}"
    path = "/".join(MASK if _secret_looking(seg) else seg for seg in parts.path.split("/"))
    query = "&".join(f"{pair.partition('=')[0]}={MASK}" if pair else ""
                     for pair in parts.query.split("&")) if parts.query else ""
    return parts._replace(netloc=netloc, path=path, query=query,
                          fragment=MASK if parts.fragment else "").geturl()


class DeadlineBackend(httpcore.SyncBackend):
    """httpcore's network backend, ending everything it opens by ``deadline`` (a
    ``time.monotonic()`` instant): the name's resolution, the connection, TLS, and every read
    and write (``DeadlineStream``). httpcore's own timeouts (like requests' and urllib3's)
    are per operation, so a server sending a byte every few seconds would otherwise hold the
    caller for ever. Any address the name resolves to: for servers the operator configured
    (the identity provider); ``VettedBackend`` for the ones a team's admin chose."""

    def __init__(self, *, deadline: float) -> None:
        self.deadline = deadline

    def addresses(self, host: str, port: int, timeout: float) -> list[str]:
        try:
            return addresses_within(host, port, timeout)
        except (OSError, UnicodeError) as exc:
            raise httpcore.ConnectError(f"{host} does not resolve") from exc

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None,
                    socket_options: Any = None) -> httpcore.NetworkStream:
        try:
            addresses = self.addresses(
                host, port, _left(self.deadline, timeout, httpcore.ConnectTimeout))
        except TimeoutError as exc:
            raise httpcore.ConnectTimeout(str(exc)) from exc
        last: Exception | None = None
        for address in addresses:
            try:
                stream = super().connect_tcp(
                    address, port, timeout=_left(self.deadline, timeout, httpcore.ConnectTimeout),
                    local_address=local_address, socket_options=socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                last = exc
                continue
            return DeadlineStream(stream, self.deadline)
        if last is None:
            raise httpcore.ConnectError(f"{host} has no address")
        raise last


class VettedBackend(DeadlineBackend):
    """``DeadlineBackend`` connecting only to vetted addresses of the host. TLS still
    verifies the certificate of the name in the URL (httpcore passes it as
    server_hostname)."""

    def addresses(self, host: str, port: int, timeout: float) -> list[str]:
        return vetted_addresses_within(host, port, timeout)


def _left(deadline: float, timeout: float | None, timed_out: type[Exception]) -> float:
    """The time an operation may take: its own timeout, but never past the deadline."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise timed_out("the deadline has passed")
    return left if timeout is None else min(timeout, left)


class DeadlineStream(httpcore.NetworkStream):
    """A network stream whose every operation ends by the deadline: reads and the TLS
    handshake get min(their timeout, the time left), and a write re-arms its socket's timeout
    before each send, since httpcore's write loop would give every partial send the whole
    timeout again (a receiver accepting a few bytes at a time)."""

    def __init__(self, stream: httpcore.NetworkStream, deadline: float) -> None:
        self._stream = stream
        self._deadline = deadline

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, _left(self._deadline, timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        sock = self._stream.get_extra_info("socket")
        if sock is None:  # not a socket stream: one write, bounded as a whole
            self._stream.write(buffer, _left(self._deadline, timeout, httpcore.WriteTimeout))
            return
        view = memoryview(buffer)
        while view:
            try:
                sock.settimeout(_left(self._deadline, timeout, httpcore.WriteTimeout))
                view = view[sock.send(view):]
            except TimeoutError as exc:
                raise httpcore.WriteTimeout(str(exc)) from exc
            except OSError as exc:
                raise httpcore.WriteError(str(exc)) from exc

    def close(self) -> None:
        self._stream.close()

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        stream = self._stream.start_tls(
            ssl_context, server_hostname=server_hostname,
            timeout=_left(self._deadline, timeout, httpcore.ConnectTimeout))
        return DeadlineStream(stream, self._deadline)

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)
