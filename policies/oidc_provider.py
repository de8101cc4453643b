"""Every call to the identity provider (SPEC 10, 17; docs/sso.md): bounded, cached, shared.

The sign-in page is anonymous and served by the dashboard's few threads, the same ones an
operator's kill switch needs. So a provider that hangs or trickles must cost the server a
bounded amount, whoever asks and however often:

- **A total deadline per call** (``OIDC_TIMEOUT``): connection, headers and body, through
  httpcore with ``DeadlineBackend`` (policies/egress.py). requests, which the library uses,
  and urllib3 bound each socket operation, not the call (urllib3's ``total`` too bounds the
  connect and then each read), so a provider sending a byte every 3 s held a thread for
  ever. Bodies are capped at ``MAX_BODY`` bytes.
- **The discovery document and the keys (JWKS) are kept** per process (``KEEP_S``, an hour);
  an ID token naming a key id we do not hold fetches the keys again, at most once per
  ``JWKS_REFETCH_S``.
- **A failure is kept too**, ``FAILURE_KEEP_S``: while the provider is failing (no answer, a
  5xx, a wrong discovery document) every sign-in is answered the 503 page at once, without
  contacting it, so a provider that is down costs one bounded attempt per interval.
- **One discovery at a time** per process; meanwhile the others use the document they hold,
  or are answered the 503 page at once.
- **At most ``MAX_CALLS`` calls in flight** per process (half the dashboard's threads);
  beyond, the 503 page at once: a provider that answers slowly but answers cannot take every
  thread either.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import ssl
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode, urlsplit

import httpcore
import httpx
from django.conf import settings

from .egress import DeadlineBackend

log = logging.getLogger(__name__)

KEEP_S = 3600.0
FAILURE_KEEP_S = 30.0
JWKS_REFETCH_S = 60.0
MAX_BODY = 1024 * 1024
MAX_CALLS = max(1, settings.DASHBOARD_THREADS // 2)


class ProviderUnreachable(Exception):
    """The provider did not answer, or answered nonsense: a 503 page, never a 500.
    ``retry_after``: seconds until the server asks the provider again."""

    def __init__(self, message: str, retry_after: int = 0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class AnswerTooLarge(ProviderUnreachable):
    """An answer over ``MAX_BODY``."""


class AnswerFailed(ProviderUnreachable):
    """An answer with a 5xx status."""


@dataclass(frozen=True)
class Provider:
    issuer: str
    authorization_endpoint: str
    token_endpoint: str
    jwks_uri: str
    userinfo_endpoint: str


@dataclass(frozen=True)
class Answer:
    status: int
    content_type: str
    body: bytes

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            raise ProviderUnreachable("it answered something that is not JSON") from None


_lock = threading.Lock()
_discovered: dict[str, tuple[float, Provider]] = {}  # issuer -> (fetched at, endpoints)
_discovering: set[str] = set()
_keys: dict[str, tuple[float, list[dict[str, Any]]]] = {}  # jwks_uri -> (fetched at, keys)
_failing: dict[str, tuple[float, str]] = {}  # issuer -> (until, why)
_calls = threading.BoundedSemaphore(MAX_CALLS)


def forget() -> None:
    """Forget everything kept (tests, and a provider that moved)."""
    with _lock:
        _discovered.clear()
        _discovering.clear()
        _keys.clear()
        _failing.clear()


def _failing_now(issuer: str) -> ProviderUnreachable | None:
    with _lock:
        failing = _failing.get(issuer)
    if failing is None:
        return None
    left = failing[0] - time.monotonic()
    if left <= 0:
        return None
    return ProviderUnreachable(f"{failing[1]}; the server tries again in {int(left) + 1} s",
                               retry_after=int(left) + 1)


def _failed(issuer: str, why: str) -> ProviderUnreachable:
    log.warning("OIDC provider %s failing: %s; not contacted again for %s s", issuer, why,
                FAILURE_KEEP_S)
    with _lock:
        _failing[issuer] = (time.monotonic() + FAILURE_KEEP_S, why)
    return ProviderUnreachable(why, retry_after=int(FAILURE_KEEP_S))


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    # The CA bundle requests used before: REQUESTS_CA_BUNDLE or CURL_CA_BUNDLE, else certifi's
    # (httpx's context also honours SSL_CERT_FILE). Built once: reading a bundle costs CPU.
    cafile = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE")
    return ssl.create_default_context(cafile=cafile) if cafile else httpx.create_ssl_context()


def _proxy(url: str) -> httpcore.Proxy | None:
    # The environment's proxy, as requests honoured it before (HTTPS_PROXY, NO_PROXY).
    parts = urlsplit(url)
    if urllib.request.proxy_bypass(parts.hostname or ""):
        return None
    proxy = urllib.request.getproxies().get(parts.scheme)
    return httpcore.Proxy(proxy) if proxy else None


def call(method: str, url: str, *, headers: dict[str, str] | None = None,
         form: dict[str, str] | None = None, per_person: bool = False) -> Answer:
    """One request to the provider, ended by ``OIDC_TIMEOUT`` whatever it sends. Raises
    ProviderUnreachable at once while the provider is failing or ``MAX_CALLS`` are in
    flight; a call that fails marks it failing. A 4xx is an answer (the caller judges it).
    ``per_person``: an answer about one person (the token, the userinfo): one too large, or
    a 5xx, is that sign-in's refusal, not the provider failing for everyone (found by an
    attacker: one person whose groups filled 1 MiB refused everyone's sign-in for 30 s; then
    one whose claims the provider could not issue, its token endpoint answering 500 for them
    alone, did the same at each try). A provider that does not answer in time still is."""
    issuer = settings.OIDC_ISSUER
    if (failing := _failing_now(issuer)) is not None:
        raise failing
    if not _calls.acquire(blocking=False):
        raise ProviderUnreachable("the server is already waiting on it for other sign-ins",
                                  retry_after=int(settings.OIDC_TIMEOUT) + 1)
    try:
        return _call(method, url, headers=headers or {}, form=form)
    except (httpcore.TimeoutException, httpcore.NetworkError, httpcore.ProtocolError,
            httpcore.UnsupportedProtocol, OSError) as exc:
        raise _failed(issuer, f"it did not answer {urlsplit(url).path or '/'} "
                              f"within {settings.OIDC_TIMEOUT:g} s ({type(exc).__name__})"
                      ) from None
    except ProviderUnreachable as exc:
        if per_person and isinstance(exc, AnswerTooLarge | AnswerFailed):
            raise
        raise _failed(issuer, str(exc)) from None
    finally:
        _calls.release()


def _call(method: str, url: str, *, headers: dict[str, str],
          form: dict[str, str] | None) -> Answer:
    deadline = time.monotonic() + settings.OIDC_TIMEOUT
    content = None
    headers = {"Accept": "application/json", **headers}
    if form is not None:
        content = urlencode(form).encode()
        headers["Content-Type"] = "application/x-www-form-urlencoded"
    with (httpcore.ConnectionPool(network_backend=DeadlineBackend(deadline=deadline),
                                  ssl_context=_ssl_context(), proxy=_proxy(url)) as pool,
          pool.stream(method, url, headers=headers, content=content) as response):
        body = bytearray()
        for chunk in response.iter_stream():
            body += chunk
            if len(body) > MAX_BODY:
                raise AnswerTooLarge(f"it sent more than {MAX_BODY} bytes")
        content_type = next((v.decode("latin-1") for k, v in response.headers
                             if k.lower() == b"content-type"), "")
    if response.status >= 500:
        raise AnswerFailed(f"{urlsplit(url).path or '/'} answered {response.status}")
    return Answer(response.status, content_type.lower(), bytes(body))


def provider() -> Provider:
    """The provider's endpoints, from <issuer>/.well-known/openid-configuration, kept for
    ``KEEP_S`` per process. Raises ProviderUnreachable."""
    issuer = settings.OIDC_ISSUER
    now = time.monotonic()
    with _lock:
        known = _discovered.get(issuer)
        if known is not None and now - known[0] < KEEP_S:
            return known[1]
        refreshing = issuer in _discovering
        if not refreshing:
            _discovering.add(issuer)
    if refreshing:
        if known is not None:  # another thread refreshes it: the old one serves meanwhile
            return known[1]
        raise ProviderUnreachable("the server is contacting it for another sign-in",
                                  retry_after=int(settings.OIDC_TIMEOUT) + 1)
    try:
        found = _discover(issuer)
    finally:
        with _lock:
            _discovering.discard(issuer)
    with _lock:
        _discovered[issuer] = (time.monotonic(), found)
    return found


def _discover(issuer: str) -> Provider:
    answer = call("GET", f"{issuer}/.well-known/openid-configuration")
    try:
        return _endpoints(issuer, answer)
    except ProviderUnreachable as exc:
        raise _failed(issuer, str(exc)) from None


def _endpoints(issuer: str, answer: Answer) -> Provider:
    if answer.status != 200:
        raise ProviderUnreachable(f"its discovery document answered {answer.status}")
    document = answer.json()
    if not isinstance(document, dict):
        raise ProviderUnreachable("its discovery document is not a JSON object")
    # The issuer as the provider spells it (some end it with "/"): ID tokens name it so.
    spelled = document.get("issuer")
    if not isinstance(spelled, str) or spelled.rstrip("/") != issuer:
        raise ProviderUnreachable(
            f"its discovery document names the issuer {document.get('issuer')!r}, "
            f"not OIDC_ISSUER ({issuer!r})")
    try:
        return Provider(
            issuer=spelled,
            authorization_endpoint=_url(document, "authorization_endpoint"),
            token_endpoint=_url(document, "token_endpoint"),
            jwks_uri=_url(document, "jwks_uri"),
            userinfo_endpoint=str(document.get("userinfo_endpoint") or ""))
    except KeyError as exc:
        raise ProviderUnreachable(f"its discovery document has no {exc.args[0]}") from None


def _url(document: dict[str, Any], name: str) -> str:
    value = document.get(name)
    if not isinstance(value, str) or not value.startswith(("https://", "http://")):
        raise KeyError(name)
    return value


def signing_keys(jwks_uri: str, *, kid: str | None = None, stale: bool = False
                 ) -> list[dict[str, Any]]:
    """The provider's keys (JWKS), kept ``KEEP_S``; fetched again when ``kid`` is not among
    them, or the caller found them ``stale`` (a token without a key id that the one key kept
    does not verify): the provider rotated its keys. At most once per ``JWKS_REFETCH_S``,
    so that forged tokens cannot make every sign-in a fetch."""
    now = time.monotonic()
    with _lock:
        known = _keys.get(jwks_uri)
    if known is not None:
        age = now - known[0]
        holds = not stale and (kid is None or any(key.get("kid") == kid for key in known[1]))
        if age < KEEP_S and (holds or age < JWKS_REFETCH_S):
            return known[1]
    answer = call("GET", jwks_uri)
    if answer.status != 200:
        raise _failed(settings.OIDC_ISSUER, f"its keys (JWKS) answered {answer.status}")
    try:
        document = answer.json()
    except ProviderUnreachable as exc:
        raise _failed(settings.OIDC_ISSUER, f"its keys (JWKS): {exc}") from None
    keys = document.get("keys") if isinstance(document, dict) else None
    if not isinstance(keys, list) or not all(isinstance(key, dict) for key in keys):
        raise _failed(settings.OIDC_ISSUER, "its keys (JWKS) are not a JSON key set")
    with _lock:
        _keys[jwks_uri] = (time.monotonic(), keys)
    return keys
