"""SPEC 20, sub-agent runs: a run's parent, root, depth and ancestors (the root first).
Existing runs are roots (depth 0, no ancestors): nothing to backfill. The columns have
database defaults, so the previous release's starts work while this one migrates
(docs/upgrades.md); their indexes are built without blocking checks by 0015."""

from django.db import migrations, models
from django.db.models import JSONField, Value


class Migration(migrations.Migration):

    dependencies = [
        ('policies', '0007_team_operator_release'),
        ('runs', '0013_decision_rule'),
    ]

    operations = [
        migrations.AddField(
            model_name='run',
            name='ancestors',
            field=models.JSONField(blank=True, default=list, db_default=Value([], JSONField())),
        ),
        migrations.AddField(
            model_name='run',
            name='depth',
            field=models.PositiveSmallIntegerField(default=0, db_default=0),
        ),
        migrations.AddField(
            model_name='run',
            name='parent_run_id',
            field=models.UUIDField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='run',
            name='root_run_id',
            field=models.UUIDField(blank=True, null=True),
        ),
    ]
