"""The check (SPEC 4, 15): one transaction that locks the run first, so the checks of one run
are serialized in every process (SPEC 4.5). A run's start and finish are
runs/check/lifecycle.py, the upload of local decisions runs/check/local.py."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any

from django.db import DatabaseError, OperationalError, connection
from django.utils import timezone
from governance_client.keys import repeat_key

from governance.errors import AppError
from governance_client import answers, rules
from policies.models import Team
from policies.services import KeyClaim, agent_key_matches, agent_key_touch
from runs import telemetry
from runs.approvals import services as approvals
from runs.check import callers, metrics, records, run_memory, tree
from runs.check.check_store import (
    CheckTransaction,
    DuplicateCheck,
    HitRow,
    Locked,
    PostgresCheck,
    RateRead,
    RunRow,
    StaleConnection,
    check_transaction,
)
from runs.check.policy_cache import rules_for_version, version_label
from runs.check.records import DecisionRow, explain_stop
from runs.killswitch import cover
from runs.live.events import publish_run_event
from runs.models import Approval, Run

log = logging.getLogger(__name__)


# The application's one error (governance/errors.py), by the name the check's callers know.
ServiceError = AppError


UNAUTHORIZED = "A valid agent key is required (Authorization: Bearer)."


def run_check(*, claim: KeyClaim, run_id: uuid.UUID, check: rules.Check,
              deadline: float | None = None) -> dict[str, Any]:
    """Decide one check and answer it (SPEC 4, 5.2): authenticate the key, lock the run,
    apply the pure rules, store the new state and the audit record in one transaction.
    ``deadline``: the time.monotonic() past which the agent no longer waits for the answer.

    The key is looked up in the statement that locks the run (runs/check/check_store.py), so a
    check costs two round trips to PostgreSQL; a revoked or unknown key answers 401, another
    team's run 404, before anything is written.
    """
    portable = False
    for attempt in (1, 2, 3):
        try:
            return _check_once(claim=claim, run_id=run_id, check=check, deadline=deadline,
                               portable=portable)
        except _Portable:
            # Approvals are involved: decided again, from the start, on the ORM path.
            portable = True
        except tree.Relock:
            # A child run whose ancestors this process did not know: again, locking them
            # first (runs/check/tree.py). At most once: they are known now.
            pass
        except DuplicateCheck:
            # A retry of this check_id committed while we waited for the run's lock: the
            # second attempt reads its answer (at most once: that answer now exists).
            if attempt == 3:
                raise
        except StaleConnection as exc:
            # A persistent connection that died while idle (PostgreSQL restarted) fails the
            # first statement. Retried once on a new connection, which is what Django's
            # per-request health check would do, without that check's extra round trip on
            # every request. Nothing was written: it was the locking read that failed.
            connection.close()
            if attempt == 3:
                raise OperationalError("the database connection broke twice") from exc
    raise AssertionError("unreachable")


# A run's team, agent and policy version never change: once this process started the run or
# checked it, the next check can read its rate-limit windows and its keyed memory's entries
# (which depend on the policy through the repeat key) in the locking round trip. Bounded
# (cleared when full); a miss only costs a separate round trip.
_RUN_FACTS: dict[uuid.UUID, tuple[int, str, int]] = {}
_RUN_FACTS_MAX = 20_000


def locked_run_of_key(*, team: Team, run_id: Any, key_agent: str) -> Run:
    """The key's run, locked for the caller's transaction (a finish, an upload of local
    decisions): 404 unless it is the key's team's, and its agent's for an agent-bound key
    (SPEC 10)."""
    runs = Run.objects.select_for_update().select_related("policy_version")
    runs = runs.filter(team=team, pk=run_id)
    if key_agent:
        runs = runs.filter(agent=key_agent)
    run = runs.first()
    if run is None:
        raise ServiceError(404, "not_found", "No such run.")
    return run


def remember_run(run_id: uuid.UUID, team_id: int, agent: str, version_id: int) -> None:
    """What never changes about a run, kept for this process's next check of it: the start
    (runs/check/lifecycle.py) and every check tell it."""
    if run_id not in _RUN_FACTS:
        if len(_RUN_FACTS) >= _RUN_FACTS_MAX:
            _RUN_FACTS.clear()
        _RUN_FACTS[run_id] = (team_id, agent, version_id)


def _rate_read(facts: tuple[int, str, int] | None, policy: rules.Policy | None,
               name: str) -> RateRead | None:
    if facts is None or policy is None:
        return None
    team_id, agent, _ = facts
    matching = rules.rate_limits_matching(policy, name)
    return RateRead(rules=matching, team_id=team_id, agent=agent) if matching else None


@dataclass(frozen=True, slots=True)
class _Keyed:
    """The check's repeat key under one policy version, and the keyed memory's entries it
    reads (by digest)."""

    version_id: int
    key: str
    wanted: dict[str, rules.Entry]


def _keyed_for(check: rules.Check, version_id: int, policy: rules.Policy) -> _Keyed:
    key = repeat_key(check.name, check.args, policy.ignore_args)
    return _Keyed(version_id, key, run_memory.digests(rules.keyed_reads(check, key)))


class _Portable(Exception):
    """The check touches approvals: start over on the portable (ORM) path."""


def _involves_approvals(policy: rules.Policy, state: rules.RunState, first: Any,
                        name: str) -> bool:
    return (state.pending is not None
            or (first is not None and first[1].get("decision") == rules.PENDING)
            or (policy.mode != "shadow" and rules.approval_pattern(policy, name) is not None))


def _last_result_json(last: rules.LastResult | None) -> dict[str, Any] | None:
    """A check's last_result as its audit record keeps it: the fields the agent sent."""
    if last is None:
        return None
    return {name: value for name, value in (("status", last.status), ("digest", last.digest),
                                            ("error", last.error), ("summary", last.summary))
            if value is not None}


