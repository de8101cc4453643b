"""Approvals (SPEC 11): an operator approves or denies an action before it runs.

A check whose action matches the policy's ``approvals.tools`` opens a request
(runs/check/services.py calls `approval_open`) and answers ``pending``. From then on the
request is settled exactly once, always under the run's row lock (the lock every check takes)
and always by a conditional UPDATE from ``pending``, which is what makes one decision win
across processes:

- an operator approves or denies it (`approval_decide`: the dashboard and the command);
- it expires: whoever looks first after ``expires_at`` settles it (a check, a GET, a page,
  the Celery beat sweep, all through `settle_if_due` / `settle_locked`);
- a kill switch that covers the run cancels it (the kill-switch fan-out, or whoever comes
  first: a check, the agent's poll, the run page, an operator's decision, which is then
  refused with 409 ``kill_switch_engaged``: no allow under a switch);
- the run ends any other way while it waits (a finish, a local stop uploaded, an
  abandonment): `settle_on_end` cancels it, its final answer the ended run's stop.

No run is ever terminal while one of its approvals is pending (SPEC 10, "No impossible
states"): every path that ends a run settles the request under the run's lock, in its own
transaction. A request that an older version left pending on an ended run is repaired by
whoever meets it (`settle_stale_locked`), and by migration runs/0010.

Settling applies `rules.settle` (the run's counters, status and active time), writes the final
answer as a second audit record at the same step, and, after the commit, wakes the screens and
notifies the team's webhook (``approval.decided``).

The reads (the API's answer, the pages' lists) are runs/approvals/selectors.py; they change
nothing, whoever reads settles first (runs/first_look.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from datetime import datetime
from functools import partial
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.db.models import Exists, OuterRef, Q, QuerySet
from django.utils import timezone

from governance.errors import AppError
from governance_client import rules
from policies.models import Team
from policies.services import audit
from runs import telemetry
from runs.approvals.selectors import final_of, iso
from runs.check import lineage, metrics, records, run_memory, states
from runs.check.policy_cache import rules_for_version
from runs.check.states import state_of
from runs.killswitch import cover
from runs.live.events import publish_team_event
from runs.models import (
    Approval,
    ApprovalStatus,
    Decision,
    Run,
    WebhookDelivery,
)
from runs.sweep import one_by_one
from runs.webhooks.delivery import APPROVAL_DECIDED, APPROVAL_REQUESTED, approval_payload

log = logging.getLogger(__name__)

MAX_NOTE = 2000
DECISIONS = {"approve": rules.APPROVED, "deny": rules.DENIED}


# The application's one error (governance/errors.py): the API and the dashboard turn it into
# their own answer (SPEC 5.3 codes).
ApprovalError = AppError


# --- Opening a request (inside the check's transaction) -------------------------------------

def approval_open(*, run: Any, pending: rules.Pending, args: Any, pattern: str,
                  decision_id: int) -> None:
    """Store the request a check just opened. Called by the check under the run's lock, in
    its transaction; the webhook and the screens are told after the commit."""
    approval = Approval.objects.create(
        id=pending.approval_id, team_id=run.team_id, run_id=run.id, check_id=pending.check_id,
        step=pending.step, action_name=pending.action_name, action_type=pending.action_type,
        args=args, pattern=pattern, requested_at=pending.since, expires_at=pending.expires_at,
        requested_decision_id=decision_id,
    )
    transaction.on_commit(partial(_after_change, approval.pk, APPROVAL_REQUESTED), robust=True)


# --- Settling (always under the run's lock) --------------------------------------------------

@dataclass(frozen=True)
class Settled:
    status: str
    answer: dict[str, Any]
    state: rules.RunState


def settle_locked(*, run: Any, state: rules.RunState, status: str, now: datetime,
                  actor: AbstractBaseUser | None = None, label: str = "", note: str = "",
                  kill: str | None = None, tree: list[rules.Ancestor] | None = None
                  ) -> Settled | None:
    """Settle the run's pending approval. The caller holds the run's row lock and passes the
    run's state as read under it; an approval passes the run's ancestors too (``tree``,
    locked root first before the run), on which the approved tool call counts (SPEC 20).
    Returns None when the conditional UPDATE finds the request no longer pending (another
    decision won)."""
    pending = state.pending
    assert pending is not None
    if status == rules.CANCELLED and kill is None and (
            not tree or rules.ended_ancestor(tree, now) is None):
        # Finishing the run: the final answer is the finished run's stop.
        raise ValueError("use run_finish to cancel by finishing")
    # The answer names the approved key's count, which an approval also raises, and its
    # warnings read the count of the error the check reported (its repeated-error nudge).
    state = run_memory.load(state.copy(), run.id, list(rules.settle_reads(pending)))
    # The policy restarts an approved run's idle deadline: time pending is not idle (SPEC 14).
    decision, new = rules.settle(state, status, now=now, by=label or None, note=note, kill=kill,
                                 policy=rules_for_version(run.policy_version_id),
                                 kill_rule=_kill_rule(run) if kill is not None else None,
                                 tree=tree or ())
    if status == rules.APPROVED and decision.outcome == rules.STOP:
        # The run's ancestors stop it (an ancestor over, or its tool calls used up): the
        # request is cancelled, the run stopped; nothing counts on them.
        status, tree = rules.CANCELLED, None
    decided_at = pending.expires_at if status == rules.EXPIRED else now
    won = Approval.objects.filter(pk=pending.approval_id, status=ApprovalStatus.PENDING).update(
        status=status, decided_at=decided_at, decided_by=actor, decided_by_label=label,
        note=note,
    )
    if not won:
        return None
    Run.objects.filter(pk=run.id).update(**states.columns_of(new, SETTLED))
    if status == rules.APPROVED and tree:
        lineage.write_counters(
            [replace(ancestor, state=after) for ancestor, after
             in zip(tree, rules.approved_in_tree(tree, pending), strict=True)],
            ("tool_calls",))
    if status in (rules.APPROVED, rules.DENIED) and tree:
        # The wait is over before its expiry, to which it had moved the ancestors' idle
        # deadline (`rules.count_in_tree`): their idle time counts from now again, not a
        # whole timeout later.
        lineage.write_counters(
            [replace(ancestor, state=replace(ancestor.state, idle_deadline=rules.next_deadline(
                ancestor.policy, ancestor.state, now)))
             for ancestor in tree
             if ancestor.state.status == rules.RUNNING and ancestor.state.pending is None],
            ("idle_deadline",))
    run_memory.save(run.id, state, new)
    answer = final_of(run, pending, decision, new, now, label)
    _record_final(run, pending, answer, now, decision)
    requested_at = pending.since
    transaction.on_commit(partial(_after_change, pending.approval_id, APPROVAL_DECIDED,
                                  team_id=run.team_id, status=status,
                                  latency=(decided_at - requested_at).total_seconds()),
                          robust=True)
    return Settled(status=status, answer=answer, state=new)


# What settling a request changes of its run: it may end it (a denial, a cancellation by a
# kill), an approval counts the tool call, the wait leaves its memory, and the idle deadline
# starts again (SPEC 11, 14).
SETTLED = (*states.ENDED, "tool_calls", "memory", "idle_deadline")


def settle_on_end(*, run: Any, before: rules.RunState, after: rules.RunState,
                  now: datetime) -> None:
    """The run waited for an approval and has just ended some other way (a finish, a local
    stop uploaded, an abandonment): the request is cancelled, its final answer the ended
    run's stop (what any check of the run now answers), audited at the request's step
    (SPEC 11). Every path that ends a run calls this, holding the run's lock, in the
    transaction that ends it; nothing happens when the run did not wait or did not end.
    The rules already ended the wait in ``after`` (`rules.end_wait`): the caller writes the
    run itself."""
    pending = before.pending
    if pending is None or before.status in rules.TERMINAL or after.status not in rules.TERMINAL:
        return
    won = Approval.objects.filter(pk=pending.approval_id, status=ApprovalStatus.PENDING).update(
        status=rules.CANCELLED, decided_at=now)
    if not won:
        return
    # The final answer names the key's count, as a check of the ended run does.
    ended = run_memory.load(after.copy(), run.id, [(rules.REPEAT, pending.repeat_key)])
    decision = rules.terminal_decision(ended, pending.repeat_key)
    decision = replace(decision, step=pending.step, approval=pending.summary(rules.CANCELLED))
    answer = final_of(run, pending, decision, ended, now, "")
    _record_final(run, pending, answer, now, decision)
    transaction.on_commit(partial(_after_change, pending.approval_id, APPROVAL_DECIDED,
                                  team_id=run.team_id, status=rules.CANCELLED,
                                  latency=(now - pending.since).total_seconds()), robust=True)


def settle_due_locked(*, run: Any, state: rules.RunState, now: datetime,
                      kill: str | None = None, tree: list[rules.Ancestor] | None = None
                      ) -> rules.RunState:
    """What is due on a waiting run, settled by whoever holds its lock first (SPEC 11): the
    expiry once ``expires_at`` has passed, else, when a kill switch covers the run (``kill``
    describes it) or one of its ancestors is over (``tree``, locked before the run, SPEC
    20), the cancellation. Returns the run's state after that. An ended run that still
    names a request (left by an older version) is repaired instead."""
    if state.status in rules.TERMINAL:
        settle_stale_locked(run=run, state=state, now=now)
        return _without_wait(state)
    pending = state.pending
    if pending is None:
        return state
    if now >= pending.expires_at:
        status = rules.EXPIRED
    elif kill is not None or (tree and rules.ended_ancestor(tree, now) is not None):
        status = rules.CANCELLED
    else:
        return state
    settled = settle_locked(run=run, state=state, status=status, now=now, kill=kill,
                            tree=tree)
    return settled.state if settled is not None else state


def _without_wait(state: rules.RunState) -> rules.RunState:
    """An ended run's state as it should have been stored: its wait ended with it."""
    pending = state.pending
    if pending is None:
        return state
    new = state.copy()
    rules.end_wait(new, state.ended_at or pending.since)
    return new


