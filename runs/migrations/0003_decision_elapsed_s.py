"""Each decision records the run's elapsed seconds as the rules counted them, so that a
backtest replays `max_seconds` exactly (docs/backtest.md).

A nullable column without a default: PostgreSQL adds it without rewriting or updating a row,
so the append-only triggers of 0002 (BEFORE UPDATE OR DELETE) have nothing to refuse and stay
in place; SQLite adds it with a plain ALTER TABLE too. Existing decisions keep NULL: a
backtest falls back to `at - started_at` for them, which is the same value for every run that
never paused.
"""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("runs", "0002_audit_append_only"),
    ]

    operations = [
        migrations.AddField(
            model_name="decision",
            name="elapsed_s",
            field=models.FloatField(blank=True, null=True),
        ),
    ]
