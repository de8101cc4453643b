"""Writes for runs: start, check, finish. Each is one transaction that locks the run first,
so the checks of one run are serialized in every process (SPEC 4.5)."""

from __future__ import annotations

import functools
import logging
import uuid
from contextlib import nullcontext
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from django.db import DatabaseError, IntegrityError, OperationalError, connection, transaction
from django.utils import timezone

from governance_client import rules
from policies.models import AgentKey, Policy, Team
from policies.services import KeyClaim, agent_key_matches, agent_key_touch
from runs.check import metrics
from runs.check.abandon import abandon_if_idle
from runs.check.check_store import (
    DecisionRow,
    DuplicateCheck,
    HitRow,
    RateRead,
    RunRow,
    RunUpdate,
    StaleConnection,
    check_transaction,
)
from runs.check.policy_cache import rules_for_version
from runs.killswitch import cover
from runs.live.events import publish_run_event
from runs.models import Run

log = logging.getLogger(__name__)


class ServiceError(Exception):
    """A refusal the API turns into its JSON error (SPEC 5.3)."""

    def __init__(self, status: int, code: str, message: str, fields: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.fields = status, code, message, fields or {}


def state_of(run: Run | RunRow) -> rules.RunState:
    """The rules' view of a run, from the ORM row or the check's own read (same fields)."""
    return rules.RunState(
        started_at=run.started_at,
        status=run.status,
        stop_reason=run.stop_reason,
        ended_at=run.ended_at,
        steps=run.steps,
        tool_calls=run.tool_calls,
        cost_usd=Decimal(run.cost_usd),
        idle_deadline=run.idle_deadline,
    ).load_memory(run.memory)


def run_start(
    *, key: AgentKey, agent: str, policy: str | None, task: str | None,
    metadata: dict[str, Any] | None, external_id: str | None,
) -> tuple[Run, bool]:
    """Start a run, or return the team's run with this external_id. Returns (run, created)."""
    team = key.team
    if key.agent and agent != key.agent:
        raise ServiceError(422, "invalid_request", "This key may only start runs of its agent.",
                           {"agent": f"this key is limited to agent {key.agent!r}"})
    if external_id is not None:
        existing = Run.objects.filter(team=team, external_id=external_id).first()
        if existing is not None:
            return existing, False
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
              external_id=external_id, idle_deadline=rules.idle_deadline(limits, now))
    try:
        for _ in range(2):
            if _insert_unless_switched(run):
                break
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
        return existing, False
    publish_run_event(run)
    return run, True


# The cover rule for a run that does not exist yet; parameters: True, team, team, agent.
_NOT_SWITCHED = f"""
WHERE NOT EXISTS (
    SELECT 1 FROM runs_killswitch ks WHERE ks.active = %s AND (
        {cover.covers_sql(switch="ks", team="%s", agent="%s", run=None)}))
"""


@functools.cache
def _start_sql(vendor: str) -> str:
    """The start's INSERT, built once per database backend (the quoting is the backend's)."""
    fields = Run._meta.concrete_fields
    columns = ", ".join(connection.ops.quote_name(f.column) for f in fields)
    return (f"INSERT INTO {connection.ops.quote_name(Run._meta.db_table)} ({columns}) "
            f"SELECT {', '.join(['%s'] * len(fields))} {_NOT_SWITCHED}")


def _insert_unless_switched(run: Run) -> bool:
    """Insert a new run unless an engaged kill switch covers it; False when one does.

    One statement, so the switch is read with the snapshot of the insert itself (a switch
    committed before the start began is always seen, SPEC 4.5) and no transaction has to be
    opened around a read and a write: one round trip instead of four, and no ORM query to
    build, on a request every run makes (docs/performance.md). The values are prepared by the
    model's own fields, as `Run.objects.create` would.
    """
    fields = Run._meta.concrete_fields
    values = [f.get_db_prep_save(getattr(run, f.attname), connection) for f in fields]
    sql = _start_sql(connection.vendor)
    # Inside a caller's transaction (tests, scripts) a savepoint keeps that transaction usable
    # after a refused insert (a duplicate external_id); on its own the statement is atomic.
    guard = transaction.atomic() if connection.in_atomic_block else nullcontext()
    with guard, connection.cursor() as cursor:
        cursor.execute(sql, [*values, True, run.team_id, run.team_id, run.agent])
        inserted = cursor.rowcount == 1
    if inserted:
        run._state.adding, run._state.db = False, connection.alias
    return inserted


@dataclass(frozen=True)
class CheckRequest:
    name: str
    type: str
    args: dict[str, Any]
    progress: str | int | float | None
    last_result: dict[str, Any] | None
    cost_usd: Decimal
    check_id: str | None


# SPEC 15: every check answer carries these, null where they do not apply. Answers stored
# before a field existed get it on replay.
ANSWER_DEFAULTS: dict[str, Any] = {
    "directive": None, "shadow": None, "approval": None, "retry_after_s": None,
}


