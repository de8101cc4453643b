"""The approval long poll's wait (SPEC 11 ``?wait=N``; SPEC 10 "No tenant slows another").

A waiting poll costs nothing of its own. In each server process the polls of one team share
one watcher (a coroutine, no thread), and the polls of one approval share its answer. The
watcher wakes when the team changes in a way that can settle a waited approval: a change of
the whole team (an approval requested or settled, a kill switch engaged, each published so
by their services) or of a waited approval's run (a finish, an abandon); and at the earliest
expiry (which the look settles), and every ``DASHBOARD_STREAM_LOOK_S`` anyway, in case a
wake-up was lost with Redis. The checks of the team's other runs do not wake it. On each
wake-up it makes ONE look at the database for every approval concerned (`look`), on the
process's look lane (runs/live/looks.py), never on the API pool, and answers the polls of
those that are no longer pending.

How many polls may wait at once is capped per agent key and per team in each server process
(``APPROVAL_WAITS_PER_KEY``, ``APPROVAL_WAITS_PER_TEAM``): past either, `slot` refuses and
the view answers 429 ``too_many_waits`` (docs/approvals.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections import Counter
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from typing import Any, TypeVar

from asgiref.sync import AsyncToSync, sync_to_async
from django.conf import settings
from django.utils import timezone

from governance.errors import AppError
from runs import first_look
from runs.approvals.selectors import approval_json, with_args_text
from runs.live.events import local_broker, redis_listener
from runs.live.looks import look_lane
from runs.models import Approval, ApprovalStatus

log = logging.getLogger(__name__)

T = TypeVar("T")

# What a refused poll is told to wait before it asks again: long enough that a client
# obeying it costs little, short against a wait of up to 60 s.
RETRY_AFTER_S = 5


def look(team_id: int, approval_ids: list[str]) -> dict[str, dict[str, Any] | None]:
    """One look at the database for waited approvals of one team: the answer of each that is
    no longer pending, None for one that is gone (deleted by retention); the pending ones are
    left out. Whoever looks first settles (SPEC 11): an approval past its expiry, or whose run
    an engaged kill switch covers, is settled here first, as the poll's own look would."""
    rows = {str(a.pk): a for a in with_args_text(
        Approval.objects.filter(team_id=team_id, pk__in=approval_ids).select_related("run"))}
    first_look.look_at_approvals(team_id, rows.values())
    answers: dict[str, dict[str, Any] | None] = {}
    for approval_id in approval_ids:
        approval = rows.get(approval_id)
        if approval is None:
            answers[approval_id] = None
        elif approval.status != ApprovalStatus.PENDING:
            answers[approval_id] = approval_json(approval)
    return answers


async def off_the_api_pool(fn: Callable[[], T], viewer: Hashable) -> T:
    """`fn()` on the process's look lane, in `viewer`'s turn."""
    if getattr(AsyncToSync.executors, "current", None) is not None:
        # Called from a synchronous thread (Django's test client, whose test holds a
        # transaction open on that thread's connection): that thread does it, as in
        # governance.pools.api_thread; only it sees the transaction's writes.
        return await sync_to_async(fn)()
    return await look_lane.run(fn, viewer)


# A poll over its key's or its team's cap of waiting polls is refused with the application's
# one error (governance/errors.py); the API adds its Retry-After.
TooManyWaits = AppError
TOO_MANY_WAITS = ("Too many polls of this key or team are waiting already: ask again after "
                  "Retry-After seconds, or with wait=0 for the status now.")


@dataclass(frozen=True)
class Outcome:
    """How a wait ended before its time: the approval's answer, or None when it is gone."""

    body: dict[str, Any] | None


@dataclass
class _Waited:
    """One approval waited on by one or more polls on one event loop."""

    run_id: str
    expires_at: datetime
    polls: int = 0
    answered: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: Outcome | None = None
    expiry_looked: bool = False  # a look came after its expiry: the periodic ones go on


@dataclass
class _Team:
    """The polls of one team waiting on one event loop, and their watcher's state."""

    team_id: int
    waited: dict[str, _Waited] = field(default_factory=dict)
    fresh: set[str] = field(default_factory=set)  # to look at on the next wake-up, whatever
    poke: asyncio.Event = field(default_factory=asyncio.Event)  # wake the watcher now
    watcher: asyncio.Task[None] | None = None  # held: the loop keeps only a weak reference


