"""Whoever looks first settles (SPEC 11, 14), bounded per request (SPEC 10, "Bounded work
per request").

What is due on a team's runs is settled by the beat sweeps, and by whoever looks first: a
run past its idle deadline ends `stopped` / `abandoned` as of that deadline, a run whose time
budget ran out with no check to stop it ends `stopped` / `max_seconds` as of that moment
(its stored deadline is the first of the two, `rules.next_deadline`), an approval past
its expiry ends its run `stopped` / `approval_expired` as of the expiry, and a request whose
run a kill switch covers is cancelled. A read of a team's runs (the API's list, the runs
page, the overview, the approvals page, and their live streams) calls `look` first. A look
settles at most `LOOK_BATCH` runs and `LOOK_BATCH` requests, the longest due first, so its
cost is the same with 10 runs overdue or 100,000 (a backlog is the beat sweep's: it drains
it in time-boxed passes).

The rows a read returns that are still due once the look's share is spent are shown as they
will be (`as_it_will_be`): the end the same rules will write, at the moment they will write
(the deadline, the expiry), which no check can change any more (a check after an idle
deadline finds the run abandoned; one after the budget deadline is stopped `max_seconds` by
rule 4 all the same, at its own time and step). A list filtered on `running`, and the
count of running runs, leave out the runs that are not running any more (`still_running`).
A read of one run (the run page, `GET /api/v1/runs/{id}`) settles that run itself: one run
is one write.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime

from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from governance_client import rules
from policies.models import Team
from runs.approvals.services import settle_due_for_team
from runs.check.abandon import abandon_idle_runs
from runs.check.check_store import state_of
from runs.check.policy_cache import rules_for_version
from runs.models import Approval, ApprovalStatus, Run

log = logging.getLogger(__name__)

# Runs ended, and requests settled, by one look at most (each kind). One locking
# transaction each: 20 keep a page's answer in the tens of milliseconds.
LOOK_BATCH = 20


def look(team: Team, *, now: datetime | None = None) -> None:
    """Before a read of the team's runs or approvals: settle what is due, a bounded share."""
    now = now or timezone.now()
    abandon_idle_runs(team_id=team.pk, now=now, limit=LOOK_BATCH)  # SPEC 14
    settle_due_for_team(team, now=now, limit=LOOK_BATCH)  # SPEC 11


def still_running(now: datetime) -> Q:
    """What a `running` filter reads, in SQL: the runs a look has not ended yet but that are
    over all the same (past their stored deadline: idle, or out of time; or waiting for a
    request past its expiry) left out."""
    expired = Approval.objects.filter(run=OuterRef("pk"), status=ApprovalStatus.PENDING,
                                      expires_at__lte=now)
    return (Q(idle_deadline__isnull=True) | Q(idle_deadline__gt=now)) & Q(~Exists(expired))


def as_it_will_be(runs: Iterable[Run], *, now: datetime) -> list[Run]:
    """The rows of a read as they are once what is due on them is settled. A row the look
    left due (past its idle deadline, or its request past its expiry) gets the status,
    stop reason, end and memory the settling will write, in memory only (nothing is saved).
    A kill switch's cancellation is left to its fan-out, which is prompt."""
    return [_as_it_will_be(run, now) for run in runs]


def _as_it_will_be(run: Run, now: datetime) -> Run:
    if run.status != rules.RUNNING or not _due(run, now):
        return run
    try:
        state = state_of(run)
        new = rules.overdue(state, rules_for_version(run.policy_version_id), now=now)
        if new is None and state.pending is not None and now >= state.pending.expires_at:
            new = rules.settle(state, rules.EXPIRED, now=now)[1]
    except Exception:
        # A memory no version wrote: shown as it is stored (SPEC 10, one bad row is one).
        log.exception("run %s: what is due on it cannot be worked out; shown as stored", run.pk)
        return run
    if new is not None:
        run.status, run.stop_reason, run.ended_at = new.status, new.stop_reason, new.ended_at
        run.memory, run.idle_deadline = new.fixed_memory(), new.idle_deadline
    return run


def _due(run: Run, now: datetime) -> bool:
    """Whether anything is due on a running row, from its columns (no query)."""
    if run.idle_deadline is not None and now >= run.idle_deadline:
        return True
    pending = (run.memory or {}).get("pending") if isinstance(run.memory, dict) else None
    if not isinstance(pending, dict):
        return False
    try:
        return now >= datetime.fromisoformat(pending["expires_at"])
    except (KeyError, TypeError, ValueError):
        return False
