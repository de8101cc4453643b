# No run is terminal while one of its approvals is pending (SPEC 10, "No impossible states").
# Older versions could leave one so: a local stop uploaded while the run waited ended the run
# and left its request pending, and every look at that request then failed (the approvals
# sweep, the team's pages, GET /api/v1/runs). This repairs such databases the way the code
# now settles a request whose run ends some other way (runs/approvals/services.py,
# `settle_stale_locked`): the request is `cancelled` as of the run's end, and the run's memory
# stops naming it (the wait's seconds move to `paused_s`). No audit record is written (the
# audit log is append-only, and the run's story ended with its stop); the request's
# `decision` then reads as the run's stop, as a replay of its check answers.
#
# Written out here, not imported, so this migration keeps doing the same thing whatever the
# application's code becomes; tests/test_stale_approvals_migration.py runs it.

from datetime import datetime

from django.db import migrations
from django.utils import timezone

RUNNING = "running"
BATCH = 1000


def settle(apps, schema_editor):
    Approval = apps.get_model("runs", "Approval")
    Run = apps.get_model("runs", "Run")
    db = schema_editor.connection.alias
    now = timezone.now()
    stale = (Approval.objects.using(db).filter(status="pending").exclude(run__status=RUNNING)
             .values_list("pk", "run__ended_at", "requested_at"))
    for pk, ended_at, requested_at in stale.iterator(chunk_size=BATCH):
        decided_at = max(ended_at or now, requested_at)
        Approval.objects.using(db).filter(pk=pk, status="pending").update(
            status="cancelled", decided_at=decided_at)
    # Runs that are over and whose memory still names a request (JSON null is "none").
    waiting = (Run.objects.using(db).exclude(status=RUNNING)
               .filter(memory__has_key="pending").exclude(memory__pending=None)
               .only("pk", "memory", "ended_at"))
    changed = []
    for run in waiting.iterator(chunk_size=BATCH):
        memory = dict(run.memory)
        pending = memory.get("pending")
        if not pending:
            continue
        paused = float(memory.get("paused_s") or 0.0)
        try:
            since = datetime.fromisoformat(pending["since"])
            paused += max(0.0, ((run.ended_at or now) - since).total_seconds())
        except (KeyError, TypeError, ValueError):
            pass  # a memory no version wrote: its pause is unknown, the request still goes
        memory.update(pending=None, paused_s=paused)
        run.memory = memory
        changed.append(run)
    Run.objects.using(db).bulk_update(changed, ["memory"], batch_size=BATCH)


class Migration(migrations.Migration):

    dependencies = [
        ("runs", "0009_check_id_expression"),
    ]

    operations = [
        # Nothing to undo: the states it repairs are impossible ones.
        migrations.RunPython(settle, migrations.RunPython.noop, elidable=False),
    ]
