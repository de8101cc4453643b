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
- the run is finished (runs/check/services.py `run_finish`).

Settling applies `rules.settle` (the run's counters, status and active time), writes the final
answer as a second audit record at the same step, and, after the commit, wakes the screens and
notifies the team's webhook (``approval.decided``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from datetime import datetime
from functools import partial
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.utils import timezone

from governance_client import rules
from policies.models import AgentKey, Team
from policies.services import audit
from runs.check import metrics, run_memory
from runs.check.check_store import state_of
from runs.check.policy_cache import rules_for_version
from runs.killswitch import cover
from runs.live.events import publish_team_event
from runs.models import (
    Approval,
    ApprovalStatus,
    Decision,
    Run,
    WebhookDelivery,
)
from runs.webhooks.delivery import APPROVAL_DECIDED, APPROVAL_REQUESTED, approval_payload

log = logging.getLogger(__name__)

MAX_NOTE = 2000
DECISIONS = {"approve": rules.APPROVED, "deny": rules.DENIED}


class ApprovalError(Exception):
    """A refusal: the API and the dashboard turn it into their own error (SPEC 5.3 codes)."""

    def __init__(self, status: int, code: str, message: str,
                 fields: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.fields = status, code, message, fields or {}


def iso(moment: datetime | None) -> str | None:
    return moment.isoformat().replace("+00:00", "Z") if moment is not None else None


def answer_of(decision: rules.Decision, state: rules.RunState, policy: rules.Policy,
              now: datetime) -> dict[str, Any]:
    """A check answer (SPEC 5.2, 15), as the check builds it."""
    from runs.check.services import _answer_of

    return _answer_of(decision, state, policy, now)


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
                  kill: str | None = None) -> Settled | None:
    """Settle the run's pending approval. The caller holds the run's row lock and passes the
    run's state as read under it. Returns None when the conditional UPDATE finds the request
    no longer pending (another decision won)."""
    pending = state.pending
    assert pending is not None
    if status == rules.CANCELLED and kill is None:
        # Finishing the run: the final answer is the finished run's stop.
        raise ValueError("use run_finish to cancel by finishing")
    # The answer names the approved key's count, which an approval also raises.
    state = run_memory.load(state.copy(), run.id, [(rules.REPEAT, pending.repeat_key)])
    # The policy restarts an approved run's idle deadline: time pending is not idle (SPEC 14).
    decision, new = rules.settle(state, status, now=now, by=label or None, note=note, kill=kill,
                                 policy=rules_for_version(run.policy_version_id))
    decided_at = pending.expires_at if status == rules.EXPIRED else now
    won = Approval.objects.filter(pk=pending.approval_id, status=ApprovalStatus.PENDING).update(
        status=status, decided_at=decided_at, decided_by=actor, decided_by_label=label,
        note=note,
    )
    if not won:
        return None
    Run.objects.filter(pk=run.id).update(
        status=new.status, stop_reason=new.stop_reason, ended_at=new.ended_at,
        tool_calls=new.tool_calls, memory=new.fixed_memory(), idle_deadline=new.idle_deadline,
    )
    run_memory.save(run.id, state, new)
    answer = _final(run, pending, decision, new, now, label)
    _record_final(run, pending, answer, now, decision)
    requested_at = pending.since
    transaction.on_commit(partial(_after_change, pending.approval_id, APPROVAL_DECIDED,
                                  team_id=run.team_id, status=status,
                                  latency=(decided_at - requested_at).total_seconds()),
                          robust=True)
    return Settled(status=status, answer=answer, state=new)


def cancel_for_finish(*, run: Any, state: rules.RunState, new: rules.RunState,
                      now: datetime) -> None:
    """Finishing the run cancels its pending approval (SPEC 11); the final answer is the
    finished run's stop. The caller holds the run's lock and writes the run itself."""
    pending = state.pending
    assert pending is not None
    won = Approval.objects.filter(pk=pending.approval_id, status=ApprovalStatus.PENDING).update(
        status=rules.CANCELLED, decided_at=now)
    if not won:
        return
    decision = rules.terminal_decision(new, pending.repeat_key)
    decision = replace(decision, step=pending.step, approval=pending.summary(rules.CANCELLED))
    answer = _final(run, pending, decision, new, now, "")
    _record_final(run, pending, answer, now, decision)
    transaction.on_commit(partial(_after_change, pending.approval_id, APPROVAL_DECIDED,
                                  team_id=run.team_id, status=rules.CANCELLED,
                                  latency=(now - pending.since).total_seconds()), robust=True)


def _final(run: Any, pending: rules.Pending, decision: rules.Decision, new: rules.RunState,
           now: datetime, label: str) -> dict[str, Any]:
    answer = answer_of(decision, new, rules_for_version(run.policy_version_id), now)
    # The approver is named in the answer (and so in its audit record): null for a command
    # run without --user, an expiry or a cancellation.
    answer["approval"] = {**(decision.approval or pending.summary()),
                          "decided_by": label or None}
    return answer


def _record_final(run: Any, pending: rules.Pending, answer: dict[str, Any], now: datetime,
                  decision: rules.Decision) -> None:
    """The second audit record, at the approval's step, and the final answer on the request."""
    approval = Approval.objects.only("args").get(pk=pending.approval_id)
    row = Decision.objects.create(
        run_id=run.id, step=pending.step, outcome=decision.outcome, reason=decision.reason,
        action_name=pending.action_name, action_type=pending.action_type, args=approval.args,
        repeat_key=pending.repeat_key, repeat_count=decision.repeat_count, check_id=None,
        answer=answer, at=now,
    )
    answer["decision_id"] = row.pk
    Approval.objects.filter(pk=pending.approval_id).update(final_decision_id=row.pk,
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
    from runs.webhooks.delivery import schedule_delivery

    team = approval.team
    if not team.webhook_url:
        return
    delivery, created = WebhookDelivery.objects.get_or_create(
        approval=approval, event=event,
        defaults={"team": team, "url": team.webhook_url,
                  "payload": approval_payload(approval, event)},
    )
    if created:
        try:
            schedule_delivery(delivery.pk, 1, 0)
        except Exception:
            # The broker is down: the beat sweep restarts pending deliveries (runs/tasks.py).
            log.exception("could not schedule webhook delivery %s", delivery.pk)


def _locked(run_id: Any) -> tuple[Run, rules.RunState]:
    run = Run.objects.select_for_update().get(pk=run_id)
    return run, state_of(run)


def covering_kill(run: Any) -> str | None:
    """The kill switch covering the run, in the words the agent reads; None when none does."""
    from runs.killswitch import cover

    switch = cover.covering_switch(team_id=run.team_id, agent=run.agent, run_id=run.id)
    return cover.switch_in_words(switch) if switch is not None else None


def settle_if_due(approval: Approval, *, now: datetime | None = None) -> bool:
    """Whoever looks first settles what is due (SPEC 11): a GET, a page, the sweep. That is
    the expiry once ``expires_at`` has passed, and the cancellation of a request whose run a
    kill switch covers: the fan-out cancels it too, but from the switch's commit on the run's
    answer is stop / killed (SPEC 4.5), and a look must not wait for a broker to say so.
    True when this call settled it."""
    now = now or timezone.now()
    if approval.status != ApprovalStatus.PENDING:
        return False
    expired = now >= approval.expires_at
    if not expired and covering_kill(approval.run) is None:
        return False
    with transaction.atomic():
        run, state = _locked(approval.run_id)
        if state.pending is None or state.pending.approval_id != str(approval.pk):
            return False
        if expired:
            settled = settle_locked(run=run, state=state, status=rules.EXPIRED, now=now)
        else:
            kill = covering_kill(run)  # again, under the run's lock: it may be released
            if kill is None:
                return False
            settled = settle_locked(run=run, state=state, status=rules.CANCELLED, now=now,
                                    kill=kill)
    return settled is not None


def settle_if_due_for_run(run: Run, *, now: datetime | None = None) -> bool:
    """A read of one run is a look too: the run's request, past its expiry, is settled
    before the run is shown (else it would read as running and waiting). The run's memory
    says whether it waits and until when, so a run with nothing due costs no query."""
    pending = (run.memory or {}).get("pending")
    if run.status != rules.RUNNING or not pending:
        return False
    now = now or timezone.now()
    if now < datetime.fromisoformat(pending["expires_at"]):
        return False
    approval = Approval.objects.filter(pk=pending["approval_id"]).first()
    return approval is not None and settle_if_due(approval, now=now)


def expire_due(*, now: datetime | None = None, limit: int = 500) -> int:
    """The beat sweep: settle every request past its expiry. Returns how many it expired."""
    now = now or timezone.now()
    due = list(Approval.objects.filter(status=ApprovalStatus.PENDING, expires_at__lte=now)
               .order_by("expires_at")[:limit])
    return sum(settle_if_due(approval, now=now) for approval in due)


def _clean_note(note: str | None, *, required: bool) -> str:
    text = (note or "").strip()
    if required and not text:
        raise ApprovalError(422, "invalid_request", "A denial needs a note: the agent reads it.",
                            {"note": "required to deny"})
    if len(text) > MAX_NOTE:
        raise ApprovalError(422, "invalid_request", f"The note is limited to {MAX_NOTE} "
                            "characters.", {"note": f"at most {MAX_NOTE} characters"})
    return text


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
    with transaction.atomic():
        run, state = _locked(approval.run_id)
        now = timezone.now()
        current = Approval.objects.get(pk=approval.pk)
        waiting = (current.status == ApprovalStatus.PENDING and state.pending is not None
                   and state.pending.approval_id == str(approval.pk))
        if waiting and now >= current.expires_at:
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
                                    label=label, note=text)
            if settled is not None:
                audit(actor=actor, actor_label=audit_label, team=approval.team,
                      action=f"approval.{decision}", target=f"run {str(run.pk)[:8]}",
                      detail={"approval": str(approval.pk), "run": str(run.pk),
                              "action": approval.action_name, "step": approval.step,
                              "note": text, "at": now.isoformat()})
                return Approval.objects.select_related("team", "run").get(pk=approval.pk)
        current.refresh_from_db()
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


# --- Reads --------------------------------------------------------------------------------

def approval_json(approval: Approval) -> dict[str, Any]:
    """The answer of GET /api/v1/approvals/{id} (SPEC 11)."""
    return {
        "id": str(approval.pk),
        "run_id": str(approval.run_id),
        "status": approval.status,
        "action": {"name": approval.action_name, "type": approval.action_type,
                   "args": approval.args if approval.args is not None else {}},
        "requested_at": iso(approval.requested_at),
        "expires_at": iso(approval.expires_at),
        "decided_at": iso(approval.decided_at),
        "decided_by": approval.decided_by_label or None,
        "note": approval.note or None,
        "decision": approval.decision if approval.status != ApprovalStatus.PENDING else None,
    }


def approval_for_key(key: AgentKey, approval_id: Any) -> Approval | None:
    """The key's team's approval (an agent-bound key: only its agent's), with what is due
    (an expiry, a kill switch's cancellation) settled."""
    approvals = Approval.objects.filter(team_id=key.team_id).select_related("run")
    if key.agent:
        approvals = approvals.filter(run__agent=key.agent)
    approval = approvals.filter(pk=approval_id).first()
    if approval is not None and settle_if_due(approval):
        approval.refresh_from_db()
    return approval


def approvals_for_team(team: Team, *, limit: int = 100) -> list[Approval]:
    """Pending first (soonest to expire first), then the latest decided ones."""
    pending = list(Approval.objects.filter(team=team, status=ApprovalStatus.PENDING)
                   .select_related("run").order_by("expires_at")[:limit])
    decided = list(Approval.objects.filter(team=team).exclude(status=ApprovalStatus.PENDING)
                   .select_related("run").order_by("-decided_at", "-requested_at")[:limit])
    return pending + decided


def pending_count(team: Team) -> int:
    return Approval.objects.filter(team=team, status=ApprovalStatus.PENDING).count()


def settle_due_for_team(team: Team, *, now: datetime | None = None) -> int:
    """A page looks: it settles the team's requests past their expiry first, and, while a
    kill switch is engaged over any of the team's runs, the requests of the runs it covers
    (its fan-out may not have got there yet). Without an engaged switch that is one
    indexed read more."""
    now = now or timezone.now()
    pending = Approval.objects.filter(team=team, status=ApprovalStatus.PENDING)
    due = list(pending.filter(expires_at__lte=now))
    if cover.engaged_over_team_ids(team.pk):
        due += list(pending.filter(expires_at__gt=now).select_related("run"))
    return sum(settle_if_due(approval, now=now) for approval in due)


def pending_for_run(run: Run) -> Approval | None:
    return Approval.objects.filter(run=run, status=ApprovalStatus.PENDING).first()
