"""A small HTTP/1.1 keep-alive client on asyncio streams: the load generator.

Why not httpx: the load generator shares the 2 cores with the server it measures, so every
microsecond it spends per request is taken from the server. Measured on the benchmark machine
(GET /healthz, loaded machine): httpx's AsyncClient about 1.7 ms of CPU per request, this
client 0.2 to 0.3 ms. It writes the request head and reads a Content-Length (or chunked)
body, and speaks only what the benchmark needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any


class HttpError(Exception):
    pass


class Connection:
    """One keep-alive connection: one simulated agent talks over one, like an HTTP client
    with a connection pool of size one."""

    def __init__(self, host: str, port: int, *, token: str | None = None,
                 timeout: float = 30.0) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self._auth = f"Authorization: Bearer {token}\r\n".encode() if token else b""
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self.reconnects = 0

    async def _open(self) -> None:
        self._reader, self._writer = await asyncio.open_connection(self.host, self.port)

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(OSError):
                await self._writer.wait_closed()
        self._reader = self._writer = None

    async def request(self, method: str, path: str, body: bytes | None = None,
                      headers: bytes = b"") -> tuple[int, bytes]:
        """Send one request and read its answer.

        A connection the server closed while it sat idle (a keep-alive race) is reopened and
        the request sent once more, only when nothing of an answer had been read; the
        agents send a `check_id`, so even a check that did reach the server is a replay, not
        a second decision. Such retries are counted in `reconnects`.
        """
        try:
            return await asyncio.wait_for(self._exchange(method, path, body, headers),
                                          self.timeout)
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            await self.close()
            if getattr(exc, "partial", b""):
                raise HttpError(f"connection lost mid-answer: {exc!r}") from exc
            self.reconnects += 1
            try:
                return await asyncio.wait_for(self._exchange(method, path, body, headers),
                                              self.timeout)
            except (ConnectionError, asyncio.IncompleteReadError) as again:
                await self.close()
                raise HttpError(f"connection lost: {again!r}") from again
        except TimeoutError as exc:
            await self.close()
            raise HttpError("timeout") from exc

    async def _exchange(self, method: str, path: str, body: bytes | None,
                        headers: bytes) -> tuple[int, bytes]:
        if self._writer is None:
            await self._open()
        assert self._reader is not None and self._writer is not None
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n".encode()
            + self._auth + headers
        )
        if body is not None:
            head += b"Content-Type: application/json\r\nContent-Length: " + \
                str(len(body)).encode() + b"\r\n"
        self._writer.write(head + b"\r\n" + (body or b""))
        raw = await self._reader.readuntil(b"\r\n\r\n")
        lines = raw.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        length = -1
        chunked = False
        close = False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            lowered = name.strip().lower()
            if lowered == b"content-length":
                length = int(value)
            elif lowered == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
            elif lowered == b"connection" and b"close" in value.lower():
                close = True
        if chunked:
            content = await self._read_chunked()
        elif length >= 0:
            content = await self._reader.readexactly(length)
        else:
            content = await self._reader.read()
            close = True
        if close:
            await self.close()
        return status, content

    async def _read_chunked(self) -> bytes:
        assert self._reader is not None
        parts: list[bytes] = []
        while True:
            size_line = await self._reader.readuntil(b"\r\n")
            size = int(size_line.split(b";")[0].strip(), 16)
            if size == 0:
                await self._reader.readuntil(b"\r\n")
                return b"".join(parts)
            parts.append(await self._reader.readexactly(size))
            await self._reader.readexactly(2)

    async def post_json(self, path: str, payload: Any) -> tuple[int, Any]:
        status, content = await self.request(
            "POST", path, json.dumps(payload, separators=(",", ":")).encode()
        )
        return status, _decode(content)

    async def get_json(self, path: str, headers: bytes = b"") -> tuple[int, Any]:
        status, content = await self.request("GET", path, None, headers)
        return status, _decode(content)


def _decode(content: bytes) -> Any:
    if not content:
        return None
    try:
        return json.loads(content)
    except ValueError:
        return {"_raw": content[:200].decode(errors="replace")}
