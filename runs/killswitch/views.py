"""Kill switch screens (SPEC 6, 7): the team page, engage (team, agent, run) with a
confirmation step, release, and the superuser's global switch. Views only translate between
HTTP and runs/killswitch/services.py;
RBAC is the team_view decorator's (outsider 404, low role 403).

Engaging is two POSTs: the first (or a GET) shows what will stop and asks for a reason, the
second carries ``confirmed`` and engages. Under htmx both answer fragments, so the run page
can confirm in place and let its live timeline show the kill.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import messages
from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.urls import reverse
from django.views.decorators.http import require_http_methods, require_POST, require_safe

from governance.web import local_next, page
from governance_client import rules
from policies.access import team_view
from policies.models import Role
from runs.dashboard import presenters
from runs.dashboard import selectors as dashboard
from runs.dashboard.stream import KillSwitchSource, sse_response
from runs.killswitch import cover
from runs.killswitch import selectors as switches
from runs.killswitch.services import (
    MAX_REASON,
    KillSwitchError,
    ReleaseRefused,
    Target,
    killswitch_engage,
    killswitch_release,
    resolve_target,
)
from runs.models import Run, Scope
from runs.webhooks import delivery as webhooks
from runs.webhooks import selectors as deliveries

# The engage confirmation names this many of the runs that will stop, then "and N more".
CONFIRM_LISTS = 10


class ReasonForm(forms.Form):
    reason = forms.CharField(
        max_length=MAX_REASON, strip=True,
        error_messages={"required": "A reason is required: it goes to the audit log."},
        widget=forms.Textarea(attrs={"rows": 2, "maxlength": MAX_REASON}),
    )


def _safe_next(request: HttpRequest, fallback: str) -> str:
    return local_next(request, request.POST.get("next") or request.GET.get("next") or "",
                      fallback)


def _run_page(run: Run) -> str:
    return reverse("runs:run", args=[run.team.slug, run.pk])


def _webhook(switch: Any) -> str:
    """Who the switch's fan-out notifies (SPEC 6: the team's ``webhook_url``): "team" when
    its team has one, "none" when it has none, "every" for the global switch (each team
    that has one)."""
    if switch.scope == Scope.GLOBAL:
        return "every"
    return "team" if switch.team is not None and switch.team.webhook_url else "none"


def _render(request: HttpRequest, full: str, fragment: str, context: dict[str, Any]
            ) -> HttpResponse:
    return page(request, fragment if request.htmx else full, context)


def _engage_flow(request: HttpRequest, target: Target, *, action: str, cancel: str,
                 done: str) -> HttpResponse:
    """Show the confirmation (GET, or a POST without ``confirmed``), or engage."""
    confirmed = request.method == "POST" and bool(request.POST.get("confirmed"))
    if confirmed:
        form = ReasonForm(request.POST)
        if form.is_valid():
            try:
                switch = killswitch_engage(
                    scope=target.scope, team=target.team,
                    agent=target.agent, run=target.run, reason=form.cleaned_data["reason"],
                    actor=request.user,
                )
            except KillSwitchError as exc:  # a run that ended meanwhile: nothing to kill
                messages.error(request, str(exc))
                return redirect(done)
            already = not switch.engaged_now
            text = (f"Already engaged: {target.describe()}, by {switch.engaged_by_label}."
                    if already else f"Kill switch engaged: {target.describe()}.")
            if request.htmx:
                response = page(request, "runs/_killswitch_done.html",
                                {"switch": switch, "already": already, "message": text,
                                 "target": target, "done_url": done,
                                 "webhook": _webhook(switch)})
                response["HX-Trigger"] = "killswitch-changed"
                return response
            (messages.info if already else messages.success)(request, text)
            return redirect(done)
    else:
        form = ReasonForm(initial={"reason": request.POST.get("reason", "")})
    covered = switches.covered_preview(target, limit=CONFIRM_LISTS)
    context = {
        "target": target,
        "scope_label": target.describe(),
        "covered_words": cover.covered_in_words(target.scope, team=target.team,
                                                agent=target.agent),
        "covered": covered.count,
        "covered_runs": covered.first,
        "covered_more": covered.more,
        # A name no run of the team ever used is most often a typo; engaging it is still
        # allowed (it blocks that agent from starting), but the operator is told.
        "unknown_agent": target.scope == Scope.AGENT and target.team is not None
        and not dashboard.agent_seen(target.team, target.agent),
        "engaged": switches.engaged_switch(target),
        "form": form,
        "action_url": action,
        "cancel_url": cancel,
        "next": request.POST.get("next") or request.GET.get("next") or "",
    }
    return _render(request, "runs/killswitch_confirm.html", "runs/_killswitch_confirm.html",
                   context)


def _release_flow(request: HttpRequest, target: Target, *, action: str, done: str
                  ) -> HttpResponse:
    engaged = switches.engaged_switch(target)
    team = target.team or getattr(request, "team", None)
    if engaged is not None and team is not None and not switches.may_release(
            engaged, team=team, user=request.user, role=getattr(request, "role", None)):
        raise PermissionDenied(switches.release_refusal(engaged, team=team))
    form = ReasonForm(request.POST if request.method == "POST" else None)
    if request.method == "POST" and form.is_valid():
        # Asked again under the switch's lock: another may have been engaged meanwhile.
        may = switches.release_check(team=team, user=request.user,
                                     role=getattr(request, "role", None)) \
            if team is not None else None
        try:
            switch = killswitch_release(
                scope=target.scope, team=target.team,
                agent=target.agent, run=target.run, reason=form.cleaned_data["reason"],
                actor=request.user, may=may,
            )
        except ReleaseRefused as refused:
            raise PermissionDenied(refused.message) from None
        if switch is None:
            messages.info(request, f"Not engaged: {target.describe()}. Nothing to release.")
        else:
            messages.success(request, f"Released: {target.describe()}. New runs may start; "
                                      "killed runs stay killed.")
        return redirect(done)
    context = {
        "target": target,
        "scope_label": target.describe(),
        "engaged": switches.engaged_switch(target),
        "form": form,
        "action_url": action,
        "cancel_url": done,
        "next": request.POST.get("next") or request.GET.get("next") or "",
    }
    return page(request, "runs/killswitch_release.html", context)


# --- Team screens ----------------------------------------------------------------------------

@require_safe
@team_view(Role.VIEWER)
def killswitch_page(request: HttpRequest, slug: str) -> HttpResponse:
    team = request.team  # type: ignore[attr-defined]
    recent = deliveries.deliveries_for_team(team)
    return page(request, "runs/killswitch.html", {
        **presenters.killswitch_context(team),
        "own_stream": True,
        "history": switches.history_for_team(team),
        "deliveries": recent,
        "overdue": {d.pk for d in recent if deliveries.overdue(d)},
        "stalled": {d.pk for d in recent if deliveries.stalled(d)},
        # The deliveries region looks again every few seconds while one is still pending.
        "polling": any(d.status == webhooks.PENDING for d in recent),
        "max_attempts": webhooks.MAX_ATTEMPTS,
    })


@require_POST
@team_view(Role.ADMIN)
def webhook_test_view(request: HttpRequest, slug: str) -> HttpResponse:
    """Send test: a signed `webhook.test` delivery, shown in the deliveries log below."""
    team = request.team  # type: ignore[attr-defined]
    try:
        webhooks.send_test(team=team, sent_by=request.user.get_username())
    except webhooks.SendTestRefused as refused:
        messages.error(request, str(refused))
    else:
        messages.success(request, "Test notification sent: its attempts show below.")
    return redirect(reverse("runs:killswitch", args=[slug]) + "#killswitch-deliveries")


@require_safe
@team_view(Role.VIEWER)
def killswitch_stream(request: HttpRequest, slug: str) -> HttpResponse:
    return sse_response(request, KillSwitchSource(request, request.team))  # type: ignore[attr-defined]


def _team_run(team: Any, run_id: Any) -> Run:
    """The team's run, or 404: another team's run is as absent as a missing one."""
    run = switches.team_run(team, run_id)
    if run is None:
        raise Http404("No such run.")
    return run


def _team_target(request: HttpRequest, data: Any) -> Target:
    scope = data.get("scope") or Scope.TEAM
    if scope not in (Scope.TEAM, Scope.AGENT):
        raise Http404("Unknown scope.")
    agent = (data.get("agent") or "").strip() if scope == Scope.AGENT else ""
    if scope == Scope.AGENT and not rules.AGENT_NAME.fullmatch(agent):
        raise KillSwitchError("Name the agent: letters, digits, '.', '_' or '-', 1 to 100.",
                              "agent")
    return resolve_target(scope=scope, team=request.team, agent=agent)  # type: ignore[attr-defined]


@require_http_methods(["GET", "POST"])
@team_view(Role.OPERATOR)
def killswitch_engage_view(request: HttpRequest, slug: str) -> HttpResponse:
    page_url = reverse("runs:killswitch", args=[slug])
    data = request.POST if request.method == "POST" else request.GET
    try:
        target = _team_target(request, data)
    except KillSwitchError as exc:
        messages.error(request, str(exc))
        return redirect(page_url)
    return _engage_flow(request, target, action=reverse("runs:killswitch-engage", args=[slug]),
                        cancel=page_url, done=_safe_next(request, page_url))


@require_http_methods(["GET", "POST"])
@team_view(Role.OPERATOR)
def killswitch_run_view(request: HttpRequest, slug: str, run_id: Any) -> HttpResponse:
    run = _team_run(request.team, run_id)  # type: ignore[attr-defined]
    run_page = _run_page(run)
    return _engage_flow(request, resolve_target(scope=Scope.RUN, run=run),
                        action=reverse("runs:killswitch-run", args=[slug, run.pk]),
                        cancel=run_page, done=_safe_next(request, run_page))


@require_http_methods(["GET", "POST"])
@team_view(Role.OPERATOR)  # _release_flow asks selectors.may_release for the switch itself
def killswitch_release_view(request: HttpRequest, slug: str) -> HttpResponse:
    team = request.team  # type: ignore[attr-defined]
    page_url = reverse("runs:killswitch", args=[slug])
    data = request.POST if request.method == "POST" else request.GET
    try:
        if data.get("scope") == Scope.RUN:
            target = resolve_target(scope=Scope.RUN, run=_team_run(team, data.get("run")))
        else:
            target = _team_target(request, data)
    except KillSwitchError as exc:
        messages.error(request, str(exc))
        return redirect(page_url)
    return _release_flow(request, target, action=reverse("runs:killswitch-release", args=[slug]),
                         done=_safe_next(request, page_url))


# --- The global switch (superusers) ----------------------------------------------------------

def _superuser(request: HttpRequest) -> HttpResponse | None:
    if not request.user.is_authenticated:
        return redirect_to_login(request.get_full_path())
    if not request.user.is_superuser:
        raise PermissionDenied("Only a superuser may engage or release the global kill switch.")
    return None


@require_safe
def killswitch_global_page(request: HttpRequest) -> HttpResponse:
    if (refusal := _superuser(request)) is not None:
        return refusal
    return page(request, "runs/killswitch_global.html", switches.global_page())


@require_http_methods(["GET", "POST"])
def killswitch_global_engage(request: HttpRequest) -> HttpResponse:
    if (refusal := _superuser(request)) is not None:
        return refusal
    page_url = reverse("runs:killswitch-global")
    return _engage_flow(request, resolve_target(scope=Scope.GLOBAL),
                        action=reverse("runs:killswitch-global-engage"), cancel=page_url,
                        done=_safe_next(request, page_url))


@require_POST
def killswitch_global_release(request: HttpRequest) -> HttpResponse:
    if (refusal := _superuser(request)) is not None:
        return refusal
    page_url = reverse("runs:killswitch-global")
    return _release_flow(request, resolve_target(scope=Scope.GLOBAL),
                         action=reverse("runs:killswitch-global-release"),
                         done=_safe_next(request, page_url))
