"""`check_id_per_run` on one expression, the run id's text followed by the check_id, instead
of the two columns (runs/models.py Decision): the check's lock statement finds a replay by
that expression, which no other index can answer (runs/check/check_store.py REPLAY_KEY).
The run id's text has a fixed length, so the index refuses exactly what it refused before.

On PostgreSQL the new index is built CONCURRENTLY under another name, then the two swap
names in one transaction and the old one is dropped CONCURRENTLY: a plain build would block
every check's audit INSERT for as long as it reads the audit log (minutes at tens of millions
of decisions), and uniqueness is enforced throughout. Outside a transaction, with IF NOT
EXISTS / IF EXISTS, so that an interrupted run can be run again (an interrupted concurrent
build leaves an invalid index behind: drop it and migrate again). Elsewhere (SQLite) the
ordinary schema editor swaps the constraints.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations, models
from django.db.models.functions import Cast, Concat

CONDITION = models.Q(check_id__isnull=False)
BY_COLUMNS = models.UniqueConstraint(fields=["run", "check_id"], condition=CONDITION,
                                     name="check_id_per_run")
BY_EXPRESSION = models.UniqueConstraint(Concat(Cast("run", models.TextField()), "check_id"),
                                        condition=CONDITION, name="check_id_per_run")
# As Django writes BY_EXPRESSION for PostgreSQL, and as the lock statement names it.
EXPRESSION_SQL = "(COALESCE((run_id)::text, '') || COALESCE(check_id, ''))"
COLUMNS_SQL = "run_id, check_id"


def _swap(schema_editor: Any, columns: str) -> None:
    schema_editor.execute(
        "CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS check_id_per_run_next "
        f"ON runs_decision ({columns}) WHERE check_id IS NOT NULL")
    schema_editor.execute(
        "ALTER INDEX IF EXISTS check_id_per_run RENAME TO check_id_per_run_previous; "
        "ALTER INDEX check_id_per_run_next RENAME TO check_id_per_run")
    schema_editor.execute("DROP INDEX CONCURRENTLY IF EXISTS check_id_per_run_previous")


def _forward(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        _swap(schema_editor, f"({EXPRESSION_SQL})")
        return
    decision = apps.get_model("runs", "Decision")
    schema_editor.remove_constraint(decision, BY_COLUMNS)
    schema_editor.add_constraint(decision, BY_EXPRESSION)


def _backward(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        _swap(schema_editor, COLUMNS_SQL)
        return
    decision = apps.get_model("runs", "Decision")
    schema_editor.remove_constraint(decision, BY_EXPRESSION)
    schema_editor.add_constraint(decision, BY_COLUMNS)


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction

    dependencies = [
        ("runs", "0008_run_team_ended"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RemoveConstraint(model_name="decision", name="check_id_per_run"),
                migrations.AddConstraint(model_name="decision", constraint=BY_EXPRESSION),
            ],
            database_operations=[migrations.RunPython(_forward, _backward, elidable=False)],
        ),
    ]