class ApprovalWaits:
    """This process's waiting polls: their caps, and one watcher per team and event loop."""

    def __init__(self) -> None:
        self._reset()
        # A forked worker starts with no polls of its own.
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._per_key: Counter[int] = Counter()
        self._per_team: Counter[int] = Counter()
        self._teams: dict[tuple[asyncio.AbstractEventLoop, int], _Team] = {}

    @staticmethod
    def seen(team_id: int) -> int:
        """The team's wake-up count now: taken before the poll's first look, so that a change
        between that look and the wait is not missed (`wait`'s ``seen``)."""
        return local_broker.seq(team_id)

    @contextlib.contextmanager
    def slot(self, *, key_id: int, team_id: int) -> Iterator[None]:
        """One waiting poll of the key, counted against both caps while it waits."""
        with self._lock:
            if (self._per_key[key_id] >= settings.APPROVAL_WAITS_PER_KEY
                    or self._per_team[team_id] >= settings.APPROVAL_WAITS_PER_TEAM):
                raise AppError(429, "too_many_waits", TOO_MANY_WAITS,
                               retry_after_s=RETRY_AFTER_S)
            self._per_key[key_id] += 1
            self._per_team[team_id] += 1
        try:
            yield
        finally:
            with self._lock:
                for counts, name in ((self._per_key, key_id), (self._per_team, team_id)):
                    counts[name] -= 1
                    if counts[name] <= 0:
                        del counts[name]

    async def wait(self, *, team_id: int, approval_id: str, run_id: str, expires_at: datetime,
                   seen: int, timeout: float) -> Outcome | None:
        """Wait up to `timeout` seconds for the approval to be settled (or to be gone); None
        when it is still pending then. `seen`: the team's wake-up count before the poll's
        last look at the approval."""
        loop = asyncio.get_running_loop()
        team = self._teams.get((loop, team_id))
        if team is None:
            team = self._teams[(loop, team_id)] = _Team(team_id)
            team.watcher = loop.create_task(self._watch(loop, team))
        waited = team.waited.get(approval_id)
        if waited is None:
            waited = team.waited[approval_id] = _Waited(run_id=run_id, expires_at=expires_at)
        waited.polls += 1
        _, changes = local_broker.changes_since(team_id, seen)
        if changes is None or run_id in changes:
            # It may have been settled since the poll's look, before the watcher knew of it.
            team.fresh.add(approval_id)
            team.poke.set()
        try:
            await asyncio.wait_for(waited.answered.wait(), timeout)
        except TimeoutError:
            return None
        finally:
            waited.polls -= 1
            if waited.polls == 0 and team.waited.get(approval_id) is waited:
                del team.waited[approval_id]
                if not team.waited:
                    team.poke.set()  # nothing left to watch: the watcher ends now
        return waited.outcome

    async def _watch(self, loop: asyncio.AbstractEventLoop, team: _Team) -> None:
        """The team's one watcher on this loop, while any of its polls wait."""
        redis_listener.ensure_running()
        look_every = float(settings.DASHBOARD_STREAM_LOOK_S)
        seen = local_broker.seq(team.team_id)
        last_look = loop.time()
        try:
            # The watcher is dropped with no await between the last check of `waited` and
            # the `finally`: a poll that comes later finds no watcher and starts one.
            while team.waited:
                now = timezone.now()
                expiries = [w.expires_at for w in team.waited.values() if not w.expiry_looked]
                timeout = look_every - (loop.time() - last_look)
                if expiries:
                    timeout = min(timeout, (min(expiries) - now).total_seconds())
                if timeout > 0 and not team.poke.is_set():
                    await self._change_or_poke(team, seen, timeout)
                team.poke.clear()
                seen, changes = local_broker.changes_since(team.team_id, seen)
                now = timezone.now()
                if changes is None or loop.time() - last_look >= look_every:
                    due = set(team.waited)
                    last_look = loop.time()
                else:
                    due = {approval_id for approval_id, w in team.waited.items()
                           if w.run_id in changes or approval_id in team.fresh
                           or (now >= w.expires_at and not w.expiry_looked)}
                team.fresh.clear()
                if due:
                    await self._look(team, sorted(due), now)
        finally:
            if self._teams.get((loop, team.team_id)) is team:
                del self._teams[(loop, team.team_id)]

    @staticmethod
    async def _change_or_poke(team: _Team, seen: int, timeout: float) -> None:
        """Until the team changes (here or, through Redis, in another process), a poll pokes
        the watcher, or `timeout`."""
        changed = asyncio.ensure_future(local_broker.await_change(team.team_id, seen, timeout))
        poked = asyncio.ensure_future(team.poke.wait())
        try:
            await asyncio.wait({changed, poked}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            changed.cancel()
            poked.cancel()

    @staticmethod
    async def _look(team: _Team, approval_ids: list[str], now: datetime) -> None:
        for approval_id in approval_ids:
            waited = team.waited.get(approval_id)
            if waited is not None and now >= waited.expires_at:
                # Looked at after its expiry, settled or not (a failed look, a lock that
                # moved on): the periodic looks go on, never a look after look.
                waited.expiry_looked = True
        try:
            answers = await off_the_api_pool(partial(look, team.team_id, approval_ids),
                                              viewer=("approvals", team.team_id))
        except Exception:
            # The polls keep waiting; the next wake-up or periodic look tries again.
            log.warning("waiting approval polls could not read the database", exc_info=True)
            return
        for approval_id in approval_ids:
            waited = team.waited.get(approval_id)
            if waited is None:
                continue
            if approval_id in answers:
                waited.outcome = Outcome(answers[approval_id])
                waited.answered.set()
                del team.waited[approval_id]


approval_waits = ApprovalWaits()
