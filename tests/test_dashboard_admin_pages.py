"""Admin pages (issue 15): confirmations before revoking a key or removing a member, the new
token's copy button, the 403 page inside the team's layout, list fields as tall as their lines,
the keys table at full width, one time and money format."""

from __future__ import annotations

import re
from datetime import timedelta
from decimal import Decimal

import pytest
from django.urls import reverse
from django.utils import timezone

from governance.templatetags.dashboard_tags import duration, money, when
from policies.models import AgentKey, Membership
from policies.services import agent_key_create
from tests.test_dashboard_runs import as_user

pytestmark = pytest.mark.django_db


def test_revoking_a_key_asks_first_and_only_the_post_revokes(team, users):
    key = agent_key_create(team=team, name="ci-bot").key
    admin = as_user(users, "admin")
    url = reverse("key_revoke", kwargs={"slug": team.slug, "key_id": key.pk})
    keys_page = admin.get(reverse("keys", kwargs={"slug": team.slug})).content.decode()
    assert f'href="{url}"' in keys_page  # a link to the confirmation, not a one-click POST
    confirm = admin.get(url).content.decode()
    assert "Revoke key ci-bot?" in confirm and "get 401" in confirm
    assert AgentKey.objects.get(pk=key.pk).revoked_at is None
    assert admin.post(url).status_code == 302
    assert AgentKey.objects.get(pk=key.pk).revoked_at is not None


def test_removing_a_member_asks_first_and_only_the_post_removes(team, users):
    membership = Membership.objects.get(team=team, user=users["viewer"])
    admin = as_user(users, "admin")
    url = reverse("member_remove", kwargs={"slug": team.slug, "membership_id": membership.pk})
    confirm = admin.get(url).content.decode()
    assert "Remove viewer from Customer support?" in confirm
    assert Membership.objects.filter(pk=membership.pk).exists()
    assert admin.post(url).status_code == 302
    assert not Membership.objects.filter(pk=membership.pk).exists()


@pytest.mark.parametrize("who", ["viewer", "operator"])
def test_the_confirmations_are_for_admins_only(team, users, who):
    key = agent_key_create(team=team, name="k").key
    membership = Membership.objects.get(team=team, user=users["viewer"])
    for url in (reverse("key_revoke", kwargs={"slug": team.slug, "key_id": key.pk}),
                reverse("member_remove", kwargs={"slug": team.slug,
                                                 "membership_id": membership.pk})):
        assert as_user(users, who).get(url).status_code == 403
    assert as_user(users, "outsider").get(
        reverse("key_revoke", kwargs={"slug": team.slug, "key_id": key.pk})).status_code == 403


def test_a_new_token_has_a_copy_button_and_the_keys_table_is_full_width(team, users):
    admin = as_user(users, "admin")
    response = admin.post(reverse("keys", kwargs={"slug": team.slug}), {"name": "fresh"})
    html = admin.get(response["Location"]).content.decode()
    assert 'id="new-token"' in html and 'data-copy="#new-token"' in html
    assert re.search(r'src="/static/copy[.\w]*\.js"', html)  # hashed name in production
    assert 'class="compact full-width keys"' in html and "grid two" not in html


def test_the_403_page_keeps_the_team_navigation(team, users):
    response = as_user(users, "viewer").get(reverse("keys", kwargs={"slug": team.slug}))
    html = response.content.decode()
    assert response.status_code == 403 and "Not allowed" in html
    assert 'aria-label="Team"' in html and f'href="/teams/{team.slug}/runs/"' in html
    assert "Agent keys" not in html.split('aria-label="Team"')[1].split("</nav>")[0]


def test_the_redacted_args_box_shows_every_line(team, users):
    html = as_user(users, "admin").get(
        reverse("policy", kwargs={"slug": team.slug, "name": "default"})).content.decode()
    box = re.search(r'<textarea[^>]*name="redact_args"[^>]*>', html).group(0)
    assert 'rows="6"' in box  # five default keys, plus a line to type in


def test_one_time_format_and_one_money_format():
    now = timezone.now()
    html = str(when(now - timedelta(minutes=3), now))
    assert ">3\xa0minutes ago</time>" in html and " UTC\"" in html and "datetime=" in html
    # A time to come (a token's expiry), and a clock a moment ahead of this one.
    assert ">in 1\xa0week</time>" in str(when(now + timedelta(days=7, seconds=5), now))
    assert ">just now</time>" in str(when(now + timedelta(seconds=2), now))
    assert money(Decimal("1234.5")) == "$1,234.50" and money(0.004) == "$0.004"
    assert money(Decimal("0.1234"), 4) == "$0.1234" and money(None) == "—"
    assert (duration(0.25), duration(12.34), duration(75), duration(7300)) == (
        "250 ms", "12.3 s", "1 min 15 s", "2 h 01 min")
