"""The index of retention's batch read (runs/audit/retention.py prunable_runs).

Built CONCURRENTLY on PostgreSQL: a plain CREATE INDEX would block every check's update of
its run for as long as the build reads the runs table, which on an installation with
millions of runs is more than a check may wait. Hence a migration outside a transaction, and
IF NOT EXISTS so that one interrupted build can be run again (an interrupted concurrent build
leaves an invalid index behind: drop it and migrate again). Elsewhere (SQLite) the ordinary
schema editor builds it.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations, models

INDEX = models.Index(fields=["team", "ended_at", "id"], name="run_team_ended",
                     condition=models.Q(ended_at__isnull=False))


def _create(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(
            "CREATE INDEX CONCURRENTLY IF NOT EXISTS run_team_ended "
            "ON runs_run (team_id, ended_at, id) WHERE ended_at IS NOT NULL")
    else:
        schema_editor.add_index(apps.get_model("runs", "Run"), INDEX)


def _drop(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("DROP INDEX CONCURRENTLY IF EXISTS run_team_ended")
    else:
        schema_editor.remove_index(apps.get_model("runs", "Run"), INDEX)


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction

    dependencies = [
        ("runs", "0007_run_memory"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.AddIndex(model_name="run", index=INDEX)],
            database_operations=[migrations.RunPython(_create, _drop, elidable=False)],
        ),
    ]
