"""Server-sent event streams for the live screens.

A stream is a *source* (what a screen shows, rendered from the database) pumped by a loop that
looks again whenever `runs.live.events.wakeups` says the team changed, and at least every
``DASHBOARD_STREAM_LOOK_S`` seconds anyway, so a lost wake-up (Redis down, or another process
without Redis) costs at most that delay. Only what changed is sent.

Each look of a source lets runs/first_look.py settle what is due first, as the page's view
does, then renders through the presenters, which change nothing.

Streams have a bounded lifetime (``DASHBOARD_STREAM_SECONDS``): it ends and the browser's
EventSource reconnects after ``retry`` ms, sending ``Last-Event-ID`` (the last decision id it
received) so nothing is missed or repeated, and is authorized again.

Under `manage.py serve` (ASGI) a stream is `apump`: it waits on the event loop, holding no
thread, and its looks at the database go through the process's one look lane
(runs/live/looks.py, `look_lane` here), whose share of the process's time is bounded however
many streams are open (docs/serving.md). Under WSGI (Django's test client, `runserver`) it is
the blocking `pump`: Django buffers a sync iterator entirely under ASGI and an async one under
WSGI, so each interface gets its own. Both drive one loop (`_loop`): what to send and when
to look is written once; the two only wait, each its own way.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from django.conf import settings
from django.core.handlers.asgi import ASGIRequest
from django.db import DatabaseError, close_old_connections
from django.http import HttpRequest, HttpResponse, HttpResponseBase, StreamingHttpResponse
from django.middleware.csrf import get_token
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils import timezone

from governance.deadlines import read_deadline
from policies.access import controls, session_sees_team
from policies.models import Team
from runs import first_look
from runs.approvals.selectors import approvals_shown_key, pending_count
from runs.dashboard.presenters import (
    APPROVALS_SHOWN,
    approvals_context,
    killswitch_context,
    overview_context,
    run_approval_context,
    run_context,
    runs_list_context,
    step_row,
)
from runs.dashboard.selectors import (
    DEFAULT_RANGE,
    RunFilters,
    timeline,
    timelines,
    with_children,
)
from runs.killswitch.selectors import engaged_ids_for_team
from runs.live import looks
from runs.live.events import Changes, awakeups, wakeups
from runs.models import Decision, Run, RunStatus

log = logging.getLogger(__name__)

RETRY_MS = 1000
KEEPALIVE_S = 5.0
# How often at most a stream's look asks again whether its viewer still sees the team (the
# session still signed in, the account active, a member): a stream opened by a member went
# on sending the team's steps, args included, until its lifetime's end after the member was
# removed, signed out or deactivated (found by an attacker: 60 s). Ended, the browser's
# reconnect meets the page's own refusal.
VIEWER_LOOK_S = 5.0
# (session key, team slug) -> (when this process last asked, the answer): asked once per
# viewer and team every VIEWER_LOOK_S, whatever the number of that viewer's open streams.
# Asked by each stream, it was 3 to 4 queries per page every 5 s: 1,000 open pages, 800
# queries a second on the look lane whose batched step looks make 7 for 100 pages
# (docs/performance.md, "Live pages at scale"). Emptied when it holds VIEWERS_KEPT.
_viewers_seen: dict[tuple[str, str], tuple[float, bool]] = {}
VIEWERS_KEPT = 10_000


def _viewer_sees(session_key: str, slug: str) -> bool:
    """`session_sees_team`, its answer kept VIEWER_LOOK_S for every stream of the viewer."""
    now = time.monotonic()
    seen = _viewers_seen.get((session_key, slug))
    if seen is not None and now - seen[0] < VIEWER_LOOK_S:
        return seen[1]
    sees = session_sees_team(session_key, slug)
    if len(_viewers_seen) >= VIEWERS_KEPT:
        _viewers_seen.clear()
    _viewers_seen[(session_key, slug)] = (now, sees)
    return sees


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
    """What one screen streams. ``frames`` returns what changed since its last call.

    Besides its own partials, every source streams the layout's live parts (the kill switch
    banner with its release forms) as the ``chrome`` event, whose HTML swaps out of band
    into the banner's slot, so a control never outlives the state that offered it.
    """

    request: HttpRequest
    team: Team
    team_id: int
    page_path: str  # the page the stream serves: where the banner's forms come back to
    partials: Partials

    #: Set by a look that found the viewer no longer sees the team: the stream ends.
    shut: bool = False

    @abstractmethod
    def frames(self) -> list[Frame]: ...

    def viewer_still_sees(self) -> bool:
        """Whether the stream's viewer still sees the team, asked again at most every
        VIEWER_LOOK_S for all of that viewer's streams (`_viewer_sees`): the session still
        signed in as an active member of the team, as `session_sees_team` asks for the
        pacing. A source without a request or a session (a test's) is not asked."""
        session = getattr(getattr(self, "request", None), "session", None)
        key = getattr(session, "session_key", None)
        if key is not None and not self.shut and not _viewer_sees(key, self.team.slug):
            self.shut = True
        return not self.shut

    def layout(self) -> dict[str, Any]:
        """What the page layout gives every template: the team and what the role may do."""
        role = getattr(self.request, "role", None)
        # One CSRF token for the whole stream: Django masks the token afresh on every render,
        # which would make every look a change and re-send (and re-swap) every form.
        if getattr(self, "_csrf_token", None) is None:
            self._csrf_token = get_token(self.request)
        return {"team": self.team, "role": role, **controls(role), "page_path": self.page_path,
                "live": True, "csrf_token": self._csrf_token}

    def render(self, names: tuple[str, ...], context: dict[str, Any], *, chrome: bool = True
               ) -> list[Frame]:
        """The changed ones of these live partials (``run-header`` is runs/_run_header.html),
        plus the layout's chrome (unless ``chrome`` is False)."""
        context = {**context, **self.layout()}
        rendered = {
            name: render_to_string(f"runs/_{name.replace('-', '_')}.html", context,
                                   request=self.request)
            for name in names
        }
        if not chrome:
            return self.partials.changed(rendered)
        rendered["chrome"] = render_to_string("runs/_killswitch_banner.html",
                                              {**context, "oob": True}, request=self.request)
        # The navigation's count of pending approvals (SPEC 11), an out-of-band swap too.
        rendered["approvals-count"] = render_to_string(
            "runs/_approvals_count.html", {"approvals_pending": pending_count(self.team)},
            request=self.request)
        return self.partials.changed(rendered)

    def finished(self) -> bool:
        """True when nothing on the screen can change any more: the stream says "end"."""
        return False

    def resume_id(self) -> str | None:
        """The event id a look that sent something ends with (an id-only message: the browser
        keeps it as its last event id and sends it back when it reconnects), or None."""
        return None

    def concerned(self, changes: Changes) -> bool:
        """Whether a change of the team (the runs that changed, or None for anything) can
        change this screen: a look is spent only then (or on the periodic look)."""
        return changes is None or bool(changes)

    def watched_run(self) -> str | None:
        """The one run whose changes (and the team-wide ones) this screen waits for, or None
        for every change of the team (`runs.live.events.awakeups`)."""
        return None


class _Look:
    """The loop asks for a look at the database: the driver sends back its text, or None when
    no look came in time (the stream ends)."""


class _Wake:
    """The loop asks for the next wake-up: the driver sends back whether the screen may have
    changed, or None when the stream's lifetime is over."""


LOOK, WAKE = _Look(), _Wake()


def _loop(source: Source) -> Generator[str | _Look | _Wake, str | bool | None, None]:
    """The stream loop, written once for `pump` and `apump`, which only do its waiting (a
    thread's, or the event loop's): it yields the chunks to send, and LOOK or WAKE where it
    needs a look or the next wake-up. A look is spent when the screen may have changed, or
    every ``DASHBOARD_STREAM_LOOK_S`` anyway; a comment goes out after ``KEEPALIVE_S`` of
    silence."""
    look_every = settings.DASHBOARD_STREAM_LOOK_S
    yield f"retry: {RETRY_MS}\n\n"
    chunk = yield LOOK
    if chunk is None or getattr(source, "shut", False):
        return
    last_look = last_write = time.monotonic()
    if chunk:
        yield str(chunk)
    if source.finished():
        yield encode(Frame("end", ""))
        return
    while (concerned := (yield WAKE)) is not None:
        now = time.monotonic()
        if concerned or now - last_look >= look_every:
            chunk = yield LOOK
            if chunk is None or getattr(source, "shut", False):
                return
            last_look = now = time.monotonic()
            if chunk:
                last_write = now
                yield str(chunk)
            if source.finished():
                yield encode(Frame("end", ""))
                return
        if now - last_write >= KEEPALIVE_S:
            # A comment line: EventSource ignores it, and writing it is how a WSGI server
            # notices a browser that went away, which frees its thread early.
            last_write = now
            yield ": keep-alive\n\n"


def pump(source: Source, *, lifetime: float | None = None, stop: threading.Event | None = None
         ) -> Iterator[str]:
    """The stream as text chunks (`_loop`). Blocking; ends after ``lifetime`` seconds."""
    lifetime = settings.DASHBOARD_STREAM_SECONDS if lifetime is None else lifetime
    poll = min(1.0, settings.DASHBOARD_STREAM_LOOK_S)
    wakes = wakeups(source.team_id, poll=poll, lifetime=lifetime)
    loop = _loop(source)
    reply: str | bool | None = None
    while True:
        try:
            step = loop.send(reply)
        except StopIteration:
            return
        reply = None
        if step is LOOK:
            reply = _look(source)
        elif step is WAKE:
            reply = next(wakes, None)  # True when the team may have changed
            if stop is not None and stop.is_set():
                return
        else:
            yield str(step)


def _look(source: Source, frames: Callable[[], list[Frame]] | None = None) -> str:
    """The text of a look at ``source`` (``frames`` if given, else its `frames`)."""
    try:
        # Within the dashboard's read deadline (governance/deadlines.py): on the look lane
        # it is the lane's; under WSGI, this thread's.
        with read_deadline():
            if not source.viewer_still_sees():
                return ""  # nothing more of the team: the stream ends (`_loop`)
            text = "".join(encode(f) for f in (frames or source.frames)())
    except DatabaseError:
        # The database blinked, or a read took longer than its deadline: keep the stream,
        # say nothing, look again next time.
        log.warning("live stream could not read the database", exc_info=True)
        close_old_connections()
        return ""
    resume = source.resume_id() if text else None
    return text + f"id: {resume}\n\n" if resume else text


class LookLane:
    """The streams' looks at the database (`_look`) on a look lane (runs/live/looks.py):
    the process's one, which the approvals' long polls share, or a lane of its own."""

    def __init__(self, lane: looks.LookLane | None = None) -> None:
        self.lane = lane if lane is not None else looks.LookLane()

    async def look(self, source: Source, viewer: Any) -> str:
        if isinstance(source, RunSource) and source.step_look_due():
            # Served with the other run pages' step looks waiting then (`_step_looks`).
            return str(await self.lane.run(source, viewer, together=_step_looks))
        return str(await self.lane.run(partial(_look, source), viewer))


look_lane = LookLane(looks.look_lane)


# The streams one viewer holds open in this process (SPEC 10: a connection is every team's;
# found by an attacker, one viewer's 250 streams at a lowered connection cap left another
# team's agents with no answer). Past DASHBOARD_STREAMS_PER_VIEWER a stream is refused,
# telling the browser to come back in a minute. Only the event loop touches it.
_open_streams: dict[Any, int] = {}
REFUSED_RETRY_MS = 60_000
# A refused stream is held this long, looking at nothing, before it ends: a client that
# ignores `retry` and reconnects at once (the benchmark's open_streams attack, 100 streams of
# one viewer) made 300 sign-ins a second when it ended at once, each a session read on the
# dashboard's pool, and another team's checks' p99 went 3.6x. Held, such a client costs one
# request per connection every REFUSED_HOLD_S; a browser waits its minute either way.
REFUSED_HOLD_S = 10.0


async def apump(source: Source, *, viewer: Any = None, lifetime: float | None = None
                ) -> AsyncIterator[str]:
    """`pump` for ASGI: waits on the event loop (no thread) and looks at the database through
    the process's `look_lane`, in `viewer`'s turn; at most DASHBOARD_STREAMS_PER_VIEWER of a
    viewer's at once (`_open_streams`)."""
    if viewer is not None and \
            _open_streams.get(viewer, 0) >= settings.DASHBOARD_STREAMS_PER_VIEWER:
        yield (f"retry: {REFUSED_RETRY_MS}\nevent: refused\ndata: too many live views are "
               "open for this account: this one is paused\n\n")
        await asyncio.sleep(REFUSED_HOLD_S)
        return
    if viewer is not None:
        _open_streams[viewer] = _open_streams.get(viewer, 0) + 1
    try:
        async for event in _apump(source, viewer=viewer, lifetime=lifetime):
            yield event
    finally:
        if viewer is not None:
            left = _open_streams.pop(viewer, 1) - 1
            if left > 0:
                _open_streams[viewer] = left


async def _apump(source: Source, *, viewer: Any, lifetime: float | None
                 ) -> AsyncIterator[str]:
    lifetime = settings.DASHBOARD_STREAM_SECONDS if lifetime is None else lifetime
    end_at = time.monotonic() + lifetime
    poll = min(1.0, settings.DASHBOARD_STREAM_LOOK_S)

    async def look() -> str | None:
        # A look still waiting for its turn when the lifetime is over ends the stream; the
        # browser reconnects and resumes (Last-Event-ID), as at any end.
        try:
            return await asyncio.wait_for(look_lane.look(source, viewer),
                                          max(0.0, end_at - time.monotonic()))
        except TimeoutError:
            return None

    wakes: AsyncGenerator[Changes, None] | None = None
    loop = _loop(source)
    reply: str | bool | None = None
    try:
        while True:
            try:
                step = loop.send(reply)
            except StopIteration:
                return
            reply = None
            if step is LOOK:
                reply = await look()
            elif step is WAKE:
                # Listens from the first wait on, for what is left of the lifetime.
                if wakes is None:
                    wakes = awakeups(source.team_id, poll=poll, lifetime=end_at - time.monotonic(),
                                     run_id=_watched_run(source))
                # One wake-up (None is one too: "anything changed"); none left leaves reply None.
                async for changes in wakes:
                    reply = source.concerned(changes)
                    break
            else:
                yield str(step)
    finally:
        if wakes is not None:
            await wakes.aclose()  # the stream's watch ends with it, not at a garbage collection


def _watched_run(source: Any) -> str | None:
    # A source that does not say (a test's) waits for every change of its team.
    watched = getattr(source, "watched_run", None)
    return watched() if watched is not None else None


def sse_response(request: HttpRequest, source: Source) -> HttpResponseBase:
    if request.method == "HEAD":
        # The headers a GET would get, and no stream: a HEAD has no body to wait for, yet
        # WSGI servers iterate the body anyway, which held a thread for the stream's lifetime.
        response: HttpResponse = HttpResponse(content_type="text/event-stream")
        response["Cache-Control"] = "no-cache, no-store"
        return response
    if isinstance(request, ASGIRequest):
        # Viewers take turns for the database looks: by user, else by session.
        viewer = getattr(request.user, "pk", None) or request.COOKIES.get("sessionid")
        content: Any = apump(source, viewer=viewer)
    else:
        content = pump(source)
    stream = StreamingHttpResponse(content, content_type="text/event-stream")
    stream["Cache-Control"] = "no-cache, no-store"
    stream["X-Accel-Buffering"] = "no"  # a proxy must not hold events back
    return stream


def resume_point(request: HttpRequest) -> tuple[int, str]:
    """Where a stream resumes: the browser's ``Last-Event-ID`` on a reconnect, else the
    ``after`` the page was rendered with (live.js keeps it up to date). Either is a decision
    id, or ``<decision id>~<page state>`` (`RunSource.resume_id`): the decision id and the
    state the page showed, or "" when it does not say."""
    for raw in (request.headers.get("Last-Event-ID"), request.GET.get("after")):
        if raw:
            after, _, seen = raw.partition("~")
            try:
                return max(0, int(after)), seen[:PAGE_STATE_CHARS]
            except ValueError:
                continue
    return 0, ""


# --- The live screens ---------------------------------------------------------------------------

PAGE_STATE_CHARS = 16


class RunSource(Source):
    """The run page: new timeline rows (with their decision id as the event id) and the
    header, counters and stop banner whenever they change.

    Most looks are *step looks*: the run's new rows and its counters (and its header in
    shadow mode, which counts would-stops), all a check of a running run changes. Those of
    many pages are served together (`_step_looks`: a few queries for up to a hundred pages).
    A *full look* also settles what is due and renders the run's tree, controls, approval
    banner and the layout's team-wide parts. It is taken when a step look finds it due: the
    first look, the one after a team-wide change (a kill switch), whenever the run is not
    running, its status changed, it waits for an approval, its deadline passed, its first
    child started, or the team's engaged switches are not those its banner shows (a lost
    team-wide wake-up); and, as a backstop, every ``DASHBOARD_STREAM_FULL_LOOK_S`` seconds.
    The periodic look of every ``DASHBOARD_STREAM_LOOK_S`` seconds is a step look
    otherwise.

    A stream's first look is a full one, unless the stream resumes one that ended: each
    look that sent something ends with the event id ``<after>~<page state>`` (`resume_id`),
    a digest of what the full looks' parts were rendered from, which the browser sends back
    on its reconnect. When the run's state read then has the same digest, the page already
    shows those parts and the first look is a step look: a page's reconnect, once every
    ``DASHBOARD_STREAM_SECONDS``, no longer costs a full look. A digest that does not match
    (or a made-up one) costs a full look, as before; it can only ever skip re-sending what
    this viewer's page was already sent."""

    def __init__(self, request: HttpRequest, team: Team, run_id: Any, after: int, *,
                 flagged: bool = False, seen: str = "", gap: bool = False):
        self.request, self.team, self.team_id = request, team, team.pk
        self.run_id, self.after, self.flagged = run_id, after, flagged
        # The stream starts later than the page asked (`selectors.resume_floor`): its first
        # rows follow a row saying that steps were left out.
        self._gap = gap
        self.page_path = reverse("runs:run", args=[team.slug, run_id])
        self.partials = Partials()
        self._finished = False
        self._full_due = True  # the first look is a full one
        self._full_at = 0.0
        self._state: tuple[str, bool] = ("", False)  # status, waiting: at the last look
        # The run had a parent or children at the last full look: its step looks render its
        # tree too (a descendant's check or stop wakes every ancestor's page, SPEC 20).
        self._family = False
        # The team's engaged switches that the banner sent at the last full look showed.
        self._switches: frozenset[int] | None = None
        self._page_state = ""  # `_digest` of what the last full look rendered
        # What the counters were last rendered from (`_counted`), and the approvals count
        # last sent: a step look renders them again only when they changed.
        self._counted: tuple[Any, ...] | None = None
        self._approvals_pending: int | None = None
        # The page state the browser says its page shows (a resumed stream), until the first
        # look compares it.
        self._seen = "" if flagged else seen
        if self._seen:
            self._full_due = False
            self._full_at = time.monotonic() - random.uniform(
                0, settings.DASHBOARD_STREAM_FULL_LOOK_S / 2)

    def step_look_due(self) -> bool:
        """Whether the next look is a step look (that `_step_looks` can serve)."""
        return not (self._full_due or self.flagged or time.monotonic() - self._full_at
                    >= settings.DASHBOARD_STREAM_FULL_LOOK_S)

    def frames(self) -> list[Frame]:
        run = self._run()
        if run is None:
            return []
        if self.step_look_due():
            frames = self.step_frames(run, timeline(run, after=self.after, flagged=self.flagged),
                                      approvals_pending=pending_count(self.team),
                                      switches=engaged_ids_for_team(self.team_id),
                                      has_children=bool(with_children([run])))
            if frames is not None:
                return frames
        return self.full_frames(run)

    def _run(self) -> Run | None:
        run = Run.objects.select_related("policy_version__policy").filter(
            team=self.team, pk=self.run_id
        ).first()
        self.seen(run)
        return run

    def seen(self, run: Run | None) -> None:
        if run is None:  # deleted by retention while watched
            self._finished = True

    def step_frames(self, run: Run, rows: list[Decision], *, approvals_pending: int,
                    switches: frozenset[int], has_children: bool) -> list[Frame] | None:
        """The step look's frames, given the run, its decisions after ``after``, the team's
        count of pending approvals (the navigation's), its engaged switches' ids
        (`engaged_ids_for_team`) and whether the run has a child; None when a full look is
        due after all."""
        state = _state(run)
        if self._seen:
            # A resumed stream's first look: the page shows what its digest says.
            seen, self._seen = self._seen, ""
            family = run.parent_run_id is not None or has_children
            if seen == self._digest(state, switches, family):
                self._state, self._switches, self._family = state, switches, family
                self._page_state = seen
        if state != self._state or state != (RunStatus.RUNNING, False):
            return None  # it ended, waits for an approval, or an approval was answered
        if switches != self._switches or (has_children and not self._family):
            return None  # the banner is not the team's, or the run's tree just began
        if run.idle_deadline is not None and run.idle_deadline <= timezone.now():
            return None  # the full look's settling ends the run (SPEC 14)
        names: tuple[str, ...] = ()
        # The counters (and a shadow run's header) change with a check or the run's policy
        # version, not with time: their Time counter ticks in the browser (live.js). So a
        # look that finds neither, most of a page's looks every DASHBOARD_STREAM_LOOK_S,
        # renders nothing (in a batch of 100 quiet pages, 266 us of CPU a page against 500).
        counted = _counted(run)
        if rows or counted != self._counted:
            names += ("run-counters",)
            if run.policy_version.document.get("mode") == "shadow":
                names += ("run-header",)
            self._counted = counted
        if self._family:
            names += ("run-tree",)
        frames = self._rows(run, rows)
        if names:
            frames += self.render(names, run_context(run, tree=self._family), chrome=False)
        if approvals_pending != self._approvals_pending:
            self._approvals_pending = approvals_pending
            frames += self.partials.changed({"approvals-count": render_to_string(
                "runs/_approvals_count.html", {"approvals_pending": approvals_pending},
                request=self.request)})
        return frames

    def full_frames(self, run: Run) -> list[Frame]:
        # Whoever looks first settles (SPEC 11, 14): a watched run past its deadline, or its
        # request past its expiry, ends on screen.
        run = first_look.look_at_run_page(run)
        # Read before the banner is rendered: a switch engaged in between costs one more
        # full look, never a banner that the step looks take for current.
        self._switches = engaged_ids_for_team(self.team_id)
        frames = self._rows(run, timeline(run, after=self.after, flagged=self.flagged))
        names = ("run-header", "run-controls", "run-counters", "run-banner", "run-approval",
                 "run-tree")
        if run.status != RunStatus.RUNNING:
            names += ("run-confirm-form",)  # only then: it replaces an open confirmation
        context = run_context(run)
        frames += self.render(names, {**context, **run_approval_context(run)})
        self._family, self._state = context["tree"] is not None, _state(run)
        self._counted, self._approvals_pending = _counted(run), None
        self._page_state = self._digest(self._state, self._switches, self._family)
        # The next full look of each page at its own time: pages opened together (a browser
        # restoring its tabs, the stream's reconnects) do not all take their full looks at
        # once again.
        self._full_due = False
        self._full_at = time.monotonic() - random.uniform(
            0, settings.DASHBOARD_STREAM_FULL_LOOK_S / 2)
        self._finished = run.finished_at is not None
        return frames

    def _rows(self, run: Run, rows: list[Decision]) -> list[Frame]:
        frames = []
        if self._gap and rows:
            self._gap = False
            frames.append(Frame("step", render_to_string(
                "runs/_timeline_gap.html", {"page_path": self.page_path},
                request=self.request), id=self.after))
        for decision in rows:
            html = render_to_string("runs/_step_row.html",
                                    {"row": step_row(decision, run.started_at)},
                                    request=self.request)
            frames.append(Frame("step", html, id=decision.pk))
            self.after = decision.pk
        return frames

    def finished(self) -> bool:
        return self._finished

    def resume_id(self) -> str | None:
        return f"{self.after}~{self._page_state}" if self._page_state else None

    def _digest(self, state: tuple[str, bool], switches: frozenset[int] | None, family: bool
                ) -> str:
        """What a full look's parts are rendered from, besides the run's rows and counters:
        the run's status, whether it waits for an approval, the banner's switches, whether
        it is in a tree, and the viewer's role (the controls and forms offered)."""
        role = getattr(self.request, "role", None)
        text = repr((state, sorted(switches or ()), family, str(role), self.page_path))
        return hashlib.sha256(text.encode()).hexdigest()[:PAGE_STATE_CHARS]

    def concerned(self, changes: Changes) -> bool:
        # Only this run's changes, or a team-wide one (a kill switch): the other runs'
        # checks leave this page as it is.
        if changes is None:
            self._full_due = True
        return changes is None or str(self.run_id) in changes

    def watched_run(self) -> str:
        return str(self.run_id)


def _step_looks(sources: list[RunSource]) -> list[str]:
    """The step looks of many run pages at once, on the look lane: their runs in one query,
    their new rows in another (`timelines`), then each page's frames as `_look` would send
    them (a page whose look turns out to be a full one gets it, alone). One read deadline
    for all (the lane's)."""
    with read_deadline():
        try:
            by_id = {run.pk: run for run in Run.objects.select_related(
                "policy_version__policy").filter(pk__in={source.run_id for source in sources})}
            afters: dict[Any, int] = {}
            for source in sources:
                run = by_id.get(source.run_id)
                if run is not None and run.team_id == source.team_id:
                    afters[run.pk] = min(afters.get(run.pk, source.after), source.after)
            rows = timelines(afters)
            # The navigation's count of pending approvals and the banner's switches, once
            # per team; which runs of pages without a tree have a child, in one read.
            teams = {source.team_id: source.team for source in sources}
            pending = {team_id: pending_count(team) for team_id, team in teams.items()}
            switches = {team_id: engaged_ids_for_team(team_id) for team_id in teams}
            parents = with_children({source.run_id: by_id[source.run_id] for source in sources
                                     if not source._family and source.run_id in afters
                                     }.values())
        except DatabaseError:
            log.warning("live streams could not read the database", exc_info=True)
            close_old_connections()
            return [""] * len(sources)
        texts = []
        for source in sources:
            run = by_id.get(source.run_id)
            if run is None or run.team_id != source.team_id:
                source.seen(None)
                texts.append("")
                continue
            mine = [row for row in rows.get(run.pk, []) if row.pk > source.after]
            texts.append(_look(source, partial(
                _step_or_full, source, run, mine, approvals_pending=pending[source.team_id],
                switches=switches[source.team_id], has_children=str(run.pk) in parents)))
        return texts


def _state(run: Run) -> tuple[str, bool]:
    """What decides whether a step look will do: the run's status, and whether it waits for
    an approval."""
    return run.status, run.awaited_approval is not None


def _counted(run: Run) -> tuple[Any, ...]:
    """What a running run's counters are rendered from, besides the time."""
    return run.steps, run.tool_calls, run.cost_usd, run.policy_version_id


def _step_or_full(source: RunSource, run: Run, rows: list[Decision], **found: Any
                  ) -> list[Frame]:
    frames = source.step_frames(run, rows, **found)
    return frames if frames is not None else source.full_frames(run)


class OverviewSource(Source):
    def __init__(self, request: HttpRequest, team: Team, range_key: str = ""):
        self.request, self.team, self.team_id = request, team, team.pk
        self.range_key = range_key
        self.page_path = reverse("runs:overview", args=[team.slug]) + (
            f"?range={range_key}" if range_key and range_key != DEFAULT_RANGE else "")
        self.partials = Partials()

    def frames(self) -> list[Frame]:
        first_look.look_at_overview(self.team)
        return self.render(("overview-running", "overview-chart", "overview-switches",
                            "overview-loops", "overview-agents", "overview-rate-limited"),
                           overview_context(self.team, range_key=self.range_key))


class RunsListSource(Source):
    def __init__(self, request: HttpRequest, team: Team, filters: RunFilters):
        self.request, self.team, self.team_id = request, team, team.pk
        self.filters = filters
        query = filters.query()
        self.page_path = reverse("runs:runs", args=[team.slug]) + (f"?{query}" if query else "")
        self.partials = Partials()

    def frames(self) -> list[Frame]:
        first_look.look(self.team)
        return self.render(("runs-table",), runs_list_context(self.team, self.filters))


class KillSwitchSource(Source):
    """The team's kill switch page: what is engaged and which engage controls are offered."""

    def __init__(self, request: HttpRequest, team: Team):
        self.request, self.team, self.team_id = request, team, team.pk
        self.page_path = reverse("runs:killswitch", args=[team.slug])
        self.partials = Partials()

    def frames(self) -> list[Frame]:
        return self.render(("killswitch-engaged", "killswitch-engage"),
                           killswitch_context(self.team))


class TeamSource(Source):
    """Any other team page (policies, keys, audit, a finished run): only the chrome."""

    def __init__(self, request: HttpRequest, team: Team, page_path: str):
        self.request, self.team, self.team_id = request, team, team.pk
        # Only a path of this site goes back into a form (and the POST checks it again).
        ok = page_path.startswith("/") and not page_path.startswith("//")
        self.page_path = page_path if ok else reverse("runs:overview", args=[team.slug])
        self.partials = Partials()

    def frames(self) -> list[Frame]:
        return self.render((), {})


class ApprovalsSource(Source):
    """The approvals page: the list (pending first), besides the layout's live parts."""

    def __init__(self, request: HttpRequest, team: Team):
        self.request, self.team, self.team_id = request, team, team.pk
        self.page_path = reverse("runs:approvals", args=[team.slug])
        self.partials = Partials()
        self._shown: tuple[Any, ...] | None = None  # `approvals_shown_key` at the last render

    def frames(self) -> list[Frame]:
        first_look.look(self.team)
        now = timezone.now()
        shown = approvals_shown_key(self.team, limit=APPROVALS_SHOWN)
        pending = shown[0]
        # A request past its expiry that no look settled yet is shown expired (runs/due.py):
        # the list is rendered again until it is.
        if shown == self._shown and not (pending and pending[0][1] <= now):
            return self.render((), {"team": self.team})  # the layout's live parts only
        self._shown = shown
        return self.render(("approvals-list",), approvals_context(self.team, now))
