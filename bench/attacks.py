"""Clients that try to take the server away from the agents: slow bodies, headers that never
finish, a viewer's many open live streams, a flood of bad keys from the agents' own address;
and a Redis that refuses or never answers (`REDIS_FAULTS`: the server is started against it).
Used by the benchmark's `attacks` phase (the p99 of valid checks under each, against the same
point without it) and by tests/test_availability.py and tests/test_attacks.py (valid checks
keep being answered within 2 s under each).

Each attack is one async function in `ATTACKS`, ``attack(target, stop, stats)``: it opens
its connections, keeps them open (opening again those the server closes) until `stop` is set,
then closes them all. Another attack is one more entry. Loopback only: `Target.host` must be a
127.x address.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import itertools
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

SLOW_BODY_CONNECTIONS = 200
UNFINISHED_HEADER_CONNECTIONS = 200
OPEN_STREAMS = 100
BAD_KEYS_PER_S = 50
LONG_POLLS = 500  # another team's agents waiting on their approvals (SPEC 11)
LONG_POLL_WAIT_S = 30
IDLE_CONNECTIONS = 2000  # from IDLE_SOURCES loopback addresses, 100 each
IDLE_SOURCES = 20
HEAVY_RATE_AGENTS = 8  # another team's agents checking under 50 rate-limit rules
HEAVY_ARGS_AGENTS = 4  # another team's agents whose every check carries 60 KiB of small values
HEAVY_READERS = 4  # another team's keys each reading its run's largest decisions, in turn
HEAVY_PAGE_VIEWERS = 4  # another team's signed-in viewers each loading its heaviest page
ACCOUNT_GUESSERS = 4  # clients of one address guessing the passwords of another team's people
ACCOUNT_GUESS_SOURCE = "127.0.0.77"  # their address: not the agents' own
# One client flooding cheap requests (bad keys, probes, unknown runs) on kept-alive
# connections, each sending its next request as soon as its answer comes.
FLOOD_CONNECTIONS = 8
FLOOD_SOURCE = "127.0.0.88"  # its address: not the agents' own


@dataclass
class Target:
    port: int
    host: str = "127.0.0.1"
    team_slug: str = ""
    # A signed-in viewer of the team (the `sessionid` cookie) and a run of it, for streams.
    session_cookie: str = ""
    run_id: str = ""
    # Another team's agents, for the attacks a tenant makes on its neighbours: their keys
    # and, for the long polls, the approvals they wait on.
    other_tokens: list[str] = field(default_factory=list)
    approval_ids: list[str] = field(default_factory=list)
    # The other team's run whose decisions `heavy_reads` reads.
    other_run_id: str = ""
    # The other team and a signed-in viewer of it (its `sessionid`), for `heavy_pages`.
    other_team_slug: str = ""
    other_session_cookie: str = ""
    # Usernames of the other team's people (its admin made them), for `account_guesses`.
    other_usernames: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not ipaddress.ip_address(self.host).is_loopback:
            raise ValueError("attacks are sent to loopback addresses only")


@dataclass
class AttackStats:
    """What the attack saw: connections opened, and how the server ended them."""

    opened: int = 0
    answers: Counter[str] = field(default_factory=Counter)  # status lines the server sent
    closed_by_server: int = 0  # connections closed, or streams ended, by the server
    errors: Counter[str] = field(default_factory=Counter)
    open_now: int = 0
    most_open: int = 0

    def opening(self) -> None:
        self.opened += 1
        self.open_now += 1
        self.most_open = max(self.most_open, self.open_now)

    def closing(self) -> None:
        self.open_now -= 1

    def dump(self) -> dict[str, object]:
        return {"opened": self.opened, "closed_by_server": self.closed_by_server,
                "open_now": self.open_now, "most_open": self.most_open,
                "answers": dict(self.answers), "errors": dict(self.errors)}

    def load(self, data: dict[str, Any]) -> None:
        """The figures the attack's process last reported."""
        self.opened, self.closed_by_server = data["opened"], data["closed_by_server"]
        self.open_now, self.most_open = data["open_now"], data["most_open"]
        self.answers, self.errors = Counter(data["answers"]), Counter(data["errors"])


