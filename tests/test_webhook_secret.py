"""The webhook signing secret (issue 15): shown to admins once when rotated, named in the
delivery log, so a receiver can verify signatures without database access."""

from __future__ import annotations

import pytest
from django.urls import reverse
from django.utils import timezone

from policies.models import OperatorEvent, Team
from policies.services import webhook_secret_id
from runs.models import KillSwitch, WebhookDelivery
from runs.webhooks import delivery as webhooks
from tests.test_dashboard_runs import as_user
from tests.workers import Receiver


@pytest.mark.django_db
def test_an_admin_rotates_the_secret_and_sees_it_once(team, users):
    admin = as_user(users, "admin")
    old = team.webhook_secret
    url = reverse("webhook_secret_rotate", kwargs={"slug": team.slug})
    settings_page = admin.get(reverse("team_settings", kwargs={"slug": team.slug})
                              ).content.decode()
    assert webhook_secret_id(old) in settings_page and old not in settings_page
    confirm = admin.get(url).content.decode()
    assert "Rotate the webhook signing secret?" in confirm
    assert Team.objects.get(pk=team.pk).webhook_secret == old  # asking changed nothing
    response = admin.post(url)
    assert response.status_code == 302
    new = Team.objects.get(pk=team.pk).webhook_secret
    assert new != old and len(new) == 64
    shown = admin.get(response["Location"]).content.decode()
    assert new in shown and 'data-copy="#new-secret"' in shown
    assert webhook_secret_id(new) in shown
    again = admin.get(response["Location"]).content.decode()
    assert new not in again  # once
    event = OperatorEvent.objects.get(action="team.webhook_secret")
    assert event.detail == {"before": webhook_secret_id(old), "after": webhook_secret_id(new)}
    assert new not in str(event.detail)


@pytest.mark.django_db
@pytest.mark.parametrize("who", ["viewer", "operator", "outsider"])
def test_only_the_teams_admins_may_rotate(team, users, who):
    old = team.webhook_secret
    url = reverse("webhook_secret_rotate", kwargs={"slug": team.slug})
    expected = 404 if who == "outsider" else 403
    assert as_user(users, who).get(url).status_code == expected
    assert as_user(users, who).post(url).status_code == expected
    assert Team.objects.get(pk=team.pk).webhook_secret == old
    from django.test import Client
    assert Client().post(url).status_code == 302


@pytest.mark.django_db(transaction=True)
def test_the_delivery_log_names_the_secret_that_signed_each_attempt(team, users, settings):
    settings.WEBHOOK_ALLOWED_HOSTS = ["127.0.0.1"]  # the receiver is on loopback
    admin = as_user(users, "admin")
    admin.post(reverse("webhook_secret_rotate", kwargs={"slug": team.slug}))
    team.refresh_from_db()
    receiver = Receiver(secrets={team.slug: team.webhook_secret}).start()
    try:
        team.webhook_url = f"{receiver.url}/{team.slug}"
        team.save()
        switch = KillSwitch.objects.create(scope="team", team=team, target=f"team:{team.pk}",
                                           reason="r", engaged_by_label="x",
                                           engaged_at=timezone.now())
        delivery = WebhookDelivery.objects.create(switch=switch, team=team, url=team.webhook_url,
                                                  payload={"id": switch.pk})
        assert webhooks.attempt_delivery(delivery_id=delivery.pk, number=1) is None
    finally:
        receiver.stop()
    assert receiver.valid[team.slug] == 1 and not receiver.invalid  # verified with the shown one
    [attempt] = delivery.tries.all()
    assert attempt.secret_id == webhook_secret_id(team.webhook_secret)
    html = admin.get(reverse("runs:killswitch", kwargs={"slug": team.slug})).content.decode()
    assert f"signed with <code data-signed-with>{attempt.secret_id}</code>" in html
