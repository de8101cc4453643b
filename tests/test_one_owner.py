"""One owner each for the check answer (governance_client/answers.py), the audit record
(runs/check/records.py) and a run's state columns (runs/check/states.py): the writers that
cannot call them (the fan-out's SQL) are built from them, and what each builds agrees with
the other writers."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest

from governance_client import answers, rules
from runs.check import records, states
from runs.killswitch import fanout as killswitch
from runs.models import Run

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def a_state() -> rules.RunState:
    return rules.RunState(started_at=NOW - timedelta(seconds=90), steps=7, tool_calls=3,
                          cost_usd=Decimal("0.25"))


def test_a_sql_writer_of_audit_records_must_name_every_column() -> None:
    every = {name: "NULL" for name in records.DECISION_COLUMNS}
    sql = records.insert_select_sql(every)
    assert sql.startswith(f"INSERT INTO runs_decision ({', '.join(records.DECISION_COLUMNS)})")
    with pytest.raises(ValueError, match="runs_decision columns"):
        records.insert_select_sql({k: v for k, v in every.items() if k != "elapsed_s"})
    with pytest.raises(ValueError, match="runs_decision columns"):
        records.insert_select_sql({**every, "not_a_column": "NULL"})


def test_the_fan_out_sql_writes_the_kill_record_and_the_columns_a_kill_sets() -> None:
    """The SQL twin of the fan-out takes its audit columns from records and its run columns
    from states.ENDED, with the values rules.kill gives."""
    assert f"INSERT INTO runs_decision ({', '.join(records.DECISION_COLUMNS)})" \
        in killswitch._KILL_SQL
    for name in states.ENDED:
        assert f"{name} = %({name})s" in killswitch._KILL_SQL
    assert killswitch._killed_columns(NOW) == {
        "status": rules.KILLED, "stop_reason": "killed", "ended_at": NOW}


def test_a_kills_fixed_answer_and_its_per_run_fields_make_the_whole_answer() -> None:
    """The fan-out's SQL adds PER_RUN to the fixed part; the ORM builds the whole answer."""
    state = a_state()
    whole = answers.kill_answer(12, "the team switch", state, {"max_steps": 50}, NOW)
    fixed = answers.kill_answer_fixed(12, "the team switch")
    assert set(whole) == set(fixed) | set(answers.PER_RUN)
    assert {k: v for k, v in whole.items() if k not in answers.PER_RUN} == fixed
    assert whole["step"] == 7 and whole["usage"] == state.usage(NOW)
    assert fixed["message"] == "Stopped by a kill switch: the team switch."
    assert fixed["reason"] == "killed" and fixed["decision"] == rules.STOP


def test_every_answer_has_every_field_of_spec_15() -> None:
    policy = rules.Policy()
    state = a_state()
    fields = set(answers.answer_of(rules.terminal_decision(state, ""), state, policy, NOW))
    assert set(answers.ANSWER_DEFAULTS) <= fields
    assert set(answers.abandon_answer(state, policy, NOW)) == fields
    assert set(answers.kill_answer(1, "x", state, {}, NOW)) == fields | {"kill_switch"}
    decided = answers.answer_of(rules.terminal_decision(state, ""), state, policy, NOW)
    assert set(answers.expired_answer(decided, state, NOW, "c1")) == fields | {"check_id"}


def test_the_records_of_a_stop_without_an_action_name_no_action() -> None:
    state, policy = a_state(), rules.Policy()
    for row in (records.abandon_row(state, policy, NOW),
                records.kill_row(3, "x", state, {}, NOW)):
        assert (row.step, row.outcome, row.action_name, row.args, row.check_id) == \
            (7, rules.STOP, "", None, None)
        assert row.elapsed_s == 90.0 and row.answer["step"] == 7


def test_the_state_columns_are_columns_of_the_run() -> None:
    columns = {f.column for f in Run._meta.concrete_fields}
    assert set(states.STATE_COLUMNS) <= columns
    state = a_state()
    written = states.columns_of(state, states.UPDATE_FIELDS)
    assert written["memory"] == state.fixed_memory()
    assert states.run_state(**{**written, "started_at": state.started_at}).steps == 7


@pytest.mark.parametrize(("vendor", "in_atomic_block", "portable", "prepared"), [
    ("postgresql", False, False, True),
    ("postgresql", True, False, False),
    ("postgresql", False, True, False),
    ("postgresql", True, True, False),
    ("sqlite", False, False, False),
    ("sqlite", True, True, False),
])
def test_the_store_table_picks_the_prepared_statements_only_on_postgresql_alone(
        vendor: str, in_atomic_block: bool, portable: bool, prepared: bool) -> None:
    """The table in runs/check/check_store.py: the two prepared round trips only on
    PostgreSQL, outside a caller's transaction, for a check that touches no approval."""
    from runs.check import check_store

    assert check_store.uses_prepared_statements(
        vendor=vendor, in_atomic_block=in_atomic_block, portable=portable) is prepared


@pytest.mark.django_db
@pytest.mark.both_stores
def test_a_check_looks_its_policy_up_once(api: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check's steps are handed the run's policy: one lookup per check, whether this
    process knew the run's policy version before the lock (it started the run) or not."""
    from runs.check import services

    response = api.post("/api/v1/runs", {"agent": "bot"}, content_type="application/json")
    run_id = response.json()["run_id"]
    version = Run.objects.get(pk=run_id).policy_version_id
    looked: list[int] = []
    lookup = services.rules_for_version
    monkeypatch.setattr(services, "rules_for_version",
                        lambda version_id: looked.append(version_id) or lookup(version_id))
    for forget in (False, True):
        if forget:
            services._RUN_FACTS.pop(uuid.UUID(run_id), None)
        looked.clear()
        answer = api.post(f"/api/v1/runs/{run_id}/check", {"action": {"name": "x"}},
                          content_type="application/json")
        assert answer.json()["decision"] == "allow"
        assert looked == [version]