def settle_stale_locked(*, run: Any, state: rules.RunState, now: datetime) -> int:
    """Repair an ended run that older versions left waiting (SPEC 10, "No impossible
    states"): its pending requests are cancelled as of its end, as a finish cancels one, and
    its memory stops naming them. No audit record is written: the run's story ended with its
    stop, and the request's `decision` reads as that stop (`final_answer`). The caller holds
    the run's lock. Returns how many requests it cancelled; logged, as a repair."""
    if state.status not in rules.TERMINAL:
        return 0
    stale = Approval.objects.filter(run_id=run.id, status=ApprovalStatus.PENDING)
    ids = [str(pk) for pk in stale.values_list("pk", flat=True)]
    cancelled = stale.update(status=rules.CANCELLED, decided_at=state.ended_at or now)
    if state.pending is not None:
        ids.append(f"{state.pending.approval_id} (in its memory)")
        Run.objects.filter(pk=run.id).update(**states.columns_of(_without_wait(state),
                                                                 ("memory",)))
    if ids:
        log.warning("run %s is %s but still waited for approval: %s; cancelled as of its end",
                    run.id, state.status, ", ".join(ids))
        transaction.on_commit(partial(publish_team_event, run.team_id), robust=True)
    return cancelled


def _record_final(run: Any, pending: rules.Pending, answer: dict[str, Any], now: datetime,
                  decision: rules.Decision) -> None:
    """The second audit record, at the approval's step, and the final answer on the request.
    The final answer is the same check's, so it carries the pending answer's ``trace_id``
    (SPEC 18: the trace the agent's action is in; null when it was not traced)."""
    approval = Approval.objects.only("args", "requested_decision_id").get(
        pk=pending.approval_id)
    if approval.requested_decision_id is not None and answer.get("trace_id") is None:
        # The key as JSON (a JSON null is None on every store; KT's text gave "null").
        answer["trace_id"] = Decision.objects.filter(
            pk=approval.requested_decision_id, run_id=run.id).values_list(
                "answer__trace_id", flat=True).first()
    pk = records.insert(run.id, [records.final_row(pending, decision, answer, approval.args,
                                                   now)])
    answer["decision_id"] = pk
    Approval.objects.filter(pk=pending.approval_id).update(final_decision_id=pk,
                                                           decision=answer)


