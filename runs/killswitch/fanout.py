"""The kill switch's fan-out (SPEC 6): what follows an engage's commit, run by the Celery task
(runs/killswitch/tasks.py), by the publisher's thread while the broker is down, and by whoever
looks first at a covered run (`killswitch_kill_run`). It marks the covered running runs
``killed`` with one audit record each, in batches, with two twins of one batch: one SQL
statement on PostgreSQL (`_KILL_SQL`), the ORM elsewhere; then it creates the webhook
deliveries (runs/killswitch/deliveries.py) and retires a run switch whose run ended.
Idempotent: it may run any number of times, concurrently too.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import connection, transaction
from django.db.models import Exists, F, OuterRef, QuerySet
from django.db.models.fields.json import KT
from django.utils import timezone

from governance_client import answers, rules
from runs.check import records, states
from runs.check.policy_cache import rules_for_version
from runs.check.states import RUN_COLUMNS, state_of
from runs.killswitch import cover
from runs.killswitch.deliveries import ensure_deliveries
from runs.live.events import publish_team_event
from runs.models import KillSwitch, Run, RunStatus, Scope


@dataclass(frozen=True)
class FanoutResult:
    killed: list[str]  # run ids killed by this pass (empty when run again)
    deliveries: list[int]  # deliveries this pass must start


# Runs killed per transaction: big enough that 10,000 runs take a few round trips, small
# enough that one batch holds its row locks (which checks of those runs wait for) briefly.
FANOUT_BATCH = 1000
# Of a batch's runs waiting for an approval, at most this many are settled in it (one by one,
# about 10 ms each); the others are left to the next batches: a batch is a fan-out's turn, and
# 1,000 waiting runs made one turn 10 s, which another team's kill waited for (found by an
# attacker).
SETTLE_PER_BATCH = 50

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
    # The switch's rule, with the run's policy and version (answers.PER_RUN_RULE).
    "rule": "%(rule)s::jsonb || (%(refs)s::jsonb -> k.policy_version_id::text)",
    "answer": """%(base)s::jsonb || jsonb_build_object(
        'rule', %(rule)s::jsonb || (%(refs)s::jsonb -> k.policy_version_id::text),
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


def _refs_of(version_ids: set[int]) -> dict[int, tuple[str, int]]:
    """Each version's (policy name, version number), which a kill's rule names."""
    return {pk: answers.policy_ref(rules_for_version(pk)) for pk in version_ids}


def _switch_rule(switch: KillSwitch) -> dict[str, Any]:
    team = switch.team.slug if switch.team_id is not None else None
    return cover.switch_rule(switch, team=team)


def _kill_batch(switch: KillSwitch, running: QuerySet[Run]) -> list[tuple[str, int]]:
    """Kill up to FANOUT_BATCH covered running runs in one transaction: one locking read of
    the runs, then one UPDATE of them all and one INSERT of all their audit records.

    The runs are locked by depth, then in id order (a parent before its children: the
    tree's lock order, runs/check/tree.py), each with the same row lock a check takes
    before it reads the switches, so a check racing the kill either committed before (the kill then
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
    # The lock order of a tree (runs/check/tree.py): a parent before its children, so the
    # runs by depth first (a check locks the root, then down to its run).
    return list(running.select_for_update().order_by("depth", "pk")
                .annotate(pending=KT("memory__pending"))
                .values_list("pk", "team_id", "policy_version_id", "pending")[:FANOUT_BATCH])


def _settle_some(switch: KillSwitch, rows: list[tuple[Any, int, int, Any]]
                 ) -> tuple[set[Any], set[Any]]:
    """The batch's waiting runs: (those settled now, those left to the next batches)."""
    waiting = [pk for pk, _, _, pending in rows if pending]
    return _settle_pending(switch, waiting[:SETTLE_PER_BATCH]), set(waiting[SETTLE_PER_BATCH:])


def _kill_batch_sql(switch: KillSwitch, running: QuerySet[Run]) -> list[tuple[str, int]]:
    rows = _locked_batch(running)
    if not rows:
        return []
    settled, later = _settle_some(switch, rows)
    locked = [(pk, team_id, version) for pk, team_id, version, _ in rows
              if pk not in settled and pk not in later]
    if not locked:
        return [(str(pk), team_id) for pk, team_id, _, _ in rows if pk in settled]
    versions = {version for _, _, version in locked}
    limits = _limits_of(versions)
    fired = _switch_rule(switch)
    base = answers.kill_answer_fixed(switch.pk, cover.switch_in_words(switch), fired)
    rule = {k: v for k, v in base["rule"].items() if k not in answers.PER_RUN_RULE}
    refs = {str(pk): {"policy": name, "version": number}
            for pk, (name, number) in _refs_of(versions).items()}
    teams = {pk: team_id for pk, team_id, _ in locked}
    now = timezone.now()
    with connection.cursor() as cursor:
        cursor.execute(_KILL_SQL, {
            "ids": list(teams), "now": now, **_killed_columns(now),
            "running": rules.RUNNING, "stop": rules.STOP, "reason": rules.KILLED,
            "base": json.dumps(base), "rule": json.dumps(rule), "refs": json.dumps(refs),
            "limits": json.dumps({str(k): v for k, v in limits.items()}),
        })
        killed = [row[0] for row in cursor.fetchall()]
    every = {pk: team_id for pk, team_id, _, _ in rows}
    return [(str(pk), every[pk]) for pk in [*settled, *killed]]


def _kill_batch_orm(switch: KillSwitch, running: QuerySet[Run]) -> list[tuple[str, int]]:
    locked = _locked_batch(running)
    if not locked:
        return []
    settled, later = _settle_some(switch, locked)
    rows = list(Run.objects.filter(pk__in=[pk for pk, *_ in locked
                                           if pk not in settled and pk not in later])
                .order_by("depth", "pk").only(*RUN_COLUMNS))
    teams = {pk: team_id for pk, team_id, _, _ in locked}
    now = timezone.now()
    versions = {run.policy_version_id for run in rows}
    limits, refs = _limits_of(versions), _refs_of(versions)
    killed: list[Run] = []
    decisions: list[tuple[Any, records.DecisionRow]] = []
    words = cover.switch_in_words(switch)
    fired = _switch_rule(switch)
    for run in rows:
        new = rules.kill(state_of(run), now=now)
        if new is None:
            continue
        killed.append(run)
        decisions.append((run.pk, records.kill_row(
            switch.pk, words, new, limits[run.policy_version_id], now, fired=fired,
            policy=refs[run.policy_version_id])))
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


def kill_locked_if_covered(run: Run) -> bool:
    """Kill ``run``, locked by the caller's transaction, now if an engaged switch covers it
    or one of its ancestors, exactly as the fan-out will (whoever looks first): what an
    upload of local decisions and a finish do under the run's lock before anything else
    (found by an attacker: an upload or a finish sent between an engage and the fan-out
    ended the run `stopped` or `completed`, its local allows not flagged and no kill
    recorded, and the fan-out then passed it by). False when none covers it or it is over;
    ``run`` is read again when it was killed."""
    if run.status != rules.RUNNING:
        return False
    switch = cover.covering_switch_of_tree(run)
    if switch is None:
        return False
    killed = _kill_batch(switch, Run.objects.filter(pk=run.pk, status=rules.RUNNING))
    if killed:
        run.refresh_from_db()
        team_id = run.team_id
        transaction.on_commit(lambda: publish_team_event(team_id))
    return bool(killed)


def _covered_running(switch: KillSwitch) -> QuerySet[Run]:
    """The running runs the switch covers. A run started after the switch's release was
    never covered: the release is read by each batch's own locking statement, not from
    ``switch`` as this pass read it (found by a tester: a pass that read the switch while
    it was engaged killed a run started 5 ms after its release)."""
    released_before = KillSwitch.objects.filter(pk=switch.pk,
                                                released_at__lte=OuterRef("started_at"))
    return Run.objects.filter(cover.runs_covered_by(switch), ~Exists(released_before),
                              status=rules.RUNNING)


def _kill_next_batch(switch: KillSwitch, running: QuerySet[Run]) -> list[str]:
    batch = _kill_batch(switch, running)
    for team_id in sorted({team_id for _, team_id in batch}):
        publish_team_event(team_id)  # one wake-up per team and batch, not per run
    return [pk for pk, _ in batch]


def _after_kills(switch: KillSwitch, killed: list[str]) -> FanoutResult:
    deliveries = ensure_deliveries(switch, resume=switch.fanout_done_at is None)
    if switch.scope == Scope.RUN:
        retire_run_switch(switch_id=switch.pk)
    return FanoutResult(killed=killed, deliveries=deliveries)


def killswitch_fanout(*, switch_id: int) -> FanoutResult | None:
    """Mark every running covered run ``killed`` (one audit record each), set-based in
    batches (_kill_batch), then create the webhook deliveries. Safe to run any number of
    times, concurrently too: each run is killed under its lock at most once, each delivery
    exists at most once."""
    switch = KillSwitch.objects.filter(pk=switch_id).first()
    if switch is None:
        return None
    running = _covered_running(switch)
    killed: list[str] = []
    while batch := _kill_next_batch(switch, running):
        killed += batch
    return _after_kills(switch, killed)


def killswitch_fanout_turn(*, switch_id: int) -> FanoutResult | None:
    """One turn of a fan-out (`next_fanout`): one batch of its covered runs killed, its
    turns counted (`fanout_passes`), None while runs may be left (or the switch is gone);
    the batch that finds none left ends it as `killswitch_fanout` does, with its result.
    A batch, not the whole fan-out: one team's switch over 60,000 of its own runs held both
    fan-out processes for 10 to 20 s while another team's switch waited (found by an
    attacker). Ended only by a batch that found nothing, never by a short one: a batch
    that waited on another pass's locks comes back short with runs still left."""
    switch = KillSwitch.objects.filter(pk=switch_id).first()
    if switch is None:
        return None
    # Counted before the batch, so that a process choosing meanwhile sees the team served.
    KillSwitch.objects.filter(pk=switch_id).update(
        fanout_turned_at=timezone.now(), fanout_passes=F("fanout_passes") + 1)
    if _kill_next_batch(switch, _covered_running(switch)):
        return None
    return _after_kills(switch, [])


# How far back a team's last turn counts (`next_fanout`): a team whose last turn is older is
# as a team never served.
FAIR_WINDOW_S = 60.0

# The waiting fan-out whose turn comes next: the team (the global switches are a team of
# their own) whose last turn is the oldest, a team never served (in the window) first; of its
# waiting switches, the one that has had the fewest turns, then the oldest. Round robin over
# the teams with fan-outs waiting, a batch of runs a turn: whatever one team queues (switch
# after switch, or a switch over tens of thousands of its runs), another team's kill waits for
# at most one batch of each team served meanwhile. Not by how much a team engaged lately: a
# team in an incident engages many switches, and its next one must not wait behind an
# attacker's batches for that (found by an attacker against a version that counted them).
_NEXT_SQL = """
WITH waiting AS (
    SELECT id, coalesce(team_id, 0) AS team, engaged_at, fanout_passes
    FROM runs_killswitch
    WHERE fanout_done_at IS NULL{skip}
), served AS (
    SELECT coalesce(team_id, 0) AS team, max(fanout_turned_at) AS last
    FROM runs_killswitch
    WHERE fanout_turned_at >= %s
    GROUP BY coalesce(team_id, 0)
)
SELECT waiting.id FROM waiting LEFT JOIN served ON served.team = waiting.team
ORDER BY served.last IS NOT NULL, served.last, waiting.fanout_passes, waiting.engaged_at,
         waiting.id
LIMIT 1
"""


def next_fanout(*, skip: Collection[int] = ()) -> int | None:
    """The waiting fan-out whose turn comes first (`_NEXT_SQL`), but those in ``skip``;
    None when none waits. One queue serves every team's fan-outs in the order they were
    engaged, so without turns one team engaging switch after switch (found by an attacker:
    2,000 in 15 s, each its own fan-out task) put another team's kill 20 s behind them (SPEC
    10). Every fan-out task takes turns (runs/killswitch/tasks.py)."""
    since = timezone.now() - timedelta(seconds=FAIR_WINDOW_S)
    skipped = list(skip)
    sql = _NEXT_SQL.format(skip=f" AND id NOT IN ({', '.join(['%s'] * len(skipped))})"
                           if skipped else "")
    with connection.cursor() as cursor:
        cursor.execute(sql, [*skipped, connection.ops.adapt_datetimefield_value(since)])
        row = cursor.fetchone()
    return row[0] if row else None


def fanout_done(switch_id: int) -> bool:
    """Whether the switch's fan-out is recorded done (a switch that is gone: nothing to do)."""
    return not KillSwitch.objects.filter(pk=switch_id, fanout_done_at__isnull=True).exists()


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