Attack = Callable[[Target, asyncio.Event, AttackStats], Awaitable[None]]


async def _wait(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep up to `seconds`; True when `stop` was set meanwhile."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
    return stop.is_set()


async def _cancel(*tasks: asyncio.Future[Any]) -> None:
    """Cancel `tasks` and wait until they have ended: a task cancelled but never awaited
    again is destroyed pending when the attack's loop closes (asyncio warns of it)."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, OSError, asyncio.IncompleteReadError,
                                 TimeoutError):
            await task


async def _hold(target: Target, stop: asyncio.Event, stats: AttackStats, first: bytes,
                drip: bytes, every: float) -> None:
    """One connection: send `first`, then one `drip` every `every` seconds, never the rest;
    when the server answers or closes, note it and connect again."""
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(target.host, target.port)
        except OSError as exc:
            stats.errors[f"connect: {type(exc).__name__}"] += 1
            if await _wait(stop, 0.5):
                return
            continue
        stats.opening()
        try:
            writer.write(first)
            await writer.drain()
            reading = asyncio.ensure_future(reader.readline())
            while not stop.is_set():
                done, _ = await asyncio.wait({reading}, timeout=every)
                if done:
                    line = reading.result()
                    if line:
                        stats.answers[line.decode(errors="replace").strip()] += 1
                    else:
                        stats.closed_by_server += 1
                    break
                writer.write(drip)
                await writer.drain()
            await _cancel(reading)
        except (OSError, asyncio.IncompleteReadError):
            stats.closed_by_server += 1
        finally:
            stats.closing()
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def slow_bodies(target: Target, stop: asyncio.Event, stats: AttackStats,
                      connections: int = SLOW_BODY_CONNECTIONS) -> None:
    """POST /api/v1/runs announcing a 1,000-byte body, then one byte a second."""
    head = (f"POST /api/v1/runs HTTP/1.1\r\nHost: {target.host}:{target.port}\r\n"
            "Authorization: Bearer gov_000000000000_slow\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{").encode()
    await asyncio.gather(*(_hold(target, stop, stats, head, b" ", 1.0)
                           for _ in range(connections)))


async def unfinished_headers(target: Target, stop: asyncio.Event, stats: AttackStats,
                             connections: int = UNFINISHED_HEADER_CONNECTIONS) -> None:
    """A request line and headers that never end: one more header byte a second."""
    head = (f"POST /api/v1/runs HTTP/1.1\r\nHost: {target.host}:{target.port}\r\n"
            "X-Never-Ending: a").encode()
    await asyncio.gather(*(_hold(target, stop, stats, head, b"a", 1.0)
                           for _ in range(connections)))


async def _stream(target: Target, path: str, stop: asyncio.Event, stats: AttackStats) -> None:
    """One browser tab's EventSource: read the stream, reconnect when the server ends it."""
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(target.host, target.port)
        except OSError as exc:
            stats.errors[f"connect: {type(exc).__name__}"] += 1
            if await _wait(stop, 0.5):
                return
            continue
        stats.opening()
        try:
            writer.write((f"GET {path} HTTP/1.1\r\nHost: {target.host}:{target.port}\r\n"
                          "Accept: text/event-stream\r\n"
                          f"Cookie: sessionid={target.session_cookie}\r\n\r\n").encode())
            await writer.drain()
            status = await asyncio.wait_for(reader.readline(), 30)
            stats.answers[status.decode(errors="replace").strip()] += 1
            if b" 200 " not in status:
                await _wait(stop, 1.0)  # a browser would back off, and so do we
                continue
            tail = b""
            while not stop.is_set():
                try:
                    chunk = await asyncio.wait_for(reader.read(65536), 0.5)
                except TimeoutError:
                    continue
                tail = (tail + chunk)[-16:]
                # The stream's lifetime is over (the connection closed, or the last chunk of
                # a chunked body): reconnect, as EventSource does.
                if not chunk or tail.endswith(b"\r\n0\r\n\r\n"):
                    stats.closed_by_server += 1
                    break
        except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
            stats.errors[f"stream: {type(exc).__name__}"] += 1
        finally:
            stats.closing()
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def open_streams(target: Target, stop: asyncio.Event, stats: AttackStats,
                       streams: int = OPEN_STREAMS) -> None:
    """One signed-in viewer's tabs: half the team overview's stream, half a run page's."""
    if not target.session_cookie or not target.run_id:
        raise ValueError("open_streams needs a viewer's session cookie and a run id")
    paths = [f"/teams/{target.team_slug}/stream",
             f"/teams/{target.team_slug}/runs/{target.run_id}/stream"]
    await asyncio.gather(*(_stream(target, paths[i % 2], stop, stats)
                           for i in range(streams)))


async def _bad_key(target: Target, stats: AttackStats, n: int) -> None:
    """One request with a key that does not exist, on a new connection, as a retrying agent
    with a revoked key sends it."""
    request = (f"POST /api/v1/runs HTTP/1.1\r\nHost: {target.host}:{target.port}\r\n"
               f"Authorization: Bearer gov_{n % 1000:012d}_revoked\r\n"
               "Content-Type: application/json\r\nContent-Length: 2\r\n"
               "Connection: close\r\n\r\n{}").encode()
    try:
        reader, writer = await asyncio.open_connection(target.host, target.port)
    except OSError as exc:
        stats.errors[f"connect: {type(exc).__name__}"] += 1
        return
    stats.opening()
    try:
        writer.write(request)
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), 10)
        stats.answers[status.decode(errors="replace").strip()] += 1
    except (OSError, TimeoutError) as exc:
        stats.errors[f"bad key: {type(exc).__name__}"] += 1
    finally:
        stats.closing()
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def bad_keys(target: Target, stop: asyncio.Event, stats: AttackStats,
                   per_s: int = BAD_KEYS_PER_S) -> None:
    """`per_s` requests a second with bad keys, from the address the valid agents use."""
    started, sent = time.monotonic(), 0
    pending: set[asyncio.Task[None]] = set()
    while not stop.is_set():
        due = started + sent / per_s
        if await _wait(stop, max(0.0, due - time.monotonic())):
            break
        task = asyncio.ensure_future(_bad_key(target, stats, sent))
        pending.add(task)
        task.add_done_callback(pending.discard)
        sent += 1
    if pending:
        await asyncio.wait(pending, timeout=15)


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    request: bytes, timeout: float) -> tuple[str, bytes]:
    """One request on a kept-alive connection: the status line and the body (which the
    server always sends with a Content-Length here: JSON answers)."""
    writer.write(request)
    await writer.drain()
    status = (await asyncio.wait_for(reader.readline(), timeout)).decode(errors="replace")
    if not status:
        raise ConnectionResetError("closed by the server")
    length = 0
    while (line := await asyncio.wait_for(reader.readline(), timeout)) not in (b"\r\n", b""):
        name, _, value = line.decode(errors="replace").partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
    body = await asyncio.wait_for(reader.readexactly(length), timeout) if length else b""
    return status.strip(), body