def _after_change(approval_id: Any, event: str, *, team_id: int | None = None,
                  status: str | None = None, latency: float | None = None) -> None:
    """After the commit: screens look again, the webhook is told, the metric recorded."""
    approval = Approval.objects.select_related("team", "run").filter(pk=approval_id).first()
    if approval is None:
        return
    publish_team_event(approval.team_id)
    if status is not None and latency is not None:
        metrics.approval_decided(team=approval.team.slug, status=status, seconds=latency)
    _notify(approval, event)


def _notify(approval: Approval, event: str) -> None:
    """The team's webhook is told, after the commit, on the request's thread: the delivery's
    row here, its publish by the publisher's thread (start_delivery), so a check that opens
    an approval never waits for the broker (SPEC 10)."""
    from runs.webhooks.delivery import start_delivery

    team = approval.team
    if not team.webhook_url:
        return
    delivery, created = WebhookDelivery.objects.get_or_create(
        approval=approval, event=event,
        defaults={"team": team, "url": team.webhook_url,
                  "payload": approval_payload(approval, event)},
    )
    if created:
        start_delivery(delivery.pk, urgent=False)


def _locked(run_id: Any) -> tuple[Run, rules.RunState]:
    run = Run.objects.select_for_update().get(pk=run_id)
    return run, state_of(run)


