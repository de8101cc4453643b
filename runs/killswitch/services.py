"""Kill switch services (SPEC 6): engage, release, and the fan-out the Celery tasks run.

The switch row is the authority. The check reads engaged switches inside its transaction,
after locking the run (runs/check/services.py), so the commit of the engage transaction is the
moment from which every check of a covered run stops, in every process, with nothing in
between (no cache, no queue). Everything after that commit is fan-out: marking the covered
runs ``killed`` with an audit record, waking screens, notifying webhooks. It runs on Celery,
is idempotent and may run any number of times.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from governance_client import rules
from policies.models import Team
from policies.services import audit
from runs.check.policy_cache import rules_for_version
from runs.check.services import state_of
from runs.killswitch import cover
from runs.live.events import publish_run_event, publish_team_event
from runs.models import Decision, KillSwitch, Run, Scope, WebhookDelivery
from runs.webhooks.delivery import PENDING, payload_for

log = logging.getLogger(__name__)

MAX_REASON = 1000


class KillSwitchError(ValueError):
    """A request the services refuse: the message is meant for the operator."""


@dataclass(frozen=True)
class Target:
    """What a switch covers, validated. ``key`` is the KillSwitch.target string that the
    partial unique index keeps to one engaged switch."""

    scope: Scope
    team: Team | None
    agent: str
    run: Run | None

    @property
    def key(self) -> str:
        if self.scope == Scope.GLOBAL:
            return "global"
        assert self.team is not None
        if self.scope == Scope.TEAM:
            return f"team:{self.team.pk}"
        if self.scope == Scope.AGENT:
            return f"agent:{self.team.pk}:{self.agent}"
        assert self.run is not None
        return f"run:{self.run.pk}"

    def describe(self) -> str:
        return cover.scope_in_words(self.scope, team=self.team, agent=self.agent, run_id=(
            self.run.pk if self.run is not None else None))

    def cover(self) -> Q:
        return cover.runs_covered(self.scope, team_id=self.team.pk if self.team else None,
                                  agent=self.agent, run_id=self.run.pk if self.run else None)


def resolve_target(*, scope: str, team: Team | None = None, agent: str = "",
                   run: Run | None = None) -> Target:
    """Check that the options fit the scope; a run switch takes its team from the run."""
    try:
        kind = Scope(scope)
    except ValueError:
        raise KillSwitchError(
            f"Unknown scope {scope!r}: use one of {', '.join(Scope.values)}."
        ) from None
    agent = (agent or "").strip()
    if kind == Scope.GLOBAL:
        if team is not None or agent or run is not None:
            raise KillSwitchError("A global switch takes no team, agent or run.")
        return Target(kind, None, "", None)
    if kind == Scope.RUN:
        if run is None:
            raise KillSwitchError("A run switch needs the run.")
        if agent:
            raise KillSwitchError("A run switch takes no agent: it covers one run.")
        if team is not None and team.pk != run.team_id:
            raise KillSwitchError("This run belongs to another team.")
        return Target(kind, run.team, "", run)
    if team is None:
        raise KillSwitchError(f"A {kind.value} switch needs the team.")
    if run is not None:
        raise KillSwitchError(f"A {kind.value} switch takes no run.")
    if kind == Scope.TEAM:
        if agent:
            raise KillSwitchError("A team switch takes no agent: use the agent scope.")
        return Target(kind, team, "", None)
    if not rules.AGENT_NAME.fullmatch(agent):
        raise KillSwitchError("An agent switch needs the agent name ([A-Za-z0-9._-], 1 to 100).")
    return Target(kind, team, agent, None)


def _clean_reason(reason: str | None) -> str:
    text = (reason or "").strip()
    if not text:
        raise KillSwitchError("A reason is required.")
    if len(text) > MAX_REASON:
        raise KillSwitchError(f"The reason is limited to {MAX_REASON} characters.")
    return text


def _label(actor: AbstractBaseUser | None, actor_label: str | None) -> str:
    label = actor_label or (actor.get_username() if actor is not None else "system")
    return label[:150]


def _team_ids(target_team: Team | None) -> list[int]:
    if target_team is not None:
        return [target_team.pk]
    return list(Team.objects.values_list("pk", flat=True))


def _wake(team: Team | None) -> None:
    for team_id in _team_ids(team):
        publish_team_event(team_id)


def _enqueue_fanout(switch_id: int) -> None:
    from runs.killswitch.tasks import killswitch_fanout_task

    try:
        killswitch_fanout_task.delay(switch_id)
    except Exception:
        # The switch is committed and every check already stops: a broker outage must not
        # fail the engage. Mark the runs here instead; the webhooks wait for a worker.
        log.exception("could not enqueue the fan-out of kill switch %s; running it here",
                      switch_id)
        try:
            killswitch_fanout(switch_id=switch_id)
        except Exception:
            log.exception("the fan-out of kill switch %s failed", switch_id)


def covered_running(target: Target) -> QuerySet[Run]:
    """The running runs a switch on this target would stop (for the confirmation step)."""
    return Run.objects.filter(target.cover(), status=rules.RUNNING)


def engaged_switch(target: Target) -> KillSwitch | None:
    return KillSwitch.objects.filter(target=target.key, active=True).first()


def killswitch_engage(
    *, scope: str, team: Team | None = None, agent: str = "", run: Run | None = None,
    reason: str, actor: AbstractBaseUser | None = None, actor_label: str | None = None,
) -> KillSwitch:
    """Engage a kill switch and commit before returning (SPEC 4.5, 6).

    Engaging a target that is already engaged changes nothing and returns the engaged switch
    (callers tell the two apart by ``engaged_at``). Raises KillSwitchError.
    """
    target = resolve_target(scope=scope, team=team, agent=agent, run=run)
    reason = _clean_reason(reason)
    label = _label(actor, actor_label)
    # durable: refuse to run inside a caller's transaction, whose commit would come later
    # than the return of this function and break the promise above.
    with transaction.atomic(durable=True):
        existing = engaged_switch(target)
        if existing is not None:
            return existing
        now = timezone.now()
        try:
            with transaction.atomic():
                switch = KillSwitch.objects.create(
                    scope=target.scope, team=target.team, agent=target.agent, run=target.run,
                    target=target.key, reason=reason, engaged_by=actor,
                    engaged_by_label=label, engaged_at=now,
                )
        except IntegrityError:
            # Two engages of one target raced; the partial unique index let one win, and
            # that one is the engaged switch for both callers.
            existing = engaged_switch(target)
            if existing is None:
                raise
            return existing
        audit(
            actor=actor, actor_label=label, action="killswitch.engage", team=target.team,
            target=target.describe(),
            detail={"switch": switch.pk, "scope": target.scope.value, "agent": target.agent or None,
                    "run": str(target.run.pk) if target.run else None, "reason": reason,
                    "at": now.isoformat()},
        )
        # Never enqueue inside the transaction: a worker could read before the commit.
        transaction.on_commit(partial(_enqueue_fanout, switch.pk), robust=True)
    _wake(target.team)
    return switch


def killswitch_release(
    *, scope: str, team: Team | None = None, agent: str = "", run: Run | None = None,
    reason: str, actor: AbstractBaseUser | None = None, actor_label: str | None = None,
) -> KillSwitch | None:
    """Release the engaged switch of a target. Returns it, or None when the target was not
    engaged (nothing changes, and that is a success). Killed runs stay killed."""
    target = resolve_target(scope=scope, team=team, agent=agent, run=run)
    reason = _clean_reason(reason)
    label = _label(actor, actor_label)
    with transaction.atomic(durable=True):
        switch = (KillSwitch.objects.select_for_update()
                  .filter(target=target.key, active=True).first())
        if switch is None:
            return None
        now = timezone.now()
        switch.active = False
        switch.released_by, switch.released_by_label = actor, label
        switch.released_at, switch.release_reason = now, reason
        switch.save(update_fields=["active", "released_by", "released_by_label", "released_at",
                                   "release_reason"])
        audit(
            actor=actor, actor_label=label, action="killswitch.release", team=target.team,
            target=target.describe(),
            detail={"switch": switch.pk, "scope": target.scope.value, "agent": target.agent or None,
                    "run": str(target.run.pk) if target.run else None, "reason": reason,
                    "at": now.isoformat(), "engaged_at": switch.engaged_at.isoformat()},
        )
    _wake(target.team)
    return switch


# --- Fan-out -------------------------------------------------------------------------------

@dataclass(frozen=True)
class FanoutResult:
    killed: list[str]  # run ids killed by this pass (empty when run again)
    deliveries: list[int]  # deliveries this pass must start


def _kill_answer(switch: KillSwitch, run: Run, state: rules.RunState, now: datetime
                 ) -> dict[str, Any]:
    """The audit record's answer, shaped like a check answer so screens show it the same."""
    return {
        "decision": rules.STOP,
        "reason": "killed",
        "step": state.steps,
        "repeat_key": "",
        "repeat_count": 0,
        "message": f"Stopped by a kill switch: {cover.switch_in_words(switch)}.",
        "next_action": rules.NEXT_ACTION["killed"],
        "usage": state.usage(now),
        "limits": rules_for_version(run.policy_version_id).limits(),
        "directive": None,
        "shadow": None,
        "approval": None,
        "retry_after_s": None,
        "kill_switch": switch.pk,
    }


