"""Dashboard screens for runs (SPEC section 7): the team overview, the live runs list and the
live run page, and their server-sent event streams (runs/dashboard/stream.py).

Each view lets runs/first_look.py settle what is due first (whoever looks first settles,
SPEC 11, 14, a bounded share), then reads through selectors and presenters, which change
nothing."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.utils import timezone
from django.views.decorators.http import require_safe

from governance.web import page
from policies.access import team_view
from policies.models import Role
from runs import first_look
from runs.audit import selectors
from runs.dashboard import presenters
from runs.dashboard import selectors as dashboard
from runs.dashboard.stream import (
    OverviewSource,
    RunsListSource,
    RunSource,
    TeamSource,
    resume_point,
    sse_response,
)


@team_view(Role.VIEWER)
@require_safe
def overview(request: HttpRequest, slug: str) -> HttpResponse:
    range_key = dashboard.chart_range(request.GET.get("range")).key
    now = timezone.now()
    first_look.look_at_overview(request.team, now=now)
    return page(request, "runs/overview.html",
                {**presenters.overview_context(request.team, now, range_key=range_key),
                 "own_stream": True})


@team_view(Role.VIEWER)
@require_safe
def overview_stream(request: HttpRequest, slug: str) -> StreamingHttpResponse:
    range_key = dashboard.chart_range(request.GET.get("range")).key
    return sse_response(request, OverviewSource(request, request.team, range_key))


@team_view(Role.VIEWER)
@require_safe
def runs_list(request: HttpRequest, slug: str) -> HttpResponse:
    filters = dashboard.RunFilters.from_query(request.GET)
    now = timezone.now()
    first_look.look(request.team, now=now)
    context = {
        **presenters.runs_list_context(request.team, filters, now),
        "choices": dashboard.run_filter_choices(request.team),
        "own_stream": True,
    }
    if request.htmx and request.htmx.target == "runs-region":
        # A filter or page change: only the region (table and its stream) is replaced, and
        # the address bar gets the canonical query (no empty fields).
        response = page(request, "runs/_runs_region.html", context)
        query = filters.query()
        response["HX-Push-Url"] = request.path + (f"?{query}" if query else "")
        return response
    return page(request, "runs/list.html", context)


@team_view(Role.VIEWER)
@require_safe
def runs_stream(request: HttpRequest, slug: str) -> StreamingHttpResponse:
    filters = dashboard.RunFilters.from_query(request.GET)
    return sse_response(request, RunsListSource(request, request.team, filters))


@team_view(Role.VIEWER)
@require_safe
def run_detail(request: HttpRequest, slug: str, run_id: str) -> HttpResponse:
    now = timezone.now()
    run = first_look.look_at_run_page(selectors.run_for_team(request.team, run_id), now=now)
    flagged = request.GET.get("only") == "flagged"
    decisions, earlier = dashboard.timeline_page(run, before=_int(request.GET.get("before")),
                                                 flagged=flagged)
    rows = [presenters.step_row(d, run.started_at) for d in decisions]
    # The stream resumes after the newest decision of the run, shown or filtered out.
    last = dashboard.latest_decision_id(run)
    return page(request, "runs/run.html", {
        **presenters.run_context(run, now),
        **presenters.run_approval_context(run, now),
        "rows": rows,
        "flagged": flagged,
        "earlier_before": rows[0].id if earlier and rows else None,
        "after": last,
        "own_stream": run.finished_at is None,
    })


def _int(raw: str | None) -> int | None:
    try:
        return max(0, int(raw)) if raw else None
    except ValueError:
        return None


@team_view(Role.VIEWER)
@require_safe
def run_timeline(request: HttpRequest, slug: str, run_id: str) -> HttpResponse:
    """Earlier timeline rows (htmx): the page before ``before``, with its own "earlier" row."""
    run = first_look.look_at_run(selectors.run_for_team(request.team, run_id))
    flagged = request.GET.get("only") == "flagged"
    decisions, earlier = dashboard.timeline_page(run, before=_int(request.GET.get("before")),
                                                 flagged=flagged)
    rows = [presenters.step_row(d, run.started_at) for d in decisions]
    return page(request, "runs/_timeline_rows.html", {
        "run": run, "rows": rows, "flagged": flagged,
        "earlier_before": rows[0].id if earlier and rows else None,
    })


@team_view(Role.VIEWER)
@require_safe
def run_stream(request: HttpRequest, slug: str, run_id: str) -> StreamingHttpResponse:
    # Only the run's team is checked here (404 else): each look of the stream settles first.
    run = selectors.run_for_team(request.team, run_id)
    after, seen = resume_point(request)
    floor = dashboard.resume_floor(run, after)
    return sse_response(request, RunSource(request, request.team, run.pk,
                                           after if floor is None else floor, seen=seen,
                                           flagged=request.GET.get("only") == "flagged",
                                           gap=floor is not None))


@team_view(Role.VIEWER)
@require_safe
def team_stream(request: HttpRequest, slug: str) -> StreamingHttpResponse:
    """The layout's live parts for a page without a stream of its own."""
    return sse_response(request, TeamSource(request, request.team, request.GET.get("next", "")))
