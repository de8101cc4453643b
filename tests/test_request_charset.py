"""A request whose Content-Type names a charset that decodes no text (a NUL, `rot13`, `base64`,
`undefined`...) is read as one with no charset, as Django reads a charset it does not know:
before, Django's request making (or its first read of the query or a form) raised, a 500
from every server. Under WSGI (`make demo`'s runserver) before any middleware, so a plain
text 500 on the API, the pages and /healthz alike; under `manage.py serve` any page's
multipart POST, the sign-in page's for anyone (found by an attacker)."""

from __future__ import annotations

import asyncio
import io
import json
from typing import Any

import pytest

from tests.on_this_thread import keeps_the_test_connection

pytestmark = pytest.mark.django_db

NO_TEXT = ["\x00", "rot13", "base64", "undefined", "idna", "punycode"]
MULTIPART = b'--zz\r\nContent-Disposition: form-data; name="username"\r\n\r\nx\r\n--zz--\r\n'


@pytest.mark.parametrize("name", NO_TEXT)
def test_a_charset_that_decodes_no_text_is_not_one(name: str) -> None:
    from governance.handlers import text_charset

    assert not text_charset(name)


@pytest.mark.parametrize("name", ["utf-8", "UTF8", "latin-1", "utf-16", "cp1252", "shift_jis",
                                  "utf-7"])
def test_a_text_charset_is_one(name: str) -> None:
    from governance.handlers import text_charset

    assert text_charset(name)


def _wsgi(method: str, path: str, content_type: str, body: bytes = b"",
          headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """The answer of the project's WSGI application (what `runserver` serves)."""
    from governance.wsgi import application

    route, _, query = path.partition("?")
    environ = {"REQUEST_METHOD": method, "PATH_INFO": route, "QUERY_STRING": query,
               "SERVER_NAME": "127.0.0.1", "SERVER_PORT": "80", "HTTP_HOST": "127.0.0.1",
               "CONTENT_TYPE": content_type, "CONTENT_LENGTH": str(len(body)),
               "wsgi.input": io.BytesIO(body), "wsgi.url_scheme": "http",
               "wsgi.errors": io.StringIO(), "SCRIPT_NAME": ""}
    environ.update({"HTTP_" + k.upper().replace("-", "_"): v
                    for k, v in (headers or {}).items()})
    started: list[Any] = []
    with keeps_the_test_connection():
        chunks = application(environ, lambda status, hs, *_: started.append((status, hs)))
        body_out = b"".join(chunks)
        chunks.close()
    status, hs = started[0]
    return int(status.split()[0]), dict(hs), body_out


@pytest.mark.parametrize("name", NO_TEXT)
def test_under_wsgi_the_api_answers_as_without_the_charset(agent_token: str, name: str) -> None:
    status, headers, body = _wsgi("POST", "/api/v1/runs?x=1", f"application/json; charset={name}",
                                  json.dumps({"agent": "bot"}).encode(),
                                  {"Authorization": f"Bearer {agent_token}"})
    assert status == 201, body
    status, headers, body = _wsgi("GET", "/api/v1/runs?limit=1", f"text/plain; charset={name}",
                                  headers={"Authorization": f"Bearer {agent_token}"})
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    assert len(json.loads(body)["runs"]) == 1


@pytest.mark.parametrize("name", NO_TEXT)
def test_under_wsgi_the_pages_and_the_probes_answer(name: str) -> None:
    assert _wsgi("GET", "/healthz?x=1", f"text/plain; charset={name}")[0] == 200
    assert _wsgi("GET", "/accounts/login/?next=/", f"text/plain; charset={name}")[0] == 200
    # A form without its CSRF token: refused as any, not a 500.
    status, _, _ = _wsgi("POST", "/accounts/login/",
                         f"multipart/form-data; boundary=zz; charset={name}", MULTIPART)
    assert status == 403


def _asgi(method: str, path: str, content_type: str, body: bytes = b"") -> int:
    """The status the project's ASGI application (`manage.py serve`) answers."""
    from governance.asgi import application

    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    route, _, query = path.partition("?")
    scope = {"type": "http", "method": method, "path": route, "raw_path": route.encode(),
             "query_string": query.encode(), "http_version": "1.1", "scheme": "http",
             "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 5000),
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", content_type.encode()),
                         (b"content-length", str(len(body)).encode())]}
    asyncio.run(application(scope, receive, send))
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("name", ["rot13", "base64", "undefined", "idna", "punycode"])
def test_under_asgi_a_multipart_form_is_refused_as_any_not_a_500(name: str) -> None:
    status = _asgi("POST", "/accounts/login/", f"multipart/form-data; boundary=zz; charset={name}",
                   MULTIPART)
    assert status == 403  # no CSRF token, as any such form
