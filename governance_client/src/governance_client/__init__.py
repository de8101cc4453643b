"""Agent-side client for the agent governance check API.

Check every action before running it, report its outcome, finish the run; compact the history
so the agent does not loop in the first place (``governance_client.history``).
"""

from .client import FailMode, GovernanceClient, Run, result_digest
from .decision import GOVERNANCE_UNAVAILABLE, Decision
from .errors import (
    ApiError,
    GovernanceError,
    GovernanceUnavailable,
    InvalidRequest,
    KillSwitchEngaged,
    RunFinished,
)
from .keys import repeat_key
from .local import LocalLimits

__all__ = [
    "GOVERNANCE_UNAVAILABLE",
    "ApiError",
    "Decision",
    "FailMode",
    "GovernanceClient",
    "GovernanceError",
    "GovernanceUnavailable",
    "InvalidRequest",
    "KillSwitchEngaged",
    "LocalLimits",
    "Run",
    "RunFinished",
    "repeat_key",
    "result_digest",
]
