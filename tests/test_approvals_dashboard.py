"""The approvals screens (SPEC 11, 7): the live approvals page per team, the controls and the
pending banner on the run page, the timeline row of a pending step, the navigation's count,
the streams that keep them live, RBAC, and the metrics."""

from __future__ import annotations

from typing import Any

import pytest
from django.conf import settings
from django.shortcuts import resolve_url
from django.test import Client, RequestFactory, override_settings
from django.urls import reverse

from policies.models import OperatorEvent, Role, Team
from runs.approvals.services import approval_decide
from runs.dashboard.stream import ApprovalsSource, RunSource
from runs.models import Approval, Run
from tests.conftest import set_policy
from tests.test_approvals_api import PAY, check, start

pytestmark = pytest.mark.django_db


@pytest.fixture
def approving(team: Team) -> Team:
    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 600})
    return team


def signed_in(user: Any) -> Client:
    client = Client()
    client.force_login(user)
    return client


def waiting(api: Client, check_id: str = "pay-1") -> tuple[str, str]:
    run_id = start(api)
    answer = check(api, run_id, PAY, check_id=check_id)
    return run_id, answer["approval"]["id"]


def test_the_page_needs_a_member(approving, users):
    url = reverse("runs:approvals", args=[approving.slug])
    assert Client().get(url).status_code == 302  # to the login page
    assert signed_in(users["outsider"]).get(url).status_code == 403


def test_viewers_see_pending_requests_without_controls(api, approving, users):
    run_id, approval_id = waiting(api)
    html = signed_in(users["viewer"]).get(reverse("runs:approvals", args=[approving.slug])
                                          ).content.decode()
    assert f'id="approval-{approval_id}"' in html and 'data-status="pending"' in html
    assert "payments.refund" in html and "s3cret" not in html and "[redacted]" in html
    assert run_id[:8] in html and "support-bot" in html
    assert "data-expires-at=" in html  # the countdown
    assert 'value="approve"' not in html
    assert "Deciding needs the operator role" in html


def test_operators_get_the_controls_and_pending_comes_first(api, approving, users):
    _, old = waiting(api, "a")
    approval_decide(team=approving, approval_id=old, decision="approve", note="",
                    actor=users["operator"])
    _run2, new = waiting(api, "b")
    html = signed_in(users["operator"]).get(reverse("runs:approvals", args=[approving.slug])
                                            ).content.decode()
    assert html.index(f"approval-{new}") < html.index(f"approval-{old}")
    assert 'value="approve"' in html and 'value="deny"' in html
    assert reverse("runs:approval_decide", args=[approving.slug, new]) in html


def test_redacted_args_stay_redacted_on_screen(api, approving, users):
    run_id = start(api)
    check(api, run_id, {"name": "payments.refund", "args": {"api_key": "k-123", "n": 1}},
          check_id="c")
    html = signed_in(users["viewer"]).get(reverse("runs:approvals", args=[approving.slug])
                                          ).content.decode()
    assert "k-123" not in html and "[redacted]" in html


def test_a_request_whose_args_came_as_a_digest_says_it_cannot_show_them(api, approving,
                                                                        users):
    """Found by an attacker: a payment's args padded past 64 KiB reached the approver as the
    client's digest only, the card reading like any other."""
    digest = {"oversize_args": {"sha256": "ab" * 32, "bytes": 70052,
                                "keys": ["amount_eur", "iban", "note"]}}
    check(api, start(api), {"name": "payments.refund", "args": digest}, check_id="big")
    check(api, start(api), PAY, check_id="small")
    html = signed_in(users["viewer"]).get(reverse("runs:approvals", args=[approving.slug])
                                          ).content.decode()
    assert html.count("approval__hidden") == 1
    assert "at 70052 bytes they were too large for a check" in html


def test_the_navigation_counts_pending_requests(api, approving, users):
    waiting(api)
    url = reverse("runs:runs", args=[approving.slug])
    html = signed_in(users["viewer"]).get(url).content.decode()
    assert 'id="nav-approvals-count"' in html and 'data-count="1"' in html


def test_the_run_page_shows_the_banner_the_controls_and_the_pending_row(api, approving, users):
    run_id, approval_id = waiting(api)
    url = reverse("runs:run", args=[approving.slug, run_id])
    html = signed_in(users["operator"]).get(url).content.decode()
    assert "Waiting for approval" in html and f'data-approval="{approval_id}"' in html
    assert 'value="deny"' in html
    assert 'class="step outcome-pending"' in html and "waiting for an operator" in html
    viewer_html = signed_in(users["viewer"]).get(url).content.decode()
    assert "Waiting for approval" in viewer_html and 'value="deny"' not in viewer_html