def _kill_rule(run: Any) -> dict[str, Any] | None:
    """The covering switch as the cancelled request's stop names it (SPEC 16): read again
    here, a rare path (a request cancelled by a kill switch), so its callers pass words."""
    switch = cover.covering_switch_of_tree(run)
    if switch is None:
        return None
    team = Team.objects.filter(pk=run.team_id).values_list("slug", flat=True).first()
    return cover.switch_rule(switch, team=team)


def covering_kill(run: Any) -> str | None:
    """The kill switch covering the run or one of its ancestors (SPEC 20), in the words the
    agent reads; None when none does."""
    switch = cover.covering_switch_of_tree(run)
    return cover.switch_in_words(switch) if switch is not None else None


def settle_if_due(approval: Approval, *, now: datetime | None = None) -> bool:
    """Whoever looks first settles what is due (SPEC 11): a GET, a page, the sweep. That is
    the expiry once ``expires_at`` has passed, and the cancellation of a request whose run a
    kill switch covers: the fan-out cancels it too, but from the switch's commit on the run's
    answer is stop / killed (SPEC 4.5), and a look must not wait for a broker to say so. A
    request still pending on a run that is over (left so by an older version) is cancelled,
    and so is one of a run whose ancestor is over (SPEC 20: it can never be an allow; its
    run stops, parent_stopped). True when this call settled it."""
    now = now or timezone.now()
    if approval.status != ApprovalStatus.PENDING:
        return False
    ended = approval.run.status != rules.RUNNING
    expired = now >= approval.expires_at
    if (not ended and not expired and covering_kill(approval.run) is None
            and not _ancestor_over(approval.run, now)):
        return False
    with transaction.atomic():
        # A child's ancestors first, the root first (the tree's lock order), then the run:
        # only to cancel by an ancestor's end; an expiry or a kill writes no ancestor.
        tree = lineage.lock_lineage(team_id=approval.run.team_id, run_id=approval.run_id) \
            if approval.run.ancestors and not ended and not expired else []
        run, state = _locked(approval.run_id)
        if state.status in rules.TERMINAL:
            before = set(Approval.objects.filter(run_id=run.id, status=ApprovalStatus.PENDING)
                         .values_list("pk", flat=True))
            settle_stale_locked(run=run, state=state, now=now)
            return approval.pk in before
        if state.pending is None or state.pending.approval_id != str(approval.pk):
            return False
        if expired:
            settled = settle_locked(run=run, state=state, status=rules.EXPIRED, now=now)
        else:
            kill = covering_kill(run)  # again, under the run's lock: it may be released
            if kill is None and rules.ended_ancestor(tree, now) is None:
                return False
            settled = settle_locked(run=run, state=state, status=rules.CANCELLED, now=now,
                                    kill=kill, tree=tree)
    return settled is not None


def _ancestor_over(run: Run, now: datetime) -> bool:
    """Whether one of the run's ancestors is over: ended, or past its idle deadline (one
    query, for a child run only)."""
    return bool(run.ancestors) and rules.ended_ancestor(
        lineage.read_lineage(run.ancestors), now) is not None


def settle_if_due_for_run(run: Run, *, now: datetime | None = None) -> bool:
    """A read of one run is a look too: the run's request, past its expiry, is settled
    before the run is shown (else it would read as running and waiting). The run's memory
    says whether it waits and until when, so a run with nothing due costs no query."""
    pending = run.awaited_approval
    if pending is None:
        return False
    now = now or timezone.now()
    if run.status != rules.RUNNING:
        # An ended run still naming a request: left so by an older version, repaired.
        with transaction.atomic():
            locked, state = _locked(run.pk)
            settle_stale_locked(run=locked, state=state, now=now)
        return True
    if now < datetime.fromisoformat(pending["expires_at"]):
        return False
    approval = Approval.objects.filter(pk=pending["approval_id"]).first()
    return approval is not None and settle_if_due(approval, now=now)


