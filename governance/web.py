"""What every dashboard page shares, for the views of every app: the layout's context."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

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
