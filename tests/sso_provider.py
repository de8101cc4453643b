"""A real OpenID Connect provider for the SSO tests (oidc-provider-mock), on a thread of the
test process, and the browser-less sign-in through its redirects."""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, urlsplit

import oidc_provider_mock
import requests
import werkzeug.serving


@dataclass
class Provider:
    """One provider instance. ``issuer`` is its URL; ``token_requests`` holds the forms the
    token endpoint received, ``paths`` every path asked; a ``token_host`` makes the token
    endpoint answer as another host (its ID tokens then name another issuer)."""

    issuer: str = ""
    token_requests: list[dict[str, str]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    token_host: str | None = None

    def set_user(self, sub: str, **claims: Any) -> None:
        response = requests.put(f"{self.issuer}/users/{sub}", json=claims, timeout=5)
        assert response.status_code == 204, response.text


class _Wrapper:
    def __init__(self, app: Any, provider: Provider) -> None:
        self.app, self.provider = app, provider

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        self.provider.paths.append(environ.get("PATH_INFO") or "")
        if environ.get("PATH_INFO") == "/oauth2/token":
            length = int(environ.get("CONTENT_LENGTH") or 0)
            body = environ["wsgi.input"].read(length)
            environ["wsgi.input"] = io.BytesIO(body)  # the provider reads it again
            self.provider.token_requests.append(
                {key: values[0] for key, values in parse_qs(body.decode()).items()})
            if self.provider.token_host:
                environ["HTTP_HOST"] = self.provider.token_host
        return self.app(environ, start_response)


@contextmanager
def running_provider(*, token_max_age: timedelta = timedelta(hours=1),
                     require_client_registration: bool = False) -> Iterator[Provider]:
    """``require_client_registration``: only a client registered at ``/oauth2/clients``,
    with its secret, may exchange a code (as a real provider's)."""
    os.environ["AUTHLIB_INSECURE_TRANSPORT"] = "1"  # the provider on plain http, loopback
    provider = Provider()
    app = oidc_provider_mock.app(require_nonce=True, access_token_max_age=token_max_age,
                                 require_client_registration=require_client_registration)
    server = werkzeug.serving.make_server("127.0.0.1", 0, _Wrapper(app, provider), threaded=True)
    provider.issuer = f"http://127.0.0.1:{server.server_port}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                              daemon=True)
    thread.start()
    try:
        yield provider
    finally:
        server.shutdown()
        server.server_close()
        thread.join(2)


def authorize(authorize_url: str, sub: str) -> str:
    """The person `sub` signs in at the provider; returns where it sends the browser."""
    answer = requests.post(authorize_url, data={"sub": sub}, allow_redirects=False, timeout=5)
    assert answer.status_code == 302, answer.text
    return answer.headers["Location"]


def path_of(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.path}?{parts.query}" if parts.query else parts.path


def query_of(url: str) -> dict[str, str]:
    return {key: values[0] for key, values in parse_qs(urlsplit(url).query).items()}
