"""Whoever looks first settles (SPEC 11, 14), bounded per request (SPEC 10, "Bounded work
per request"): the one place where a read writes.

What is due on a team's runs is settled by the beat sweeps, and by whoever looks first: a
run past its idle deadline ends `stopped` / `abandoned` as of that deadline, a run whose time
budget ran out with no check to stop it ends `stopped` / `max_seconds` as of that moment
(its stored deadline is the first of the two, `rules.next_deadline`), an approval past
its expiry ends its run `stopped` / `approval_expired` as of the expiry, and a request whose
run a kill switch covers is cancelled.

The views, the API's reads and the live streams call one function here before their reads,
one for each kind of read; the selectors and presenters they read through then change
nothing (import-linter contracts in pyproject.toml: only those callers import this module,
and the reads import none of what writes):

- `look`: a read of a team's runs or approvals (the API's list, the runs page, the
  approvals page, and their live streams) settles at most `LOOK_BATCH` runs and
  `LOOK_BATCH` requests, the longest due first, so its cost is the same with 10 runs overdue
  or 100,000 (a backlog is the beat sweep's: it drains it in time-boxed passes). The rows the
  read returns that are still due once the share is spent are shown as they will be
  (runs/due.py);
- `look_at_overview`: the overview (and its stream), the same look, and on the embedded
  stack, which runs no beat, the rate limits' old hits pruned now and then;
- `look_at_run`: a read of one run (`GET /api/v1/runs/{id}` and its decisions, the timeline's
  earlier rows) settles that run itself, its request past its expiry and its idle or time
  deadline: one run is one write;
- `look_at_request`: a read of the request a run waits for (the run page's banner) settles
  what is due on it (a kill switch's cancellation too, ahead of the fan-out); the run page
  and its stream, `look_at_run_page`, look at the run and at its request;
- `look_at_approval`: the agent's poll of one request (`GET /api/v1/approvals/{id}`); and
  `look_at_approvals`, the long polls' one look at the requests they wait on.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from django.conf import settings
from django.utils import timezone

from governance_client import rules
from policies.models import Team
from runs.approvals.selectors import pending_for_run
from runs.approvals.services import settle_due_for_team, settle_if_due, settle_if_due_for_run
from runs.check.abandon import abandon_idle_runs, abandon_if_idle
from runs.check.rate_limits import prune_hits_now_and_then
from runs.killswitch import cover
from runs.killswitch.fanout import killswitch_kill_run
from runs.models import Approval, ApprovalStatus, Run

# Runs ended, and requests settled, by one look at most (each kind). One locking
# transaction each: 20 keep a page's answer in the tens of milliseconds.
LOOK_BATCH = 20


def look(team: Team, *, now: datetime | None = None) -> None:
    """Before a read of the team's runs or approvals: settle what is due, a bounded share."""
    now = now or timezone.now()
    abandon_idle_runs(team_id=team.pk, now=now, limit=LOOK_BATCH)  # SPEC 14
    settle_due_for_team(team, now=now, limit=LOOK_BATCH)  # SPEC 11


def look_at_overview(team: Team, *, now: datetime | None = None) -> None:
    """Before the overview's reads: `look`, and the embedded stack's rate-limit hits kept
    small (it runs no beat to prune them; at most once a minute per process)."""
    now = now or timezone.now()
    look(team, now=now)
    if not settings.REDIS_URL:
        prune_hits_now_and_then(now=now)


def look_at_run(run: Run, *, now: datetime | None = None) -> Run:
    """Before a read of one run: its request past its expiry settled (else it would read as
    running and waiting), and the run ended if it is past its deadline. The run's memory and
    deadline say whether anything is due, so a run with nothing due costs no query. Returns
    the run as it now is."""
    now = now or timezone.now()
    if settle_if_due_for_run(run, now=now):  # SPEC 11
        run.refresh_from_db()
    return abandon_if_idle(run, now=now)  # SPEC 14


def look_at_run_page(run: Run, *, now: datetime | None = None) -> Run:
    """Before the run page's reads (and each look of its stream), which show the request the
    run waits for: `look_at_run`, then `look_at_request`."""
    now = now or timezone.now()
    run = look_at_run(run, now=now)
    if look_at_request(run, now=now):
        run.refresh_from_db()
    return run


def look_at_request(run: Run, *, now: datetime | None = None) -> bool:
    """Before a read of the request a run waits for (the run page's banner, and the banner
    an operator's decision answers with): what is due on it settled, a kill switch's
    cancellation included (from the switch's commit on the run's answer is stop / killed,
    SPEC 4.5: the page does not wait for the fan-out to say so). The run's memory says
    whether it waits, so a run that does not costs no query. True when it was settled."""
    if run.status != rules.RUNNING or run.awaited_approval is None:
        return False
    pending = pending_for_run(run)
    return pending is not None and settle_if_due(pending, now=now)


def look_at_approval(approval: Approval, *, now: datetime | None = None) -> bool:
    """Before the agent's read of one request: what is due on it settled (an expiry, a kill
    switch's cancellation), and an approved request whose run a switch now covers killed.
    True when something was written (the caller reads the request again)."""
    return settle_if_due(approval, now=now) or _kill_if_covered(approval)


def look_at_approvals(team_id: int, approvals: Iterable[Approval], *,
                      now: datetime | None = None) -> None:
    """Before the long polls' read of the requests they wait on (one team's): those still
    pending that are due settled, each read again. One query for the team's switches, not
    one per request: without an engaged switch only the expired ones can be due."""
    now = now or timezone.now()
    pending = [a for a in approvals if a.status == ApprovalStatus.PENDING]
    engaged = bool(pending) and bool(cover.engaged_over_team_ids(team_id))
    for approval in pending:
        if (engaged or now >= approval.expires_at) and settle_if_due(approval, now=now):
            approval.refresh_from_db()


def _kill_if_covered(approval: Approval) -> bool:
    """An approved request whose run a kill switch now covers: the run is killed now, as the
    fan-out will, so that its answer is stop / killed from the engage's commit on (SPEC 4.5),
    exactly as a replay of its check answers, and never the allow that preceded the switch."""
    if approval.status != ApprovalStatus.APPROVED or approval.run.status != rules.RUNNING:
        return False
    return killswitch_kill_run(run_id=approval.run_id)