def _request(target: Target, method: str, path: str, token: str, body: bytes = b"",
             cookie: str = "") -> bytes:
    """An API request with the bearer `token`, or a page's with the session `cookie`."""
    who = f"Cookie: sessionid={cookie}" if cookie else f"Authorization: Bearer {token}"
    return (f"{method} {path} HTTP/1.1\r\nHost: {target.host}:{target.port}\r\n"
            f"{who}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def _get_again(target: Target, stop: asyncio.Event, stats: AttackStats, token: str,
                     path: str, timeout: float, what: str, cookie: str = "") -> None:
    """One client sending GET `path` again as soon as each answer comes (`_send_again`). With
    `cookie`, a signed-in person's page instead of an API call."""
    request = _request(target, "GET", path, token, cookie=cookie)
    await _send_again(target, stop, stats, lambda: request, timeout, what)


async def _send_again(target: Target, stop: asyncio.Event, stats: AttackStats,
                      next_request: Callable[[], bytes], timeout: float, what: str,
                      local_addr: tuple[str, int] | None = None, back_off: bool = True
                      ) -> None:
    """One client sending `next_request()` again as soon as each answer comes, on one
    kept-alive connection (opened again when the server ends it; from `local_addr` if
    given); a refusal (429) backs off a second, as the client does, unless not `back_off`
    (a flood). `stop` ends a request in progress too (a long poll's 30 s)."""
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(
                target.host, target.port, local_addr=local_addr, limit=2**20)
        except OSError as exc:
            stats.errors[f"connect: {type(exc).__name__}"] += 1
            if await _wait(stop, 0.5):
                return
            continue
        stats.opening()
        try:
            while not stop.is_set():
                ask = asyncio.ensure_future(_exchange(reader, writer, next_request(), timeout))
                stopping = asyncio.ensure_future(stop.wait())
                done, _ = await asyncio.wait({ask, stopping},
                                             return_when=asyncio.FIRST_COMPLETED)
                await _cancel(stopping)
                if ask not in done:
                    await _cancel(ask)
                    return
                status, _ = ask.result()
                stats.answers[status] += 1
                if back_off and " 200 " not in status and await _wait(stop, 1.0):
                    return
        except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
            stats.errors[f"{what}: {type(exc).__name__}"] += 1
            stats.closed_by_server += 1
        finally:
            stats.closing()
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def long_polls(target: Target, stop: asyncio.Event, stats: AttackStats,
                     polls: int = LONG_POLLS) -> None:
    """Another team's agents each waiting on its pending approval with `?wait=30`, polling
    again as soon as an answer comes: `polls` waits held open at once, from its keys."""
    if not target.other_tokens or not target.approval_ids:
        raise ValueError("long_polls needs another team's keys and pending approvals")
    await asyncio.gather(*(
        _get_again(target, stop, stats, target.other_tokens[i % len(target.other_tokens)],
                   f"/api/v1/approvals/{target.approval_ids[i % len(target.approval_ids)]}"
                   f"?wait={LONG_POLL_WAIT_S}", LONG_POLL_WAIT_S + 10, "poll")
        for i in range(polls)))


