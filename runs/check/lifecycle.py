"""A run's start and finish (SPEC 5.1): each one or two statements, without a transaction
around a read and a write, on requests every run makes (docs/performance.md). A run waiting
for an approval, or one still checking, is finished under its lock instead (`_finish_locked`).
The checks in between are runs/check/services.py.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from datetime import datetime
from typing import Any

from django.db import IntegrityError, connection, transaction
from django.db.models import Exists, Q
from django.utils import timezone

from governance_client import rules
from policies.models import AgentKey, Policy, Team
from runs.approvals import services as approvals
from runs.check import lineage, lineages, records, states, tree
from runs.check.abandon import abandon_if_idle
from runs.check.policy_cache import rules_for_version
from runs.check.services import ServiceError, locked_run_of_key, remember_run
from runs.check.states import state_of
from runs.killswitch import cover, fanout
from runs.live.events import publish_run_event
from runs.models import KillSwitch, Run


def run_start(
    *, key: AgentKey, agent: str, policy: str | None, task: str | None,
    metadata: dict[str, Any] | None, external_id: str | None,
    parent_run_id: Any = None,
) -> tuple[Run, bool]:
    """Start a run, or return the team's run with this external_id. Returns (run, created).
    ``parent_run_id``: the run this one is a sub-agent of (SPEC 20)."""
    team = key.team
    if key.agent and agent != key.agent:
        # The agent is named in the message too: an MCP client's model, or a log line, shows
        # the message alone (found by a newcomer whose gateway said only "its agent").
        raise ServiceError(422, "invalid_request",
                           f"This key may only start runs of its agent, {key.agent!r}.",
                           {"agent": f"this key is limited to agent {key.agent!r}"})
    if external_id is not None:
        existing = Run.objects.filter(team=team, external_id=external_id).first()
        if existing is not None:
            return _same_start(existing, key, parent_run_id), False
    parent = _parent_of(key, parent_run_id) if parent_run_id is not None else None
    if parent is not None and policy is None:
        policy = parent.policy_version.document.get("name")  # the parent's (SPEC 20)
    name = policy or "default"
    # The version comes along: the answer shows it, without a query of its own.
    policy_row = Policy.objects.filter(team=team, name=name).select_related("current").first()
    if policy_row is None or policy_row.current_id is None:
        raise ServiceError(422, "invalid_request", f"Unknown policy {name!r}.",
                           {"policy": f"no policy named {name!r} in this team"})
    limits = rules_for_version(policy_row.current_id)
    metadata = rules.redact(metadata or {}, limits.redact_args)
    now = timezone.now()
    run = Run(team=team, agent=agent, policy_version=policy_row.current,
              started_at=now, task=task or "", metadata=metadata,
              external_id=external_id,
              idle_deadline=rules.next_deadline(limits, rules.RunState(started_at=now), now))
    if parent is not None:
        run.parent_run_id = parent.pk
        run.root_run_id = parent.root_run_id or parent.pk
        run.depth = parent.depth + 1
        run.ancestors = [*(parent.ancestors or []), str(parent.pk)]
    try:
        for _ in range(2):
            if _insert_unless_switched(run):
                break
            if parent is not None:
                _refuse_if_over(Run.objects.only("status", "stop_reason").get(pk=parent.pk))
            switch = cover.covering_switch(team_id=team.pk, agent=agent, run_id=None)
            if switch is not None:
                raise ServiceError(409, "kill_switch_engaged",
                                   f"No new run may start: {cover.switch_in_words(switch)}.")
            # Released between the two statements: the start is tried once more.
        else:
            raise ServiceError(409, "kill_switch_engaged",
                               "No new run may start: a kill switch covers it.")
    except IntegrityError:
        # Two starts raced with one external_id: the loser answers with the winner's run.
        # Without an external_id the error is something else, never another run's start.
        if external_id is None:
            raise
        existing = Run.objects.filter(team=team, external_id=external_id).first()
        if existing is None:
            raise
        return _same_start(existing, key, parent_run_id), False
    lineages.remember(run.pk, team.pk, run.ancestors)
    publish_run_event(run)
    return run, True


PARENT_FIELD = "parent_run_id"


def _parent_of(key: AgentKey, parent_run_id: Any) -> Run:
    """The parent a start names (SPEC 20): a running run of the key's team (another team's
    or unknown: 404 naming the field; an agent-bound key sees only its agent's runs), not
    over (409 `parent_finished`), not at the deepest level (422), not under a kill switch
    (409 `kill_switch_engaged`, for the parent or any of its ancestors)."""
    runs = Run.objects.select_related("policy_version").filter(team=key.team, pk=parent_run_id)
    if key.agent:
        runs = runs.filter(agent=key.agent)
    parent = runs.first()
    if parent is None:
        raise ServiceError(404, "not_found", "No such parent run.",
                           {PARENT_FIELD: "no run of this key's team with this id"})
    parent = abandon_if_idle(parent)
    _refuse_if_over(parent)
    if parent.depth + 1 > rules.MAX_DEPTH:
        raise ServiceError(422, "invalid_request", "The request is not valid.",
                           {PARENT_FIELD: f"a run tree is at most {rules.MAX_DEPTH} levels "
                            "deep below its root; that run is at the deepest level"})
    # The parent still reads running until its next check, but its tree is over when one
    # of its ancestors is: ended, or past its idle deadline, as the rules read the tree
    # (found by an attacker: a grandchild started under a child whose root had finished,
    # or gone idle, then stopped at its first check).
    ended = rules.ended_ancestor(lineage.read_lineage(parent.ancestors or []), timezone.now())
    if ended is not None:
        over, reason = ended
        status = over.state.status if over.state.status != rules.RUNNING else "over"
        # "is completed", not "is completed (reason: completed)", as `_refuse_if_over`.
        why = f" (reason: {reason})" if reason != status else ""
        raise ServiceError(
            409, "parent_finished", f"The parent run's ancestor {over.run_id} is "
            f"{status}{why}: the tree is over, no sub-agent may start in it.",
            {PARENT_FIELD: f"an ancestor of that run is {status}{why}"})
    family = [*(parent.ancestors or []), str(parent.pk)]
    for ancestor in Run.objects.filter(pk__in=family).only("id", "team_id", "agent"):
        switch = cover.covering_switch(team_id=ancestor.team_id, agent=ancestor.agent,
                                       run_id=ancestor.pk)
        if switch is not None:
            raise ServiceError(409, "kill_switch_engaged",
                               f"No new run may start: {cover.switch_in_words(switch)}.")
    return parent


def _refuse_if_over(parent: Run) -> None:
    if parent.status != rules.RUNNING:
        reason = parent.stop_reason or parent.status
        # "is completed", not "is completed (reason: completed)": a finish's reason is its
        # status (as the rules' parent_stopped says it).
        why = f" (reason: {reason})" if reason != parent.status else ""
        message = f"The parent run is {parent.status}{why}: no sub-agent may start under it."
        if parent.status in (rules.STOPPED, rules.KILLED):
            # Its stop in its own words, as every later check of the parent answers it: a
            # kill's switch, who engaged it and why; a limit and its value (found by an
            # agent author: the operator's reason was lost, and an MCP gateway's model reads
            # this message). One probe of the parent's first stop, on a refusal only.
            words, _ = records.stop_detail(parent.pk, parent.stop_reason or parent.status)
            if words:
                message = f"{message} Its stop: {words}"
        raise ServiceError(409, "parent_finished", message,
                           {PARENT_FIELD: f"that run is {parent.status}"})


def _same_start(existing: Run, key: AgentKey, parent_run_id: Any) -> Run:
    """The team's run an external_id names (SPEC 5.1), except to a key bound to another
    agent, which would read another agent's run through it (SPEC 10); and, to a start that
    names a parent, only when it is that parent's child: else a sub-agent would be handed a
    run outside the tree, with a budget of its own (SPEC 20). A team key sees every agent's
    runs: it gets the run whatever agent its start names."""
    if key.agent and existing.agent != key.agent:
        raise ServiceError(409, "external_id_conflict",
                           "This external_id belongs to a run of another agent.",
                           {"external_id": "already used by a run of another agent"})
    if parent_run_id is not None and str(existing.parent_run_id) != str(parent_run_id):
        raise ServiceError(409, "external_id_conflict",
                           "This external_id belongs to a run that is not a child of this "
                           "parent_run_id.",
                           {"external_id": "already used by a run outside this parent"})
    return existing


# The cover rule for a run that does not exist yet; parameters: team, team, agent. `ks.active`
# as the partial unique index of the switches' keys says it, so that both databases read
# the (at most three) keys from it.
_NOT_SWITCHED = f"""
WHERE NOT EXISTS (
    SELECT 1 FROM runs_killswitch ks WHERE ks.active AND (
        {cover.covers_sql(switch="ks", team="%s", agent="%s", run=None)}))
