"""Approval screens (SPEC 11, 7): the team's live approvals page and the decide action that
the page, the run page and their live streams share. Views only translate between HTTP and
runs/approvals/services.py; RBAC is the team_view decorator's (outsider 404, viewer 403 on
decide). Before a read, whoever looks first settles (runs/first_look.py)."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.http import Http404, HttpRequest, HttpResponse, StreamingHttpResponse
from django.shortcuts import redirect
from django.urls import reverse
from django.views.decorators.http import require_POST, require_safe

from governance.web import local_next, page
from policies.access import team_view
from policies.models import Role
from runs import first_look
from runs.approvals.services import ApprovalError, approval_decide
from runs.dashboard import presenters
from runs.dashboard.stream import ApprovalsSource, sse_response
from runs.models import Approval


@team_view(Role.VIEWER)
@require_safe
def approvals_page(request: HttpRequest, slug: str) -> HttpResponse:
    first_look.look(request.team)
    return page(request, "runs/approvals.html", presenters.approvals_context(request.team))


@team_view(Role.VIEWER)
@require_safe
def approvals_stream(request: HttpRequest, slug: str) -> StreamingHttpResponse:
    return sse_response(request, ApprovalsSource(request, request.team))


def _next(request: HttpRequest, fallback: str) -> str:
    return local_next(request, request.POST.get("next") or "", fallback)


# The live regions a decide form can answer into (runs/_approval_card.html `region`), by the
# element id htmx names in HX-Target.
LIST_REGION, RUN_REGION = "approvals-list", "run-approval"


@team_view(Role.OPERATOR)
@require_POST
def approval_decide_view(request: HttpRequest, slug: str, approval_id: Any) -> HttpResponse:
    """Approve or deny. Answers 200 with the decided request, 409 when another decision won
    or the request expired, 422 for an unknown decision or a denial without a note; under
    htmx as the region the form's card is in (the approvals list or the run's banner, with
    the message on the card), else as a redirect or the page."""
    team = request.team  # type: ignore[attr-defined]
    status, error = 200, ""
    try:
        approval_decide(team=team, approval_id=approval_id,
                        decision=request.POST.get("decision", ""),
                        note=request.POST.get("note", ""), actor=request.user)
    except ApprovalError as exc:
        if exc.status == 404:
            raise Http404("No such approval.") from None
        status, error = exc.status, exc.message
    approval = Approval.objects.select_related("run").filter(team=team, pk=approval_id).first()
    if approval is None:
        raise Http404("No such approval.")
    if request.htmx:
        flash = {"id": str(approval.pk), "error": error,
                 "done": "" if error else f"{approval.status.capitalize()}."}
        if request.htmx.target == LIST_REGION:
            first_look.look(team)
            return page(request, "runs/_approvals_list.html",
                        {**presenters.approvals_context(team), "flash": flash}, status=status)
        if request.htmx.target == RUN_REGION:
            first_look.look_at_request(approval.run)
            return page(request, "runs/_run_approval.html",
                        {**presenters.run_approval_context(approval.run), "flash": flash},
                        status=status)
        return page(request, "runs/_approval_card.html",
                    {"card": presenters.approval_card(approval), "flash": flash},
                    status=status)
    if status == 200:
        messages.success(request, f"{approval.status.capitalize()}: {approval.action_name}.")
        return redirect(_next(request, reverse("runs:approvals", args=[team.slug])))
    messages.error(request, error)
    first_look.look(team)
    return page(request, "runs/approvals.html", presenters.approvals_context(team),
                status=status)