@dataclass(slots=True)
class _Read:
    """What the check read under the run's lock: the lock's result, the run, the rate-limit
    windows asked for with the lock (`rate`), the rate limits the action matches, the check's
    repeat key and keyed entries, the run's state with those entries loaded, and the run's
    policy (parsed rules, read once per attempt and handed down to every step)."""

    locked: Locked
    run: RunRow
    policy: rules.Policy
    rate: RateRead | None
    matching: tuple[rules.RateLimit, ...]
    keyed: _Keyed
    state: rules.RunState


def _check_once(*, claim: KeyClaim, run_id: uuid.UUID, check: rules.Check,
                deadline: float | None, portable: bool = False) -> dict[str, Any]:
    """One attempt at a check, in the order of SPEC 15: an idle run is ended first, then a
    terminal run answers its stop, then a replay, then the 409 of a run waiting for an
    approval, then rules 1 to 9, the rate limits, the approvals, and the allow. Raises
    _Portable (start again on the ORM), DuplicateCheck or StaleConnection for `run_check`
    to retry."""
    with check_transaction(portable=portable) as tx:
        # A child run's ancestors first, the root first (SPEC 20, runs/check/tree.py).
        family = tree.lock_ancestors(tx, run_id)
        read = _lock_and_read(tx, claim=claim, run_id=run_id, check=check)
        tree.check_lineage(read.run, family)
        run, loaded, policy = read.run, read.state, read.policy
        trace_id = _traced(read)
        if isinstance(tx, PostgresCheck) and _involves_approvals(
                policy, loaded, read.locked.earlier_answer, check.name):
            raise _Portable()
        now = timezone.now()
        state, rows, kill, first = _settle_first(read, policy, check, now=now,
                                                 tree=family.tree)
        switch: cover.SwitchFields | None = read.locked.switch
        if kill is None and state.status == rules.RUNNING and (over := family.switch()):
            # An ancestor's switch: the stop's rule names it as the fan-out's kill does
            # (found by an attacker: a descendant's check before the fan-out recorded an
            # empty rule, which every later answer replayed).
            switch, kill = over, cover.switch_in_words(over)
        # A run whose ancestor is over stops at this check, a replay's too (SPEC 20, 4.5).
        ends_now = first is not None and rules.ends_at_this_check(
            family.tree, now, covered=kill is not None)
        replayed, retry = _replay_or_refuse(state, rows, first, policy, check, kill=kill,
                                            ends_now=ends_now)
        if replayed is not None:
            return replayed
        if retry:
            check = replace(check, check_id=None)
        windows = _windows(tx, read, state, kill=kill, now=now)
        kill_rule = cover.switch_rule(switch, team=read.locked.team_slug) \
            if switch is not None else None
        decision, new_state, answer, check_id = _decide(
            policy, state, check, kill=kill, windows=windows, key=read.keyed.key, now=now,
            deadline=deadline, kill_rule=kill_rule, tree=family.tree, retry=retry)
        if trace_id is not None:  # the audit record keeps the trace its decision is in
            answer = {**answer, "trace_id": trace_id}
        args = rules.redact(check.args, policy.redact_args)
        rows.append(_record(decision, new_state, check, check_id=check_id, args=args,
                            answer=answer, now=now))
        # A pending answer takes its hit now, not again once approved (SPEC 12, 15).
        counted = decision.outcome in rules.RATE_COUNTED
        hit = HitRow(team_id=run.team_id, agent=run.agent, action_name=check.name) \
            if counted else None
        # The rules give a new state only when something changed; an abandonment ended it.
        changed = new_state if new_state is not state or rows else None
        tx.write_ancestors(tree.ancestor_writes(family, decision, check,
                                                new_state.steps > state.steps, now=now))
        decision_id = tx.write(run_id=run.id, state=changed, rows=rows, hit=hit,
                               keyed=run_memory.rows(rules.keyed_changes(loaded, new_state)))
        if decision.outcome == rules.PENDING:
            assert new_state.pending is not None  # only on the portable path, in its atomic
            approvals.approval_open(
                run=run, pending=new_state.pending, args=args,
                pattern=rules.approval_pattern(policy, check.name) or "", decision_id=decision_id)
    _after_commit(read, decision, windows, db_seconds=tx.db_seconds)
    for ancestor in family.rows:  # the run pages of the tree show its usage (SPEC 20)
        publish_run_event(ancestor)
    return {**answer, "decision_id": decision_id}


