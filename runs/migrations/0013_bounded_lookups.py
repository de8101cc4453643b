"""Reads bounded by an index (docs/reliability.md "Reads bounded by an index"):

- `killswitch_team_engaged` (team) of the engaged switches: a team's, without the history.

And the run switches of runs that already ended are retired, as the fan-out retires them
now (runs/killswitch/services.py retire_run_switch): they have nothing left to guard.

On PostgreSQL each index is built CONCURRENTLY (the SQL is Django's for the index, with IF
NOT EXISTS): a plain build would block the table's writes for as long as it reads the
table. Outside a transaction, so an interrupted run can be run again (an interrupted
concurrent build leaves an invalid index behind: drop it and migrate again). Elsewhere
(SQLite) the ordinary schema editor builds them.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations, models
from django.utils import timezone

from runs.killswitch.services import retired

SWITCH_INDEX = models.Index(fields=["team"], name="killswitch_team_engaged",
                            condition=models.Q(active=True))


def _indexes(apps: Any) -> list[tuple[Any, models.Index]]:
    return [(apps.get_model("runs", "KillSwitch"), SWITCH_INDEX)]


def _forward(apps: Any, schema_editor: Any) -> None:
    postgres = schema_editor.connection.vendor == "postgresql"
    for model, index in _indexes(apps):
        if postgres:
            sql = str(index.create_sql(model, schema_editor, concurrently=True))
            schema_editor.execute(sql.replace("CREATE INDEX CONCURRENTLY",
                                              "CREATE INDEX CONCURRENTLY IF NOT EXISTS", 1))
        else:
            schema_editor.add_index(model, index)


def _backward(apps: Any, schema_editor: Any) -> None:
    postgres = schema_editor.connection.vendor == "postgresql"
    for model, index in _indexes(apps):
        if postgres:
            schema_editor.execute(
                f"DROP INDEX CONCURRENTLY IF EXISTS {schema_editor.quote_name(index.name)}")
        else:
            schema_editor.remove_index(model, index)


def retire_ended_run_switches(apps: Any, schema_editor: Any) -> None:
    KillSwitch = apps.get_model("runs", "KillSwitch")
    (KillSwitch.objects.filter(scope="run", active=True).exclude(run__status="running")
     .update(**retired(timezone.now())))


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction

    dependencies = [
        ("runs", "0011_rate_counters"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(model_name="killswitch", index=SWITCH_INDEX),
            ],
            database_operations=[migrations.RunPython(_forward, _backward, elidable=False)],
        ),
        migrations.RunPython(retire_ended_run_switches, migrations.RunPython.noop,
                             elidable=False),
    ]