def _due(pending: QuerySet[Approval], now: datetime) -> QuerySet[Approval]:
    """Pending requests past their expiry, and those of runs that are over (which older
    versions could leave behind)."""
    return pending.filter(Q(expires_at__lte=now) | ~Q(run__status=rules.RUNNING))


def _settle_each(due: list[Approval], now: datetime) -> int:
    # One request that cannot be settled is logged and left: the others still are.
    return sum(one_by_one(due, partial(settle_if_due, now=now), what="approval"))


def expire_due(*, now: datetime | None = None, limit: int = 500) -> int:
    """The beat sweep: settle every request past its expiry (and any left pending on a run
    that is over). Returns how many it settled."""
    now = now or timezone.now()
    pending = Approval.objects.filter(status=ApprovalStatus.PENDING).select_related("run")
    due = list(_due(pending, now).order_by("expires_at")[:limit])
    return _settle_each(due + _in_ended_trees(pending, now, limit), now)


def _in_ended_trees(pending: QuerySet[Approval], now: datetime, limit: int) -> list[Approval]:
    """Requests of child runs whose tree ended while they waited (SPEC 20), so that a list
    does not show pending what can never be an allow (found by an attacker: `govctl
    approvals list` showed one until its expiry): at most ``limit`` whose parent has ended
    (chosen by the database, however many requests of live trees wait), then, of the
    ``limit`` child requests expiring first, those whose farther ancestor has ended. Two
    indexed reads, three when grandchildren wait; an ancestor only past its idle deadline
    is the other looks' (the poll's, the check's)."""
    waiting = pending.filter(expires_at__gt=now, run__status=rules.RUNNING).exclude(
        run__ancestors=[])
    parent_over = Exists(Run.objects.filter(pk=OuterRef("run__parent_run_id")).exclude(
        status=rules.RUNNING))
    found = list(waiting.filter(parent_over).order_by("expires_at")[:limit])
    children = [a for a in waiting.order_by("expires_at")[:limit] if len(a.run.ancestors) > 1]
    over = {str(pk) for pk in Run.objects.filter(
        pk__in={a for approval in children for a in approval.run.ancestors}).exclude(
        status=rules.RUNNING).values_list("pk", flat=True)} if children else set()
    seen = {approval.pk for approval in found}
    return found + [approval for approval in children
                    if approval.pk not in seen and over.intersection(approval.run.ancestors)]


def settle_due_for_team(team: Team, *, now: datetime | None = None, limit: int = 500) -> int:
    """A look (runs/first_look.py): it settles the team's requests past their expiry first
    (and any left pending on a run that is over), and, while a kill switch is engaged over
    any of the team's runs, the requests of the runs it covers (its fan-out may not have got
    there yet), and those of child runs whose tree ended (`_in_ended_trees`). At most
    ``limit`` of each, soonest expiry first: the beat's `expire_due` and the fan-out do the
    rest. Without an engaged switch that is three indexed reads, four when grandchildren
    wait."""
    now = now or timezone.now()
    pending = (Approval.objects.filter(team=team, status=ApprovalStatus.PENDING)
               .select_related("run").order_by("expires_at"))
    due = list(_due(pending, now)[:limit])
    if cover.engaged_over_team_ids(team.pk):
        due += list(pending.filter(expires_at__gt=now, run__status=rules.RUNNING)[:limit])
    return _settle_each(due + _in_ended_trees(pending, now, limit), now)


def _clean_note(note: str | None, *, required: bool) -> str:
    text = (note or "").strip()
    if required and not text:
        raise ApprovalError(422, "invalid_request", "A denial needs a note: the agent reads it.",
                            {"note": "required to deny"})
    if len(text) > MAX_NOTE:
        raise ApprovalError(422, "invalid_request", f"The note is limited to {MAX_NOTE} "
                            "characters.", {"note": f"at most {MAX_NOTE} characters"})
    return text


