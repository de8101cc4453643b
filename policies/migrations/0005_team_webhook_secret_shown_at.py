"""Each webhook signing secret is shown to an admin once (issue 15), like an agent key.

A secret made by a rotation before this field existed was shown then, on the page after the
rotation: its team gets the time of that rotation, so it is not shown a second time. Any other
secret (the one a team was made with) was never shown: it stays null, and an admin may see it
once from the settings page.
"""

import hashlib

from django.db import migrations, models


def secret_id(secret):
    # policies.services.webhook_secret_id, frozen here as migrations must be.
    return "whsec_" + hashlib.sha256(secret.encode()).hexdigest()[:10] if secret else ""


def mark_rotated_secrets_shown(apps, schema_editor):
    Team = apps.get_model("policies", "Team")
    OperatorEvent = apps.get_model("policies", "OperatorEvent")
    for team in Team.objects.exclude(webhook_secret="").only("id", "webhook_secret"):
        rotation = (OperatorEvent.objects
                    .filter(team_id=team.id, action="team.webhook_secret",
                            detail__after=secret_id(team.webhook_secret))
                    .order_by("-at").values_list("at", flat=True).first())
        if rotation is not None:
            Team.objects.filter(pk=team.id).update(webhook_secret_shown_at=rotation)


class Migration(migrations.Migration):

    dependencies = [
        ("policies", "0004_idle_and_rate_limits"),
    ]

    operations = [
        migrations.AddField(
            model_name="team",
            name="webhook_secret_shown_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.RunPython(mark_rotated_secrets_shown, migrations.RunPython.noop),
    ]