def _answer_of(decision: rules.Decision, state: rules.RunState, policy: rules.Policy,
               now: Any) -> dict[str, Any]:
    return {
        "decision": decision.answer,
        "reason": decision.reason,
        "step": decision.step,
        "repeat_key": decision.repeat_key,
        "repeat_count": decision.repeat_count,
        "message": decision.message,
        "next_action": decision.next_action,
        "usage": state.usage(now),
        "limits": policy.limits(),
        "directive": decision.directive,
        "shadow": decision.shadow,
        "approval": None,  # SPEC 11 (approvals) fills it for a pending answer
        "retry_after_s": decision.retry_after_s,
    }


def abandon_answer(state: rules.RunState, policy: rules.Policy, now: Any) -> dict[str, Any]:
    """The audit record of an abandonment (SPEC 14), shaped like a check answer (as a kill's
    is) so screens show it the same way."""
    return {
        **ANSWER_DEFAULTS,
        "decision": rules.STOP, "reason": rules.ABANDONED, "step": state.steps,
        "repeat_key": "", "repeat_count": 0, "message": rules.abandoned_message(policy),
        "next_action": rules.NEXT_ACTION[rules.ABANDONED], "usage": state.usage(now),
        "limits": policy.limits(),
    }


def abandon_row(state: rules.RunState, policy: rules.Policy, now: Any) -> DecisionRow:
    """Audited like a kill by the fan-out: outcome stop, no action, step unchanged."""
    return DecisionRow(
        step=state.steps, outcome=rules.STOP, reason=rules.ABANDONED, action_name="",
        action_type="", args=None, repeat_key="", repeat_count=0, check_id=None,
        progress=None, last_result=None, cost_usd=Decimal(0),
        answer=abandon_answer(state, policy, now), at=now, elapsed_s=state.elapsed_s(now),
    )


UNAUTHORIZED = "A valid agent key is required (Authorization: Bearer)."


def run_check(*, claim: KeyClaim, run_id: uuid.UUID, req: CheckRequest) -> dict[str, Any]:
    """Decide one check and answer it (SPEC 4, 5.2): authenticate the key, lock the run,
    apply the pure rules, store the new state and the audit record in one transaction.

    The key is looked up in the statement that locks the run (runs/check/check_store.py), so a
    check costs two round trips to PostgreSQL; a revoked or unknown key answers 401, another
    team's run 404, before anything is written.
    """
    for attempt in (1, 2):
        try:
            return _check_once(claim=claim, run_id=run_id, req=req)
        except DuplicateCheck:
            # A retry of this check_id committed while we waited for the run's lock: the
            # second attempt reads its answer (at most once: that answer now exists).
            if attempt == 2:
                raise
        except StaleConnection as exc:
            # A persistent connection that died while idle (PostgreSQL restarted) fails the
            # first statement. Retried once on a new connection, which is what Django's
            # per-request health check would do, without that check's extra round trip on
            # every request. Nothing was written: it was the locking read that failed.
            connection.close()
            if attempt == 2:
                raise OperationalError("the database connection broke twice") from exc
    raise AssertionError("unreachable")


# A run's team, agent and policy version never change: once a check of the run succeeded in
# this process, the next one can read its rate-limit windows in the locking round trip.
# Bounded (cleared when full); a miss only costs the separate round trip.
_RUN_FACTS: dict[uuid.UUID, tuple[int, str, int]] = {}
_RUN_FACTS_MAX = 20_000


def _rate_read(run_id: uuid.UUID, name: str) -> RateRead | None:
    facts = _RUN_FACTS.get(run_id)
    if facts is None:
        return None
    team_id, agent, version_id = facts
    matching = rules.rate_limits_matching(rules_for_version(version_id), name)
    return RateRead(rules=matching, team_id=team_id, agent=agent) if matching else None


