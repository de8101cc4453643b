"""Small things that read as unfinished (issue 26): one money format on a page, JSON rather
than Python's repr, a countdown that says "left" once."""

from __future__ import annotations

from django.test import Client
from django.urls import reverse

from tests.conftest import set_policy
from tests.test_dashboard_runs import as_user, check, start


def test_a_runs_cost_reads_the_same_in_its_counter_and_its_timeline(team, users):
    set_policy(team, budgets={"max_usd": 0.5})
    run = start(team)
    check(team, run, cost="0.009")
    page = as_user(users).get(reverse("runs:run", args=[team.slug, run.pk])).content.decode()
    # $0.009 was "$0.01" in the counter and "$0.0090" in the step's row.
    assert "$0.009" in page
    assert "$0.01" not in page and "$0.0090" not in page
    assert "$0.50" in page  # the limit, in cents


def test_top_looping_tools_show_args_as_json(team, users):
    run = start(team)
    for _ in range(4):
        check(team, run, args={"query": "refunds"})
    page = as_user(users).get(reverse("runs:overview", args=[team.slug])).content.decode()
    assert "{&quot;query&quot;: &quot;refunds&quot;}" in page
    assert "&#x27;query&#x27;" not in page  # Python's repr quoted with '


def test_an_approvals_countdown_says_left_once(team, users):
    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 600})
    run = start(team)
    answer = Client().post(f"/api/v1/runs/{run.pk}/check",
                           {"action": {"name": "payments.refund", "args": {}},
                            "check_id": "c1"}, content_type="application/json",
                           HTTP_AUTHORIZATION=f"Bearer {run.token}")  # type: ignore[attr-defined]
    assert answer.json()["decision"] == "pending"
    page = as_user(users).get(reverse("runs:approvals", args=[team.slug])).content.decode()
    # live.js writes "14:58 left" into the <time>; the label before it said "time left:".
    assert "time left:" not in page
    assert 'class="countdown"' in page
