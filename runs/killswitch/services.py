"""Kill switch services (SPEC 6): engage, release, and the fan-out the Celery tasks run.

The switch row is the authority. The check reads engaged switches inside its transaction,
after locking the run (runs/check/services.py), so the commit of the engage transaction is the
moment from which every check of a covered run stops, in every process, with nothing in
between (no cache, no queue). Everything after that commit is fan-out: marking the covered
runs ``killed`` with an audit record, waking screens, notifying webhooks. It runs on Celery,
is idempotent and may run any number of times.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, connection, transaction
from django.db.models import Q, QuerySet
from django.db.models.fields.json import KT
from django.utils import timezone

from governance.errors import AppError
from governance_client import answers, rules
from policies.models import Team
from policies.services import audit
from runs.check import records, states
from runs.check.policy_cache import rules_for_version
from runs.check.states import RUN_COLUMNS, state_of
from runs.killswitch import cover
from runs.killswitch.selectors import engaged_switch
from runs.live.events import publish_team_event
from runs.models import KillSwitch, Run, RunStatus, Scope, WebhookDelivery
from runs.publisher import publisher
from runs.webhooks.delivery import PENDING, payload_for

log = logging.getLogger(__name__)

MAX_REASON = 1000


class KillSwitchError(AppError):
    """A switch the services refuse (its scope and options do not fit, no reason): the
    application's one error as 422 invalid_request, the message meant for the operator."""

    def __init__(self, message: str) -> None:
        super().__init__(422, "invalid_request", message)


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
    (SPEC 10). If that thread never publishes it, the beat sweep (`stale_work`, every minute)
    finds the switch without `fanout_done_at` and publishes it again; running the fan-out
    twice is harmless."""
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


# Runs killed per transaction: big enough that 10,000 runs take a few round trips, small
# enough that one batch holds its row locks (which checks of those runs wait for) briefly.
FANOUT_BATCH = 1000

# PostgreSQL: the runs locked by the batch's first statement killed by one UPDATE, and their
# audit records written by one INSERT ... SELECT from its RETURNING, in one statement. The
# answer is built in SQL from the same parts as answers.kill_answer: the switch's fixed part, the
# run's usage (rules.RunState.usage: the run ended now, so elapsed is now - started_at,
# rounded to the millisecond) and the limits of the run's policy version.
_KILL_SQL = """
WITH killed AS (
    UPDATE runs_run r SET """ + ", ".join(f"{name} = %({name})s" for name in states.ENDED) + """
    WHERE r.id = ANY(%(ids)s::uuid[]) AND r.status = %(running)s
    RETURNING r.id, r.policy_version_id, r.steps, r.tool_calls, r.cost_usd,
              greatest(0, extract(epoch FROM %(now)s - r.started_at)) AS elapsed
)
""" + records.insert_select_sql({
    # As records.kill_row: a stop with no action, nothing counted, the step unchanged.
    "run_id": "k.id", "step": "k.steps", "outcome": "%(stop)s", "reason": "%(reason)s",
    "action_name": "''", "action_type": "''", "args": "NULL", "repeat_key": "''",
    "repeat_count": "0", "check_id": "NULL", "progress": "NULL", "last_result": "NULL",
    "cost_usd": "0",
    "answer": """%(base)s::jsonb || jsonb_build_object(
        'step', k.steps,
        'usage', jsonb_build_object(
            'steps', k.steps, 'tool_calls', k.tool_calls, 'cost_usd', k.cost_usd::float8,
            'elapsed_s', round(k.elapsed, 3)::float8),
        'limits', %(limits)s::jsonb -> k.policy_version_id::text)""",
    "at": "%(now)s", "elapsed_s": "k.elapsed::float8",
}) + """
FROM killed k
RETURNING run_id
"""


def _killed_columns(now: datetime) -> dict[str, Any]:
    """The columns a kill sets, the same for every run it kills (`rules.kill`)."""
    killed = rules.kill(rules.RunState(started_at=now), now=now)
    assert killed is not None
    return states.columns_of(killed, states.ENDED)


def _limits_of(version_ids: set[int]) -> dict[int, dict[str, Any]]:
    return {pk: rules_for_version(pk).limits() for pk in version_ids}


def _kill_batch(switch: KillSwitch, running: QuerySet[Run]) -> list[tuple[str, int]]:
    """Kill up to FANOUT_BATCH covered running runs in one transaction: one locking read of
    the runs, then one UPDATE of them all and one INSERT of all their audit records.

    The runs are locked in id order, each with the same row lock a check takes before it
    reads the switches, so a check racing the kill either committed before (the kill then
    sees its new state) or waits and then finds the run killed. Every fan-out locks in the
    same order, so two of them (a team and a global switch) never deadlock. A run a check or
    another pass ended meanwhile is re-read under the lock (READ COMMITTED) and left out:
    each run is killed at most once (every run the locking read returns is running and
    stays so under the lock, so each batch kills all it locked). Returns (run id, team id)
    of the runs killed; empty when nothing is left."""
    with transaction.atomic():
        if connection.vendor == "postgresql":
            return _kill_batch_sql(switch, running)
        return _kill_batch_orm(switch, running)


def _settle_pending(switch: KillSwitch, run_ids: list[Any]) -> set[Any]:
    """The batch's runs that wait for an approval (SPEC 11), already locked by the batch:
    the kill cancels the approval, and the approval's final answer (stop / killed, at the
    same step) is the kill's audit record; a request already past its expiry expires
    instead, as it would for any look. Either way the run ends here with its request
    settled, never killed below with it pending (SPEC 10). Rare, so one by one. Returns the
    ids ended."""
    if not run_ids:
        return set()
    from runs.approvals.services import settle_due_locked

    settled = set()
    now = timezone.now()
    for run in Run.objects.filter(pk__in=run_ids).only(*RUN_COLUMNS):
        state = state_of(run)
        if state.pending is None or state.status != rules.RUNNING:
            continue
        after = settle_due_locked(run=run, state=state, now=now,
                                  kill=cover.switch_in_words(switch))
        if after.status != rules.RUNNING:
            settled.add(run.pk)
    return settled


def _locked_batch(running: QuerySet[Run]) -> list[tuple[Any, int, int, Any]]:
    """Lock the batch: (id, team id, policy version id, pending approval or None)."""
    return list(running.select_for_update().order_by("pk")
                .annotate(pending=KT("memory__pending"))
                .values_list("pk", "team_id", "policy_version_id", "pending")[:FANOUT_BATCH])


def _kill_batch_sql(switch: KillSwitch, running: QuerySet[Run]) -> list[tuple[str, int]]:
    rows = _locked_batch(running)
    if not rows:
        return []
    settled = _settle_pending(switch, [pk for pk, _, _, pending in rows if pending])
    locked = [(pk, team_id, version) for pk, team_id, version, _ in rows if pk not in settled]
    if not locked:
        return [(str(pk), team_id) for pk, team_id, _, _ in rows]
    limits = _limits_of({version for _, _, version in locked})
    teams = {pk: team_id for pk, team_id, _ in locked}
    now = timezone.now()
    with connection.cursor() as cursor:
        cursor.execute(_KILL_SQL, {
            "ids": list(teams), "now": now, **_killed_columns(now),
            "running": rules.RUNNING, "stop": rules.STOP, "reason": rules.KILLED,
            "base": json.dumps(answers.kill_answer_fixed(switch.pk, cover.switch_in_words(switch))),
            "limits": json.dumps({str(k): v for k, v in limits.items()}),
        })
        killed = [row[0] for row in cursor.fetchall()]
    every = {pk: team_id for pk, team_id, _, _ in rows}
    return [(str(pk), every[pk]) for pk in [*settled, *killed]]


def _kill_batch_orm(switch: KillSwitch, running: QuerySet[Run]) -> list[tuple[str, int]]:
    locked = _locked_batch(running)
    if not locked:
        return []
    settled = _settle_pending(switch, [pk for pk, _, _, pending in locked if pending])
    rows = list(Run.objects.filter(pk__in=[pk for pk, *_ in locked if pk not in settled])
                .order_by("pk").only(*RUN_COLUMNS))
    teams = {pk: team_id for pk, team_id, _, _ in locked}
    now = timezone.now()
    limits = _limits_of({run.policy_version_id for run in rows})
    killed: list[Run] = []
    decisions: list[tuple[Any, records.DecisionRow]] = []
    words = cover.switch_in_words(switch)
    for run in rows:
        new = rules.kill(state_of(run), now=now)
        if new is None:
            continue
        killed.append(run)
        decisions.append((run.pk, records.kill_row(switch.pk, words, new,
                                                   limits[run.policy_version_id], now)))
    if killed:
        Run.objects.filter(pk__in=[run.pk for run in killed]).update(**_killed_columns(now))
        records.insert_many(decisions, batch_size=FANOUT_BATCH)
    return [(str(pk), teams[pk]) for pk in [*settled, *(run.pk for run in killed)]]


def killswitch_kill_run(*, run_id: Any) -> bool:
    """Kill one running run that an engaged switch covers, now, exactly as the fan-out will
    (whoever looks first: an approved request's poll, runs/approvals/services.py). False
    when no switch covers it or it is over; idempotent like the fan-out."""
    run = Run.objects.filter(pk=run_id, status=rules.RUNNING).only("team_id", "agent").first()
    if run is None:
        return False
    switch = cover.covering_switch(team_id=run.team_id, agent=run.agent, run_id=run.pk)
    if switch is None:
        return False
    killed = _kill_batch(switch, Run.objects.filter(pk=run.pk, status=rules.RUNNING))
    if killed:
        publish_team_event(run.team_id)
    return bool(killed)


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
    """Mark every running covered run ``killed`` (one audit record each), set-based in
    batches (_kill_batch), then create the webhook deliveries. Safe to run any number of
    times, concurrently too: each run is killed under its lock at most once, each delivery
    exists at most once."""
    switch = KillSwitch.objects.filter(pk=switch_id).first()
    if switch is None:
        return None
    running = Run.objects.filter(cover.runs_covered_by(switch), status=rules.RUNNING)
    if switch.released_at is not None:
        # Released before this pass ran: runs started after the release were never covered.
        running = running.filter(started_at__lt=switch.released_at)
    killed: list[str] = []
    while batch := _kill_batch(switch, running):
        killed += [pk for pk, _ in batch]
        for team_id in sorted({team_id for _, team_id in batch}):
            publish_team_event(team_id)  # one wake-up per team and batch, not per run
    deliveries = _ensure_deliveries(switch, resume=switch.fanout_done_at is None)
    if switch.scope == Scope.RUN:
        retire_run_switch(switch_id=switch.pk)
    return FanoutResult(killed=killed, deliveries=deliveries)


RUN_ENDED = "its run ended"


def retired(now: datetime) -> dict[str, Any]:
    """The release of a run switch whose run ended: the columns it sets (here, and for the
    switches of runs that ended before this existed, migration runs 0012)."""
    return {"active": False, "released_at": now, "released_by_label": "the system",
            "release_reason": RUN_ENDED}


def retire_run_switch(*, switch_id: int) -> bool:
    """A run switch whose run has ended has nothing left to guard (a killed run stays killed,
    and a check of an ended run is answered by its end, before any switch is read): it is
    released as "its run ended", so the history does not show it engaged for ever and no
    read of the engaged switches keeps finding it. Returns whether it was retired."""
    return bool(KillSwitch.objects.filter(
        pk=switch_id, scope=Scope.RUN, active=True,
        run__status__in=[s for s in RunStatus.values if s != RunStatus.RUNNING],
    ).update(**retired(timezone.now())))


def killswitch_fanout_done(*, switch_id: int) -> None:
    """Record that a fan-out pass finished, deliveries started. Until then a new pass (the
    task delivered again after its worker died) restarts the deliveries left unstarted."""
    KillSwitch.objects.filter(pk=switch_id, fanout_done_at__isnull=True).update(
        fanout_done_at=timezone.now()
    )


STALE_AFTER = timedelta(minutes=1)
# What one pass of the sweep restarts at most, of each kind: a pass publishes a bounded number
# of messages however much an outage left behind; the next pass (a minute later) takes the
# next ones, as the restarted deliveries end (delivered, or failed after their attempts).
STALE_BATCH = 200


def stale_work(*, now: datetime | None = None) -> tuple[list[int], list[tuple[int, int]]]:
    """Fan-outs not finished and pending deliveries not attempted for a while, oldest first,
    at most STALE_BATCH of each: the switch ids to fan out again, and (delivery id, attempt
    number) pairs to try again."""
    cutoff = (now or timezone.now()) - STALE_AFTER
    fanouts = list(KillSwitch.objects.filter(fanout_done_at__isnull=True, engaged_at__lt=cutoff)
                   .order_by("engaged_at", "pk").values_list("pk", flat=True)[:STALE_BATCH])
    # An old pending delivery is named even if its chain is alive; the delivery's own claim
    # (runs/webhooks/delivery.py) lets a message through only when its attempt is really due,
    # so a live chain is not doubled.
    deliveries = [(pk, max(attempts, 1)) for pk, attempts in WebhookDelivery.objects.filter(
        status=PENDING, created_at__lt=cutoff).order_by("created_at", "pk")
        .values_list("pk", "attempts")[:STALE_BATCH]]
    return fanouts, deliveries
