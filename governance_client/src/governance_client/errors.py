"""Exceptions raised by the client.

A *decision* is never an exception: a stop is a normal answer (``Decision.allowed`` is False).
Exceptions are for requests the service refused (``ApiError`` and its subclasses, carrying the
SPEC 5.3 error body) and for a service that could not be reached where no decision can stand in
for an answer (``GovernanceUnavailable``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class GovernanceError(Exception):
    """Base class of every error raised by governance_client."""


class GovernanceUnavailable(GovernanceError):
    """The service could not be reached (network error, timeout or 5xx) after the retries."""


class ApiError(GovernanceError):
    """The service answered with an error body ``{"error": {"code", "message", "fields"}}``."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        fields: Mapping[str, Any] | None = None,
    ) -> None:
        named = "; ".join(f"{name}: {problem}" for name, problem in (fields or {}).items())
        # The fields in the text too: a log line or a traceback then says what was wrong.
        super().__init__(f"{status} {code}: {message}" + (f" ({named})" if named else ""))
        self.status = status
        self.code = code
        self.message = message
        self.fields: dict[str, Any] = dict(fields or {})


class InvalidRequest(ApiError):
    """422 ``invalid_request``: ``fields`` names each bad field (e.g. an unknown ``policy``)."""


class KillSwitchEngaged(ApiError):
    """409 ``kill_switch_engaged``: a kill switch covers the run that was being started."""


class RunFinished(ApiError):
    """409 ``run_finished``: the run was already finished."""


class ApprovalPending(ApiError):
    """409 ``approval_pending``: another check of the run is waiting for an operator (SPEC 11);
    ``fields`` or the message name it."""


class RunClosed(GovernanceError):
    """The run was finished (its ``with`` block exited, or ``finish`` was called): a check or
    report on it is a bug in the agent, refused before anything is sent."""


_BY_CODE: dict[str, type[ApiError]] = {
    "invalid_request": InvalidRequest,
    "kill_switch_engaged": KillSwitchEngaged,
    "run_finished": RunFinished,
    "approval_pending": ApprovalPending,
}


def api_error(status: int, body: Any) -> ApiError:
    """The typed exception for an error response; tolerant of bodies that are not SPEC 5.3."""
    error = body.get("error") if isinstance(body, Mapping) else None
    if not isinstance(error, Mapping):
        return ApiError(status, f"http_{status}", "unexpected error response")
    code = str(error.get("code") or f"http_{status}")
    fields = error.get("fields")
    return _BY_CODE.get(code, ApiError)(
        status,
        code,
        str(error.get("message") or ""),
        fields if isinstance(fields, Mapping) else None,
    )
