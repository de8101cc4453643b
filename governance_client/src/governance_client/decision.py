"""The answer to one check (SPEC 5.2), from the service or from the local fallback."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

GOVERNANCE_UNAVAILABLE = "governance_unavailable"


@dataclass(frozen=True)
class Decision:
    """``allowed`` is the only field an agent must read: on False, do not run the action.

    On a stop, ``message`` says which limit was hit and ``next_action`` what the agent should do
    (return its partial response, usually); ``user_notice()`` formats both for the end user.
    ``directive`` (on an allow) is a message the agent should inject into its history, e.g. the
    change-approach nudge after a repeated error. ``local`` is True when the client decided
    without the service (it was unreachable: see ``GovernanceClient(fail_mode=...)``).
    """

    allowed: bool = field(init=False)
    decision: Literal["allow", "stop"]
    reason: str
    message: str | None = None
    next_action: str | None = None
    directive: dict[str, Any] | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    limits: dict[str, Any] = field(default_factory=dict)
    shadow: dict[str, Any] | None = None
    step: int | None = None
    repeat_key: str | None = None
    repeat_count: int | None = None
    decision_id: int | None = None
    local: bool = False

    def __post_init__(self) -> None:
        # Derived rather than passed so that it can never contradict ``decision``.
        object.__setattr__(self, "allowed", self.decision == "allow")

    @classmethod
    def from_response(cls, body: Mapping[str, Any]) -> Decision:
        """Build from a check answer; a malformed one is a stop, never an accidental allow."""
        decision = body.get("decision")
        return cls(
            decision="allow" if decision == "allow" else "stop",
            reason=str(body.get("reason") or "invalid_response"),
            message=body.get("message"),
            next_action=body.get("next_action"),
            directive=body.get("directive"),
            usage=dict(body.get("usage") or {}),
            limits=dict(body.get("limits") or {}),
            shadow=body.get("shadow"),
            step=body.get("step"),
            repeat_key=body.get("repeat_key"),
            repeat_count=body.get("repeat_count"),
            decision_id=body.get("decision_id"),
        )

    def user_notice(self, partial_response: str | None = None) -> str:
        """What an agent should show its user when it stops: what it got, why, what next."""
        lines = [partial_response.rstrip(), ""] if partial_response else []
        lines.append(f"Stopped by governance ({self.reason}): {self.message or 'no detail given.'}")
        if self.next_action:
            lines.append(f"Next: {self.next_action}")
        return "\n".join(lines)
