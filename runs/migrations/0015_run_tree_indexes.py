"""The partial indexes of child runs by parent and by root (SPEC 20), built CONCURRENTLY on
PostgreSQL as runs.0008 builds its own: a plain CREATE INDEX would block every check's update
of its run while it reads the runs table."""

from __future__ import annotations

from typing import Any

from django.db import migrations, models

INDEXES = {
    "run_parent": ("parent_run_id", models.Index(
        fields=["parent_run_id"], name="run_parent",
        condition=models.Q(parent_run_id__isnull=False))),
    "run_root": ("root_run_id", models.Index(
        fields=["root_run_id"], name="run_root", condition=models.Q(root_run_id__isnull=False))),
}


def _create(apps: Any, schema_editor: Any) -> None:
    for name, (column, index) in INDEXES.items():
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.execute(f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} "
                                  f"ON runs_run ({column}) WHERE {column} IS NOT NULL")
        else:
            schema_editor.add_index(apps.get_model("runs", "Run"), index)


def _drop(apps: Any, schema_editor: Any) -> None:
    for name, (_column, index) in INDEXES.items():
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")
        else:
            schema_editor.remove_index(apps.get_model("runs", "Run"), index)


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction

    dependencies = [
        ("runs", "0014_run_tree"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.AddIndex(model_name="run", index=index)
                              for _column, index in INDEXES.values()],
            database_operations=[migrations.RunPython(_create, _drop, elidable=False)],
        ),
    ]