def test_deciding_from_the_page_redirects_with_a_message(api, approving, users):
    run_id, approval_id = waiting(api)
    operator = signed_in(users["operator"])
    back = reverse("runs:run", args=[approving.slug, run_id])
    response = operator.post(reverse("runs:approval_decide", args=[approving.slug, approval_id]),
                             {"decision": "approve", "next": back})
    assert response.status_code == 302 and response["Location"] == back
    assert Approval.objects.get(pk=approval_id).status == "approved"
    html = operator.get(back).content.decode()
    assert "Waiting for approval" not in html and "approval approved by operator" in html


@pytest.mark.parametrize("target", ["on", "approvals", "home"])
def test_a_next_that_is_not_a_path_goes_to_the_approvals_page(api, approving, users, target):
    # Found by an attacker: `next` was reversed as a view name by redirect(), a 500 (after the
    # decision was saved) for a word without "/" or ".".
    _, approval_id = waiting(api)
    response = signed_in(users["operator"]).post(
        reverse("runs:approval_decide", args=[approving.slug, approval_id]),
        {"decision": "approve", "next": target})
    assert response.status_code == 302
    assert response["Location"] == reverse("runs:approvals", args=[approving.slug])
    assert Approval.objects.get(pk=approval_id).status == "approved"


def test_an_htmx_decision_answers_the_card(api, approving, users):
    _, approval_id = waiting(api)
    response = signed_in(users["admin"]).post(
        reverse("runs:approval_decide", args=[approving.slug, approval_id]),
        {"decision": "deny", "note": "wrong customer"}, HTTP_HX_REQUEST="true")
    assert response.status_code == 200
    html = response.content.decode()
    assert 'data-status="denied"' in html and "wrong customer" in html
    assert "<html" not in html


def test_a_late_decision_answers_409_on_the_card(api, approving, users):
    _, approval_id = waiting(api)
    url = reverse("runs:approval_decide", args=[approving.slug, approval_id])
    signed_in(users["operator"]).post(url, {"decision": "approve"}, HTTP_HX_REQUEST="true")
    late = signed_in(users["admin"]).post(url, {"decision": "deny", "note": "x"},
                                          HTTP_HX_REQUEST="true")
    assert late.status_code == 409 and "already approved by operator" in late.content.decode()


def test_the_forms_answer_into_the_region_the_stream_swaps(api, approving, users):
    """The decide form posts into its card's live region, the element the page's stream
    swaps too (the approvals list, the run's banner), so the two can only overwrite each
    other: a card swapped inside a list being replaced left two cards of one id on screen."""
    run_id, approval_id = waiting(api)
    operator = signed_in(users["operator"])
    page_html = operator.get(reverse("runs:approvals", args=[approving.slug])).content.decode()
    assert 'hx-target="#approvals-list" hx-swap="innerHTML"' in page_html
    run_html = operator.get(reverse("runs:run", args=[approving.slug, run_id])).content.decode()
    assert 'hx-target="#run-approval" hx-swap="innerHTML"' in run_html

    url = reverse("runs:approval_decide", args=[approving.slug, approval_id])
    in_list = {"HTTP_HX_REQUEST": "true", "HTTP_HX_TARGET": "approvals-list"}
    refused = operator.post(url, {"decision": "deny", "note": ""}, **in_list)
    html = refused.content.decode()
    assert refused.status_code == 422 and "<html" not in html
    assert html.count(f'id="approval-{approval_id}"') == 1
    assert 'data-status="pending"' in html and "approval__error" in html and "note" in html
    assert "Waiting for a decision" in html and "Decided" in html  # the whole list

    denied = operator.post(url, {"decision": "deny", "note": "wrong customer"}, **in_list)
    html = denied.content.decode()
    assert denied.status_code == 200 and html.count(f'id="approval-{approval_id}"') == 1
    assert 'data-status="denied"' in html and "Denied." in html
    assert 'id="approvals-empty"' in html  # nothing waits any more


def test_a_decision_from_the_run_page_answers_its_banner(api, approving, users):
    _, approval_id = waiting(api)
    operator = signed_in(users["operator"])
    url = reverse("runs:approval_decide", args=[approving.slug, approval_id])
    in_banner = {"HTTP_HX_REQUEST": "true", "HTTP_HX_TARGET": "run-approval"}
    refused = operator.post(url, {"decision": "bogus"}, **in_banner)
    html = refused.content.decode()
    assert refused.status_code == 422 and "Waiting for approval" in html
    assert "approval__error" in html and html.count(f'id="approval-{approval_id}"') == 1

    approved = operator.post(url, {"decision": "approve"}, **in_banner)
    html = approved.content.decode()
    assert approved.status_code == 200 and "Waiting for approval" not in html
    assert "Approved." in html and "approval-" not in html

    late = signed_in(users["admin"]).post(url, {"decision": "deny", "note": "x"}, **in_banner)
    assert late.status_code == 409 and "already approved by operator" in late.content.decode()


