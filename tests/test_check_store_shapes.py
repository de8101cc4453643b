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


def test_the_lock_statement_reads_every_entry_a_check_can_name() -> None:
    """The keyed statement reads KEYED_MAX keyed entries at most (one lookup each): a check
    with everything set names exactly that many, and `lock` refuses more rather than drop
    some (a dropped entry would read as never seen)."""
    import uuid

    import pytest

    from governance_client import rules

    everything = rules.Check(name="x", progress="p", last_result=rules.LastResult(
        status="error", digest="d", error="boom"))
    assert len(rules.keyed_reads(everything, "x:k")) == check_store.KEYED_MAX
    assert check_store.KEYED_SQL.count("digest = $2[") == check_store.KEYED_MAX
    with pytest.raises(ValueError):
        check_store.PostgresCheck.lock(
            object.__new__(check_store.PostgresCheck), prefix="p", run_id=uuid.uuid4(),
            check_id=None, keyed=["a"] * (check_store.KEYED_MAX + 1))
