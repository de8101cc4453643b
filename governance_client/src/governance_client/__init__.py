"""Agent-side client for the agent governance check API.

Check every action before running it, report its outcome, finish the run; compact the history
so the agent does not loop in the first place (``governance_client.history``).
"""

from ._core import FailMode, result_digest
from .aio import AsyncGovernanceClient, AsyncRun
from .client import GovernanceClient, Run
from .decision import GOVERNANCE_UNAVAILABLE, Decision
from .errors import (
    ApiError,
    ApprovalPending,
    GovernanceError,
    GovernanceStop,
    GovernanceUnavailable,
    InvalidRequest,
    KillSwitchEngaged,
    ParentFinished,
    RunClosed,
    RunFinished,
)
from .keys import repeat_key
from .local import LocalLimits

__all__ = [
    "GOVERNANCE_UNAVAILABLE",
    "ApiError",
    "ApprovalPending",
    "AsyncGovernanceClient",
    "AsyncRun",
    "Decision",
    "FailMode",
    "GovernanceClient",
    "GovernanceError",
    "GovernanceStop",
    "GovernanceUnavailable",
    "InvalidRequest",
    "KillSwitchEngaged",
    "LocalLimits",
    "ParentFinished",
    "Run",
    "RunClosed",
    "RunFinished",
    "repeat_key",
    "result_digest",
]
