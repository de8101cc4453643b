"""A team's rate-limit rules by their last read (rate_limits.COUNTED_RULES: an action is
counted for the most recently read ones only). Built plainly: the table holds the rules checks
have met, a few per policy, and its writes are a rule's registration and its hourly read
stamp (docs/upgrades.md keeps CONCURRENTLY for the large tables the checks write). The new
index comes before the old one goes, so the team's lookups always have one."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('runs', '0018_run_children_index'),
    ]

    operations = [
        migrations.AddIndex(
            model_name='raterule',
            index=models.Index(fields=['team_id', '-read_at', 'key'], name='raterule_team_read'),
        ),
        migrations.RemoveIndex(
            model_name='raterule',
            name='raterule_team',
        ),
    ]
