"""The dashboard's one format for each kind of value, so every page reads the same:
times relative with the absolute UTC time on hover, money in dollars, durations in words.

Here, in the project package, because the pages of every app use it: the policies app may not
depend on runs (pyproject's import contracts), so the formats cannot live there. Plain values
in, text out: nothing here reads a model."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

from django import template
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.timesince import timesince, timeuntil

register = template.Library()


@register.filter
def when(value: datetime | None, now: datetime | None = None) -> SafeString | str:
    """``<time>`` with "3 minutes ago" and the exact UTC time as its title."""
    if not value:
        return "—"
    now = now or timezone.now()
    utc = value.astimezone(UTC) if timezone.is_aware(value) else value
    if value > now + timedelta(minutes=1):
        # A time to come (a token's expiry): "in 1 week" (found by a newcomer: it read "just
        # now", as if the token had expired).
        label = f"in {timeuntil(value, now).split(',')[0]}"
    elif value > now:
        label = "just now"  # a clock a moment ahead of this one
    else:
        label = f"{timesince(value, now).split(',')[0]} ago"
        if label.startswith("0\xa0minutes"):
            label = "just now"
    return format_html('<time datetime="{}" title="{} UTC">{}</time>',
                       utc.isoformat(), utc.strftime("%Y-%m-%d %H:%M:%S"), label)


@register.filter
def money(value: Any, places: int = 4) -> str:
    """Dollars, one format on every page: cents always ("$0.42", "$1,234.50"), and the
    fractions of a cent a step's cost has, up to `places` decimals ("$0.009", "$0.0125"), so
    the same amount never reads "$0.0090" in one place and "$0.01" in another."""
    if value is None or value == "":
        return "—"
    amount = Decimal(str(value)).quantize(Decimal(1).scaleb(-max(2, int(places))),
                                          rounding=ROUND_HALF_UP)
    text = f"{amount:,f}"
    whole, _, fraction = text.partition(".")
    return f"${whole}.{fraction.rstrip('0').ljust(2, '0')}"


@register.filter
def duration(seconds: Any) -> str:
    """"850 ms", "12.4 s", "3 min 04 s", "2 h 05 min"."""
    if seconds is None or seconds == "":
        return "—"
    s = float(seconds)
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 60:
        return f"{s:.1f} s"
    minutes, rest = divmod(round(s), 60)
    if minutes < 60:
        return f"{minutes} min {rest:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"



@register.filter
def as_json(value: Any) -> str:
    """A value as the API shows it (`{"q": "refunds"}`), not Python's repr (`{'q': ...}`)."""
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "), default=str)
