"""The webhook signing secret (issue 15): each secret, the one a team is made with included, is
shown to admins once (like an agent key), named in the delivery log, so a receiver can verify
signatures without database access."""

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
def test_an_admin_sees_the_secret_the_team_was_made_with_once(team, users):
    admin = as_user(users, "admin")
    secret = team.webhook_secret
    settings_url = reverse("team_settings", kwargs={"slug": team.slug})
    show_url = reverse("webhook_secret_show", kwargs={"slug": team.slug})
    before = admin.get(settings_url).content.decode()
    assert "data-show-secret" in before and secret not in before
    assert admin.get(show_url).status_code == 405  # showing takes a POST, never a link
    response = admin.post(show_url)
    assert response.status_code == 302 and response["Location"] == settings_url
    shown = admin.get(settings_url).content.decode()
    assert secret in shown and 'data-copy="#new-secret"' in shown
    assert f"Signing secret {webhook_secret_id(secret)}" in shown
    assert "New signing secret" not in shown  # the same secret: receivers change nothing
    assert "data-show-secret" not in shown and "data-secret-shown" in shown
    again = admin.get(settings_url).content.decode()
    assert secret not in again  # once
    refused = admin.post(show_url, follow=True).content.decode()
    assert secret not in refused and "already shown once" in refused
    assert Team.objects.get(pk=team.pk).webhook_secret == secret  # showing changed nothing
    [event] = OperatorEvent.objects.filter(action="team.webhook_secret.shown")
    assert event.detail == {"secret": webhook_secret_id(secret)}
    assert event.actor == users["admin"] and secret not in str(event.detail)


@pytest.mark.django_db
def test_a_rotated_secret_is_not_offered_a_second_time(team, users):
    admin = as_user(users, "admin")
    admin.post(reverse("webhook_secret_rotate", kwargs={"slug": team.slug}))
    new = Team.objects.get(pk=team.pk).webhook_secret
    settings_url = reverse("team_settings", kwargs={"slug": team.slug})
    assert new in admin.get(settings_url).content.decode()  # shown by the rotation
    later = admin.get(settings_url).content.decode()
    assert "data-show-secret" not in later and new not in later
    admin.post(reverse("webhook_secret_show", kwargs={"slug": team.slug}))
    assert new not in admin.get(settings_url).content.decode()
    assert not OperatorEvent.objects.filter(action="team.webhook_secret.shown").exists()


@pytest.mark.django_db
@pytest.mark.parametrize("who", ["viewer", "operator", "outsider"])
def test_only_the_teams_admins_may_see_the_secret(team, users, who):
    """SPEC 7: the webhook is the admins' to manage; nobody else sees its secret or uses up
    its one showing."""
    client = as_user(users, who)
    show_url = reverse("webhook_secret_show", kwargs={"slug": team.slug})
    expected = 403
    response = client.post(show_url)
    assert response.status_code == expected
    assert team.webhook_secret not in response.content.decode()
    assert client.get(reverse("team_settings", kwargs={"slug": team.slug})
                      ).status_code == expected
    assert Team.objects.get(pk=team.pk).webhook_secret_shown_at is None
    from django.test import Client
    assert Client().post(show_url).status_code == 302  # to the sign-in page
    assert Team.objects.get(pk=team.pk).webhook_secret_shown_at is None


@pytest.mark.django_db
def test_the_migration_counts_a_secret_made_by_an_earlier_rotation_as_shown(team, users):
    import importlib

    from django.apps import apps

    from policies.services import audit

    mark = importlib.import_module(
        "policies.migrations.0005_team_webhook_secret_shown_at").mark_rotated_secrets_shown
    rotated = Team.objects.create(slug="rotated", name="rotated", webhook_secret="b" * 64)
    audit(actor=None, action="team.webhook_secret", team=rotated, target=rotated.slug,
          detail={"before": webhook_secret_id("a" * 64), "after": webhook_secret_id("b" * 64)})
    # Rotated, then its secret replaced some other way: the rotation's secret is not this one.
    replaced = Team.objects.create(slug="replaced", name="replaced", webhook_secret="c" * 64)
    audit(actor=None, action="team.webhook_secret", team=replaced, target=replaced.slug,
          detail={"before": "", "after": webhook_secret_id("d" * 64)})
    mark(apps, None)
    assert Team.objects.get(pk=rotated.pk).webhook_secret_shown_at is not None
    assert Team.objects.get(pk=replaced.pk).webhook_secret_shown_at is None
    assert Team.objects.get(pk=team.pk).webhook_secret_shown_at is None  # never rotated


@pytest.mark.django_db
@pytest.mark.parametrize("who", ["viewer", "operator", "outsider"])
def test_only_the_teams_admins_may_rotate(team, users, who):
    old = team.webhook_secret
    url = reverse("webhook_secret_rotate", kwargs={"slug": team.slug})
    expected = 403
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


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_two_admins_asking_at_once_one_sees_the_secret(team, users):
    """Real concurrency: eight threads ask at the same moment, each on its own connection;
    the conditional UPDATE lets exactly one of them have the secret, audited once."""
    import threading

    from django.db import connection

    from policies.services import team_show_webhook_secret

    barrier = threading.Barrier(8)
    results: list[str | None] = []

    def ask() -> None:
        try:
            barrier.wait(timeout=10)
            results.append(team_show_webhook_secret(team=team, actor=users["admin"]))
        finally:
            connection.close()

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(results) == 8 and results.count(None) == 7
    assert [r for r in results if r is not None] == [team.webhook_secret]
    assert OperatorEvent.objects.filter(action="team.webhook_secret.shown").count() == 1