"""


# A sub-agent's start inserts only under a parent still running, read in the same statement,
# locked (PostgreSQL: FOR SHARE, so a finish committing meanwhile is waited for and read;
# SQLite writes one statement at a time): a start and its parent's finish at the same moment
# made a running child of a completed parent (found by an attacker, 13 times in 40).
_PARENT_RUNNING = f"""
AND EXISTS (
    SELECT 1 FROM runs_run p WHERE p.id = %s AND p.status = '{rules.RUNNING}' {{lock}})
"""


@functools.cache
def _start_sql(vendor: str, *, with_parent: bool) -> str:
    """The start's INSERT, built once per database backend (the quoting is the backend's)."""
    fields = Run._meta.concrete_fields
    columns = ", ".join(connection.ops.quote_name(f.column) for f in fields)
    parent = _PARENT_RUNNING.format(lock="FOR SHARE" if vendor == "postgresql" else "") \
        if with_parent else ""
    return (f"INSERT INTO {connection.ops.quote_name(Run._meta.db_table)} ({columns}) "
            f"SELECT {', '.join(['%s'] * len(fields))} {_NOT_SWITCHED}{parent}")


def _insert_unless_switched(run: Run) -> bool:
    """Insert a new run unless an engaged kill switch covers it, or its parent has ended;
    False when either happened.

    One statement, so the switch is read with the snapshot of the insert itself (a switch
    committed before the start began is always seen, SPEC 4.5) and no transaction has to be
    opened around a read and a write: one round trip instead of four, and no ORM query to
    build, on a request every run makes (docs/performance.md). The values are prepared by the
    model's own fields, as `Run.objects.create` would.
    """
    fields = Run._meta.concrete_fields
    values = [f.get_db_prep_save(getattr(run, f.attname), connection) for f in fields]
    with_parent = run.parent_run_id is not None
    sql = _start_sql(connection.vendor, with_parent=with_parent)
    params = [*values, run.team_id, run.team_id, run.agent]
    if with_parent:
        params.append(Run._meta.pk.get_db_prep_value(run.parent_run_id, connection))
    # Inside a caller's transaction (tests, scripts) a savepoint keeps that transaction usable
    # after a refused insert (a duplicate external_id); on its own the statement is atomic.
    guard = transaction.atomic() if connection.in_atomic_block else nullcontext()
    with guard, connection.cursor() as cursor:
        cursor.execute(sql, params)
        inserted = cursor.rowcount == 1
    if inserted:
        run._state.adding, run._state.db = False, connection.alias
        remember_run(run.pk, run.team_id, run.agent, run.policy_version_id)
    return inserted


def run_finish(*, team: Team, run_id: Any, status: str, output: str | None,
               key_agent: str = "") -> Run:
    """Finish a run (SPEC 5.1) without a transaction around a read and a write: the run is
    read, `rules.finish` decides, and the update applies only if the run is still as read.
    A check that stopped the run, took a step or opened an approval, or another finish, in
    between makes it match nothing, and the finish is decided again on the new row. Two
    round trips instead of four, on a request every run makes (docs/performance.md); a run
    whose agent keeps checking while it finishes is finished under its lock after two
    misses (`_finish_locked`)."""
    for _ in range(2):
        runs = Run.objects.select_related("policy_version").filter(team=team, pk=run_id)
        if key_agent:  # an agent-bound key finishes only its agent's runs (SPEC 10)
            runs = runs.filter(agent=key_agent)
        run = runs.first()
        if run is None:
            raise ServiceError(404, "not_found", "No such run.")
        now = timezone.now()
        # A finish after the idle deadline finds the run abandoned (SPEC 14): it then keeps
        # that status and reason and stores the output, like any stopped run. First, as in a
        # check (SPEC 21): an idle sub-agent under an ended tree is abandoned, not
        # parent_stopped (found by a review). A run waiting for an operator has no deadline.
        run = abandon_if_idle(run, now=now)
        if run.awaited_approval is not None or _tree_over(run, now):
            return _finish_locked(team=team, run_id=run.pk, status=status, output=output,
                                  key_agent=key_agent)
        try:
            new_state = rules.finish(state_of(run), status,
                                     already_finished=run.finished_at is not None, now=now)
        except rules.FinishError:
            raise ServiceError(409, "run_finished", "This run was already finished.") from None
        # Finishing changes only these: the counters and the memory stay as the last check
        # left them, and are not written back.
        changes = {**states.columns_of(new_state, states.ENDED), "finished_at": now}
        if output is not None:
            changes["output"] = output
        # A check that opened an approval since the read makes this match nothing too: the
        # next pass finishes through _finish_locked, which cancels it. So does a step taken
        # since: its audit record's time would come after the end read before it (found by
        # an attacker racing 40 checks with a finish: an allow 3.7 ms after `ended_at`).
        no_approval = Q(memory__pending=None) | Q(memory__pending__isnull=True)
        # Nor while an engaged switch covers the run: the fan-out may not have reached it
        # yet, and the kill comes first (`_finish_locked`; found by an attacker: a finish
        # between an engage and its fan-out ended the run `completed`, no kill recorded).
        unchanged = Run.objects.filter(no_approval, pk=run.pk, status=run.status,
                                       steps=run.steps, finished_at__isnull=True)
        if run.status == rules.RUNNING:  # an ended run is never killed: nothing to look for
            unchanged = unchanged.exclude(Exists(KillSwitch.objects.filter(
                target__in=cover.tree_covering_targets(run), active=True)))
        if unchanged.update(**changes):
            states.set_columns(run, changes)
            publish_run_event(run)
            tree.publish_ancestors(run)
            return run
    return _finish_locked(team=team, run_id=run_id, status=status, output=output,
                          key_agent=key_agent)


def _tree_over(run: Run, now: datetime) -> bool:
    """Whether a running sub-agent's tree is over (SPEC 20), read without locks (one query,
    for a child run only): its finish then goes under the locks, which decide."""
    return (run.status == rules.RUNNING and bool(run.ancestors)
            and rules.ended_ancestor(lineage.read_lineage(run.ancestors), now) is not None)


def _finish_locked(*, team: Team, run_id: Any, status: str, output: str | None,
                   key_agent: str = "") -> Run:
    """Finish a run under its lock: one that waits for an approval (SPEC 11), whose request
    expires if it is past its expiry, else finishing cancels it, and one whose checks kept
    changing it under `run_finish`'s reads; then the run is finished as usual (a stopped run
    keeps its status and reason). The end's time is read under the lock, after every check
    that committed before it. A sub-agent whose tree is over is stopped `parent_stopped`
    first (SPEC 20: a stop of an ancestor stops the tree), its ancestors locked before it
    (the tree's lock order, runs/check/tree.py)."""
    with transaction.atomic():
        ancestors = lineage.lock_lineage(team_id=team.pk, run_id=run_id)
        run = locked_run_of_key(team=team, run_id=run_id, key_agent=key_agent)
        if run.finished_at is not None:
            raise ServiceError(409, "run_finished", "This run was already finished.")
        fanout.kill_locked_if_covered(run)  # a covered run is killed, then finished
        now = timezone.now()
        state = approvals.settle_due_locked(run=run, state=state_of(run), now=now,
                                            tree=ancestors)
        stopped = rules.stopped_by_tree(state, ancestors, now)
        if stopped is not None:
            decision, state = stopped
            records.insert(run.pk, [records.tree_stop_row(
                decision, state, rules_for_version(run.policy_version_id), now)])
        new_state = rules.finish(state, status, already_finished=False, now=now)
        approvals.settle_on_end(run=run, before=state, after=new_state, now=now)
        states.set_columns(run, states.columns_of(new_state, (*states.ENDED, "memory")))
        run.finished_at = now
        fields = [*states.ENDED, "memory", "finished_at"]
        if output is not None:
            run.output = output
            fields.append("output")
        run.save(update_fields=fields)
    publish_run_event(run)
    tree.publish_ancestors(run)
    return run
