"""The audit record of a decision (`runs_decision`, SPEC 7), in one place: its columns, the
row every writer builds (`DecisionRow`), the inserts (the ORM's here, the SQL writers' from
`DECISION_COLUMNS` and `insert_select_sql`), and the answers read back from those records
(a check of an ended run, the words of a kill).

Writers: the check (runs/check/check_store.py, its prepared statement and its ORM twin), an
abandonment (runs/check/abandon.py), an approval's final answer (runs/approvals/services.py),
an upload of local decisions (runs/check/local.py) and the kill switch's fan-out
(runs/killswitch/fanout.py, its SQL and its ORM batch). The answer stored in each record
is built by governance_client/answers.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from datetime import datetime
from decimal import Decimal
from typing import Any

from django.utils import timezone

from governance_client import answers, rules
from runs.check import run_memory
from runs.check.policy_cache import rules_for_version
from runs.check.states import state_of
from runs.models import Decision, Run


@dataclass(slots=True)
class DecisionRow:
    """The audit record of a check: every column of runs_decision but its id and run."""

    step: int
    outcome: str
    reason: str
    action_name: str
    action_type: str
    args: Any
    repeat_key: str
    repeat_count: int
    check_id: str | None
    progress: Any
    last_result: Any
    cost_usd: Decimal
    elapsed_s: float | None  # since the run's start, as the rules counted it (backtests)
    answer: dict[str, Any]
    at: datetime
    # SPEC 16: the answer's rule, kept in a column of its own (the decision endpoint, the
    # timeline's "why"); taken from the answer unless given.
    rule: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.rule is None and isinstance(self.answer, dict):
            self.rule = self.answer.get("rule")


# The columns are the model's and DecisionRow's own, written once each: the check's SQL, the
# fan-out's SQL, the ORM inserts below and tests/test_check_store_shapes.py take them from
# here.
DECISION_COLUMNS = tuple(f.column for f in Decision._meta.concrete_fields if not f.primary_key)
ROW_FIELDS = tuple(f.name for f in fields(DecisionRow))


def row_values(row: DecisionRow) -> dict[str, Any]:
    return {name: getattr(row, name) for name in ROW_FIELDS}


def insert(run_id: Any, rows: Iterable[DecisionRow]) -> int:
    """Insert one run's records in order (ORM): the id of the last one, 0 when none."""
    pk = 0
    for row in rows:
        pk = Decision.objects.create(run_id=run_id, **row_values(row)).pk
    return int(pk)


def insert_many(rows: Iterable[tuple[Any, DecisionRow]], *, batch_size: int | None = None
                ) -> None:
    """Insert (run id, record) pairs in bulk (ORM), where no id is needed back."""
    Decision.objects.bulk_create(
        [Decision(run_id=run_id, **row_values(row)) for run_id, row in rows],
        batch_size=batch_size)


def insert_select_sql(values: Mapping[str, str]) -> str:
    """`INSERT INTO runs_decision (...) SELECT ...` for a writer in SQL: ``values`` gives
    each column's SQL expression, by column name; one missing or unknown is an error, so a
    column added to the model cannot be forgotten by a SQL writer."""
    if set(values) != set(DECISION_COLUMNS):
        raise ValueError(f"runs_decision columns: {sorted(DECISION_COLUMNS)}, "
                         f"given {sorted(values)}")
    return (f"INSERT INTO runs_decision ({', '.join(DECISION_COLUMNS)})\n"
            f"SELECT {', '.join(values[name] for name in DECISION_COLUMNS)}")


def _no_action(decision: rules.Decision, answer: dict[str, Any], at: datetime,
               elapsed_s: float | None) -> DecisionRow:
    """The record of a stop no action asked for (an abandonment, a kill): no action, nothing
    counted, the step unchanged."""
    return DecisionRow(
        step=decision.step, outcome=decision.outcome, reason=decision.reason, action_name="",
        action_type="", args=None, repeat_key="", repeat_count=0, check_id=None,
        progress=None, last_result=None, cost_usd=Decimal(0), answer=answer, at=at,
        elapsed_s=elapsed_s)


