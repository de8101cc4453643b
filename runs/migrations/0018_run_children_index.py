"""A run's children in the order they started (SPEC 20): the index of child runs by parent
gains the start time, so the first children a run's answer lists (`children_ids`) and its
page shows (`children_of`) are one range of it instead of a sort of all of a parent's
children (a tree is bounded in depth, not in width: SPEC 10's bounded reads). It replaces
`run_parent`, whose lookups by parent it serves as well. Built CONCURRENTLY on PostgreSQL, as
runs.0015 built the one it replaces, the new one before the old one goes: the checks update
the runs table the whole time (docs/upgrades.md)."""

from __future__ import annotations

from typing import Any

from django.db import migrations, models

OLD = models.Index(fields=["parent_run_id"], name="run_parent",
                   condition=models.Q(parent_run_id__isnull=False))
NEW = models.Index(fields=["parent_run_id", "started_at", "id"], name="run_children",
                   condition=models.Q(parent_run_id__isnull=False))
_NEW_SQL = ("CREATE INDEX CONCURRENTLY IF NOT EXISTS run_children "
            "ON runs_run (parent_run_id, started_at, id) WHERE parent_run_id IS NOT NULL")
_OLD_SQL = ("CREATE INDEX CONCURRENTLY IF NOT EXISTS run_parent "
            "ON runs_run (parent_run_id) WHERE parent_run_id IS NOT NULL")


def _forward(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(_NEW_SQL)
        schema_editor.execute("DROP INDEX CONCURRENTLY IF EXISTS run_parent")
    else:
        run = apps.get_model("runs", "Run")
        schema_editor.add_index(run, NEW)
        schema_editor.remove_index(run, OLD)


def _backward(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(_OLD_SQL)
        schema_editor.execute("DROP INDEX CONCURRENTLY IF EXISTS run_children")
    else:
        run = apps.get_model("runs", "Run")
        schema_editor.add_index(run, OLD)
        schema_editor.remove_index(run, NEW)


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction

    dependencies = [
        ("runs", "0017_killswitch_history"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.RemoveIndex(model_name="run", name="run_parent"),
                              migrations.AddIndex(model_name="run", index=NEW)],
            database_operations=[migrations.RunPython(_forward, _backward, elidable=False)],
        ),
    ]
