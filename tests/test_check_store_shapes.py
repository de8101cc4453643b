"""The check's write takes its columns from the model, once: the audit record names every
column of runs_decision, the run's new state only columns of runs_run."""

from __future__ import annotations

from runs.check import check_store
from runs.models import Decision, Run


def test_the_audit_record_is_every_decision_column() -> None:
    columns = {f.column for f in Decision._meta.concrete_fields if not f.primary_key}
    assert set(check_store.DECISION_COLUMNS) == columns
    assert set(check_store.ROW_FIELDS) | {"run_id"} == columns
    assert check_store.INSERT_SQL.count(", ".join(check_store.DECISION_COLUMNS)) == 2


def test_the_state_update_names_columns_of_the_run() -> None:
    columns = {f.column for f in Run._meta.concrete_fields}
    assert set(check_store.UPDATE_FIELDS) <= columns
    for name in check_store.UPDATE_FIELDS:
        assert f"{name} = n.{name}" in check_store.WRITE_SQL
