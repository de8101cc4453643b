"""What a backtest is asked for (SPEC 13): the `--since` window and the draft policy, from a
YAML file or the editor. Parsing only: refusals name what is wrong, nothing is read or written."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

from policies.document import DocumentError, load_yaml, parse_document, parse_policy

SINCE_RE = re.compile(r"^(\d{1,6})([smhdw])$")
SINCE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
DEFAULT_SINCE = "30d"
DEFAULT_LIMIT = 1000
MAX_LIMIT = 100_000
MAX_SINCE = timedelta(days=3660)


class InputError(ValueError):
    """A bad option or draft: the message says which and why."""


def parse_since(text: str, *, name: str = "--since") -> timedelta:
    """``30d``, ``12h``, ``90m``, ``2w``, ``45s``: a positive count and one unit. ``name`` is
    what the refusal calls it: the command's option, or the API's field (``since``)."""
    match = SINCE_RE.match(text.strip())
    if not match or int(match.group(1)) == 0:
        raise InputError(f"{name} must be a whole number from 1 to 999999 and a unit of s, "
                         f"m, h, d or w (e.g. 7d, 12h), not {text!r}")
    window = timedelta(seconds=int(match.group(1)) * SINCE_UNITS[match.group(2)])
    if window > MAX_SINCE:
        raise InputError(f"{name} may reach back at most {MAX_SINCE.days} days, not {text!r}")
    return window


def check_limit(limit: int) -> int:
    if not 1 <= limit <= MAX_LIMIT:
        raise InputError(f"--limit must be between 1 and {MAX_LIMIT}, not {limit}")
    return limit


def _problems(exc: DocumentError) -> str:
    return "; ".join(f"{path}: {message}" for path, message in exc.errors.items())


def load_draft(source: str | bytes) -> Any:
    """The draft's data, read within the bounds of every policy document (`load_yaml`)."""
    try:
        return load_yaml(source)
    except DocumentError as exc:
        raise InputError(f"the draft {exc.errors['document']}") from None


def team_drafts(data: Any, team: str) -> list[dict[str, Any]]:
    """Every policy of ``team`` in a document of the `apply_policies` format, normalized
    (the whole document must be valid, as `apply_policies` would require)."""
    try:
        teams = parse_document(data)
    except DocumentError as exc:
        raise InputError(f"the draft is not a valid policy document: {_problems(exc)}") from None
    for entry in teams:
        if entry["slug"] == team:
            return list(entry["policies"])
    raise InputError(f"the draft document has no team {team!r}")


def draft_policy(data: Any, *, team: str, policy: str) -> dict[str, Any]:
    """The draft of policy ``policy``: from a document of the `apply_policies` format (its
    team ``team``), or a document of that one policy (as the history page shows it)."""
    if isinstance(data, dict) and "teams" not in data and "step_limits" in data:
        try:
            document = parse_policy(data)
        except DocumentError as exc:
            raise InputError(f"the draft is not a valid policy: {_problems(exc)}") from None
        if document["name"] != policy:
            raise InputError(f"the draft is policy {document['name']!r}, not {policy!r}")
        return document
    for document in team_drafts(data, team):
        if document["name"] == policy:
            return document
    raise InputError(f"the draft document has no policy {policy!r} for team {team!r}")