def abandon_row(state: rules.RunState, policy: rules.Policy, now: datetime) -> DecisionRow:
    """An abandonment (SPEC 14), audited like a kill by the fan-out."""
    return _no_action(answers.abandon_decision(state, policy),
                      answers.abandon_answer(state, policy, now), now, state.elapsed_s(now))


def tree_stop_row(decision: rules.Decision, state: rules.RunState, policy: rules.Policy,
                  now: datetime) -> DecisionRow:
    """A descendant stopped by its tree's end as it finishes (SPEC 20,
    `rules.stopped_by_tree`), audited like a kill: ``state`` the run after the stop."""
    return _no_action(decision, answers.answer_of(decision, state, policy, now), now,
                      state.elapsed_s(now))


def kill_row(switch_id: int, words: str, state: rules.RunState, limits: dict[str, Any],
             now: datetime, *, fired: dict[str, Any] | None = None,
             policy: tuple[str, int] | None = None) -> DecisionRow:
    """A kill by the fan-out (SPEC 6); its SQL twin is the fan-out's `_KILL_SQL`."""
    return _no_action(answers.kill_decision(words, step=state.steps, fired=fired),
                      answers.kill_answer(switch_id, words, state, limits, now, fired=fired,
                                          policy=policy), now,
                      state.elapsed_s(now))


def final_row(pending: rules.Pending, decision: rules.Decision, answer: dict[str, Any],
              args: Any, now: datetime) -> DecisionRow:
    """An approval's final answer (SPEC 11): a second record at the request's step, for the
    action that was asked for, with no check_id (the pending record holds it)."""
    return DecisionRow(
        step=pending.step, outcome=decision.outcome, reason=decision.reason,
        action_name=pending.action_name, action_type=pending.action_type, args=args,
        repeat_key=pending.repeat_key, repeat_count=decision.repeat_count, check_id=None,
        progress=None, last_result=None, cost_usd=Decimal(0), answer=answer, at=now,
        elapsed_s=None)


# --- Answers read back from the records ------------------------------------------------------

def stop_answer(run: Run, key: str, *, now: Any = None) -> dict[str, Any]:
    """What a check of this ended run answers, without checking it (SPEC 4.4): its stop,
    nothing counted, ``key`` the check's repeat key; ``decision_id`` names the audit record
    of the run's last stop (a finished run's last record). An approval's final answer once
    its run is over (runs/approvals/services.py `final_answer`), equal to a replay's."""
    now = now or timezone.now()
    state = run_memory.load(state_of(run), run.pk, [(rules.REPEAT, key)])
    explain_stop(state, run.pk)
    answer = answers.answer_of(rules.terminal_decision(state, key), state,
                               rules_for_version(run.policy_version_id), now)
    records = Decision.objects.filter(run_id=run.pk).order_by("-id").values_list("id", flat=True)
    last = records.filter(outcome=rules.STOP).first() or records.first() or 0
    return {**answer, "decision_id": last}


def stop_detail(run_id: Any, reason: str | None) -> tuple[str | None, dict[str, Any] | None]:
    """The words of the stop that ended a run (the limit and its value; for a kill the
    switch, who engaged it and why) and its rule, from its audit record, for the stop
    answered to every later check (SPEC 4.4: every stop names the limit and its value; 6,
    16: a kill's rule names the switch, whether the check or the fan-out killed the run, and
    whether the switch is still engaged): the run's first stop, since a stop ends a run
    (`decision_run_stop`: one probe, however many checks of the run were answered since).
    None for a run its agent ended (no stop of that reason)."""
    first = (Decision.objects.of_run(run_id).filter(outcome=rules.STOP)
             .values_list("reason", "answer").first())
    return stop_words(first[1] if first is not None and first[0] == reason else None)


def stop_words(answer: Any) -> tuple[str | None, dict[str, Any] | None]:
    """A stop's record's answer as (its words, its rule), None for what it lacks."""
    if not isinstance(answer, dict):
        return None, None
    fired = answer.get("rule")
    return answer.get("message") or None, fired if isinstance(fired, dict) else None


def explain_stop(state: rules.RunState, run_id: Any) -> None:
    """A stopped or killed run's state as its later checks answer it: its stop's words
    and rule."""
    if state.status in (rules.STOPPED, rules.KILLED):
        state.stop_detail, state.stop_rule = stop_detail(
            run_id, state.stop_reason or state.status)