async def _silent(target: Target, stop: asyncio.Event, stats: AttackStats, source: str
                  ) -> None:
    """A connection that never sends a byte; opened again when the server closes it."""
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(target.host, target.port,
                                                           local_addr=(source, 0))
        except OSError as exc:
            stats.errors[f"connect: {type(exc).__name__}"] += 1
            if await _wait(stop, 0.5):
                return
            continue
        stats.opening()
        try:
            reading = asyncio.ensure_future(reader.read(1))
            stopping = asyncio.ensure_future(stop.wait())
            done, _ = await asyncio.wait({reading, stopping},
                                         return_when=asyncio.FIRST_COMPLETED)
            await _cancel(stopping)
            if reading in done:
                stats.closed_by_server += 1
                if await _wait(stop, 0.2):
                    return
            else:
                await _cancel(reading)
        except OSError:
            stats.closed_by_server += 1
        finally:
            stats.closing()
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def idle_connections(target: Target, stop: asyncio.Event, stats: AttackStats,
                           connections: int = IDLE_CONNECTIONS) -> None:
    """Connections that never send a byte, from IDLE_SOURCES loopback addresses other than
    the agents' (127.0.1.x), reopened as the server closes them."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, connections + 1024)), hard))
    sources = [f"127.0.1.{n + 1}" for n in range(IDLE_SOURCES)]
    await asyncio.gather(*(_silent(target, stop, stats, sources[i % len(sources)])
                           for i in range(connections)))


def _small_args(step: int) -> dict[str, Any]:
    return {"n": step}


def _nested_args(step: int) -> dict[str, Any]:
    """About 60 KiB of the dearest JSON a check may carry to parse and walk: 1,000 arrays
    nested 30 deep, new at each step (no loop stop)."""
    leaf: Any = step
    for _ in range(30):
        leaf = [leaf]
    return {"n": step, "deep": [leaf] * 1000}


async def _heavy_agent(target: Target, stop: asyncio.Event, stats: AttackStats, token: str,
                       n: int, args: Callable[[int], dict[str, Any]] = _small_args) -> None:
    """One agent of the other team: a run, checks with new args each time (no loop stop)
    until the run stops, then another run; on one kept-alive connection."""
    try:
        reader, writer = await asyncio.open_connection(target.host, target.port)
    except OSError as exc:
        stats.errors[f"connect: {type(exc).__name__}"] += 1
        return
    stats.opening()
    try:
        step = 0
        while not stop.is_set():
            status, body = await _exchange(reader, writer, _request(
                target, "POST", "/api/v1/runs", token,
                json.dumps({"agent": f"heavy-{n}"}).encode()), 10)
            stats.answers[status] += 1
            if " 201 " not in status:
                if await _wait(stop, 1.0):
                    return
                continue
            run = json.loads(body)["run_id"]
            while not stop.is_set():
                step += 1
                check = json.dumps({"action": {"name": f"tool{step % 50}.call",
                                               "args": args(step)}},
                                   separators=(",", ":")).encode()
                status, body = await _exchange(reader, writer, _request(
                    target, "POST", f"/api/v1/runs/{run}/check", token, check), 10)
                stats.answers[status] += 1
                if " 200 " not in status or json.loads(body)["decision"] == "stop":
                    break
    except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
        stats.errors[f"heavy: {type(exc).__name__}"] += 1
    finally:
        stats.closing()
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def heavy_rate_limits(target: Target, stop: asyncio.Event, stats: AttackStats,
                            agents: int = HEAVY_RATE_AGENTS) -> None:
    """Another team's agents checking as fast as they can under a policy of 50 rate-limit
    rules that match every action (SPEC 10: a check's rate-limit cost does not grow with the
    hits in the window, nor may it slow another team's checks)."""
    if not target.other_tokens:
        raise ValueError("heavy_rate_limits needs another team's key")
    await asyncio.gather(*(_heavy_agent(target, stop, stats, target.other_tokens[0], n)
                           for n in range(agents)))


async def heavy_args(target: Target, stop: asyncio.Event, stats: AttackStats,
                     agents: int = HEAVY_ARGS_AGENTS) -> None:
    """Another team's agents checking as fast as they are answered, each check's args 1,000
    arrays nested 30 deep (60 KiB: tens of ms to parse and walk where a check takes one;
    SPEC 10: no tenant's checks raise another team's check p99 beyond 2x)."""
    if not target.other_tokens:
        raise ValueError("heavy_args needs another team's key")
    await asyncio.gather(*(_heavy_agent(target, stop, stats, target.other_tokens[0], n,
                                        _nested_args)
                           for n in range(agents)))


async def heavy_reads(target: Target, stop: asyncio.Event, stats: AttackStats,
                      readers: int = HEAVY_READERS) -> None:
    """Another team's keys reading, over and over, the most decisions a page gives of its run
    whose every decision carries the most arguments a check may (SPEC 10: no tenant's reads
    raise another team's check p99 beyond 2x)."""
    if not target.other_tokens or not target.other_run_id:
        raise ValueError("heavy_reads needs another team's keys and its run")
    path = f"/api/v1/runs/{target.other_run_id}/decisions?limit=1000"
    await asyncio.gather(*(_get_again(target, stop, stats,
                                      target.other_tokens[i % len(target.other_tokens)],
                                      path, 30, "read")
                           for i in range(readers)))


async def heavy_pages(target: Target, stop: asyncio.Event, stats: AttackStats,
                      viewers: int = HEAVY_PAGE_VIEWERS) -> None:
    """Another team's viewers loading, over and over, its audit page at its heaviest: 50
    policy versions, each diffed on the page (SPEC 10: no tenant's pages raise another
    team's check p99 beyond 2x)."""
    if not target.other_team_slug or not target.other_session_cookie:
        raise ValueError("heavy_pages needs another team and a viewer of it")
    path = f"/teams/{target.other_team_slug}/audit/"
    await asyncio.gather(*(_get_again(target, stop, stats, "", path, 60, "page",
                                      cookie=target.other_session_cookie)
                           for _ in range(viewers)))


async def account_guesses(target: Target, stop: asyncio.Event, stats: AttackStats,
                          guessers: int = ACCOUNT_GUESSERS) -> None:
    """Clients of one address signing in as another team's people with wrong passwords, each
    username in turn (their team's admin made them): past the address's bound an unknown
    username costs no hash, but a real account's does, each (address, username) bucket
    allowing 10 a window (SPEC 10: failed authentications never slow another team's
    checks). A refusal (429) backs off a second, as a script would."""
    if not target.other_usernames:
        raise ValueError("account_guesses needs another team's usernames")
    names = target.other_usernames
    await asyncio.gather(*(_guess_again(target, stop, stats, names[i::guessers] + names[:i])
                           for i in range(guessers)))


async def _guess_again(target: Target, stop: asyncio.Event, stats: AttackStats,
                       usernames: list[str]) -> None:
    # The CSRF check takes its cookie's secret sent back as the form's token (Django 4.1+).
    secret = "guess" * 6 + "xy"
    turns = itertools.count()

    def next_guess() -> bytes:
        turn = next(turns)
        body = (f"username={usernames[turn % len(usernames)]}&password=wrong-{turn + 1}"
                f"&csrfmiddlewaretoken={secret}").encode()
        return (f"POST /accounts/login/ HTTP/1.1\r\nHost: {target.host}:{target.port}\r\n"
                f"Cookie: csrftoken={secret}\r\n"
                "Content-Type: application/x-www-form-urlencoded\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode() + body

    await _send_again(target, stop, stats, next_guess, 30, "sign-in",
                      local_addr=(ACCOUNT_GUESS_SOURCE, 0))


async def _flood(target: Target, stop: asyncio.Event, stats: AttackStats,
                 next_request: Callable[[], bytes], what: str) -> None:
    """FLOOD_CONNECTIONS kept-alive connections from FLOOD_SOURCE, each sending
    `next_request()` as soon as its last answer came, whatever it was (no back-off)."""
    await asyncio.gather(*(_send_again(target, stop, stats, next_request, 30, what,
                                       local_addr=(FLOOD_SOURCE, 0), back_off=False)
                           for _ in range(FLOOD_CONNECTIONS)))


def _unknown_run_check(target: Target, token: str) -> bytes:
    """A check of a run that does not exist (a new id each time) with bearer `token`."""
    return _request(target, "POST", f"/api/v1/runs/{uuid.uuid4()}/check", token,
                    b'{"action": {"name": "search.docs", "args": {}}}')


async def bad_key_flood(target: Target, stop: asyncio.Event, stats: AttackStats) -> None:
    """Checks with a new random key each (a key's shape, found by nobody: 401), from one
    address on a few kept-alive connections, as fast as they are answered (SPEC 10: failed
    authentications from one address never slow another team's checks)."""
    await _flood(target, stop, stats, lambda: _unknown_run_check(
        target, f"gov_{os.urandom(6).hex()}_{os.urandom(16).hex()}"), "bad key")


async def repeated_key_flood(target: Target, stop: asyncio.Event, stats: AttackStats) -> None:
    """`bad_key_flood` with one bad key over and over: 401, then 429 too_many_failures."""
    key = f"gov_{os.urandom(6).hex()}_{os.urandom(16).hex()}"
    await _flood(target, stop, stats, lambda: _unknown_run_check(target, key), "repeated key")


async def unknown_run_flood(target: Target, stop: asyncio.Event, stats: AttackStats) -> None:
    """Another team's valid key checking runs that do not exist (404), as `bad_key_flood`."""
    if not target.other_tokens:
        raise ValueError("unknown_run_flood needs another team's key")
    token = target.other_tokens[0]
    await _flood(target, stop, stats, lambda: _unknown_run_check(target, token), "unknown run")


async def probe_flood(target: Target, stop: asyncio.Event, stats: AttackStats) -> None:
    """`GET /healthz` without a credential, as `bad_key_flood`."""
    request = (f"GET /healthz HTTP/1.1\r\nHost: {target.host}:{target.port}\r\n"
               "\r\n").encode()
    await _flood(target, stop, stats, lambda: request, "probe")


async def together(target: Target, stop: asyncio.Event, stats: AttackStats) -> None:
    """Every attack above at once."""
    await asyncio.gather(slow_bodies(target, stop, stats),
                         unfinished_headers(target, stop, stats),
                         open_streams(target, stop, stats),
                         bad_keys(target, stop, stats))


async def _no_clients(target: Target, stop: asyncio.Event, stats: AttackStats) -> None:
    """The Redis faults send nothing: the fault is the server's Redis (`REDIS_FAULTS`)."""
    await stop.wait()


# The benchmark measures each entry.
ATTACKS: dict[str, Attack] = {
    "slow_bodies": slow_bodies,
    "unfinished_headers": unfinished_headers,
    "open_streams": open_streams,
    "bad_keys": bad_keys,
    "together": together,
    "long_polls": long_polls,
    "idle_connections": idle_connections,
    "heavy_rate_limits": heavy_rate_limits,
    "heavy_args": heavy_args,
    "heavy_reads": heavy_reads,
    "heavy_pages": heavy_pages,
    "account_guesses": account_guesses,
    "bad_key_flood": bad_key_flood,
    "repeated_key_flood": repeated_key_flood,
    "unknown_run_flood": unknown_run_flood,
    "probe_flood": probe_flood,
    "redis_refused": _no_clients,
    "redis_hung": _no_clients,
}


_HUNG_LISTENER = """
import socket, sys
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
sock.listen(512)
print(sock.getsockname()[1], flush=True)
held = []
while True:
    held.append(sock.accept()[0])
"""


class HungRedis:
    """A loopback port that accepts connections and never answers: a Redis that hangs (a
    frozen process behind a live kernel). It runs in a process of its own: in the load
    generator's, its accepting thread would compete with the agents for the interpreter."""

    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", _HUNG_LISTENER],
                                        stdout=subprocess.PIPE)
        assert self.process.stdout is not None
        self.port = int(self.process.stdout.readline())

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


def refused_redis_url() -> str:
    """A Redis URL whose port nothing listens on: every connection is refused at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"


# Attacks that are a fault of the server's Redis: the phase starts a second server of the
# same shape against it, and alternates its slices with the healthy server's.
REDIS_FAULTS = ("redis_refused", "redis_hung")


@contextlib.contextmanager
def running(attack: Attack, target: Target, *, settle: float = 1.0
            ) -> Iterator[AttackStats]:
    """Run `attack` while the block runs (`settle` seconds first, so its connections are
    open), then stop it and wait for it to close them all.

    The attack runs in a process of its own (`python -m bench.attacks`), which reports its
    figures four times a second into the `AttackStats` yielded: inside the process that
    measures the valid checks, its hundreds of connections would compete with the measuring
    client for the interpreter, and a slow client would read as a slow server."""
    name = next(n for n, a in ATTACKS.items() if a is attack)
    stats = AttackStats()
    spec = json.dumps({"attack": name, "target": dataclasses.asdict(target)})
    process = subprocess.Popen([sys.executable, "-m", "bench.attacks", spec],
                               cwd=Path(__file__).resolve().parents[1], text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert process.stdin is not None and process.stdout is not None
    failed: list[str] = []

    def read(lines: IO[str]) -> None:
        for line in lines:
            data = json.loads(line)
            if "failed" in data:
                failed.append(data["failed"])
            else:
                stats.load(data)

    reader = threading.Thread(target=read, args=(process.stdout,), daemon=True)
    reader.start()
    try:
        time.sleep(settle)
        yield stats
    finally:
        process.stdin.close()  # the child's signal to stop
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        reader.join(5)
    if failed:
        raise RuntimeError(f"the attack failed: {failed[0]}")


def _child(spec: str) -> None:
    """`python -m bench.attacks SPEC`: run one attack until stdin closes, printing its
    figures as JSON lines."""
    data = json.loads(spec)
    attack, target = ATTACKS[data["attack"]], Target(**data["target"])
    stats = AttackStats()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    def watch_stdin() -> None:
        sys.stdin.read()
        with contextlib.suppress(RuntimeError):  # the loop is closed already
            loop.call_soon_threadsafe(stop.set)

    async def report() -> None:
        while not await _wait(stop, 0.25):
            print(json.dumps(stats.dump()), flush=True)

    async def main() -> None:
        await asyncio.gather(attack(target, stop, stats), report())

    threading.Thread(target=watch_stdin, daemon=True).start()
    try:
        loop.run_until_complete(main())
    except Exception as exc:  # reported to the parent, which raises it
        print(json.dumps({"failed": repr(exc)}), flush=True)
    print(json.dumps(stats.dump()), flush=True)


if __name__ == "__main__":
    _child(sys.argv[1])
