"""The kill switch history's indexes, newest first (runs/killswitch/selectors.py). Built
plainly: the switches table holds the operators' engages, a small table, and no check writes
it (docs/upgrades.md keeps CONCURRENTLY for the large tables the checks write)."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('runs', '0016_decision_run_flagged'),
    ]

    operations = [
        migrations.AddIndex(
            model_name='killswitch',
            index=models.Index(fields=['team', '-engaged_at', '-id'], name='killswitch_team_history'),
        ),
        migrations.AddIndex(
            model_name='killswitch',
            index=models.Index(condition=models.Q(('scope', 'global')), fields=['-engaged_at', '-id'], name='killswitch_global_history'),
        ),
    ]
