"""SPEC 20, sub-agent runs: a run's parent, root, depth and ancestors (the root first), and
the partial indexes of child runs by parent and by root. Existing runs are roots (depth 0, no
ancestors): nothing to backfill."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('policies', '0007_team_operator_release'),
        ('runs', '0012_bounded_lookups'),
    ]

    operations = [
        migrations.AddField(
            model_name='run',
            name='ancestors',
            field=models.JSONField(blank=True, default=list),
        ),
        migrations.AddField(
            model_name='run',
            name='depth',
            field=models.PositiveSmallIntegerField(default=0),
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
        migrations.AddIndex(
            model_name='run',
            index=models.Index(condition=models.Q(('parent_run_id__isnull', False)), fields=['parent_run_id'], name='run_parent'),
        ),
        migrations.AddIndex(
            model_name='run',
            index=models.Index(condition=models.Q(('root_run_id__isnull', False)), fields=['root_run_id'], name='run_root'),
        ),
    ]