def _kill_one(switch: KillSwitch, run_id: Any) -> str | None:
    """Kill one run under its lock, the same lock the check takes, so a kill and a check of
    the run never interleave. None when the run is already over (the idempotence)."""
    with transaction.atomic():
        run = (Run.objects.select_for_update()
               .only("id", "team_id", "policy_version_id", "status", "stop_reason", "steps",
                     "tool_calls", "cost_usd", "started_at", "ended_at", "memory")
               .filter(pk=run_id).first())
        if run is None:
            return None
        now = timezone.now()
        new = rules.kill(state_of(run), now=now)
        if new is None:
            return None
        run.status, run.stop_reason, run.ended_at = new.status, new.stop_reason, new.ended_at
        run.save(update_fields=["status", "stop_reason", "ended_at"])
        Decision.objects.create(
            run=run, step=new.steps, outcome=rules.STOP, reason="killed", action_name="",
            action_type="", args=None, answer=_kill_answer(switch, run, new, now), at=now,
            elapsed_s=new.elapsed_s(now),
        )
    publish_run_event(run)
    return str(run.pk)


def killed_by(switch: KillSwitch, team: Team) -> list[str]:
    """The team's runs this switch stopped: covered, killed since it was engaged, whether by
    the fan-out or by a check that saw the switch first."""
    ids = (Run.objects.filter(cover.runs_covered_by(switch), team=team, status=rules.KILLED,
                              stop_reason="killed", ended_at__gte=switch.engaged_at)
           .order_by("ended_at", "id").values_list("pk", flat=True))
    return [str(pk) for pk in ids]


