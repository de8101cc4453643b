"""RBAC for the dashboard (SPEC section 7), enforced on the server for every view.

An outsider gets 404 (the team's existence is not confirmed), a member whose role is too low
gets 403, a superuser acts as an admin of every team.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import wraps
from importlib import import_module
from typing import Any

from django.conf import settings
from django.contrib.auth import SESSION_KEY, get_user_model
from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import PermissionDenied
from django.core.validators import slug_re
from django.http import Http404, HttpRequest, HttpResponse
from django_htmx.http import HttpResponseClientRedirect

from .models import ROLE_RANK, Membership, Role, Team


def role_in(user: Any, team: Team) -> Role | None:
    """The user's effective role in the team, or None for an outsider."""
    if not user.is_authenticated:
        return None
    if user.is_superuser:
        return Role.ADMIN
    role = Membership.objects.filter(user=user, team=team).values_list("role", flat=True).first()
    return Role(role) if role else None


# A session key as Django makes them (32 lowercase letters and digits), before any lookup.
_SESSION_KEY = re.compile(r"[a-z0-9]{32,40}")


def session_sees_team(session_key: str, slug: str) -> bool:
    """Whether the dashboard session ``session_key`` is signed in as a member of team
    ``slug`` (a superuser sees every team). The server's pacing asks before a page of a
    session it does not know yet for that team (governance/asgi.py `Application.page`), so
    that the page waits with the team's: a session and a team membership looked up, no
    more. A key or slug no session or team could have costs no query."""
    if not _SESSION_KEY.fullmatch(session_key) or not slug_re.match(slug):
        return False
    user_id = import_module(settings.SESSION_ENGINE).SessionStore(session_key).get(SESSION_KEY)
    user = get_user_model()._default_manager.filter(pk=user_id, is_active=True).first() \
        if user_id is not None else None
    team = Team.objects.filter(slug=slug).first() if user is not None else None
    return team is not None and role_in(user, team) is not None


def can(role: Role | None, needed: Role) -> bool:
    return role is not None and ROLE_RANK[role] >= ROLE_RANK[needed]


def teams_of(user: Any) -> list[Team]:
    if not user.is_authenticated:
        return []
    if user.is_superuser:
        return list(Team.objects.all())
    return list(Team.objects.filter(memberships__user=user).order_by("slug"))


def team_view(needed: Role = Role.VIEWER) -> Callable[[Callable[..., HttpResponse]],
                                                      Callable[..., HttpResponse]]:
    """Decorate a view taking ``slug``: sets ``request.team`` and ``request.role``."""

    def decorator(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
        @wraps(view)
        def wrapper(request: HttpRequest, slug: str, *args: Any, **kwargs: Any) -> HttpResponse:
            if not request.user.is_authenticated:
                return _to_login(request)
            team = Team.objects.filter(slug=slug).first()
            role = role_in(request.user, team) if team is not None else None
            if team is None and request.user.is_superuser:
                raise Http404("No such team.")  # a superuser sees every team: none is hidden
            if team is None or role is None:
                # SPEC 7: every refusal is a 403 page; the same one whether the team exists or
                # not, so that a team's existence is not revealed either.
                raise PermissionDenied("You are not a member of this team.")
            # Set before refusing: the 403 page shows the team's navigation for this role.
            request.team, request.role = team, role  # type: ignore[attr-defined]
            if not can(role, needed):
                raise PermissionDenied(f"This needs the {needed.label} role.")
            return view(request, slug, *args, **kwargs)

        return wrapper

    return decorator


def _to_login(request: HttpRequest) -> HttpResponse:
    """The login page, then back. An htmx request (a decide form, a table's page) whose
    session ended goes there as a whole page, back to the page it was sent from: followed
    inside htmx, the redirect swapped the login form into the region, and signing in from
    it came back to a POST-only URL (405)."""
    htmx = getattr(request, "htmx", None)
    if htmx:
        try:
            here = htmx.current_url_abs_path  # None if off-site
        except ValueError:  # HX-Current-URL is not a URL (an unclosed IPv6 bracket): off-site
            here = None
        back = here or request.get_full_path()
        return HttpResponseClientRedirect(redirect_to_login(back).url)
    return redirect_to_login(request.get_full_path())


def controls(role: Role | None) -> dict[str, bool]:
    """What the role may do, for templates that hide the controls the server would refuse.
    The page layout and the live streams both use it, so a control re-rendered live is
    offered to exactly the people the page offered it to."""
    return {"can_operate": can(role, Role.OPERATOR), "can_admin": can(role, Role.ADMIN)}
