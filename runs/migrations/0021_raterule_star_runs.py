"""A registered rule's pattern in SQL with each run of stars as one ".*" (rate_limits.glob_regex):
rules registered before kept the form PostgreSQL took seconds to match (a run of 190 ".*"),
and a check's write matches every registered rule of its team. Only the rules whose stored
form has two ".*" in a row are rewritten."""

from __future__ import annotations

from typing import Any

from django.db import migrations

from runs.check.rate_limits import glob_regex


def collapse(apps: Any, schema_editor: Any) -> None:
    RateRule = apps.get_model("runs", "RateRule")
    for rule in RateRule.objects.filter(regex__contains=".*.*").only("key", "match").iterator():
        RateRule.objects.filter(key=rule.key).update(regex=glob_regex(rule.match))


class Migration(migrations.Migration):

    dependencies = [
        ('runs', '0020_killswitch_fanout_turns'),
    ]

    operations = [
        migrations.RunPython(collapse, migrations.RunPython.noop),
    ]
