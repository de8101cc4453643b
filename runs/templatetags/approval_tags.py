"""The navigation's approvals count, for the base layout on every team page."""

from __future__ import annotations

from django import template

from policies.models import Team
from runs.approvals.selectors import pending_count

register = template.Library()


@register.simple_tag
def approvals_pending(team: Team | None) -> int:
    return pending_count(team) if team is not None else 0
