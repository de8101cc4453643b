"""The local fallback of ``fail_mode="open"``: bounded steps and repeats while the service is down.

An outage must never turn into an unbounded loop, so the client keeps a small ledger of every
check of the run (the ones the service answered and the ones it decided itself) and applies the
two limits that matter most against runaway agents: ``max_steps`` and ``max_repeat_action``,
with the very repeat key the server uses (``governance_client.keys``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .decision import Decision
from .keys import repeat_key

# Same wording as the server's, so an agent handles a local stop exactly like a remote one.
NEXT_ACTION = {
    "max_steps": "Return the partial response, then split the task or relaunch with a narrower "
    "scope.",
    "loop_detected": "Return the partial response, then reformulate the request or relaunch with "
    "a narrower scope.",
}
_LOCALLY = "decided locally: the governance service is unreachable"


@dataclass(frozen=True)
class LocalLimits:
    """Limits the client enforces itself while the service is unreachable (``fail_mode="open"``).

    The defaults are the defaults of a new policy. ``ignore_args`` should mirror the policy's
    ``repeat_key.ignore_args`` so that local keys match the server's.
    """

    max_steps: int = 18
    max_repeat_action: int = 3
    ignore_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_steps < 1 or self.max_repeat_action < 1:
            raise ValueError("max_steps and max_repeat_action must be >= 1")

    @classmethod
    def from_policy(cls, policy: Mapping[str, Any] | None) -> LocalLimits:
        """The step limits of the policy a run started with (``start_run``'s answer)."""
        steps = (policy or {}).get("step_limits") or {}
        defaults = cls()
        return cls(
            max_steps=int(steps.get("max_steps") or defaults.max_steps),
            max_repeat_action=int(steps.get("max_repeat_action") or defaults.max_repeat_action),
        )


class LocalLedger:
    """Counters of one run, fed by every check; decides on its own only during an outage."""

    def __init__(self, limits: LocalLimits) -> None:
        self.limits = limits
        self.steps = 0
        self.counts: dict[str, int] = {}
        self.stop: Decision | None = None

    def key(self, name: str, args: Mapping[str, Any] | None) -> str:
        return repeat_key(name, args, self.limits.ignore_args)

    def record(self, name: str, args: Mapping[str, Any] | None, decision: Decision) -> None:
        """Account for a decision the service made."""
        # The server's step is authoritative (other processes may check the same run).
        self.steps = max(self.steps + 1, decision.step or 0)
        if decision.allowed:
            key = self.key(name, args)
            self.counts[key] = self.counts.get(key, 0) + 1

    def decide(self, name: str, args: Mapping[str, Any] | None) -> Decision:
        """Decide one check without the service. A local stop is final for the run: the
        service never saw the locally allowed actions, so it cannot be trusted to stop them."""
        if self.stop is not None:
            return self.stop
        self.steps += 1
        key = self.key(name, args)
        count = self.counts.get(key, 0)
        limits = {
            "max_steps": self.limits.max_steps,
            "max_repeat_action": self.limits.max_repeat_action,
        }
        common: dict[str, Any] = {
            "step": self.steps,
            "repeat_key": key,
            "limits": limits,
            "local": True,
        }
        if self.steps > self.limits.max_steps:
            self.stop = self._stop(
                "max_steps",
                f"Step {self.steps} exceeds max_steps={self.limits.max_steps} ({_LOCALLY}).",
                repeat_count=count,
                **common,
            )
            return self.stop
        if count >= self.limits.max_repeat_action:
            self.stop = self._stop(
                "loop_detected",
                f"{name} was called {count} times with the same arguments "
                f"(max_repeat_action={self.limits.max_repeat_action}; {_LOCALLY}).",
                repeat_count=count,
                **common,
            )
            return self.stop
        self.counts[key] = count + 1
        return Decision(
            decision="allow",
            reason="step_ok",
            repeat_count=count + 1,
            usage={"steps": self.steps},
            **common,
        )

    def _stop(self, reason: str, message: str, **fields: Any) -> Decision:
        return Decision(
            decision="stop",
            reason=reason,
            message=message,
            next_action=NEXT_ACTION[reason],
            usage={"steps": self.steps},
            **fields,
        )