@pytest.mark.parametrize("who, status", [("viewer", 403), ("outsider", 403)])
def test_a_forged_decision_is_refused_and_changes_nothing(api, approving, users, who, status):
    _, approval_id = waiting(api)
    response = signed_in(users[who]).post(
        reverse("runs:approval_decide", args=[approving.slug, approval_id]),
        {"decision": "approve"})
    assert response.status_code == status
    assert Approval.objects.get(pk=approval_id).status == "pending"
    assert not OperatorEvent.objects.filter(action__startswith="approval.").exists()


def test_another_teams_approval_is_404_on_the_dashboard(api, approving, other_team, users):
    _, approval_id = waiting(api)
    from policies.services import membership_set

    membership_set(team=other_team, user=users["operator"], role=Role.OPERATOR, actor=None)
    response = signed_in(users["operator"]).post(
        reverse("runs:approval_decide", args=[other_team.slug, approval_id]),
        {"decision": "approve"})
    assert response.status_code == 404
    assert Approval.objects.get(pk=approval_id).status == "pending"


def stream_request(user: Any, team: Team) -> Any:
    request = RequestFactory().get("/")
    request.user = user
    request.team, request.role = team, Role.OPERATOR
    return request


def test_the_streams_render_the_same_partials_and_follow_decisions(api, approving, users):
    run_id, approval_id = waiting(api)
    request = stream_request(users["operator"], approving)
    approvals = ApprovalsSource(request, approving)
    frames = {f.event: f.data for f in approvals.frames()}
    assert set(frames) == {"approvals-list", "approvals-count", "chrome"}
    assert f"approval-{approval_id}" in frames["approvals-list"]
    assert 'data-count="1"' in frames["approvals-count"]
    assert 'hx-swap-oob="true"' in frames["approvals-count"]
    assert approvals.frames() == []  # nothing changed, nothing sent

    run_source = RunSource(request, approving, run_id, after=0)
    run_frames = {f.event: f.data for f in run_source.frames()}
    assert "Waiting for approval" in run_frames["run-approval"]
    assert 'value="approve"' in run_frames["run-approval"]

    approval_decide(team=approving, approval_id=approval_id, decision="approve", note="",
                    actor=users["operator"])
    after = {f.event: f.data for f in approvals.frames()}
    assert 'data-status="approved"' in after["approvals-list"]
    assert 'data-count="0"' in after["approvals-count"]
    run_after = run_source.frames()
    assert "Waiting for approval" not in next(f.data for f in run_after
                                              if f.event == "run-approval")
    steps = [f for f in run_after if f.event == "step"]
    assert len(steps) == 1 and "approval approved by operator" in steps[0].data


def test_the_approvals_stream_renders_its_list_only_when_the_requests_change(
        api, approving, users, monkeypatch):
    """A card holds up to 14 KB of task and args: rendering a hundred of them on every check
    of the team, in every open approvals page, made another team's check p99 7x (found by an
    attacker)."""
    from runs.dashboard import stream

    _, approval_id = waiting(api)
    approvals = ApprovalsSource(stream_request(users["operator"], approving), approving)
    assert "approvals-list" in {f.event for f in approvals.frames()}
    rendered: list[Any] = []
    real = stream.approvals_context
    monkeypatch.setattr(stream, "approvals_context",
                        lambda *a, **kw: rendered.append(1) or real(*a, **kw))
    other = start(api)
    check(api, other, {"name": "search.docs", "args": {"q": "x"}})  # the team changed
    assert approvals.frames() == [] and rendered == []
    _, second = waiting(api, check_id="pay-2")  # a new request: the list again
    frames = {f.event: f.data for f in approvals.frames()}
    assert rendered == [1] and f"approval-{second}" in frames["approvals-list"]
    approval_decide(team=approving, approval_id=approval_id, decision="approve", note="",
                    actor=users["operator"])
    assert 'data-status="approved"' in {f.event: f.data for f in approvals.frames()}[
        "approvals-list"]


def test_the_page_settles_an_expired_request(api, team, users):
    import time

    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 1})
    run_id, _approval_id = waiting(api)
    time.sleep(1.2)
    url = reverse("runs:approvals", args=[team.slug])
    html = signed_in(users["viewer"]).get(url).content.decode()
    assert 'data-status="expired"' in html
    assert Run.objects.get(pk=run_id).stop_reason == "approval_expired"


