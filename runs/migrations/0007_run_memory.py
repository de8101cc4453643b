# The run's keyed memory moves out of the `memory` document into rows (issue 17): a check then
# reads and writes its own entries only. The data step moves every run's entries, running or
# ended (a check of an ended run still answers its key's count), and back when reversed.
#
# The conversion is written out here, not imported, so this migration keeps doing the same
# thing whatever the application's code becomes; tests/test_run_memory_migration.py checks
# that its digest is the one runs/check/run_memory.py looks entries up by.

import hashlib

import django.db.models.deletion
from django.db import migrations, models

# The keyed parts of the stored memory, and the kind of entry each one holds.
KEYED = {"repeat_counts": "repeat", "progress_seen": "progress",
         "signatures_seen": "signature", "error_counts": "error"}
BATCH = 1000


def digest(kind, text):
    return hashlib.sha256(f"{kind}:{text}".encode()).hexdigest()


def to_rows(apps, schema_editor):
    Run = apps.get_model("runs", "Run")
    RunMemory = apps.get_model("runs", "RunMemory")
    db = schema_editor.connection.alias
    with_keyed = (Run.objects.using(db).filter(memory__has_any_keys=list(KEYED))
                  .only("id", "memory").order_by("pk"))
    last = None
    while True:
        batch = list((with_keyed if last is None else with_keyed.filter(pk__gt=last))[:BATCH])
        if not batch:
            return
        rows = []
        for run in batch:
            for name, kind in KEYED.items():
                value = run.memory.pop(name, None) or ()
                items = value.items() if isinstance(value, dict) else ((t, 1) for t in value)
                rows.extend(RunMemory(run_id=run.pk, digest=digest(kind, text), kind=kind,
                                      text=text, count=int(count)) for text, count in items)
        RunMemory.objects.using(db).bulk_create(rows, batch_size=BATCH)
        Run.objects.using(db).bulk_update(batch, ["memory"], batch_size=BATCH)
        last = batch[-1].pk


def to_document(apps, schema_editor):
    Run = apps.get_model("runs", "Run")
    RunMemory = apps.get_model("runs", "RunMemory")
    db = schema_editor.connection.alias
    names = {kind: name for name, kind in KEYED.items()}
    runs = Run.objects.using(db).only("id", "memory").order_by("pk")
    last = None
    while True:
        batch = list((runs if last is None else runs.filter(pk__gt=last))[:BATCH])
        if not batch:
            return
        entries = {}
        for run_id, kind, text, count in (RunMemory.objects.using(db)
                                          .filter(run_id__in=[r.pk for r in batch])
                                          .values_list("run_id", "kind", "text", "count")):
            entries.setdefault(run_id, []).append((kind, text, count))
        changed = []
        for run in batch:
            if run.pk not in entries:
                continue
            memory = {**(run.memory or {}), "repeat_counts": {}, "progress_seen": [],
                      "signatures_seen": [], "error_counts": {}}
            for kind, text, count in entries[run.pk]:
                part = memory[names[kind]]
                if isinstance(part, dict):
                    part[text] = count
                else:
                    part.append(text)
            memory["progress_seen"].sort()
            memory["signatures_seen"].sort()
            run.memory = memory
            changed.append(run)
        Run.objects.using(db).bulk_update(changed, ["memory"], batch_size=BATCH)
        last = batch[-1].pk


class Migration(migrations.Migration):

    dependencies = [
        ('runs', '0006_idle_deadline_rate_hits'),
    ]

    operations = [
        migrations.CreateModel(
            name='RunMemory',
            fields=[
                ('pk', models.CompositePrimaryKey('run_id', 'digest', blank=True, editable=False, primary_key=True, serialize=False)),
                ('digest', models.CharField(max_length=64)),
                ('kind', models.CharField(max_length=10)),
                ('text', models.TextField()),
                ('count', models.PositiveIntegerField()),
                ('run', models.ForeignKey(db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='+', to='runs.run')),
            ],
        ),
        migrations.RunPython(to_rows, to_document, elidable=False),
    ]
