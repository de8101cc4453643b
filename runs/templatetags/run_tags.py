"""Values of a run that its pages show and the rules compute (the formats themselves are the
project's `dashboard_tags`)."""

from __future__ import annotations

from django import template

from runs.audit.selectors import elapsed_s
from runs.models import Run

register = template.Library()


@register.filter
def elapsed(run: Run) -> float:
    """A run's duration so far, as max_seconds counts it: to its end, or to now while it runs."""
    return elapsed_s(run)