@telemetry.traced("governance.approval.decide", telemetry.describe_approval)
def approval_decide(*, team: Team | None, approval_id: Any, decision: str, note: str | None,
                    actor: AbstractBaseUser | None = None, actor_label: str | None = None
                    ) -> Approval:
    """Approve or deny (SPEC 11). Exactly one decision wins: the run's lock serializes the
    deciders and the conditional UPDATE from ``pending`` lets one through; the other gets 409
    ``approval_decided``. After ``expires_at`` the request expires instead, and the decision
    is refused with 409 ``approval_expired``; under a kill switch covering the run it is
    cancelled instead, and the decision refused with 409 ``kill_switch_engaged``. ``team``
    None: any team (the command line)."""
    status = DECISIONS.get(decision)
    if status is None:
        raise ApprovalError(422, "invalid_request", "Decide with approve or deny.",
                            {"decision": "must be approve or deny"})
    text = _clean_note(note, required=status == rules.DENIED)
    # decided_by names a dashboard user, or nobody (a command run without --user); the
    # operator audit log always names who acted.
    label = actor.get_username()[:150] if actor is not None else ""
    audit_label = (actor_label or label or "system")[:150]
    approvals = Approval.objects.all() if team is None else Approval.objects.filter(team=team)
    approval = approvals.filter(pk=approval_id).first()
    if approval is None:
        raise ApprovalError(404, "not_found", "No such approval.")
    expired = False
    kill = None
    ended: rules.RunState | None = None
    stopped: Settled | None = None
    with transaction.atomic():
        # The tree's lock order, root first (docs/reliability.md): an approved tool call
        # counts on the ancestors too.
        tree = lineage.lock_lineage(team_id=approval.team_id, run_id=approval.run_id)
        run, state = _locked(approval.run_id)
        now = timezone.now()
        current = Approval.objects.get(pk=approval.pk)
        waiting = (current.status == ApprovalStatus.PENDING and state.pending is not None
                   and state.pending.approval_id == str(approval.pk))
        if current.status == ApprovalStatus.PENDING and state.status in rules.TERMINAL:
            # Left pending on a run that is over by an older version: nothing can run now.
            settle_stale_locked(run=run, state=state, now=now)
            ended = state
        elif waiting and now >= current.expires_at:
            expired = settle_locked(run=run, state=state, status=rules.EXPIRED,
                                    now=now) is not None
        elif waiting and (kill := covering_kill(run)) is not None:
            # A kill switch covers the run and its fan-out has not got here yet: an approval
            # now would be an allow under the switch. The request is cancelled instead.
            if settle_locked(run=run, state=state, status=rules.CANCELLED, now=now,
                             kill=kill) is None:
                kill = None
        elif waiting:
            settled = settle_locked(run=run, state=state, status=status, now=now, actor=actor,
                                    label=label, note=text, tree=tree)
            if settled is not None and settled.status != status:
                stopped = settled  # the run's ancestors stopped it instead (SPEC 20)
            elif settled is not None:
                audit(actor=actor, actor_label=audit_label, team=approval.team,
                      action=f"approval.{decision}", target=f"run {str(run.pk)[:8]}",
                      detail={"approval": str(approval.pk), "run": str(run.pk),
                              "action": approval.action_name, "step": approval.step,
                              "note": text, "at": now.isoformat()})
                return Approval.objects.select_related("team", "run").get(pk=approval.pk)
        current.refresh_from_db()
    if ended is not None:
        why = f", {ended.stop_reason}" if ended.stop_reason else ""
        raise ApprovalError(409, "run_finished",
                            f"The run is over ({ended.status}{why}): the request was "
                            "cancelled, and an approval could not run anything now.")
    if stopped is not None:
        raise ApprovalError(409, "run_finished",
                            f"{stopped.answer.get('message', 'The run is over.')} The request "
                            "was cancelled: an approval could not run anything now.")
    if kill is not None:
        raise ApprovalError(409, "kill_switch_engaged",
                            f"A kill switch covers the run ({kill}): the request was "
                            "cancelled and the run killed.")
    if expired or current.status == ApprovalStatus.EXPIRED:
        raise ApprovalError(409, "approval_expired",
                            f"The approval expired at {iso(current.expires_at)}: nobody decided "
                            "in time and the run was stopped.")
    raise ApprovalError(409, "approval_decided",
                        f"The approval was already {current.status}"
                        + (f" by {current.decided_by_label}" if current.decided_by_label else "")
                        + ".")
