"""Dashboard screens for runs (SPEC section 7): the team overview, the live runs list and the
live run page, and their server-sent event streams (runs/dashboard/stream.py)."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.utils import timezone
from django.views.decorators.http import require_safe

from governance.web import page
from policies.access import team_view
from policies.models import Role
from runs.audit import selectors
from runs.dashboard import presenters
from runs.dashboard import selectors as dashboard
from runs.dashboard.stream import (
    OverviewSource,
    RunsListSource,
    RunSource,
    last_event_id,
    sse_response,
)


@team_view(Role.VIEWER)
@require_safe
def overview(request: HttpRequest, slug: str) -> HttpResponse:
    return page(request, "runs/overview.html", presenters.overview_context(request.team))


@team_view(Role.VIEWER)
@require_safe
def overview_stream(request: HttpRequest, slug: str) -> StreamingHttpResponse:
    return sse_response(request, OverviewSource(request, request.team))


@team_view(Role.VIEWER)
@require_safe
def runs_list(request: HttpRequest, slug: str) -> HttpResponse:
    filters = dashboard.RunFilters.from_query(request.GET)
    context = {
        **presenters.runs_list_context(request.team, filters),
        "choices": dashboard.run_filter_choices(request.team),
    }
    if request.htmx and request.htmx.target == "runs-region":
        # A filter or page change: only the region (table and its stream) is replaced.
        return page(request, "runs/_runs_region.html", context)
    return page(request, "runs/list.html", context)


@team_view(Role.VIEWER)
@require_safe
def runs_stream(request: HttpRequest, slug: str) -> StreamingHttpResponse:
    filters = dashboard.RunFilters.from_query(request.GET)
    return sse_response(request, RunsListSource(request, request.team, filters))


@team_view(Role.VIEWER)
@require_safe
def run_detail(request: HttpRequest, slug: str, run_id: str) -> HttpResponse:
    run = selectors.run_for_team(request.team, run_id)
    now = timezone.now()
    rows = [presenters.step_row(d) for d in dashboard.timeline(run)]
    return page(request, "runs/run.html", {
        **presenters.run_context(run, now),
        **presenters.run_approval_context(run, now),
        "rows": rows,
        "after": rows[-1].id if rows else 0,
    })


@team_view(Role.VIEWER)
@require_safe
def run_stream(request: HttpRequest, slug: str, run_id: str) -> StreamingHttpResponse:
    run = selectors.run_for_team(request.team, run_id)
    return sse_response(request, RunSource(request, request.team, run.pk,
                                           last_event_id(request)))
