"""Rate limits (SPEC 12) counted per rule instead of scanned from every hit: the registered
rules (RateRule), each scope's count (RateCount) and ring of its last `max` stamps
(RateSlot), and the bounded wait for the rules' advisory locks (a PostgreSQL function);
runs/check/rate_limits.py has the design. The hits table goes.

The rules of every policy's current version, and of the versions running runs use, are
registered here and given the hits of the last 86,400 s, so that no window starts empty at
the upgrade. Rules met later are registered by the first check that reads them.
"""

from __future__ import annotations

from collections import deque
from datetime import timedelta
from typing import Any

from django.db import migrations, models
from django.utils import timezone
from governance_client.rules import RateLimit

# The key, the pattern's SQL form and the scope must be the ones the checks compute.
from runs.check.rate_limits import (
    DROP_LOCK_FUNCTION_SQL,
    LOCK_FUNCTION_SQL,
    MAX_WINDOW_S,
    glob_regex,
    rule_key,
    scope_value,
)

BACKFILL_SQL = f"""
WITH hits AS (
    SELECT r.key, r.max, s.scope, h.at,
           row_number() OVER (PARTITION BY r.key, s.scope ORDER BY h.at, h.id) AS i,
           count(*) OVER (PARTITION BY r.key, s.scope) AS n
    FROM runs_ratehit h
    JOIN runs_raterule r ON r.team_id = h.team_id AND h.action_name ~ r.regex
    CROSS JOIN LATERAL (SELECT CASE r.per WHEN 'run' THEN h.run_id::text
                                          WHEN 'agent' THEN h.agent ELSE '' END AS scope) s
    WHERE h.at > clock_timestamp() - interval '{MAX_WINDOW_S} seconds'
), slots AS (
    INSERT INTO runs_rateslot (rule_key, scope, slot, at)
    SELECT key, scope, mod(i - 1, max), at FROM hits WHERE i > n - max
)
INSERT INTO runs_ratecount (rule_key, scope, n, last_at)
SELECT key, scope, max(n), max(at) FROM hits GROUP BY key, scope
"""


def _rules_in_use(apps: Any) -> dict[Any, tuple[int, RateLimit]]:
    Policy = apps.get_model("policies", "Policy")
    PolicyVersion = apps.get_model("policies", "PolicyVersion")
    Run = apps.get_model("runs", "Run")
    versions = set(Policy.objects.exclude(current=None).values_list("current_id", flat=True))
    versions |= set(Run.objects.filter(status="running").values_list("policy_version_id",
                                                                     flat=True).distinct())
    out = {}
    for team_id, document in (PolicyVersion.objects.filter(pk__in=versions)
                              .values_list("policy__team_id", "document")):
        for r in document.get("rate_limits") or ():
            rule = RateLimit(match=r["match"], per=r["per"], max=r["max"],
                             window_s=r["window_s"])
            out[rule_key(rule, team_id=team_id)] = (team_id, rule)
    return out


def backfill(apps: Any, schema_editor: Any) -> None:
    RateRule = apps.get_model("runs", "RateRule")
    now = timezone.now()
    rules = _rules_in_use(apps)
    RateRule.objects.bulk_create(
        [RateRule(key=key, team_id=team_id, per=rule.per, match=rule.match,
                  regex=glob_regex(rule.match), max=rule.max, read_at=now)
         for key, (team_id, rule) in rules.items()], ignore_conflicts=True)
    if not rules:
        return
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(BACKFILL_SQL)
        return
    # The embedded store: the same, by hand (its hits are few).
    RateHit = apps.get_model("runs", "RateHit")
    RateCount = apps.get_model("runs", "RateCount")
    RateSlot = apps.get_model("runs", "RateSlot")
    rings: dict[tuple[Any, str], tuple[int, deque[Any]]] = {}
    by_team: dict[int, list[tuple[Any, RateLimit]]] = {}
    for key, (team_id, rule) in rules.items():
        by_team.setdefault(team_id, []).append((key, rule))
    hits = RateHit.objects.filter(team_id__in=list(by_team),
                                  at__gt=now - timedelta(seconds=MAX_WINDOW_S))
    for team_id, agent, run_id, name, at in hits.order_by("at", "id").values_list(
            "team_id", "agent", "run_id", "action_name", "at"):
        for key, rule in by_team[team_id]:
            if rule.matches(name):
                ring = (key, scope_value(rule, agent=agent, run_id=run_id))
                n, stamps = rings.get(ring) or (0, deque(maxlen=rule.max))
                stamps.append(at)
                rings[ring] = (n + 1, stamps)
    for (key, scope), (n, stamps) in rings.items():
        size = rules[key][1].max
        RateCount.objects.create(rule_key=key, scope=scope, n=n, last_at=stamps[-1])
        RateSlot.objects.bulk_create(
            [RateSlot(rule_key=key, scope=scope, slot=i % size, at=at)
             for i, at in enumerate(stamps, start=n - len(stamps))])


def create_lock_function(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(LOCK_FUNCTION_SQL)


def drop_lock_function(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP_LOCK_FUNCTION_SQL)


class Migration(migrations.Migration):

    dependencies = [
        ('runs', '0010_settle_stale_approvals'),
    ]

    operations = [
        migrations.CreateModel(
            name='RateCount',
            fields=[
                ('pk', models.CompositePrimaryKey('rule_key', 'scope', blank=True, editable=False, primary_key=True, serialize=False)),
                ('rule_key', models.UUIDField()),
                ('scope', models.TextField()),
                ('n', models.BigIntegerField()),
                ('last_at', models.DateTimeField()),
            ],
            options={
                'indexes': [models.Index(fields=['last_at'], name='ratecount_last')],
            },
        ),
        migrations.CreateModel(
            name='RateRule',
            fields=[
                ('key', models.UUIDField(primary_key=True, serialize=False)),
                ('team_id', models.BigIntegerField()),
                ('per', models.CharField(max_length=10)),
                ('match', models.CharField(max_length=200)),
                ('regex', models.TextField()),
                ('max', models.IntegerField()),
                ('read_at', models.DateTimeField()),
            ],
            options={
                'indexes': [models.Index(fields=['team_id'], name='raterule_team'),
                            models.Index(fields=['read_at'], name='raterule_read')],
            },
        ),
        migrations.CreateModel(
            name='RateSlot',
            fields=[
                ('pk', models.CompositePrimaryKey('rule_key', 'scope', 'slot', blank=True, editable=False, primary_key=True, serialize=False)),
                ('rule_key', models.UUIDField()),
                ('scope', models.TextField()),
                ('slot', models.IntegerField()),
                ('at', models.DateTimeField()),
            ],
        ),
        migrations.RunPython(backfill, migrations.RunPython.noop),
        migrations.DeleteModel(
            name='RateHit',
        ),
        migrations.RunPython(create_lock_function, drop_lock_function),
    ]
