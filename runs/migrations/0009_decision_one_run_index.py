"""One index for a run's decisions: `check_id_per_run` on (run, check_id), unique, no longer
partial, in place of the partial unique index and the foreign key's own index on run.

Why (docs/performance.md "Cost as one run grows"): the check's locking read looks up a
retried check_id with `run_id = $1 AND check_id = $2`, and with two indexes starting with
run_id a generic plan made from the statistics of a nearly empty table could take the
run's index and filter every decision of the run for the check_id, a cost that grows with
the run; with one index there is no such plan. And every audit insert maintains one B-tree
fewer. Uniqueness is unchanged: NULLs are distinct in a unique index, so the decisions
without a check_id (kills, waits, abandonments) never collide, as when the index was
partial on `check_id IS NOT NULL`.

PostgreSQL: the new index is built CONCURRENTLY (a plain build would block every check's
audit insert for as long as it reads the audit table), then takes the constraint's name in
one short transaction, then the foreign key's index is dropped CONCURRENTLY: outside a
transaction, each step IF [NOT] EXISTS so that an interrupted run can be run again (an
interrupted concurrent build leaves an invalid index: drop it and migrate again). The
append-only triggers are untouched: no row is updated or deleted. SQLite gets the same
indexes by name.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations, models, transaction

TABLE = "runs_decision"
NEW = "decision_run_check_id"  # the new index's name until it becomes the constraint
OLD_PARTIAL = "decision_check_id_partial"  # the same, reversing


def _run_index(schema_editor: Any) -> str:
    # The name Django gave the foreign key's index (its hash of table and column).
    return schema_editor._create_index_name(TABLE, ["run_id"], suffix="")


def _forwards(apps: Any, schema_editor: Any) -> None:
    run_index = _run_index(schema_editor)
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS {NEW} "
                              f"ON {TABLE} (run_id, check_id)")
        with transaction.atomic(using=schema_editor.connection.alias):
            schema_editor.execute("DROP INDEX IF EXISTS check_id_per_run")
            schema_editor.execute(f"ALTER TABLE {TABLE} ADD CONSTRAINT check_id_per_run "
                                  f"UNIQUE USING INDEX {NEW}")
        schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {run_index}")
    else:
        schema_editor.execute("DROP INDEX IF EXISTS check_id_per_run")
        schema_editor.execute(f"CREATE UNIQUE INDEX check_id_per_run ON {TABLE} "
                              "(run_id, check_id)")
        schema_editor.execute(f"DROP INDEX IF EXISTS {run_index}")


def _backwards(apps: Any, schema_editor: Any) -> None:
    run_index = _run_index(schema_editor)
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {run_index} "
                              f"ON {TABLE} (run_id)")
        schema_editor.execute(f"CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS {OLD_PARTIAL} "
                              f"ON {TABLE} (run_id, check_id) WHERE check_id IS NOT NULL")
        with transaction.atomic(using=schema_editor.connection.alias):
            schema_editor.execute(f"ALTER TABLE {TABLE} DROP CONSTRAINT IF EXISTS "
                                  "check_id_per_run")
            schema_editor.execute(f"ALTER INDEX {OLD_PARTIAL} RENAME TO check_id_per_run")
    else:
        schema_editor.execute(f"CREATE INDEX IF NOT EXISTS {run_index} ON {TABLE} (run_id)")
        schema_editor.execute("DROP INDEX IF EXISTS check_id_per_run")
        schema_editor.execute(f"CREATE UNIQUE INDEX check_id_per_run ON {TABLE} "
                              "(run_id, check_id) WHERE check_id IS NOT NULL")


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction

    dependencies = [
        ("runs", "0008_run_team_ended"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RemoveConstraint(model_name="decision", name="check_id_per_run"),
                migrations.AlterField(
                    model_name="decision",
                    name="run",
                    field=models.ForeignKey(db_index=False,
                                            on_delete=models.deletion.CASCADE,
                                            related_name="decisions", to="runs.run"),
                ),
                migrations.AddConstraint(
                    model_name="decision",
                    constraint=models.UniqueConstraint(fields=("run", "check_id"),
                                                       name="check_id_per_run"),
                ),
            ],
            database_operations=[migrations.RunPython(_forwards, _backwards, elidable=False)],
        ),
    ]