def _traced(read: _Read) -> str | None:
    """The run's facts on the check's span (SPEC 18), and its trace id; None, at the cost
    of one context lookup, while tracing is off."""
    trace_id = telemetry.check_trace_id()
    if trace_id is not None:
        run = read.run
        telemetry.check_facts(run_id=run.id, team=read.locked.team_slug, agent=run.agent,
                              policy=version_label(run.policy_version_id))
    return trace_id


def _lock_and_read(tx: CheckTransaction, *, claim: KeyClaim, run_id: uuid.UUID,
                   check: rules.Check) -> _Read:
    """Lock the run and read what the check needs (401 and 404 before anything else). When
    this process already knows the run's policy version (`_RUN_FACTS`), the rate-limit
    windows and the keyed entries are read in the locking round trip; else the entries take
    one more round trip once the run is locked."""
    facts = _RUN_FACTS.get(run_id)
    # The policy of the version this process knows for the run, looked up once: the rate
    # limits, the keyed entries and the decision all read it.
    known = rules_for_version(facts[2]) if facts is not None else None
    rate = _rate_read(facts, known, check.name)
    guess = _keyed_for(check, facts[2], known) if facts and known else None
    locked = tx.lock(prefix=claim.prefix, run_id=run_id, check_id=check.check_id,
                     rate=rate, keyed=list(guess.wanted) if guess is not None else None)
    if locked is None or not agent_key_matches(claim, locked.key_hash):
        raise ServiceError(401, "unauthorized", UNAUTHORIZED)
    callers.remember(claim.digest, locked.team_id)  # its team's share of the API's threads
    run = locked.run
    if run is None:
        raise ServiceError(404, "not_found", "No such run.")
    remember_run(run.id, run.team_id, run.agent, run.policy_version_id)
    # A run's policy version never changes: what this process knew is the run's.
    policy = known if facts and known and facts[2] == run.policy_version_id \
        else rules_for_version(run.policy_version_id)
    if guess is not None and guess.version_id == run.policy_version_id \
            and locked.keyed is not None:
        keyed, counts = guess, locked.keyed
    else:
        keyed = _keyed_for(check, run.policy_version_id, policy)
        counts = tx.read_keyed(run_id=run.id, keyed=list(keyed.wanted))
    # Only the check's own entries of the keyed memory: the rules answer the same as with
    # all of it (governance_client.rules, keyed_reads), and what they change is written.
    state = run.state.load_keyed(run_memory.found(keyed.wanted, counts))
    # The rate limits the action matches, matched once: under the policy this process knew,
    # the ones asked for with the lock (`_rate_read` asks only when some match).
    matching = (rate.rules if rate is not None else ()) if policy is known \
        else rules.rate_limits_matching(policy, check.name)
    return _Read(locked=locked, run=run, policy=policy, rate=rate, matching=matching,
                 keyed=keyed, state=state)