def _check_once(*, claim: KeyClaim, run_id: uuid.UUID, req: CheckRequest) -> dict[str, Any]:
    # The order of SPEC 15: an idle run is ended first, then a terminal run answers its stop,
    # then a replay, then rules 1 to 9, the rate limits, and the allow.
    with check_transaction() as tx:
        rate = _rate_read(run_id, req.name)
        locked = tx.lock(prefix=claim.prefix, run_id=run_id, check_id=req.check_id, rate=rate)
        if locked is None or not agent_key_matches(claim, locked.key_hash):
            raise ServiceError(401, "unauthorized", UNAUTHORIZED)
        run = locked.run
        if run is None:
            raise ServiceError(404, "not_found", "No such run.")
        if run.id not in _RUN_FACTS:
            if len(_RUN_FACTS) >= _RUN_FACTS_MAX:
                _RUN_FACTS.clear()
            _RUN_FACTS[run.id] = (run.team_id, run.agent, run.policy_version_id)
        state = state_of(run)
        policy = rules_for_version(run.policy_version_id)
        now = timezone.now()
        rows: list[DecisionRow] = []
        abandoned = rules.abandon(state, now=now)
        if abandoned is not None:
            rows.append(abandon_row(abandoned, policy, now))
            state = abandoned
        check_id = req.check_id
        if locked.earlier_answer is not None:
            first_id, first_answer = locked.earlier_answer
            if not rows and rules.replay_allowed(state, first_answer.get("decision", "")):
                return {**ANSWER_DEFAULTS, **first_answer, "decision_id": first_id}
            # The first answer was an allow and the run is over: answer the run's stop, as
            # a new audited decision (the retry must not leak an allow, SPEC 4.5).
            check_id = None
        last = req.last_result
        check = rules.Check(
            name=req.name, type=req.type, args=req.args, progress=req.progress,
            last_result=rules.LastResult(
                status=last["status"], digest=last.get("digest"), error=last.get("error"),
                summary=last.get("summary"),
            ) if last else None,
            cost_usd=req.cost_usd,
        )
        kill = cover.switch_in_words(locked.switch) if locked.switch is not None else None
        windows: list[rules.RateWindow] = []
        if state.status == rules.RUNNING and kill is None:
            matching = rules.rate_limits_matching(policy, req.name)
            if locked.windows is not None and rate is not None and rate.rules == matching:
                windows = locked.windows
            elif matching:
                windows = tx.rate_windows(run=run, rules=matching, now=now)
        decision, new_state = rules.evaluate(policy, state, check, now=now, kill=kill,
                                             rate=windows)
        answer = _answer_of(decision, new_state, policy, now)
        update = None
        if new_state is not state or rows:
            update = RunUpdate(
                status=new_state.status, stop_reason=new_state.stop_reason,
                ended_at=new_state.ended_at, steps=new_state.steps,
                tool_calls=new_state.tool_calls, cost_usd=new_state.cost_usd,
                memory=new_state.memory(), idle_deadline=new_state.idle_deadline,
            )
        waited = decision.outcome == rules.WAIT
        counted = decision.outcome in (rules.ALLOW, rules.WOULD_STOP)
        rows.append(DecisionRow(
            step=decision.step, outcome=decision.outcome, reason=decision.reason,
            action_name=req.name, action_type=req.type,
            args=rules.redact(req.args, policy.redact_args), repeat_key=decision.repeat_key,
            repeat_count=decision.repeat_count,
            # A wait keeps no check_id: the same check_id is decided again (SPEC 12), and
            # its cost is not registered (the agent sends it again).
            check_id=None if waited else check_id, progress=req.progress,
            last_result=last, cost_usd=Decimal(0) if waited else req.cost_usd, answer=answer,
            at=now, elapsed_s=new_state.elapsed_s(now),
        ))
        hit = HitRow(team_id=run.team_id, agent=run.agent, action_name=req.name) \
            if counted else None
        decision_id = tx.write(run_id=run.id, update=update, rows=rows, hit=hit)
    # Committed: the agent must get this answer, so nothing below may raise (each of these
    # only logs its own failure).
    metrics.decision_made(team=locked.team_slug, outcome=decision.outcome,
                          reason=decision.reason, db_seconds=tx.db_seconds)
    if decision.outcome == rules.WAIT or (decision.shadow or {}).get("reason") == \
            rules.RATE_LIMITED:
        limited = rules.rate_wait(windows)
        if limited is not None:
            metrics.rate_limited(team=locked.team_slug, rule=limited[0].rule,
                                 outcome=decision.outcome)
    try:
        agent_key_touch(locked.key_id, locked.key_last_used_at)
    except DatabaseError:
        log.warning("could not record the agent key's last use", exc_info=True)
    publish_run_event(run)
    return {**answer, "decision_id": decision_id}


def run_finish(*, team: Team, run_id: Any, status: str, output: str | None) -> Run:
    """Finish a run (SPEC 5.1) without a transaction around a read and a write: the run is
    read, `rules.finish` decides, and the update applies only if the run is still as read.
    A check that stopped the run or another finish in between makes it match nothing, and the
    finish is decided again on the new row; that can happen at most twice, since a run's
    status and its finish each change once. Two round trips instead of four, on a request
    every run makes (docs/performance.md)."""
    for _ in range(3):
        run = Run.objects.select_related("policy_version").filter(team=team, pk=run_id).first()
        if run is None:
            raise ServiceError(404, "not_found", "No such run.")
        now = timezone.now()
        # A finish after the idle deadline finds the run abandoned (SPEC 14): it then keeps
        # that status and reason and stores the output, like any stopped run.
        run = abandon_if_idle(run, now=now)
        try:
            new_state = rules.finish(state_of(run), status,
                                     already_finished=run.finished_at is not None, now=now)
        except rules.FinishError:
            raise ServiceError(409, "run_finished", "This run was already finished.") from None
        # Finishing changes only these: the counters and the memory stay as the last check
        # left them, and are not written back.
        changes = {"status": new_state.status, "stop_reason": new_state.stop_reason,
                   "ended_at": new_state.ended_at, "finished_at": now}
        if output is not None:
            changes["output"] = output
        if Run.objects.filter(pk=run.pk, status=run.status, finished_at__isnull=True
                              ).update(**changes):
            for name, value in changes.items():
                setattr(run, name, value)
            publish_run_event(run)
            return run
    raise OperationalError("the run kept changing while it was being finished")
