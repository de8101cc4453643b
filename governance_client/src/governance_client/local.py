"""The local fallback of ``fail_mode="open"``: the server's own rules while the service is down.

An outage must never turn into an unbounded loop, so the client keeps its own copy of the run's
state (``governance_client.rules.RunState``), fed by every answer of the service, and decides
with the very rules the server applies (``rules.evaluate``) when the service cannot be reached:
steps, repeats, no progress, budgets, tool allow/deny lists, repeated errors. The decisions it
makes are queued and uploaded, marked local, once the service answers again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from . import rules
from .decision import Decision
from .keys import repeat_key
from .rules import make_check as make_check  # where _core and testing import it from

_LOCALLY = "decided locally: the governance service is unreachable"


@dataclass(frozen=True)
class LocalLimits:
    """Limits the client enforces itself while the service is unreachable (``fail_mode="open"``).

    Without them the client uses the policy the run started with (``start_run``'s answer: step
    limits, budgets, tool lists, ``ignore_args`` and repeated-error handling). Set a field to
    override that; ``ignore_args`` should mirror the policy's ``repeat_key.ignore_args``.
    """

    max_steps: int | None = None
    max_repeat_action: int | None = None
    ignore_args: tuple[str, ...] | None = None
    no_progress_window: int | None = None
    max_usd: float | None = None
    max_seconds: float | None = None
    max_tool_calls: int | None = None
    deny: tuple[str, ...] | None = None
    allow: tuple[str, ...] | None = None
    #: Action name patterns that need an operator (the policy's ``approvals.tools``): never
    #: allowed locally. For runs started locally, which know no policy of the service.
    approvals: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("max_steps", "max_repeat_action", "no_progress_window"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1")

    def policy(self, policy_json: Mapping[str, Any] | None) -> rules.Policy:
        """The rules' policy: the run's (as the service sent it), with these overrides."""
        base = policy_from_json(policy_json)
        changes: dict[str, Any] = {}
        for name in ("max_steps", "max_repeat_action", "no_progress_window", "max_seconds",
                     "max_tool_calls", "ignore_args", "deny", "allow"):
            value = getattr(self, name)
            if value is not None:
                changes[name] = tuple(value) if isinstance(value, list) else value
        if self.max_usd is not None:
            changes["max_usd"] = Decimal(str(self.max_usd))
        if self.approvals is not None:
            changes["approval_tools"] = tuple(self.approvals)
        return replace(base, **changes)  # a new policy: its patterns compiled anew

    @classmethod
    def from_policy(cls, policy: Mapping[str, Any] | None) -> LocalLimits:
        """Kept for callers of the first version: the run's policy, no override."""
        return cls()


def policy_from_json(policy: Mapping[str, Any] | None) -> rules.Policy:
    """A ``rules.Policy`` from the ``policy`` of a run as the API shows it (SPEC 5.1): the
    server's own parse of a policy (``rules.Policy.from_document``), so the two read one
    policy alike. Sections the answer leaves out keep the defaults of a new policy."""
    return rules.Policy.from_document(policy or {})


class LocalLedger:
    """The client's copy of one run's state; decides on its own only during an outage."""

    def __init__(self, policy: rules.Policy, *, started_at: datetime | None = None) -> None:
        self.policy = policy
        self.state = rules.RunState(started_at=started_at or datetime.now(UTC))
        self.stop: Decision | None = None

    @property
    def steps(self) -> int:
        return self.state.steps

    def key(self, name: str, args: Mapping[str, Any] | None) -> str:
        return repeat_key(name, args, self.policy.ignore_args)

    def record(self, check: rules.Check, decision: Decision) -> None:
        """Account for a final decision the service made."""
        if decision.decision not in ("allow", "stop") or self.state.status != rules.RUNNING:
            return
        now = datetime.now(UTC)
        _, self.state = rules.record_outcome(
            self.policy, self.state, check, allowed=decision.allowed, reason=decision.reason,
            now=now,
        )
        # The service is authoritative (other processes may check the same run).
        usage = decision.usage
        if isinstance(usage.get("steps"), int):
            self.state.steps = max(self.state.steps, usage["steps"])
        if isinstance(usage.get("tool_calls"), int):
            self.state.tool_calls = max(self.state.tool_calls, usage["tool_calls"])
        if isinstance(usage.get("cost_usd"), int | float):
            self.state.cost_usd = max(self.state.cost_usd, Decimal(str(usage["cost_usd"])))
        # A budget the service warned of is not warned of again here (SPEC 16: once per
        # run), during an outage either: its rule names it, or, beside a shadow would-stop
        # whose rule the answer names, the rules find it on the counters just agreed.
        warned = rules.warned_budget(decision.rule)
        if warned is not None:
            self.state.budget_warned = self.state.budget_warned | {warned}
        elif decision.allowed and (decision.directive or {}).get("code") == rules.BUDGET:
            rules.remember_warning(self.policy, self.state, check, decision.directive or {},
                                   now)

    def decide(self, check: rules.Check) -> Decision | None:
        """Decide one check with the server's rules. A local stop is final for the run: the
        service never saw the locally allowed actions, so it cannot be trusted to stop them.
        None when the rules want an operator's approval (SPEC 11): nobody can give it during
        an outage, so the check is not decided here and changes nothing."""
        if self.stop is not None:
            return self.stop
        now = datetime.now(UTC)
        verdict, state = rules.evaluate(self.policy, self.state, check, now=now)
        if verdict.answer == rules.PENDING:
            return None
        self.state = state
        common: dict[str, Any] = {
            "step": verdict.step,
            "repeat_key": verdict.repeat_key,
            "repeat_count": verdict.repeat_count,
            "usage": self.state.usage(now),
            "limits": self.policy.limits(),
            "local": True,
        }
        if verdict.answer == rules.STOP:
            self.stop = Decision(
                decision="stop",
                reason=verdict.reason,
                message=f"{verdict.message} ({_LOCALLY})",
                next_action=verdict.next_action,
                **common,
            )
            return self.stop
        return Decision(
            decision="allow",
            reason=verdict.reason,
            directive=verdict.directive,
            shadow=verdict.shadow,
            **common,
        )
