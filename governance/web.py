"""What every dashboard page shares, for the views of every app: the layout's context."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils.http import url_has_allowed_host_and_scheme

from policies.access import controls, teams_of
from policies.models import Role, Team


def page(request: HttpRequest, template: str, context: dict[str, Any] | None = None,
         *, status: int = 200) -> HttpResponse:
    """Render a team screen with what the layout needs: the team, the role, the team
    switcher and what the role may do (so templates hide controls the server would refuse)."""
    team: Team | None = getattr(request, "team", None)
    role: Role | None = getattr(request, "role", None)
    base = {
        "team": team,
        "role": role,
        "teams": teams_of(request.user),
        **controls(role),
    }
    return render(request, template, {**base, **(context or {})}, status=status)


def local_next(request: HttpRequest, target: str, fallback: str) -> str:
    """`target` (a form's `next`) when it is a path of this site, else `fallback`. A path
    only: redirect() takes a word without "/" or "." for a view's name to reverse (a 500
    after the form's change was saved, for one that names no view)."""
    if target.startswith("/") and url_has_allowed_host_and_scheme(
        target, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        return target
    return fallback
