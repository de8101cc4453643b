"""What is due on a team's runs, as a read shows it without writing (SPEC 11, 14).

A read first lets runs/first_look.py settle a bounded share of what is due; the rows it
returns that are still due once that share is spent are shown here as they will be
(`as_it_will_be`): the end the same rules will write, at the moment they will write (the
deadline, the expiry), which no check can change any more (a check after an idle deadline
finds the run abandoned; one after the budget deadline is stopped `max_seconds` by rule 4 all
the same, at its own time and step). A list filtered on `running`, and the count of running
runs, leave out the runs that are not running any more (`still_running`).

Approvals likewise (`approvals_as_they_will_be`): a request past its expiry that the look left
pending is shown `expired`, with the final answer its settling will store (built by the same
`final_of`; only the audit record's id, which the settling makes, is null), and a list filtered
on `pending` leaves it out (`still_pending`), one filtered on `expired` takes it in
(`expired_by_now`). Found by an attacker: the operator API's list showed such requests
`pending` while the agent API, which settles the one request it reads, answered `expired`.

Nothing here writes: the selectors and presenters use it, and they change nothing (an
import-linter contract in pyproject.toml).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime

from django.db.models import Exists, OuterRef, Q

from governance_client import rules
from runs.approvals.selectors import final_of
from runs.check import run_memory
from runs.check.policy_cache import rules_for_version
from runs.check.states import state_of
from runs.models import Approval, ApprovalStatus, Run

log = logging.getLogger(__name__)


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
    pending = run.awaited_approval
    if pending is None:
        return False
    try:
        return now >= datetime.fromisoformat(pending["expires_at"])
    except (KeyError, TypeError, ValueError):
        return False


# A request that its settling will expire, in SQL and in Python (`_will_expire`): kept side by
# side so that the lists' filters and the rows they show agree.
def _will_expire_q(now: datetime) -> Q:
    return Q(status=ApprovalStatus.PENDING, expires_at__lte=now, run__status=rules.RUNNING)


def _will_expire(approval: Approval, now: datetime) -> bool:
    return (approval.status == ApprovalStatus.PENDING and now >= approval.expires_at
            and approval.run.status == rules.RUNNING)


def still_pending(now: datetime) -> Q:
    """What a `pending` filter reads: the pending requests not past their expiry."""
    return Q(status=ApprovalStatus.PENDING) & ~_will_expire_q(now)


def expired_by_now(now: datetime) -> Q:
    """What an `expired` filter reads: the expired requests, and those the look left pending
    past their expiry (shown expired, `approvals_as_they_will_be`)."""
    return Q(status=ApprovalStatus.EXPIRED) | _will_expire_q(now)


def approvals_as_they_will_be(approvals: Iterable[Approval], *, now: datetime
                              ) -> list[Approval]:
    """The rows of a read of requests (their runs selected with them) as they are once
    settled: a request past its expiry on a running run gets, in memory only, the status,
    decision time and final answer its expiry will write (SPEC 11: stop /
    approval_expired, as of ``expires_at``), and its run the end it will get. One query for
    each such row (the repeat key's count the answer names); none for the others."""
    return [_approval_as_it_will_be(approval, now) for approval in approvals]


def _approval_as_it_will_be(approval: Approval, now: datetime) -> Approval:
    if not _will_expire(approval, now):
        return approval
    run = approval.run
    try:
        state = state_of(run)
        pending = state.pending
        if pending is None or pending.approval_id != str(approval.pk):
            return approval  # not what the run waits for: its settling changes nothing
        # As settle_locked does: the answer names the repeat key's count.
        state = run_memory.load(state.copy(), run.id, list(rules.settle_reads(pending)))
        decision, new = rules.settle(state, rules.EXPIRED, now=now)
        answer = final_of(run, pending, decision, new, now, "")
    except Exception:
        # A memory no version wrote: shown as stored (SPEC 10, one bad row is one).
        log.exception("approval %s: its expiry cannot be worked out; shown as stored",
                      approval.pk)
        return approval
    answer["decision_id"] = None  # the audit record its settling writes has no id yet
    approval.status, approval.decided_at = ApprovalStatus.EXPIRED, pending.expires_at
    approval.decided_by, approval.decided_by_label, approval.note = None, "", ""
    approval.decision = answer
    run.status, run.stop_reason, run.ended_at = new.status, new.stop_reason, new.ended_at
    run.memory, run.idle_deadline = new.fixed_memory(), new.idle_deadline
    return approval
