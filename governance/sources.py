"""Who a request comes from: its client address, as the failed-key throttle
(governance/throttle.py) and the pacing of cheap answers (governance/pacing.py) both count it.

The address is the TCP peer, unless the peer is one of ``TRUSTED_PROXIES`` (unset: none), in
which case the nearest untrusted hop of ``X-Forwarded-For`` (SPEC 10). Small on purpose and
free of the apps' models: the ASGI application reads it before Django sees the request, and
the benchmark's minimal server serves that application without the apps.
"""

from __future__ import annotations

import ipaddress

from django.conf import settings
from django.http import HttpRequest


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    text = text.strip()
    if text.startswith("[") and "]" in text:  # "[2001:db8::1]:443"
        text = text[1:text.index("]")]
    elif text.count(":") == 1:  # "198.51.100.7:443"
        text = text.partition(":")[0]
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _trusted(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    return any(address in network for network in settings.TRUSTED_PROXIES
               if network.version == address.version)


def client_address(peer: str, forwarded: str) -> str:
    """The client's address, from the TCP peer and the X-Forwarded-For header's value (its
    lines joined by commas; "" for none): the peer, unless the peer is a trusted proxy
    (TRUSTED_PROXIES), in which case the nearest untrusted hop of the header.

    The header is read from the right: each trusted proxy appends the address it got the
    request from, and everything left of the first untrusted hop was written by the client
    itself (so a client can never choose its own bucket by sending the header)."""
    peer_address = _address(peer)
    if peer_address is None or not settings.TRUSTED_PROXIES or not _trusted(peer_address):
        return peer
    client = peer
    for hop in reversed([h for h in forwarded.split(",") if h.strip()]):
        address = _address(hop)
        if address is None:
            break  # garbage from the client: the last trusted hop is all we know
        client = str(address)
        if not _trusted(address):
            break
    return client


def source_of(request: HttpRequest) -> str:
    """The client's address of a Django request (`client_address`)."""
    return client_address(request.META.get("REMOTE_ADDR") or "unknown",
                          request.META.get("HTTP_X_FORWARDED_FOR", ""))


def counted_source(source: str) -> str:
    """The source a bucket counts: an IPv6 client by its /64 (one site's prefix, from which it
    may send from any of 2**64 addresses: each a bucket of its own, found by an attacker's
    reading), an IPv4-mapped IPv6 address as the IPv4 one; anything else as it is."""
    address = _address(source)
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return source
