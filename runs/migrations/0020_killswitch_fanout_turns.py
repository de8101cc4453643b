"""The fan-outs' turns (runs/killswitch/fanout.py `next_fanout`): a switch's turns so far (with
a default in the database, so that the previous release's engages still insert rows) and when
its last began, and the indexes of the switches whose fan-out still waits and of the last
turns. Built plainly: the switches' table holds a row per engage, which no check writes
(docs/upgrades.md keeps CONCURRENTLY for the large tables the checks write)."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('runs', '0019_raterule_counted_order'),
    ]

    operations = [
        migrations.AddField(
            model_name='killswitch',
            name='fanout_passes',
            field=models.PositiveIntegerField(db_default=0, default=0),
        ),
        migrations.AddField(
            model_name='killswitch',
            name='fanout_turned_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddIndex(
            model_name='killswitch',
            index=models.Index(condition=models.Q(('fanout_done_at__isnull', True)),
                               fields=['engaged_at'], name='killswitch_fanout_waiting'),
        ),
        migrations.AddIndex(
            model_name='killswitch',
            index=models.Index(condition=models.Q(('fanout_turned_at__isnull', False)),
                               fields=['fanout_turned_at'], name='killswitch_turned_at'),
        ),
    ]
