"""Webhooks that fail say why, and can be tested (issue 26): an internationalised host saved
in its IDNA form, a DNS failure told apart from a refused address, a "Send test" button, a
banner on the overview while notifications fail, credentials masked for all but admins."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from policies.egress import ascii_url, masked_url
from policies.services import team_update_webhook
from runs.models import KillSwitch, WebhookAttempt, WebhookDelivery
from runs.webhooks import delivery as webhooks
from tests.workers import Receiver

SECRET_URL = ("https://ops:hunter2@hooks.example.com/services/T0001/B0002/"
              "q8Zr4kV9mX2pL7tN1bW6yH3c?token=s3cr3t-value")


def signed_in(user: Any) -> Client:
    client = Client()
    client.force_login(user)
    return client


def delivery_to(team: Any, url: str) -> WebhookDelivery:
    # The team's URL, as when the product makes a delivery (a retry follows the team's).
    type(team).objects.filter(pk=team.pk).update(webhook_url=url)
    switch = KillSwitch.objects.create(scope="team", team=team, target=f"team:{team.pk}",
                                       reason="r", engaged_by_label="x",
                                       engaged_at=timezone.now())
    return WebhookDelivery.objects.create(switch=switch, team=team, url=url,
                                          payload={"id": switch.pk})


@pytest.fixture
def receiver(team: Any) -> Iterator[Receiver]:
    rec = Receiver(secrets={team.slug: team.webhook_secret}).start()
    yield rec
    rec.stop()


# --- Internationalised host names ------------------------------------------------------------

def test_an_internationalised_host_is_saved_in_its_idna_form(team, users, settings):
    settings.WEBHOOK_ALLOWED_HOSTS = []
    response = signed_in(users["admin"]).post(
        reverse("team_settings", kwargs={"slug": team.slug}),
        {"webhook_url": "https://例え.jp/hook"})
    assert response.status_code == 302, response.content
    team.refresh_from_db()
    assert team.webhook_url == "https://xn--r8jz45g.jp/hook"


def test_a_host_with_no_idna_form_is_refused_with_a_message(team, users, settings):
    settings.WEBHOOK_ALLOWED_HOSTS = []
    response = signed_in(users["admin"]).post(
        reverse("team_settings", kwargs={"slug": team.slug}),
        {"webhook_url": "https://例え" + "あ" * 70 + ".jp/hook"})
    assert response.status_code == 422
    assert b"field-error" in response.content  # Django's URLField or ours: a message
    team.refresh_from_db()
    assert team.webhook_url is None


def test_a_host_with_no_idna_form_has_a_message_of_its_own() -> None:
    from policies.egress import RefusedTarget

    with pytest.raises(RefusedTarget, match="internationalised domain name"):
        ascii_url("https://例え" + "あ" * 70 + ".jp/hook")


def test_ascii_url_keeps_credentials_port_path_and_query() -> None:
    assert (ascii_url("https://u:p@Bücher.example:8443/a/b?x=1#f")
            == "https://u:p@xn--bcher-kva.example:8443/a/b?x=1#f")
    assert ascii_url("https://plain.example/hook") == "https://plain.example/hook"


@pytest.mark.django_db(transaction=True)
def test_a_stored_internationalised_url_is_delivered_not_stuck_in_flight(team, settings):
    """Saved before the IDNA conversion: the attempt gets an outcome (here, as this machine
    has no DNS for it, a DNS failure), never stays "in flight" behind a TypeError."""
    settings.WEBHOOK_ALLOWED_HOSTS = []
    delivery = delivery_to(team, "https://例え.invalid/hook")
    webhooks.attempt_delivery(delivery_id=delivery.pk, number=1)
    [attempt] = delivery.tries.all()
    assert attempt.error == webhooks.UNRESOLVED
    assert attempt.error != webhooks.IN_FLIGHT


def test_ascii_url_writes_a_non_ascii_path_query_and_fragment_as_http_carries_them() -> None:
    # Found by an attacker: only the host was made ASCII, so a URL with "é" in its path
    # was saved as typed and every delivery to it failed "unexpectedly" (a TypeError).
    assert (ascii_url("https://hooks.example/hoök?q=é#ü")
            == "https://hooks.example/ho%C3%B6k?q=%C3%A9#%C3%BC")
    # Escapes already written stay as they are (never encoded twice).
    assert ascii_url("https://hooks.example/ho%C3%B6k?a=%2F") \
        == "https://hooks.example/ho%C3%B6k?a=%2F"
    assert ascii_url("https://Bücher.example/ä") == "https://xn--bcher-kva.example/%C3%A4"


def test_a_url_with_a_non_ascii_path_is_saved_as_http_carries_it(team, users, settings):
    settings.WEBHOOK_ALLOWED_HOSTS = ["hooks.example"]
    url = reverse("team_settings", kwargs={"slug": team.slug})
    admin = signed_in(users["admin"])
    assert admin.post(url, {"webhook_url": "https://hooks.example/hoök"}).status_code == 302
    team.refresh_from_db()
    assert team.webhook_url == "https://hooks.example/ho%C3%B6k"
    # Longer than the column once written so: refused with a message, nothing saved.
    refused = admin.post(url, {"webhook_url": "https://hooks.example/" + "é" * 470})
    assert refused.status_code == 422 and b"field-error" in refused.content
    team.refresh_from_db()
    assert team.webhook_url == "https://hooks.example/ho%C3%B6k"


@pytest.mark.django_db(transaction=True)
def test_a_stored_url_with_a_non_ascii_path_is_delivered(team, settings):
    """Saved as typed before its path was made ASCII: delivered all the same."""
    settings.WEBHOOK_ALLOWED_HOSTS = ["127.0.0.1"]
    receiver = Receiver(secrets={"ho%C3%B6k": team.webhook_secret}).start()
    try:
        delivery = delivery_to(team, f"{receiver.url}/hoök")
        webhooks.attempt_delivery(delivery_id=delivery.pk, number=1)
        delivery.refresh_from_db()
        assert delivery.status == webhooks.DELIVERED
        assert receiver.valid["ho%C3%B6k"] == 1
    finally:
        receiver.stop()


# --- Errors that say what happened -----------------------------------------------------------

@pytest.mark.django_db(transaction=True)
def test_an_unresolvable_host_is_reported_as_a_dns_failure_not_a_refused_address(
        team, settings):
    settings.WEBHOOK_ALLOWED_HOSTS = []
    delivery = delivery_to(team, "https://hooks.nothing-here.invalid/hook")
    webhooks.attempt_delivery(delivery_id=delivery.pk, number=1)
    [attempt] = delivery.tries.all()
    assert attempt.error == webhooks.UNRESOLVED
    assert "DNS" in attempt.error and "not public" not in attempt.error


@pytest.mark.django_db(transaction=True)
def test_an_unexpected_error_is_recorded_as_the_attempts_outcome(team, settings,
                                                                 monkeypatch):
    settings.WEBHOOK_ALLOWED_HOSTS = ["127.0.0.1"]

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise TypeError("something no one planned for")

    monkeypatch.setattr(webhooks.httpcore.ConnectionPool, "stream", broken)
    delivery = delivery_to(team, "http://127.0.0.1:9/hook")
    step = webhooks.attempt_delivery(delivery_id=delivery.pk, number=1)
    [attempt] = delivery.tries.all()
    assert attempt.error == webhooks.UNEXPECTED
    assert step is not None and step.number == 2  # retried like any failure


# --- Send test ---------------------------------------------------------------------------------

@pytest.mark.django_db(transaction=True)
def test_an_admin_sends_a_test_and_sees_its_outcome(team, users, receiver, settings,
                                                      monkeypatch):
    from runs.webhooks.tasks import webhook_deliver_task

    # Delivered in this process (a background thread), with or without a worker running.
    monkeypatch.setitem(webhook_deliver_task.app.conf, "task_always_eager", True)
    settings.WEBHOOK_ALLOWED_HOSTS = ["127.0.0.1"]
    team_update_webhook(team=team, webhook_url=f"{receiver.url}/{team.slug}", actor=None)
    admin = signed_in(users["admin"])
    response = admin.post(reverse("runs:webhook-test", args=[team.slug]))
    assert response.status_code == 302
    [delivery] = WebhookDelivery.objects.filter(team=team, event=webhooks.TEST_EVENT)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        delivery.refresh_from_db()
        if delivery.status == webhooks.DELIVERED:
            break
        time.sleep(0.1)
    assert delivery.status == webhooks.DELIVERED
    assert receiver.valid[team.slug] == 1
    assert receiver.bodies[0]["event"] == "webhook.test"
    assert receiver.bodies[0]["sent_by"] == "admin"
    page = admin.get(reverse("runs:killswitch", args=[team.slug])).content.decode()
    assert "webhook.test" in page and "data-webhook-test" in page


def test_only_admins_may_send_a_test(team, users, other_team):
    url = reverse("runs:webhook-test", args=[team.slug])
    assert signed_in(users["operator"]).post(url).status_code == 403
    assert signed_in(users["viewer"]).post(url).status_code == 403
    assert signed_in(users["outsider"]).post(url).status_code == 403
    assert signed_in(users["admin"]).get(url).status_code == 405
    assert not WebhookDelivery.objects.exists()
    page = signed_in(users["operator"]).get(reverse("runs:killswitch", args=[team.slug]))
    assert b"data-webhook-test" not in page.content


def test_a_second_test_is_refused_while_the_teams_last_one_is_pending(team, users):
    """One test at a time per team: a button pressed in a loop cannot queue hundreds of
    attempts (each up to 5 s of the webhook worker's time, retried 8 times)."""
    team_update_webhook(team=team, webhook_url="https://hooks.example.com/t", actor=None)
    admin = signed_in(users["admin"])
    url = reverse("runs:webhook-test", args=[team.slug])
    assert b"Test notification sent" in admin.post(url, follow=True).content
    # No worker has taken it (this test's commit hooks never run): it is still pending.
    refused = admin.post(url, follow=True).content.decode()
    assert "still pending" in refused
    assert WebhookDelivery.objects.filter(team=team, event=webhooks.TEST_EVENT).count() == 1
    team.refresh_from_db()
    with pytest.raises(webhooks.SendTestRefused, match="still pending"):
        webhooks.send_test(team=team, sent_by="admin")
    # Once it has an outcome, the next test goes out.
    WebhookDelivery.objects.filter(team=team).update(status=webhooks.FAILED)
    assert b"Test notification sent" in admin.post(url, follow=True).content
    assert WebhookDelivery.objects.filter(team=team, event=webhooks.TEST_EVENT).count() == 2


def test_a_test_of_a_url_the_team_no_longer_has_does_not_hold_up_a_test_of_the_new_one(
        team, users):
    """An admin who sees a test fail, fixes the URL and presses Send test again tests the
    new URL at once: the old URL's test, still retrying (up to two minutes of backoff), is
    given up rather than making the admin wait for it to fail."""
    team_update_webhook(team=team, webhook_url="https://no-such-host.example/t", actor=None)
    admin = signed_in(users["admin"])
    url = reverse("runs:webhook-test", args=[team.slug])
    assert b"Test notification sent" in admin.post(url, follow=True).content
    team_update_webhook(team=team, webhook_url="https://hooks.example.com/fixed", actor=None)
    assert b"Test notification sent" in admin.post(url, follow=True).content
    tests = WebhookDelivery.objects.filter(team=team, event=webhooks.TEST_EVENT)
    assert {(d.url, d.status) for d in tests} == {
        ("https://no-such-host.example/t", webhooks.FAILED),
        ("https://hooks.example.com/fixed", webhooks.PENDING)}
    given_up = tests.get(url="https://no-such-host.example/t")
    assert [a.error for a in given_up.tries.all()] == [webhooks.SUPERSEDED]
    page = admin.get(reverse("runs:killswitch", args=[team.slug])).content.decode()
    assert "webhook URL changed" in page
    # The new URL's test still counts: one at a time.
    assert "still pending" in admin.post(url, follow=True).content.decode()


@pytest.mark.django_db(transaction=True)
def test_a_kill_notification_still_retrying_reaches_the_url_an_admin_fixed(team, receiver,
                                                                           settings):
    """The overview's banner asks an admin to fix a failing URL: the notifications still
    retrying then go to the fixed URL rather than spend their attempts on the broken one."""
    settings.WEBHOOK_ALLOWED_HOSTS = ["127.0.0.1"]
    delivery = delivery_to(team, "https://hooks.nothing-here.invalid/hook")
    webhooks.attempt_delivery(delivery_id=delivery.pk, number=1)
    assert delivery.tries.get().error == webhooks.UNRESOLVED
    fixed = f"{receiver.url}/{team.slug}"
    team_update_webhook(team=team, webhook_url=fixed, actor=None)
    assert webhooks.attempt_delivery(delivery_id=delivery.pk, number=2) is None
    delivery.refresh_from_db()
    assert (delivery.status, delivery.url) == (webhooks.DELIVERED, fixed)
    assert receiver.valid[team.slug] == 1
    assert [a.error for a in delivery.tries.order_by("number")] == [webhooks.UNRESOLVED, ""]


@pytest.mark.django_db(transaction=True)
def test_a_notification_still_retrying_when_the_url_is_removed_is_given_up_saying_so(
        team, settings):
    settings.WEBHOOK_ALLOWED_HOSTS = []
    delivery = delivery_to(team, "https://hooks.nothing-here.invalid/hook")
    webhooks.attempt_delivery(delivery_id=delivery.pk, number=1)
    team_update_webhook(team=team, webhook_url=None, actor=None)
    assert webhooks.attempt_delivery(delivery_id=delivery.pk, number=2) is None
    delivery.refresh_from_db()
    assert delivery.status == webhooks.FAILED
    assert [a.error for a in delivery.tries.order_by("number")] == [
        webhooks.UNRESOLVED, webhooks.URL_REMOVED]


def test_a_test_without_a_webhook_says_so(team, users):
    response = signed_in(users["admin"]).post(reverse("runs:webhook-test", args=[team.slug]),
                                              follow=True)
    assert b"no webhook URL" in response.content
    assert not WebhookDelivery.objects.exists()


# --- The overview says when notifications fail --------------------------------------------------

def attempt(delivery: WebhookDelivery, number: int, *, error: str = "",
            status_code: int | None = None) -> WebhookAttempt:
    return WebhookAttempt.objects.create(delivery=delivery, number=number, at=timezone.now(),
                                         error=error, status_code=status_code)


def test_the_overview_shows_a_banner_while_notifications_fail(team, users):
    overview = reverse("runs:overview", args=[team.slug])
    viewer = signed_in(users["viewer"])
    assert b"data-webhook-failing" not in viewer.get(overview).content
    delivery = delivery_to(team, "https://hooks.example.com/x")
    attempt(delivery, 1, error=webhooks.UNRESOLVED)
    page = viewer.get(overview).content.decode()
    assert "data-webhook-failing" in page
    assert "DNS failure" in page
    # Who can do something about it: the URL is the admins' (the link to the settings is
    # theirs alone), so a viewer or an operator is told to ask one.
    assert "ask an admin of the team to fix the URL" in page
    admin_page = signed_in(users["admin"]).get(overview).content.decode()
    assert "fix the URL" in admin_page and "ask an admin" not in admin_page
    # A later success clears it.
    attempt(delivery, 2, status_code=200)
    assert b"data-webhook-failing" not in viewer.get(overview).content


# --- Credentials masked for everyone but admins ---------------------------------------------

def test_masked_url_hides_credentials_tokens_and_query_values() -> None:
    shown = masked_url(SECRET_URL)
    for secret in ("hunter2", "ops:", "q8Zr4kV9mX2pL7tN1bW6yH3c", "s3cr3t-value"):
        assert secret not in shown
    assert shown.startswith("https://•••@hooks.example.com/services/")
    assert "token=•••" in shown
    assert masked_url("https://hooks.example.com/governance") == \
        "https://hooks.example.com/governance"
    assert masked_url(None) == ""
    # Found by an attacker: secrets that did not look like tokens were shown whole.
    for url, secret in (("https://hooks.zapier.com/hooks/catch/1234567/abcd123/", "abcd123"),
                        ("https://example.com/h/sk_live_abcdefgh", "sk_live"),
                        ("https://example.com/secret/ALPHA-SECRET-PATH", "ALPHA")):
        shown = masked_url(url)
        assert secret not in shown and "•••" in shown, shown
    assert masked_url("https://hooks.zapier.com/hooks/catch/1234567/abcd123/") == \
        "https://hooks.zapier.com/hooks/catch/•••/•••/"


def test_the_webhook_url_is_masked_for_viewers_and_operators_not_admins(team, users,
                                                                        settings):
    settings.WEBHOOK_ALLOWED_HOSTS = ["hooks.example.com"]
    team_update_webhook(team=team, webhook_url=SECRET_URL, actor=users["admin"])
    delivery_to(team, SECRET_URL)
    for role in ("viewer", "operator"):
        client = signed_in(users[role])
        for page in (reverse("runs:killswitch", args=[team.slug]),
                     reverse("audit", args=[team.slug])):
            content = client.get(page).content.decode()
            assert "hunter2" not in content and "s3cr3t-value" not in content, (role, page)
            assert "hooks.example.com" in content, (role, page)
    admin = signed_in(users["admin"])
    assert "hunter2" in admin.get(reverse("runs:killswitch", args=[team.slug])).content.decode()
    assert "hunter2" in admin.get(reverse("audit", args=[team.slug])).content.decode()


def test_the_policies_export_and_api_mask_the_webhook_url_for_all_but_admins(
        team, users, settings):
    # Found by an attacker: the kill switch page masked it, but a viewer's YAML export and
    # the operator API's policy list gave the URL whole.
    from policies.services import policy_apply
    from policies.tokens import operator_token_create

    settings.WEBHOOK_ALLOWED_HOSTS = ["hooks.example.com"]
    team_update_webhook(team=team, webhook_url=SECRET_URL, actor=users["admin"])
    export = reverse("policies_export", args=[team.slug])
    shown = {}
    for role in ("viewer", "operator", "admin"):
        yaml_text = signed_in(users[role]).get(export).content.decode()
        token = operator_token_create(user=users[role], name="t", role=role, team=team).secret
        listed = Client(HTTP_AUTHORIZATION=f"Bearer {token}").get(
            f"/api/v1/teams/{team.slug}/policies").json()["team"]["webhook_url"]
        shown[role] = ("hunter2" in yaml_text, "hunter2" in listed)
    assert shown == {"viewer": (False, False), "operator": (False, False),
                     "admin": (True, True)}
    # A viewer's file, applied back by an admin, keeps the stored URL, not its mask.
    import yaml

    viewer_file = yaml.safe_load(signed_in(users["viewer"]).get(export).content)
    assert viewer_file["teams"][0]["webhook_url"] == masked_url(SECRET_URL)
    policy_apply(data=viewer_file, actor=users["admin"])
    team.refresh_from_db()
    assert team.webhook_url == ascii_url(SECRET_URL)


def test_the_audit_log_shows_details_as_json_not_python_repr(team, users, settings):
    from policies.services import policy_apply

    settings.WEBHOOK_ALLOWED_HOSTS = ["hooks.example.com"]
    policy_apply(data={"teams": [{"slug": team.slug, "name": "Renamed",
                             "webhook_url": "https://hooks.example.com/x"}]},
                 actor=users["admin"])
    content = signed_in(users["admin"]).get(reverse("audit", args=[team.slug])).content.decode()
    assert "&#x27;webhook_url&#x27;" not in content and "None" not in content
    assert "&quot;webhook_url&quot;: &quot;https://hooks.example.com/x&quot;" in content
