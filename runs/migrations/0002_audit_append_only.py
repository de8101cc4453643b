"""The audit tables are append-only in the database itself, on PostgreSQL (docs/reliability.md).

Application code never updates or deletes an audit row, but a bug, a hand-typed SQL statement
or a compromised process could; a trigger refuses them whatever the client. The one escape
hatch is a transaction that sets ``governance.audit_maintenance`` to ``on`` with SET LOCAL:
there DELETE and TRUNCATE pass (retention pruning, test-database flushes), UPDATE never does.
An operator event may still lose its team or actor reference (ON DELETE SET NULL when a team
or user is deleted): its ``actor_label`` keeps who did it, so nothing recorded is changed.

SQLite has no equivalent worth the name, so the embedded default is unguarded: it is a
development database.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations

FUNCTION = """
CREATE OR REPLACE FUNCTION governance_audit_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    old_row jsonb;
    new_row jsonb;
    detachable text;
BEGIN
    IF TG_OP IN ('DELETE', 'TRUNCATE')
       AND coalesce(current_setting('governance.audit_maintenance', true), '') = 'on' THEN
        RETURN OLD;  -- ignored for TRUNCATE (statement level)
    END IF;
    IF TG_OP = 'UPDATE' AND TG_NARGS > 0 THEN
        -- The trigger's arguments name the references that may be cleared, nothing else.
        old_row := to_jsonb(OLD);
        new_row := to_jsonb(NEW);
        FOREACH detachable IN ARRAY TG_ARGV LOOP
            IF new_row -> detachable = 'null'::jsonb THEN
                old_row := old_row - detachable;
                new_row := new_row - detachable;
            END IF;
        END LOOP;
        IF old_row = new_row THEN
            RETURN NEW;
        END IF;
    END IF;
    RAISE EXCEPTION 'governance: % on % refused, the audit log is append-only', TG_OP, TG_TABLE_NAME
        USING ERRCODE = 'insufficient_privilege',
              HINT = 'Only retention pruning removes audit records (manage.py prune_audit).';
END
$$;
"""

# (table, references an UPDATE may set to NULL)
TABLES = [
    ("runs_decision", []),
    ("policies_operatorevent", ["team_id", "actor_id"]),
]


def _install(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(FUNCTION, params=None)  # "%" in RAISE is not a placeholder
    for table, detachable in TABLES:
        args = ", ".join(f"'{column}'" for column in detachable)
        schema_editor.execute(
            f"CREATE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table} "
            f"FOR EACH ROW EXECUTE FUNCTION governance_audit_append_only({args})"
        )
        # TRUNCATE triggers exist only per statement; without one TRUNCATE bypasses the rows'.
        schema_editor.execute(
            f"CREATE TRIGGER {table}_no_truncate BEFORE TRUNCATE ON {table} "
            f"FOR EACH STATEMENT EXECUTE FUNCTION governance_audit_append_only()"
        )


def _uninstall(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    for table, _ in TABLES:
        schema_editor.execute(f"DROP TRIGGER IF EXISTS {table}_append_only ON {table}")
        schema_editor.execute(f"DROP TRIGGER IF EXISTS {table}_no_truncate ON {table}")
    schema_editor.execute("DROP FUNCTION IF EXISTS governance_audit_append_only()")


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0001_initial"),
        ("policies", "0001_initial"),
    ]

    operations = [migrations.RunPython(_install, _uninstall, elidable=False)]