def _settle_first(read: _Read, policy: rules.Policy, check: rules.Check, *, now: Any,
                  tree: list[rules.Ancestor]
                  ) -> tuple[rules.RunState, list[DecisionRow], str | None, Any]:
    """What is due before the check is decided: an idle run is abandoned (its audit record
    comes first), a waiting run's request expires or is cancelled by a kill switch or by an
    ancestor that is over (``tree``, SPEC 20). Returns
    the run's state after that, the records written so far, the covering switch in words
    (None when none covers the run) and the earlier answer to this check_id."""
    run, state = read.run, read.state
    rows: list[DecisionRow] = []
    # Past a deadline that is its time budget's, the run is not abandoned: rule 4 stops it.
    abandoned = rules.abandon(state, now=now, policy=policy)
    if abandoned is not None:
        rows.append(records.abandon_row(abandoned, policy, now))
        approvals.settle_on_end(run=run, before=state, after=abandoned, now=now)
        state = abandoned
    switch = read.locked.switch
    kill = cover.switch_in_words(switch) if switch is not None else None
    first = read.locked.earlier_answer
    if state.pending is not None or (first is not None
                                     and first[1].get("decision") == rules.PENDING):
        state, first = _settle_on_check(run, state, first, check, now=now, kill=kill,
                                        tree=tree)
    if abandoned is not None and state.stop_reason == rules.ABANDONED:
        # The abandonment's record is written with this check's, so the audit log cannot
        # tell its words yet: they are the row's (SPEC 4.4, 16: the check that finds the
        # run abandoned names max_idle_seconds, as every later check does).
        state.stop_detail, state.stop_rule = records.stop_words(rows[0].answer)
    else:
        explain_stop(state, run.id)
    return state, rows, kill, first


def _replay_or_refuse(state: rules.RunState, rows: list[DecisionRow], first: Any,
                      policy: rules.Policy, check: rules.Check, *, kill: str | None,
                      ends_now: bool) -> tuple[dict[str, Any] | None, bool]:
    """A replay's answer (the earlier answer to this check_id, when it still holds), or
    None and whether the check is a retry to decide again (`rules.evaluate`'s ``retry``:
    recorded without its check_id, counting nothing again); raises the 409 of a run waiting
    for an approval and the 422 of a check_id the policy requires. ``ends_now``: a switch
    covers the run or an ancestor is over (`rules.replay_allowed`)."""
    if first is not None:
        first_id, first_answer = first
        if not rows and rules.replay_allowed(state, first_answer.get("decision", ""),
                                             ends_now=ends_now):
            return {**answers.ANSWER_DEFAULTS, **first_answer, "decision_id": first_id}, False
    # Else the first answer was an allow and the run is over: the run's stop is answered as
    # a new audited decision (the retry must not leak an allow, SPEC 4.5).
    retry = first is not None
    if state.status == rules.RUNNING and state.pending is not None:
        message, fields = rules.approval_pending(state.pending)
        raise ServiceError(409, "approval_pending", message, fields)
    missing = rules.check_id_missing(policy, state, check, kill=kill)
    if missing is not None:
        raise ServiceError(422, "invalid_request", "The request is not valid.",
                           {"check_id": missing})
    return None, retry


