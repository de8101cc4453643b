"""Server-sent event streams for the live screens.

A stream is a *source* (what a screen shows, rendered from the database) pumped by a loop that
looks again whenever `runs.events.wakeups` says the team changed, and at least every
``DASHBOARD_STREAM_LOOK_S`` seconds anyway, so a lost wake-up (Redis down, or another process
without Redis) costs at most that delay. Only what changed is sent.

Streams have a bounded lifetime (``DASHBOARD_STREAM_SECONDS``): under WSGI each one holds a
server thread, so it ends and the browser's EventSource reconnects after ``retry`` ms,
sending ``Last-Event-ID`` (the last decision id it received) so nothing is missed or repeated.

Django buffers a sync iterator entirely under ASGI and an async one under WSGI, so the view
hands out the same loop either directly (WSGI) or driven from one dedicated thread (ASGI).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.core.handlers.asgi import ASGIRequest
from django.db import DatabaseError, close_old_connections, connections
from django.http import HttpRequest, StreamingHttpResponse
from django.template.loader import render_to_string

from policies.models import Team
from runs.check.abandon import abandon_if_idle
from runs.dashboard.presenters import overview_context, run_context, runs_list_context, step_row
from runs.dashboard.selectors import RunFilters, timeline
from runs.live.events import wakeups
from runs.models import Run

log = logging.getLogger(__name__)

RETRY_MS = 1000
KEEPALIVE_S = 5.0


@dataclass(frozen=True)
class Frame:
    event: str
    data: str
    id: int | None = None


def encode(frame: Frame) -> str:
    lines = [f"event: {frame.event}"]
    if frame.id is not None:
        lines.append(f"id: {frame.id}")
    # A data field cannot hold a newline: each line of the HTML is its own data line, which
    # the browser joins back with "\n".
    lines += [f"data: {line}" for line in (frame.data.splitlines() or [""])]
    return "\n".join(lines) + "\n\n"


@dataclass
class Partials:
    """Remembers what each named partial last sent, so only changed HTML goes out."""

    sent: dict[str, str] = field(default_factory=dict)

    def changed(self, rendered: dict[str, str]) -> list[Frame]:
        frames = []
        for name, html in rendered.items():
            digest = hashlib.sha1(html.encode()).hexdigest()
            if self.sent.get(name) != digest:
                self.sent[name] = digest
                frames.append(Frame(name, html))
        return frames


class Source(ABC):
    """What one screen streams. ``frames`` returns what changed since its last call."""

    team_id: int

    @abstractmethod
    def frames(self) -> list[Frame]: ...

    def finished(self) -> bool:
        """True when nothing on the screen can change any more: the stream says "end"."""
        return False


def pump(source: Source, *, lifetime: float | None = None, stop: threading.Event | None = None
         ) -> Iterator[str]:
    """The stream as text chunks. Blocking; ends after ``lifetime`` seconds."""
    lifetime = settings.DASHBOARD_STREAM_SECONDS if lifetime is None else lifetime
    look_every = settings.DASHBOARD_STREAM_LOOK_S
    yield f"retry: {RETRY_MS}\n\n"
    last_look = last_write = time.monotonic()
    chunk = _look(source)
    if chunk:
        yield chunk
    if source.finished():
        yield encode(Frame("end", ""))
        return
    for changed in wakeups(source.team_id, poll=min(1.0, look_every), lifetime=lifetime):
        if stop is not None and stop.is_set():
            return
        now = time.monotonic()
        if changed or now - last_look >= look_every:
            last_look = now
            chunk = _look(source)
            if chunk:
                last_write = now
                yield chunk
            if source.finished():
                yield encode(Frame("end", ""))
                return
        if now - last_write >= KEEPALIVE_S:
            # A comment line: EventSource ignores it, and writing it is how a WSGI server
            # notices a browser that went away, which frees this thread early.
            last_write = now
            yield ": keep-alive\n\n"


def _look(source: Source) -> str:
    try:
        return "".join(encode(f) for f in source.frames())
    except DatabaseError:
        # The database blinked: keep the stream, say nothing, look again next time.
        log.warning("live stream could not read the database", exc_info=True)
        close_old_connections()
        return ""


async def apump(source: Source) -> AsyncIterator[str]:
    """`pump` for ASGI: the blocking loop runs in one thread of its own, so its database
    connection stays in that thread and is closed there when the stream ends."""
    loop = asyncio.get_running_loop()
    stop = threading.Event()
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sse")
    chunks = pump(source, stop=stop)
    done = object()
    try:
        while True:
            chunk = await loop.run_in_executor(executor, next, chunks, done)
            if chunk is done:
                return
            yield chunk  # type: ignore[misc]
    finally:
        stop.set()
        # Close the generator and the thread's database connections in that same thread.
        await loop.run_in_executor(executor, _close, chunks)
        executor.shutdown(wait=False)


def _close(chunks: Iterator[str]) -> None:
    try:
        chunks.close()  # type: ignore[attr-defined]
    finally:
        connections.close_all()


def sse_response(request: HttpRequest, source: Source) -> StreamingHttpResponse:
    content: Any = apump(source) if isinstance(request, ASGIRequest) else pump(source)
    response = StreamingHttpResponse(content, content_type="text/event-stream")
    response["Cache-Control"] = "no-cache, no-store"
    response["X-Accel-Buffering"] = "no"  # a proxy must not hold events back
    return response


def last_event_id(request: HttpRequest) -> int:
    """Where a stream resumes: the browser's ``Last-Event-ID`` on a reconnect, else the
    ``after`` the page was rendered with."""
    for raw in (request.headers.get("Last-Event-ID"), request.GET.get("after")):
        if raw:
            try:
                return max(0, int(raw))
            except ValueError:
                continue
    return 0


# --- The three live screens --------------------------------------------------------------------

class RunSource(Source):
    """The run page: new timeline rows (with their decision id as the event id) and the
    header, counters and stop banner whenever they change."""

    def __init__(self, request: HttpRequest, team: Team, run_id: Any, after: int):
        self.request, self.team, self.team_id = request, team, team.pk
        self.run_id, self.after = run_id, after
        self.partials = Partials()
        self._finished = False

    def frames(self) -> list[Frame]:
        run = Run.objects.select_related("policy_version__policy").filter(
            team=self.team, pk=self.run_id
        ).first()
        if run is None:  # deleted by retention while watched
            self._finished = True
            return []
        run = abandon_if_idle(run)  # SPEC 14: a watched run past its deadline ends on screen
        frames = []
        for decision in timeline(run, after=self.after):
            html = render_to_string("runs/_step_row.html", {"row": step_row(decision)},
                                    request=self.request)
            frames.append(Frame("step", html, id=decision.pk))
            self.after = decision.pk
        context = {**run_context(run), "team": self.team}
        frames += self.partials.changed({
            name: render_to_string(f"runs/_{name.replace('-', '_')}.html", context,
                                   request=self.request)
            for name in ("run-header", "run-counters", "run-banner")
        })
        self._finished = run.finished_at is not None
        return frames

    def finished(self) -> bool:
        return self._finished


class OverviewSource(Source):
    def __init__(self, request: HttpRequest, team: Team):
        self.request, self.team, self.team_id = request, team, team.pk
        self.partials = Partials()

    def frames(self) -> list[Frame]:
        context = overview_context(self.team)
        return self.partials.changed({
            name: render_to_string(f"runs/_{name.replace('-', '_')}.html", context,
                                   request=self.request)
            for name in ("overview-running", "overview-chart", "overview-switches",
                         "overview-loops", "overview-rate-limited")
        })


class RunsListSource(Source):
    def __init__(self, request: HttpRequest, team: Team, filters: RunFilters):
        self.request, self.team, self.team_id = request, team, team.pk
        self.filters = filters
        self.partials = Partials()

    def frames(self) -> list[Frame]:
        context = runs_list_context(self.team, self.filters)
        return self.partials.changed({
            "runs-table": render_to_string("runs/_runs_table.html", context,
                                           request=self.request)
        })
