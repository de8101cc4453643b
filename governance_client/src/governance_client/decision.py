"""The answer to one check (SPEC 5.2, 15), from the service or from the local fallback."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast

GOVERNANCE_UNAVAILABLE = "governance_unavailable"
#: The service got the check too late (past its deadline_ms) and decided nothing.
DEADLINE_EXPIRED = "deadline_expired"
#: A check still waiting for an operator when the author's approval timeout ran out.
APPROVAL_TIMEOUT = "approval_timeout"
#: A check still rate limited when the client's wait budget ran out.
RATE_LIMITED = "rate_limited"

DecisionKind = Literal["allow", "stop", "pending", "wait"]
_KINDS = frozenset({"allow", "stop", "pending", "wait"})


@dataclass(frozen=True)
class Decision:
    """``allowed`` is the only field an agent must read: on False, do not run the action.

    On a stop, ``message`` says which limit was hit and ``next_action`` what the agent should do
    (return its partial response, usually); ``user_notice()`` formats both for the end user.
    ``directive`` (on an allow) is a message the agent should inject into its history, e.g. the
    change-approach nudge after a repeated error. ``local`` is True when the client decided
    without the service (it was unreachable: see ``GovernanceClient(fail_mode=...)``).

    ``decision`` is ``pending`` or ``wait`` only when the client gave up waiting (the approval
    was not decided within ``approval_timeout``, the rate limit did not clear within
    ``wait_budget``); by default the client waits and returns the final answer.

    A Decision is stored in agent state as ``to_state()`` (a plain dict, which every checkpoint
    serializer keeps as is) and read back with ``Decision.from_state``.

    ``message`` and ``next_action`` are fit to show the end user (``user_notice``); what only
    the agent's developer needs (an error, an API endpoint) is in ``detail``.
    """

    decision: DecisionKind
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
    approval: dict[str, Any] | None = None
    retry_after_s: float | None = None
    #: The check_id the client sent (None for a decision made without asking).
    check_id: str | None = None
    #: The framework's tool call id this decision is about, when the caller gave one.
    call_id: str | None = None
    #: For the agent's developer, never shown by ``user_notice``: what the client met (the
    #: connection error of an outage, the service's own words and API steps for a wait it
    #: stopped waiting for). ``message`` and ``next_action`` are then words for the user.
    detail: str | None = None
    #: SPEC 16: the rule that decided ({"name", "policy", "version", "limit", "observed",
    #: "scope"}); None for a plain allow and for an answer from a service without it.
    rule: dict[str, Any] | None = None
    #: SPEC 18: the OpenTelemetry trace the service recorded this check in (32 hex digits),
    #: to find its span in your tracing backend; None while the service's tracing is off, for
    #: a decision the client made itself (``local``) and from a service without it.
    trace_id: str | None = None

    @property
    def allowed(self) -> bool:
        # A property, not a field: it can never contradict ``decision``, and it is not part of
        # the constructor, so checkpoint serializers that rebuild dataclasses from their
        # fields (LangGraph's) rebuild a Decision.
        return self.decision == "allow"

    @classmethod
    def from_response(
        cls, body: Mapping[str, Any], *, check_id: str | None = None, call_id: str | None = None
    ) -> Decision:
        """Build from a check answer; a malformed one is a stop, never an accidental allow."""
        decision = body.get("decision")
        retry_after = body.get("retry_after_s")
        return cls(
            decision=cast(DecisionKind, decision if decision in _KINDS else "stop"),
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
            approval=body.get("approval"),
            retry_after_s=float(retry_after) if isinstance(retry_after, int | float) else None,
            check_id=check_id,
            call_id=call_id,
            rule=body.get("rule") if isinstance(body.get("rule"), dict) else None,
            trace_id=body.get("trace_id") if isinstance(body.get("trace_id"), str) else None,
        )

    def to_state(self) -> dict[str, Any]:
        """A plain, JSON-ready dict: what to keep in a framework's state or checkpoint."""
        return dataclasses.asdict(self)

    @classmethod
    def from_state(cls, value: Decision | Mapping[str, Any] | None) -> Decision | None:
        """The Decision back from ``to_state()`` (or a Decision, or None, as is)."""
        if value is None or isinstance(value, Decision):
            return value
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in value.items() if k in names})

    def user_notice(self, partial_response: str | None = None) -> str:
        """What an agent should show its user when it stops: what it got, why, what next.

        An allow stopped nothing: its notice is ``partial_response`` alone (``""`` without
        one), never "Stopped by governance (step_ok)"."""
        if self.allowed:
            return partial_response.rstrip() if partial_response else ""
        lines = [partial_response.rstrip(), ""] if partial_response else []
        lines.append(f"Stopped by governance ({self.reason}): {self.message or 'no detail given.'}")
        if self.next_action:
            lines.append(f"Next: {self.next_action}")
        return "\n".join(lines)
