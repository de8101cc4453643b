"""Kill switch services (SPEC 6): engage, release, and the fan-out the Celery tasks run.

The switch row is the authority. The check reads engaged switches inside its transaction,
after locking the run (runs/check/services.py), so the commit of the engage transaction is the
moment from which every check of a covered run stops, in every process, with nothing in
between (no cache, no queue). Everything after that commit is fan-out: marking the covered
runs ``killed`` with an audit record, waking screens, notifying webhooks. It runs on Celery,
is idempotent and may run any number of times (runs/killswitch/fanout.py); the beat sweep
restarts what an outage left behind (runs/killswitch/sweep.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from governance.errors import AppError
from governance_client import rules
from policies.models import Team
from policies.services import audit
from runs import telemetry
from runs.killswitch import cover
from runs.killswitch.fanout import killswitch_fanout
from runs.killswitch.selectors import engaged_switch
from runs.live.events import publish_team_event
from runs.models import KillSwitch, Run, Scope
from runs.publisher import publisher

log = logging.getLogger(__name__)

MAX_REASON = 1000


class KillSwitchError(AppError):
    """A switch the services refuse (its scope and options do not fit, no reason): the
    application's one error as 422 invalid_request, the message meant for the operator;
    ``field`` names the option at fault in the error's ``fields`` (SPEC 5.3)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(422, "invalid_request", message,
                         {field: message} if field is not None else None)


class ReleaseRefused(AppError):
    """The switch engaged at the moment of the release, read under its lock, is not one this
    person may release (`killswitch_release`'s ``may``): 403, saying why and whom to ask."""

    def __init__(self, switch: KillSwitch, message: str) -> None:
        super().__init__(403, "forbidden", message)
        self.switch = switch


@dataclass(frozen=True)
class Target:
    """What a switch covers, validated. ``key`` is the KillSwitch.target string that the
    partial unique index keeps to one engaged switch (cover.target_key, which the reads of
    the covering switches look up)."""

    scope: Scope
    team: Team | None
    agent: str
    run: Run | None

    @property
    def key(self) -> str:
        return cover.target_key(self.scope, team_id=self.team.pk if self.team else None,
                                agent=self.agent, run_id=self.run.pk if self.run else None)

    def describe(self) -> str:
        return cover.scope_in_words(self.scope, team=self.team, agent=self.agent, run_id=(
            self.run.pk if self.run is not None else None))

    def cover(self) -> Q:
        return cover.runs_covered(self.scope, team_id=self.team.pk if self.team else None,
                                  agent=self.agent, run_id=self.run.pk if self.run else None)


def a_switch(scope: str) -> str:
    """The switch of ``scope`` as a refusal starts with it: "An agent switch", "A team
    switch" (found by a reviewer: "A agent switch")."""
    name = str(getattr(scope, "value", scope))
    return f"{'An' if name[0] in 'aeiou' else 'A'} {name} switch"


def resolve_target(*, scope: str, team: Team | None = None, agent: str = "",
                   run: Run | None = None) -> Target:
    """Check that the options fit the scope; a run switch takes its team from the run."""
    try:
        kind = Scope(scope)
    except ValueError:
        raise KillSwitchError(
            f"Unknown scope {scope!r}: use one of {', '.join(Scope.values)}.", "scope"
        ) from None
    agent = (agent or "").strip()
    if kind == Scope.GLOBAL:
        if team is not None or agent or run is not None:
            extra = "team" if team is not None else "agent" if agent else "run"
            raise KillSwitchError("A global switch takes no team, agent or run.", extra)
        return Target(kind, None, "", None)
    if kind == Scope.RUN:
        if run is None:
            raise KillSwitchError("A run switch needs the run.", "run")
        if agent:
            raise KillSwitchError("A run switch takes no agent: it covers one run.", "agent")
        if team is not None and team.pk != run.team_id:
            raise KillSwitchError("This run belongs to another team.", "run")
        return Target(kind, run.team, "", run)
    if team is None:
        raise KillSwitchError(f"{a_switch(kind)} needs the team.", "team")
    if run is not None:
        raise KillSwitchError(f"{a_switch(kind)} takes no run.", "run")
    if kind == Scope.TEAM:
        if agent:
            raise KillSwitchError("A team switch takes no agent: use the agent scope.",
                                  "agent")
        return Target(kind, team, "", None)
    if not rules.AGENT_NAME.fullmatch(agent):
        raise KillSwitchError("An agent switch needs the agent name ([A-Za-z0-9._-], 1 to 100).",
                              "agent")
    return Target(kind, team, agent, None)


def _clean_reason(reason: str | None) -> str:
    text = (reason or "").strip()
    if not text:
        raise KillSwitchError("A reason is required.", "reason")
    if len(text) > MAX_REASON:
        raise KillSwitchError(f"The reason is limited to {MAX_REASON} characters.", "reason")
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