def _windows(tx: CheckTransaction, read: _Read, state: rules.RunState, *, kill: str | None,
             now: Any) -> list[rules.RateWindow]:
    """The rate-limit windows the check's action matches (SPEC 12): those read with the lock
    when they are the right ones, else read now (taking the rules' locks)."""
    if state.status != rules.RUNNING or kill is not None:
        return []
    locked, rate, matching = read.locked, read.rate, read.matching
    if locked.windows is not None and rate is not None and rate.rules == matching:
        return locked.windows
    if matching:
        return tx.rate_windows(run=read.run, rules=matching, now=now)
    return []


def _decide(policy: rules.Policy, state: rules.RunState, check: rules.Check, *,
            kill: str | None, windows: list[rules.RateWindow], key: str, now: Any,
            deadline: float | None, kill_rule: dict[str, Any] | None = None,
            tree: list[rules.Ancestor] | None = None, retry: bool = False
            ) -> tuple[rules.Decision, rules.RunState, dict[str, Any], str | None]:
    """The rules' decision, the run's new state, the answer and the check_id to record.
    ``tree``: a child run's ancestors, the root first (SPEC 20); ``retry``: a check_id
    counted already, decided again (`rules.evaluate`)."""
    check_id = check.check_id
    decision, new_state = rules.evaluate(policy, state, check, now=now, kill=kill,
                                         rate=windows, key=key,
                                         approval_id=str(uuid.uuid4()), kill_rule=kill_rule,
                                         tree=tree or (), retry=retry)
    answer = answers.answer_of(decision, new_state, policy, now)
    # The agent may have given up on this check (its deadline_ms passed while the check
    # waited, for the run's lock usually): the rules say what then stands.
    expired = rules.expire(state, decision, new_state,
                           past_deadline=deadline is not None and time.monotonic() > deadline)
    if expired is not None:
        answer = answers.expired_answer(answer, state, now, check_id, policy)
        decision, new_state = expired
        # The check_id stays free: the client may upload its own decision for it.
        check_id = None
    return decision, new_state, answer, check_id


def _record(decision: rules.Decision, new_state: rules.RunState, check: rules.Check, *,
            check_id: str | None, args: Any, answer: dict[str, Any], now: Any) -> DecisionRow:
    """The check's audit record."""
    waited = decision.outcome == rules.WAIT
    return DecisionRow(
        step=decision.step, outcome=decision.outcome, reason=decision.reason,
        action_name=check.name, action_type=check.type,
        args=args, repeat_key=decision.repeat_key,
        repeat_count=decision.repeat_count,
        # A wait keeps no check_id: the same check_id is decided again (SPEC 12), and
        # its cost is not registered (the agent sends it again).
        check_id=None if waited else check_id, progress=check.progress,
        last_result=_last_result_json(check.last_result),
        cost_usd=Decimal(0) if waited else check.cost_usd, answer=answer,
        at=now, elapsed_s=new_state.elapsed_s(now),
    )


def _after_commit(read: _Read, decision: rules.Decision, windows: list[rules.RateWindow], *,
                  db_seconds: float) -> None:
    """Committed: the agent must get this answer, so nothing here may raise (each of these
    only logs its own failure): metrics, the key's last use, the screens' wake-up."""
    locked = read.locked
    metrics.decision_made(team=locked.team_slug, outcome=decision.outcome,
                          reason=decision.reason, db_seconds=db_seconds)
    telemetry.decision_made(team=locked.team_slug, outcome=decision.outcome,
                            reason=decision.reason)
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
    publish_run_event(read.run)


def _settle_on_check(run: RunRow, state: rules.RunState, first: Any, check: rules.Check, *,
                     now: Any, kill: str | None, tree: list[rules.Ancestor]
                     ) -> tuple[rules.RunState, Any]:
    """The run waits for an approval and a check arrives (SPEC 11, 15): past its expiry the
    request expires, under a kill switch or an ancestor that is over it is cancelled
    (whoever looks first settles).
    Returns the run's state after that, and what a replay of the pending check answers: its
    final answer once there is one, else the pending answer."""
    state = approvals.settle_due_locked(run=run, state=state, now=now, kill=kill, tree=tree)
    if first is not None and first[1].get("decision") == rules.PENDING:
        final = (Approval.objects.filter(run_id=run.id, check_id=check.check_id)
                 .values_list("decision", flat=True).first())
        if final:
            first = (int(final["decision_id"]), final)
    return state, first
