"""The policy editor's "Test against recorded runs" (SPEC 13): start a backtest of the form as
it stands (or of an imported document, before it is applied), then show its progress and
result. Whoever may see the team's policies may run one: it writes nothing but its own row
(services.py bounds how many a team runs at once). Views only translate."""

from __future__ import annotations

from typing import Any

from django import forms
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST, require_safe

from governance.web import page
from policies import selectors as policy_selectors
from policies.access import team_view
from policies.forms import FIELD_PATHS, ImportForm, PolicyForm
from policies.models import Role

from . import inputs, selectors
from .models import Backtest
from .services import ACTIVE, MAX_DRAFTS, Busy, TooManyDrafts, backtest_start

SINCE_CHOICES = ("7d", "30d", "90d")
PARTIAL = "backtests/_backtest.html"


def _since(request: HttpRequest) -> Any:
    raw = request.POST.get("since") or inputs.DEFAULT_SINCE
    return inputs.parse_since(raw if raw in SINCE_CHOICES else inputs.DEFAULT_SINCE)


def _show(request: HttpRequest, *, job: Backtest | None = None, problem: str | None = None,
          status: int = 200) -> HttpResponse:
    """The partial for htmx, the job's page otherwise (a real href keeps working without JS)."""
    if job is not None and not request.htmx:
        return redirect("backtest", slug=request.team.slug, job_id=job.pk)  # type: ignore[attr-defined]
    context = _context(request, job)
    context["problem"] = problem
    if request.htmx:
        return render(request, PARTIAL, context)
    return page(request, "backtests/detail.html", context, status=status)


# Hours of the estimate a result page lists (a week's worth); the command lists them all.
SHOWN_HOURS = 168


def _shown(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The stored results, with the estimate's first hours as a list a template can slice
    (a result stored before the estimate existed has none)."""
    shown = []
    for result in results:
        hours = list(((result.get("report") or {}).get("estimate") or {})
                     .get("by_hour", {}).items())
        shown.append({**result, "hours": hours[:SHOWN_HOURS],
                      "hours_left": max(0, len(hours) - SHOWN_HOURS)})
    return shown


def _context(request: HttpRequest, job: Backtest | None) -> dict[str, Any]:
    return {"team": request.team, "job": job,  # type: ignore[attr-defined]
            "active": job is not None and job.status in ACTIVE,
            "results": _shown(job.results or []) if job is not None else [],
            "percent": (100 * job.done // job.total) if job is not None and job.total else 0}


def _start(request: HttpRequest, drafts: list[dict[str, Any]], source: str) -> HttpResponse:
    try:
        job = backtest_start(team=request.team, user=request.user,  # type: ignore[attr-defined]
                             drafts=drafts, source=source, since=_since(request),
                             limit=inputs.DEFAULT_LIMIT)
    except Busy:
        return _show(request, problem="This team already runs as many backtests as it may: "
                                      "try again when one has finished.", status=429)
    except TooManyDrafts:
        return _show(request, problem=f"This document names {len(drafts)} policies of the "
                                      f"team: a backtest replays at most {MAX_DRAFTS}. Test "
                                      "them in smaller documents.", status=422)
    # Eagerly run (embedded default) it is already done; elsewhere the page polls it.
    job.refresh_from_db()
    return _show(request, job=job)


@team_view(Role.VIEWER)
@require_POST
def backtest_policy(request: HttpRequest, slug: str, name: str) -> HttpResponse:
    """The editor's form as it stands, unsaved; without its fields (a viewer's read-only
    form sends none) the current version."""
    policy = policy_selectors.policy_of(request.team, name)  # type: ignore[attr-defined]
    if any(field in request.POST for field in FIELD_PATHS):
        form = PolicyForm(request.POST, fixed_name=policy.name)
        if not form.is_valid() or form.normalized is None:
            return _show(request, problem="The form has errors: fix them, then test again.",
                         status=422)
        document = form.normalized
    else:
        document = policy.current.document
    return _start(request, [{"policy": policy.name, "document": document}], "editor")


@team_view(Role.VIEWER)
@require_POST
def backtest_import(request: HttpRequest, slug: str) -> HttpResponse:
    """Every policy of an imported document that this team already has (a new policy has no
    recorded runs), before the document is applied."""
    form = ImportForm(request.POST, request.FILES)
    problem = None
    drafts: list[dict[str, Any]] = []
    if not form.is_valid():
        problem = "Paste a YAML document or choose a file."
    else:
        try:
            data = form.data_of()
            others = [t.get("slug") for t in (data.get("teams") or [])
                      if isinstance(t, dict) and t.get("slug") != slug] \
                if isinstance(data, dict) and isinstance(data.get("teams"), list) else []
            if others:
                raise inputs.InputError(f"this import is for team {slug!r} only, not {others}")
            existing = {p.name for p in policy_selectors.policies_of(request.team)}  # type: ignore[attr-defined]
            drafts = [{"policy": d["name"], "document": d}
                      for d in inputs.team_drafts(data, slug) if d["name"] in existing]
        except (forms.ValidationError, inputs.InputError) as exc:
            problem = "; ".join(exc.messages) if isinstance(exc, forms.ValidationError) \
                else str(exc)
        else:
            if not drafts:
                problem = "The document names no policy this team has: nothing to replay."
    if problem is not None:
        return _show(request, problem=problem, status=422)
    return _start(request, drafts, "import")


@team_view(Role.VIEWER)
@require_safe
def backtest_detail(request: HttpRequest, slug: str, job_id: Any) -> HttpResponse:
    job = selectors.backtest_of(request.team, job_id)  # type: ignore[attr-defined]
    if request.htmx:
        return render(request, PARTIAL, _context(request, job))
    return page(request, "backtests/detail.html", _context(request, job))