def _run_fanout_here(switch_id: int) -> None:
    """Mark the covered runs killed without a worker (the webhooks wait for one: the
    deliveries stay pending until the fan-out task or the sweep starts them)."""
    try:
        killswitch_fanout(switch_id=switch_id)
    except Exception:
        log.exception("the fan-out of kill switch %s failed", switch_id)


def _enqueue_fanout(switch_id: int) -> None:
    """After the engage's commit. The embedded default runs the task eagerly, here (no
    broker to wait for); with a broker, the publish is handed to a background thread
    (runs/publisher.py), so an engage returns once its commit is done whatever Redis is doing
    (SPEC 10). If that thread never publishes it, the beat sweep (every minute, sweep.py
    `stale_work`) finds the switch without `fanout_done_at` and publishes it again; running
    the fan-out (fanout.py) twice is harmless."""
    from runs.killswitch.tasks import killswitch_fanout_task

    if killswitch_fanout_task.app.conf.task_always_eager:
        try:
            killswitch_fanout_task.delay(switch_id)
        except Exception:
            log.exception("the fan-out task of kill switch %s failed; running it here",
                          switch_id)
            _run_fanout_here(switch_id)
        return
    # While the broker is down or hung the publisher's thread marks the covered runs killed
    # itself, so screens and the API show them killed without waiting for it; the webhooks
    # wait for the worker (or the sweep).
    publisher.submit(killswitch_fanout_task.name, switch_id,
                     while_down=partial(_run_fanout_here, switch_id))


def _last_switch_if_over(run: Run) -> KillSwitch | None:
    """The answer to a run switch's engage when the run is over: nothing to kill. Its
    fan-out retires a run switch once the run is over, so an engage sent again after it (a
    retry, a second operator) found no engaged switch and engaged a new one, told it had
    changed something, with a fan-out of its own (found by a tester: two and three
    "engaged" answers for one run). The run's last switch is the answer, as a switch still
    engaged is; without one, a refusal. None while the run is running."""
    status = Run.objects.filter(pk=run.pk).values_list("status", flat=True).first()
    if status is None or status == rules.RUNNING:
        return None
    last = KillSwitch.objects.filter(run_id=run.pk).order_by("-engaged_at", "-pk").first()
    if last is None:
        raise KillSwitchError(f"Run {run.pk} is already {status}: there is nothing to kill.",
                              "run")
    return last


@telemetry.traced("governance.killswitch.engage", telemetry.describe_engage)
def killswitch_engage(
    *, scope: str, team: Team | None = None, agent: str = "", run: Run | None = None,
    reason: str, actor: AbstractBaseUser | None = None, actor_label: str | None = None,
) -> KillSwitch:
    """Engage a kill switch and commit before returning (SPEC 4.5, 6).

    Engaging a target that is already engaged changes nothing and returns the engaged switch
    (callers tell the two apart by ``engaged_now``); so does a run switch of a run that is
    over, returning the run's last switch (``active`` false once its fan-out retired it).
    Raises KillSwitchError, for a run that is over without a switch among others.
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
        over = _last_switch_if_over(target.run) if target.run is not None else None
        if over is not None:
            return over
        now = timezone.now()
        try:
            with transaction.atomic():
                switch = KillSwitch.objects.create(
                    scope=target.scope, team=target.team, agent=target.agent, run=target.run,
                    target=target.key, reason=reason, engaged_by=actor,
                    engaged_by_label=label, engaged_at=now,
                )
                switch.engaged_now = True
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


@telemetry.traced("governance.killswitch.release", telemetry.describe_release)
def killswitch_release(
    *, scope: str, team: Team | None = None, agent: str = "", run: Run | None = None,
    reason: str, actor: AbstractBaseUser | None = None, actor_label: str | None = None,
    may: Callable[[KillSwitch], str | None] | None = None,
) -> KillSwitch | None:
    """Release the engaged switch of a target. Returns it, or None when the target was not
    engaged (nothing changes, and that is a success). Killed runs stay killed.

    ``may`` says why the actor may not release the switch it is given (None: they may),
    asked of the engaged switch under its lock: asked before, an operator allowed to release
    the switches they engaged could release one an admin engaged in between, after another
    release (found by an attacker; `ReleaseRefused`, nothing changed)."""
    target = resolve_target(scope=scope, team=team, agent=agent, run=run)
    reason = _clean_reason(reason)
    label = _label(actor, actor_label)
    with transaction.atomic(durable=True):
        switch = (KillSwitch.objects.select_for_update()
                  .filter(target=target.key, active=True).first())
        if switch is None:
            return None
        refusal = may(switch) if may is not None else None
        if refusal is not None:
            raise ReleaseRefused(switch, refusal)
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
