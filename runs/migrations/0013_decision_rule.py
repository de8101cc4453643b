"""SPEC 16: each decision records the rule that decided it (`rule`), as its answer carries it.

A nullable column without a default, as 0003 added `elapsed_s`: PostgreSQL adds it without
rewriting or updating a row, so the append-only triggers of 0002 (BEFORE UPDATE OR DELETE)
have nothing to refuse and stay in place. Decisions recorded before keep NULL (the decision
endpoint and the timeline then read the answer's `rule`, null too).
"""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("runs", "0012_bounded_lookups"),
    ]

    operations = [
        migrations.AddField(
            model_name="decision",
            name="rule",
            field=models.JSONField(blank=True, null=True),
        ),
    ]