@override_settings(METRICS_TOKEN="t")
def test_metrics_count_pending_requests_and_time_decisions(api, approving, users):
    from runs.check import metrics

    _, approval_id = waiting(api)
    scrape = Client().get("/metrics", HTTP_AUTHORIZATION="Bearer t").content.decode()
    assert f'governance_approvals_pending{{team="{approving.slug}"}} 1.0' in scrape
    approval_decide(team=approving, approval_id=approval_id, decision="approve", note="",
                    actor=users["operator"])
    # The histogram is observed after the commit (this test's transaction never commits).
    metrics.approval_decided(team=approving.slug, status="approved", seconds=3.0)
    scrape = Client().get("/metrics", HTTP_AUTHORIZATION="Bearer t").content.decode()
    assert f'governance_approvals_pending{{team="{approving.slug}"}} 0.0' in scrape
    assert ('governance_approval_decision_seconds_count{status="approved",'
            f'team="{approving.slug}"}}') in scrape


def test_the_delivery_log_lists_approval_notifications(api, approving, users):
    from runs.models import WebhookDelivery

    _, approval_id = waiting(api)
    WebhookDelivery.objects.create(approval_id=approval_id, event="approval.requested",
                                   team=approving, url="https://hooks.example.com/x",
                                   payload={"event": "approval.requested"})
    html = signed_in(users["viewer"]).get(reverse("runs:killswitch", args=[approving.slug])
                                          ).content.decode()
    assert "approval.requested" in html


def test_a_stale_decision_on_the_run_page_says_so_above_the_new_request(api, approving, users):
    run_id, first = waiting(api, "pay-1")
    approval_decide(team=approving, approval_id=first, decision="approve", note="",
                    actor=users["admin"])
    second = check(api, run_id, PAY, check_id="pay-2")["approval"]["id"]
    late = signed_in(users["operator"]).post(
        reverse("runs:approval_decide", args=[approving.slug, first]), {"decision": "approve"},
        HTTP_HX_REQUEST="true", HTTP_HX_TARGET="run-approval")
    html = late.content.decode()
    assert late.status_code == 409
    assert "already approved by admin" in html and "A new request of the run waits below" in html
    assert html.index("approval__error") < html.index(f'id="approval-{second}"')
    assert Approval.objects.get(pk=second).status == "pending"


def test_the_forms_next_is_the_page_they_are_on_wherever_they_were_rendered(
        api, approving, users):
    run_id, approval_id = waiting(api)
    operator = signed_in(users["operator"])
    url = reverse("runs:approval_decide", args=[approving.slug, approval_id])
    listed = operator.post(url, {"decision": "bogus"}, HTTP_HX_REQUEST="true",
                           HTTP_HX_TARGET="approvals-list").content.decode()
    page_url = reverse("runs:approvals", args=[approving.slug])
    assert f'name="next" value="{page_url}"' in listed and f'value="{url}"' not in listed
    banner = operator.post(url, {"decision": "bogus"}, HTTP_HX_REQUEST="true",
                           HTTP_HX_TARGET="run-approval").content.decode()
    assert f'name="next" value="{reverse("runs:run", args=[approving.slug, run_id])}"' in banner


@pytest.mark.parametrize("current", ["http://[::1", "http://[zz]/x", "https://[::1/teams/"])
def test_an_unreadable_htmx_current_url_is_off_site_not_a_500(approving, current):
    # Found by an attacker: django-htmx parses HX-Current-URL on demand, and one that is not a
    # URL (an unclosed IPv6 bracket) raised, a 500 on every team page for anyone signed out.
    page_url = reverse("runs:approvals", args=[approving.slug])
    response = Client().get(page_url, HTTP_HX_REQUEST="true", HTTP_HX_CURRENT_URL=current)
    assert response.status_code == 200
    assert response["HX-Redirect"] == f"{resolve_url(settings.LOGIN_URL)}?next={page_url}"


def test_an_htmx_request_without_a_session_goes_to_the_login_page_and_back(api, approving):
    _, approval_id = waiting(api)
    page_url = reverse("runs:approvals", args=[approving.slug])
    response = Client().post(
        reverse("runs:approval_decide", args=[approving.slug, approval_id]),
        {"decision": "approve"}, HTTP_HX_REQUEST="true", HTTP_HX_TARGET="approvals-list",
        HTTP_HX_CURRENT_URL=f"http://testserver{page_url}")
    assert response.status_code == 200 and response.content == b""
    login = response["HX-Redirect"]
    assert login == f"{resolve_url(settings.LOGIN_URL)}?next={page_url}"
    assert Approval.objects.get(pk=approval_id).status == "pending"
    plain = Client().post(reverse("runs:approval_decide", args=[approving.slug, approval_id]),
                          {"decision": "approve"})
    assert plain.status_code == 302
    assert plain["Location"].startswith(resolve_url(settings.LOGIN_URL))
