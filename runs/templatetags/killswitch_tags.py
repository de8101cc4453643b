"""The kill-switch banner's data, for the base layout's include on every team page."""

from __future__ import annotations

from typing import Any

from django import template
from django.http import HttpRequest
from django.urls import reverse

from policies.access import role_in
from policies.egress import masked_url
from policies.models import OperatorRelease, Role, Team
from runs.killswitch import cover
from runs.killswitch.selectors import engaged_for_team, may_release
from runs.models import KillSwitch, Scope, WebhookAttempt
from runs.webhooks.selectors import failing_notice

register = template.Library()


def release_url(switch: KillSwitch, team: Team, user: Any, role: Role | None) -> str | None:
    """Where this user may release the switch, or None (selectors.may_release)."""
    if not may_release(switch, team=team, user=user, role=role):
        return None
    if switch.scope == Scope.GLOBAL:
        return reverse("runs:killswitch-global-release")
    return reverse("runs:killswitch-release", args=[team.slug])


@register.simple_tag
def killswitch_banner(team: Team | None, request: HttpRequest | None) -> list[dict[str, Any]]:
    if team is None:
        return []
    switches = engaged_for_team(team)
    if not switches:
        return []
    user = getattr(request, "user", None)
    # The RBAC decorator leaves the role on the request; look it up only if it did not.
    role = getattr(request, "role", None)
    if role is None and user is not None:
        role = role_in(user, team)
    page = reverse("runs:killswitch", args=[team.slug])
    return [
        {
            "switch": switch,
            "label": cover.switch_scope_in_words(switch),
            "release_url": release_url(switch, team, user, role) if user is not None else None,
            "page_url": page,
        }
        for switch in switches
    ]


@register.filter
def scope_label(switch: KillSwitch) -> str:
    return cover.switch_scope_in_words(switch)


@register.filter
def webhook_url_for(url: str | None, can_admin: bool) -> str:
    """A webhook URL as this reader may see it: whole for the team's admins, its credentials
    (user and password, query values, token-like path segments) masked for everyone else."""
    return (url or "") if can_admin else masked_url(url)


@register.simple_tag
def webhook_failing(team: Team | None) -> WebhookAttempt | None:
    return failing_notice(team) if team is not None else None


@register.simple_tag
def release_hint(banner: list[dict[str, Any]], team: Team | None) -> str:
    """What the reader can do about the engaged switches, never an instruction they cannot
    follow: where their release forms are, or who may release."""
    if any(item["release_url"] for item in banner):
        return "Release forms are in the banner above."
    who = "its team's admins"
    if team is not None and team.operator_release == OperatorRelease.OWN:
        who += " and the operator who engaged it"
    elif team is not None and team.operator_release == OperatorRelease.ANY:
        who += " and operators"
    return f"A switch is released by {who} (the global switch: superusers)."
