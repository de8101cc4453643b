"""The operator audit page (SPEC 7) shows a team its own events and the global kill switch,
and its work is bounded whatever the log holds (SPEC 10): found by an attacker, a viewer's
token for all of its teams wrote `token.read` events without a team, which every team's
page listed (who works where, their token's name, how often they read), and a page of large
policy versions took a dashboard thread for 18 s."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from policies import selectors
from policies.document import parse_policy
from policies.models import OperatorEvent
from policies.services import audit, policy_save
from policies.tokens import operator_token_create
from runs.killswitch.services import killswitch_engage

pytestmark = pytest.mark.django_db


def signed_in(user: Any) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_a_persons_events_without_a_team_stay_off_every_teams_page(team, other_team, users):
    token = operator_token_create(user=users["viewer"], name="everywhere", role="viewer",
                                  team=None).secret
    assert Client(HTTP_AUTHORIZATION=f"Bearer {token}").get("/api/v1/teams").status_code == 200
    assert OperatorEvent.objects.filter(action="token.read", team=None).exists()
    killswitch_engage(scope="global", reason="all stop", actor=users["superuser"])
    page = signed_in(users["outsider"]).get(reverse("audit", args=[other_team.slug]))
    content = page.content.decode()
    assert "token.read" not in content and "everywhere" not in content
    assert "killswitch.engage" in content  # the global switch concerns every team
    choices = selectors.audit_choices(other_team)
    assert "token.read" not in choices["actions"] and "killswitch.engage" in choices["actions"]


def test_a_large_policy_version_is_summarised_with_a_link_to_its_diff(team, users):
    document = {**team.policies.get(name="default").current.document}
    document["repeat_key"] = {"ignore_args": [f"arg.{'x' * 150}{i}" for i in range(256)]}
    policy_save(team=team, document=parse_policy(document), actor=users["admin"],
                source="test")
    small = {**document, "tools": {"allow": None, "deny": ["files.delete_*"]}}
    policy_save(team=team, document=parse_policy(small), actor=users["admin"], source="test")
    big_version = team.policies.get(name="default").current.version - 1
    content = signed_in(users["viewer"]).get(reverse("audit", args=[team.slug])).content.decode()
    # The newest save's before is the large one: both are summarised, neither is diffed.
    history = reverse("policy_history", kwargs={"slug": team.slug, "name": "default"})
    assert "too large to diff here" in content
    assert f"{history}?b={big_version}&amp;a={big_version - 1}" in content
    assert "x" * 150 not in content
    # A small one is still diffed on the page.
    audit(actor=users["admin"], action="policy.version", team=team, target="default",
          detail={"version": 99, "before": {"a": 1}, "after": {"a": 2}, "source": "test"})
    content = signed_in(users["viewer"]).get(reverse("audit", args=[team.slug])).content.decode()
    assert "+a: 2" in content


def test_the_pager_stops_counting_at_its_cap(team, users, monkeypatch):
    monkeypatch.setattr(selectors, "AUDIT_COUNT_CAP", 120)
    OperatorEvent.objects.bulk_create([
        OperatorEvent(team=team, actor_label="bot", action="token.read", target=f"GET /{i}")
        for i in range(300)])
    with CaptureQueriesContext(connection) as queries:
        page = selectors.audit_page(team, page=3)
        assert page.paginator.count == 120 and page.paginator.capped
    assert page.paginator.num_pages == 3 and len(page.object_list) == 20
    # Only the page's rows have their detail measured: not the counted ones (found by an
    # attacker: the count measured the detail of 10,000 events, 2 s and a 503 a page view),
    # nor the ones an offset skips.
    measured = [q["sql"] for q in queries if "LENGTH" in q["sql"].upper()]
    assert len(measured) == 1 and "OFFSET" not in measured[0].upper()
    content = signed_in(users["viewer"]).get(reverse("audit", args=[team.slug])).content.decode()
    assert "Page 1 of 3+" in content
