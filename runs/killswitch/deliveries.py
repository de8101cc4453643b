"""The webhook deliveries of a kill switch (SPEC 6, 13): one per notified team, created by the
fan-out (runs/killswitch/fanout.py) once the covered runs are killed, with the runs the switch
stopped in the payload. Sending them is the webhooks' transport (runs/webhooks), which knows
nothing of switches.
"""

from __future__ import annotations

from django.db import IntegrityError, transaction
from django.db.models import QuerySet

from governance_client import rules
from policies.models import Team
from runs.killswitch import cover
from runs.models import KillSwitch, Run, Scope, WebhookDelivery
from runs.webhooks.delivery import PENDING, payload_for


def killed_by(switch: KillSwitch, team: Team) -> list[str]:
    """The team's runs this switch stopped: covered, killed since it was engaged, whether by
    the fan-out or by a check that saw the switch first."""
    ids = (Run.objects.filter(cover.runs_covered_by(switch), team=team, status=rules.KILLED,
                              stop_reason="killed", ended_at__gte=switch.engaged_at)
           .order_by("ended_at", "id").values_list("pk", flat=True))
    return [str(pk) for pk in ids]


def _teams_to_notify(switch: KillSwitch) -> QuerySet[Team]:
    teams = Team.objects.exclude(webhook_url__isnull=True).exclude(webhook_url="")
    if switch.scope != Scope.GLOBAL:
        teams = teams.filter(pk=switch.team_id)
    return teams.order_by("pk")


def ensure_deliveries(switch: KillSwitch, *, resume: bool) -> list[int]:
    """One delivery per notified team (unique per switch and team). Returns the ids to start:
    the ones created now, and, when a previous pass died before finishing (``resume``), the
    ones it created but may not have started."""
    start: list[int] = []
    for team in _teams_to_notify(switch):
        payload = payload_for(switch, team, killed_by(switch, team))
        try:
            with transaction.atomic():
                delivery, created = WebhookDelivery.objects.get_or_create(
                    switch=switch, team=team,
                    defaults={"url": team.webhook_url, "payload": payload},
                )
        except IntegrityError:  # a concurrent pass created it: that pass starts it
            continue
        if created or (resume and delivery.status == PENDING and delivery.attempts == 0):
            start.append(delivery.pk)
    return start

