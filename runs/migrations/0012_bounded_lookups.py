"""Reads bounded by an index (docs/reliability.md "Reads bounded by an index"):

- `decision_run` (run, id + 0) replaces the foreign key's index on `run_id` alone: a run's
  decisions in id order, so a page of them is a range of the index, not a sort of the run's
  every decision nor a walk of the primary key (runs.models.IN_RUN_ORDER says why `+ 0`);
  `decision_run_stop` and `decision_run_would_stop`, the same on the run's stops and
  would-stops only, for the reads of the first one;
- `run_team_agent_recent` (team, agent, -started_at): an agent's runs, newest first;
- `killswitch_team_engaged` (team) of the engaged switches: a team's, without the history.

And the run switches of runs that already ended are retired, as the fan-out retires them
now (runs/killswitch/fanout.py retire_run_switch): they have nothing left to guard.

On PostgreSQL each index is built CONCURRENTLY (the SQL is Django's for the index, with IF
NOT EXISTS), the new one before the old one is dropped (CONCURRENTLY, IF EXISTS): a plain
build would block every check's audit INSERT, or its run's update, for as long as it reads
the table. Outside a transaction, so an interrupted run can be run again (an interrupted
concurrent build leaves an invalid index behind: drop it and migrate again). Elsewhere
(SQLite) the ordinary schema editor builds them, and the old index is dropped by its name
(altering the field would copy the whole table).
"""

from __future__ import annotations

from typing import Any

from django.db import migrations, models
from django.utils import timezone

from runs.killswitch.fanout import retired

# As runs.models.IN_RUN_ORDER: ordered by an expression the primary key does not index.
IN_RUN_ORDER = models.Func(models.F("id"), template="(%(expressions)s + 0)",
                           output_field=models.BigIntegerField())
DECISION_INDEXES = [
    models.Index(models.F("run"), IN_RUN_ORDER, name="decision_run"),
    models.Index(models.F("run"), IN_RUN_ORDER, name="decision_run_stop",
                 condition=models.Q(outcome="stop")),
    models.Index(models.F("run"), IN_RUN_ORDER, name="decision_run_would_stop",
                 condition=models.Q(outcome="would_stop")),
]
RUN_INDEX = models.Index(fields=["team", "agent", "-started_at"], name="run_team_agent_recent")
SWITCH_INDEX = models.Index(fields=["team"], name="killswitch_team_engaged",
                            condition=models.Q(active=True))


def _indexes(apps: Any) -> list[tuple[Any, models.Index]]:
    decision = apps.get_model("runs", "Decision")
    return [*((decision, index) for index in DECISION_INDEXES),
            (apps.get_model("runs", "Run"), RUN_INDEX),
            (apps.get_model("runs", "KillSwitch"), SWITCH_INDEX)]


def _run_id_indexes(schema_editor: Any, decision: Any) -> list[str]:
    """The foreign key's own index on `run_id` alone, by whatever name it has."""
    with schema_editor.connection.cursor() as cursor:
        constraints = schema_editor.connection.introspection.get_constraints(
            cursor, decision._meta.db_table)
    return sorted(name for name, info in constraints.items()
                  if info["index"] and not info["unique"] and info["columns"] == ["run_id"])


def _forward(apps: Any, schema_editor: Any) -> None:
    decision = apps.get_model("runs", "Decision")
    postgres = schema_editor.connection.vendor == "postgresql"
    for model, index in _indexes(apps):
        if postgres:
            sql = str(index.create_sql(model, schema_editor, concurrently=True))
            schema_editor.execute(sql.replace("CREATE INDEX CONCURRENTLY",
                                              "CREATE INDEX CONCURRENTLY IF NOT EXISTS", 1))
        else:
            schema_editor.add_index(model, index)
    quote = schema_editor.quote_name
    for name in _run_id_indexes(schema_editor, decision):
        concurrently = "CONCURRENTLY " if postgres else ""
        schema_editor.execute(f"DROP INDEX {concurrently}IF EXISTS {quote(name)}")


def _backward(apps: Any, schema_editor: Any) -> None:
    decision = apps.get_model("runs", "Decision")
    postgres = schema_editor.connection.vendor == "postgresql"
    if not _run_id_indexes(schema_editor, decision):
        field = decision._meta.get_field("run")
        if postgres:
            sql = str(schema_editor._create_index_sql(decision, fields=[field],
                                                      concurrently=True))
            sql = sql.replace("CREATE INDEX CONCURRENTLY",
                              "CREATE INDEX CONCURRENTLY IF NOT EXISTS", 1)
        else:
            sql = str(schema_editor._create_index_sql(decision, fields=[field]))
        schema_editor.execute(sql)
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
                migrations.AlterField(
                    model_name="decision", name="run",
                    field=models.ForeignKey(db_index=False, on_delete=models.CASCADE,
                                            related_name="decisions", to="runs.run"),
                ),
                *(migrations.AddIndex(model_name="decision", index=index)
                  for index in DECISION_INDEXES),
                migrations.AddIndex(model_name="run", index=RUN_INDEX),
                migrations.AddIndex(model_name="killswitch", index=SWITCH_INDEX),
            ],
            database_operations=[migrations.RunPython(_forward, _backward, elidable=False)],
        ),
        migrations.RunPython(retire_ended_run_switches, migrations.RunPython.noop,
                             elidable=False),
    ]
