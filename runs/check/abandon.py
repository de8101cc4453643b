"""Abandoned runs (SPEC 14): a running run with no start, check, wait or finish for its
policy's `budgets.max_idle_seconds` is ended `stopped` / `abandoned`, with `ended_at` at its
deadline, and audited like a kill by the fan-out (outcome stop, no action, step unchanged).
Runs out of time the same way (issue 26): a running run whose active time reached
`budgets.max_seconds` with no check to stop it can only be stopped, so it is ended `stopped`
/ `max_seconds` as of the moment its time ran out, audited the same way, its message naming
the budget (`rules.overdue`).

Each run keeps its deadline in `Run.idle_deadline`: the first of its last activity +
max_idle_seconds and its budget deadline (`rules.next_deadline`; null for never), written by
the start and by every check in the same statement as the rest of its state, so finding the
overdue runs is one indexed range read. Who ends a run:
- the check and the finish that find it overdue (runs/services.py), under the run's lock;
- `sweep_idle_runs`: the Celery beat sweep on the production stack (every minute, batch
  after batch for up to SWEEP_SECONDS), and `abandon_idle_runs`, a few runs at a time, on
  every look at a team's runs (runs/first_look.py: lists, overview, the API's list) on both
  stacks, so that an embedded deployment without beat ends them too;
- `abandon_if_idle` for a single run that is read after its deadline (the run page, the API).
Every one locks the run and tests again, so a check that got the lock first wins: its new
deadline makes the test fail and the run goes on.

Time pending approval (SPEC 11) must not count as idle, nor as active time. The hook is the
deadline itself: while a check waits for an operator's decision the approvals code sets
`idle_deadline` to null (never idle, and the budget's clock stands still), and the decision
sets it again with `rules.next_deadline`, like the check does.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from governance_client import rules
from runs.approvals.services import settle_on_end
from runs.check import records, states
from runs.check.policy_cache import rules_for_version
from runs.check.states import RUN_COLUMNS, state_of
from runs.live.events import publish_run_event
from runs.models import Run
from runs.sweep import one_by_one

# The overdue runs one read finds; the beat's pass reads batch after batch for at most
# SWEEP_SECONDS (one locking transaction a run), so a backlog of 100,000 overdue runs drains
# in minutes, and what is left goes next minute.
SWEEP_BATCH = 500
SWEEP_SECONDS = 10.0


def _abandon_one(run_id: Any, *, now: datetime) -> Run | None:
    """End one overdue run under its lock; None when, once locked, it is not overdue any more
    (a check or a finish came first) or is already over."""
    with transaction.atomic():
        run = (Run.objects.select_for_update()
               .only(*RUN_COLUMNS)
               .filter(pk=run_id).first())
        if run is None:
            return None
        state = state_of(run)
        policy = rules_for_version(run.policy_version_id)
        new = rules.overdue(state, policy, now=now)
        if new is None:
            return None
        ended = states.columns_of(new, (*states.ENDED, "memory"))
        Run.objects.filter(pk=run.pk).update(**ended)
        states.set_columns(run, ended)
        records.insert(run.pk, [records.abandon_row(new, policy, now)])
        # A waiting run has no idle deadline, but one recorded by an older version may:
        # its request ends with it (SPEC 10, "No impossible states").
        settle_on_end(run=run, before=state, after=new, now=now)
        transaction.on_commit(lambda: publish_run_event(run))
    return run


def abandon_idle_runs(*, team_id: int | None = None, now: datetime | None = None,
                      limit: int = SWEEP_BATCH) -> list[str]:
    """End the overdue running runs (of one team, or all), at most ``limit`` of them, the
    longest overdue first: the ids of the runs ended."""
    now = now or timezone.now()
    return _abandon_batch(team_id=team_id, now=now, limit=limit, after=None)[0]


def sweep_idle_runs(*, now: datetime | None = None, seconds: float = SWEEP_SECONDS) -> list[str]:
    """The beat's pass: batches of SWEEP_BATCH, the longest overdue first, each one starting
    after the last run the one before read (a run that could not be ended is not read
    again), until none is left or ``seconds`` have gone by: the ids of the runs ended.
    The first batch is always done."""
    now = now or timezone.now()
    stop_at = time.monotonic() + seconds
    ended: list[str] = []
    after: tuple[datetime, Any] | None = None
    while True:
        batch, after = _abandon_batch(team_id=None, now=now, limit=SWEEP_BATCH, after=after)
        ended += batch
        if after is None or time.monotonic() >= stop_at:
            return ended


def _abandon_batch(*, team_id: int | None, now: datetime, limit: int,
                   after: tuple[datetime, Any] | None
                   ) -> tuple[list[str], tuple[datetime, Any] | None]:
    """One batch: the ids of the runs ended, and where the next batch starts (the last run
    read), or None when this one found fewer than ``limit`` (nothing is left)."""
    overdue = Run.objects.filter(status=rules.RUNNING, idle_deadline__lte=now)
    if team_id is not None:
        overdue = overdue.filter(team_id=team_id)
    if after is not None:
        deadline, pk = after
        overdue = overdue.filter(Q(idle_deadline__gt=deadline)
                                 | Q(idle_deadline=deadline, pk__gt=pk))
    due = list(overdue.order_by("idle_deadline", "pk")
               .values_list("pk", "idle_deadline")[:limit])
    # One run that cannot be ended is logged and left: the others still are (SPEC 10).
    ended = one_by_one([pk for pk, _ in due],
                       lambda run_id: (run_id, _abandon_one(run_id, now=now)),
                       what="idle run")
    last = (due[-1][1], due[-1][0]) if len(due) == limit else None
    return [str(run_id) for run_id, run in ended if run is not None], last


def abandon_if_idle(run: Run, *, now: datetime | None = None) -> Run:
    """The run as it should be read: ended first when it is past its deadline."""
    now = now or timezone.now()
    if run.status != rules.RUNNING or run.idle_deadline is None or now < run.idle_deadline:
        return run
    ended = _abandon_one(run.pk, now=now)
    if ended is not None:
        run.status, run.stop_reason, run.ended_at = ended.status, ended.stop_reason, \
            ended.ended_at
    else:
        run.refresh_from_db()
    return run
