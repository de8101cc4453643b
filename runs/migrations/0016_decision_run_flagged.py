"""The partial index of a run's flagged decisions (the timeline's "stops and warnings
only"), built CONCURRENTLY on PostgreSQL as runs.0015 builds its own: a plain CREATE INDEX
would block every check's audit INSERT while it reads the decisions table, the largest."""

from __future__ import annotations

from typing import Any

from django.db import migrations, models

# As runs.models has them today (runs.models.FLAGGED, IN_RUN_ORDER), frozen here.
IN_RUN_ORDER = models.Func(models.F("id"), template="(%(expressions)s + 0)",
                           output_field=models.BigIntegerField())
FLAGGED = (~models.Q(outcome="allow") | models.Q(answer__directive__type__isnull=False)
           | models.Q(answer__policy_violation=True))
INDEX = models.Index(models.F("run"), IN_RUN_ORDER, name="decision_run_flagged",
                     condition=FLAGGED)


def _create(apps: Any, schema_editor: Any) -> None:
    model = apps.get_model("runs", "Decision")
    if schema_editor.connection.vendor == "postgresql":
        # Django's own statement for the index (the condition's SQL exactly as the reads
        # write it, which the planner must match), built without locking out writes.
        sql = str(INDEX.create_sql(model, schema_editor))
        schema_editor.execute(sql.replace("CREATE INDEX", "CREATE INDEX CONCURRENTLY IF NOT "
                                          "EXISTS", 1))
    else:
        schema_editor.add_index(model, INDEX)


def _drop(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {INDEX.name}")
    else:
        schema_editor.remove_index(apps.get_model("runs", "Decision"), INDEX)


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction

    dependencies = [
        ("runs", "0015_run_tree_indexes"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.AddIndex(model_name="decision", index=INDEX)],
            database_operations=[migrations.RunPython(_create, _drop, elidable=False)],
        ),
    ]
