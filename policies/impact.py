"""A policy change that would stop most recent runs at once asks for an explicit confirmation
showing the backtest's numbers (issue 26; the rule is in docs/policies.md).

The rule and the confirmation's token are pure and live here. The numbers come from the
backtest, which reads the runs: the policies app may not import the backtests or the runs
(the import contracts in pyproject.toml), so the backtests app hands its reader in when it
loads (`backtests.apps`), and the policies views ask this module. Without a reader (the
backtests app not installed) nothing asks: the policies alone know of no runs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .models import Team

# The field (form, restore, import) whose value confirms a change: the token of the drafts it
# confirms, so a confirmation never carries over to a draft edited after the numbers were shown.
CONFIRM_FIELD = "confirm_stops"


@dataclass(frozen=True)
class Impact:
    """What one draft would do to its policy's most recent ended runs (the backtest's
    numbers): ``stopped_at_once`` of ``runs`` stopped at their first step."""

    policy: str
    runs: int
    stopped_at_once: int
    by_reason: dict[str, int] = field(default_factory=dict)
    since_days: int = 30

    @property
    def needs_confirmation(self) -> bool:
        return needs_confirmation(runs=self.runs, stopped_at_once=self.stopped_at_once)

    def sentence(self) -> str:
        reasons = ", ".join(f"{reason} {count}" for reason, count in self.by_reason.items())
        return (f"Policy {self.policy} would stop {self.stopped_at_once} of its "
                f"{self.runs} most recent ended run{'s' if self.runs != 1 else ''} (started "
                f"within {self.since_days} days) at their first step"
                + (f": {reasons}." if reasons else "."))


def needs_confirmation(*, runs: int, stopped_at_once: int) -> bool:
    """More than half of the recent runs replayed stopped at their first step. No recent run,
    no evidence: a new or unused policy never asks."""
    return runs > 0 and 2 * stopped_at_once > runs


def confirmation_token(documents: list[dict[str, Any]]) -> str:
    """A short digest of the drafts a confirmation is for (normalized policy documents, in
    any order): the page puts it in the confirming checkbox, the save compares it."""
    canonical = json.dumps(sorted(documents, key=lambda d: str(d.get("name"))),
                           sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def confirmed(value: Any, documents: list[dict[str, Any]]) -> bool:
    return isinstance(value, str) and value == confirmation_token(documents)


Reader = Callable[[Team, list[dict[str, Any]]], list[Impact]]
_reader: list[Reader] = []


def provide(reader: Reader) -> None:
    """The backtests app's reader of the numbers (called once, when the app is ready)."""
    _reader[:] = [reader]


def impacts_to_confirm(team: Team, documents: list[dict[str, Any]]) -> list[Impact]:
    """The drafts among ``documents`` (normalized policies of ``team``) that would stop most
    of their policy's recent runs at once, with the numbers to show; [] when none would."""
    if not _reader or not documents:
        return []
    return [impact for impact in _reader[0](team, documents) if impact.needs_confirmation]


def stop_confirmation(team: Team, documents: list[dict[str, Any]], answer: Any
                      ) -> tuple[list[Impact], str]:
    """(impacts still to confirm, the token that confirms them): nothing to confirm when the
    answer already confirms these very drafts (then no runs are read at all)."""
    token = confirmation_token(documents)
    if confirmed(answer, documents):
        return [], token
    return impacts_to_confirm(team, documents), token