def _teams_to_notify(switch: KillSwitch) -> QuerySet[Team]:
    teams = Team.objects.exclude(webhook_url__isnull=True).exclude(webhook_url="")
    if switch.scope != Scope.GLOBAL:
        teams = teams.filter(pk=switch.team_id)
    return teams.order_by("pk")


def _ensure_deliveries(switch: KillSwitch, *, resume: bool) -> list[int]:
    """One delivery per notified team (unique per switch and team). Returns the ids to start:
    the ones created now, and, when a previous pass died before finishing (``resume``), the
    ones it created but may not have started."""
    start: list[int] = []
    for team in _teams_to_notify(switch):
        payload = payload_for(switch, team, killed_by(switch, team))
        try:
            with transaction.atomic():
                delivery, created = WebhookDelivery.objects.get_or_create(
                    switch=switch, team=team,
                    defaults={"url": team.webhook_url, "payload": payload},
                )
        except IntegrityError:  # a concurrent pass created it: that pass starts it
            continue
        if created or (resume and delivery.status == PENDING and delivery.attempts == 0):
            start.append(delivery.pk)
    return start


def killswitch_fanout(*, switch_id: int) -> FanoutResult | None:
    """Mark every running covered run ``killed`` (one audit record each), then create the
    webhook deliveries. Safe to run any number of times, concurrently too: each run is
    killed under its lock at most once, each delivery exists at most once."""
    switch = KillSwitch.objects.filter(pk=switch_id).first()
    if switch is None:
        return None
    running = Run.objects.filter(cover.runs_covered_by(switch), status=rules.RUNNING)
    if switch.released_at is not None:
        # Released before this pass ran: runs started after the release were never covered.
        running = running.filter(started_at__lt=switch.released_at)
    killed = [pk for pk in (_kill_one(switch, run_id)
                            for run_id in running.values_list("pk", flat=True)) if pk]
    deliveries = _ensure_deliveries(switch, resume=switch.fanout_done_at is None)
    return FanoutResult(killed=killed, deliveries=deliveries)


def killswitch_fanout_done(*, switch_id: int) -> None:
    """Record that a fan-out pass finished, deliveries started. Until then a new pass (the
    task delivered again after its worker died) restarts the deliveries left unstarted."""
    KillSwitch.objects.filter(pk=switch_id, fanout_done_at__isnull=True).update(
        fanout_done_at=timezone.now()
    )


STALE_AFTER = timedelta(minutes=1)


def stale_work(*, now: datetime | None = None) -> tuple[list[int], list[tuple[int, int]]]:
    """Fan-outs not finished and pending deliveries not attempted for a while: the switch
    ids to fan out again, and (delivery id, attempt number) pairs to try again."""
    cutoff = (now or timezone.now()) - STALE_AFTER
    fanouts = list(KillSwitch.objects.filter(fanout_done_at__isnull=True, engaged_at__lt=cutoff)
                   .values_list("pk", flat=True))
    # Every old pending delivery is named; the delivery's own claim (runs/webhooks/delivery.py) lets
    # a message through only when its attempt is really due, so a live chain is not doubled.
    deliveries = [(pk, max(attempts, 1)) for pk, attempts in WebhookDelivery.objects.filter(
        status=PENDING, created_at__lt=cutoff).values_list("pk", "attempts")]
    return fanouts, deliveries


# --- Reads for screens ---------------------------------------------------------------------

def engaged_for_team(team: Team) -> list[KillSwitch]:
    """Engaged switches covering the team, for its banner and kill switch page. A run switch
    is listed only while its run is running: once the run is killed (and a killed run stays
    killed) it has nothing left to guard."""
    return list(
        KillSwitch.objects.filter(active=True)
        .filter(cover.team_switches(team.pk)
                | Q(scope=Scope.RUN, team=team, run__status=rules.RUNNING))
        .select_related("team", "run")
        .order_by("engaged_at", "pk")
    )


def history_for_team(team: Team, *, limit: int = 50) -> list[KillSwitch]:
    return list(
        KillSwitch.objects.filter(Q(scope=Scope.GLOBAL) | Q(team=team))
        .select_related("team", "run").order_by("-engaged_at", "-pk")[:limit]
    )
