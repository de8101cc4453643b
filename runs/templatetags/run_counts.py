"""Counts of runs for the policies app's pages, which know nothing of runs themselves."""

from __future__ import annotations

from django import template

from policies.models import Policy, Team
from runs.dashboard.selectors import running_on_old_versions as _running_on_old_versions

register = template.Library()


@register.simple_tag
def running_on_old_versions(team: Team, policy: Policy | None) -> int:
    """Running runs that keep an older version of this policy (0 for a policy not saved)."""
    return _running_on_old_versions(team, policy) if policy is not None else 0
