"""Exceptions raised by the client.

A *decision* is never an exception: a stop is a normal answer (``Decision.allowed`` is False).
Exceptions are for requests the service refused (``ApiError`` and its subclasses, carrying the
SPEC 5.3 error body) and for a service that could not be reached where no decision can stand in
for an answer (``GovernanceUnavailable``). An agent key no request could carry is refused
before anything is sent (``agent_key_problem``), and no message here repeats a key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class GovernanceError(Exception):
    """Base class of every error raised by governance_client.

    Its text is for the agent's developer; ``user_notice()`` is what to tell the end user
    instead (the agent did not run, why, what to do), in the words of
    ``Decision.user_notice``."""

    reason = "governance_error"
    user_message = "The governance service refused the agent's request, so the agent did not run."
    user_next = "Try again later; if it keeps happening, tell the agent's developer."

    def user_notice(self) -> str:
        return f"Stopped by governance ({self.reason}): {self.user_message}\nNext: {self.user_next}"


class GovernanceUnavailable(GovernanceError):
    """The service could not be reached (network error, timeout or 5xx) after the retries.

    ``timed_out`` says which: True when the service was reached but did not answer within
    the request's ``deadline`` (seconds), so it is slow (a loaded machine, a long queue)
    rather than unreachable (a refused connection, an unknown host, a 5xx). Both are the
    same outage for the fail modes; only the words differ (found by a newcomer: a check that
    took 2.1 s under load said "unreachable", which sent them looking for a network fault
    instead of raising ``deadline``)."""

    reason = "governance_unavailable"
    user_message = "The governance service is unreachable, so the agent did not run."
    user_next = "Try again in a few minutes."

    def __init__(self, message: str = "", *, timed_out: bool = False,
                 deadline: float | None = None) -> None:
        super().__init__(message)
        self.timed_out = timed_out
        self.deadline = deadline
        if timed_out:
            self.user_message = ("The governance service did not answer in time, so the agent "
                                 "did not run.")


# Answers that a retry would get again: a bad or revoked key, a key not allowed this, a run
# that is not the key's, a request the service refused as invalid.
_NOT_AGAIN = frozenset({400, 401, 403, 404, 413, 422})
_FIX_IT = ("Trying again will not help: tell the agent's developer (the service did not "
           "accept the agent's key or request; the error says why).")
_OVER = "Trying again will not help: start the task again as a new request."

# The words of each conflict (SPEC 5.3, 11, 20) for the end user: what happened, and whether
# trying again can help. A run or a parent that is over stays over, and an external_id stays
# another run's; a pending approval is decided in time (found by a newcomer: a sub-agent
# refused under a stopped parent said "governance_error ... Try again later").
_NOTICES: dict[str, tuple[str, str]] = {
    "parent_finished": ("The task this sub-agent was started for has already ended, so the "
                        "sub-agent did not run.", _OVER),
    "run_finished": ("This agent's run has already ended, so nothing more was run in it.",
                     _OVER),
    "external_id_conflict": ("The agent named its run with an id (external_id) that belongs "
                             "to another run, so the agent did not run.", _FIX_IT),
    "approval_pending": ("Another action of this agent is waiting for an operator's approval, "
                         "so this one was not run.",
                         "Try again once an operator has decided on the waiting action."),
}


class ApiError(GovernanceError):
    """The service answered with an error body ``{"error": {"code", "message", "fields"}}``.
    Its ``reason`` (in ``user_notice()``) is the code."""

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
        if "reason" not in type(self).__dict__:  # a class's own reason (killed) stands
            self.reason = code
        if code in _NOTICES:
            self.user_message, self.user_next = _NOTICES[code]
        elif status in _NOT_AGAIN:
            # The agent's key or request was refused as such: trying again would get the same
            # answer (found by a newcomer: a bad sub-agent name said "Try again later").
            self.user_next = _FIX_IT


class InvalidRequest(ApiError):
    """422 ``invalid_request``: ``fields`` names each bad field (e.g. an unknown ``policy``)."""


class KillSwitchEngaged(ApiError):
    """409 ``kill_switch_engaged``: a kill switch covers the run that was being started."""

    reason = "killed"
    # The switch may be the team's, the agent's, a parent run's or the global one: the words
    # say what any of them means (found by a newcomer: a team switch read "stopped this
    # agent"); the service's message, shown first, names the switch.
    user_message = "An operator's kill switch covers this run."
    user_next = "An operator stopped new runs here: try again once the kill switch is released."

    def user_notice(self) -> str:
        # The service names the switch, who engaged it and why: words meant for people.
        return (f"Stopped by governance ({self.reason}): {self.message or self.user_message}"
                f"\nNext: {self.user_next}")


class RunFinished(ApiError):
    """409 ``run_finished``: the run was already finished."""


class ParentFinished(ApiError):
    """409 ``parent_finished``: the parent a child run was started under is over (SPEC 20)."""


class ApprovalPending(ApiError):
    """409 ``approval_pending``: another check of the run is waiting for an operator (SPEC 11);
    ``fields`` or the message name it."""


class RunClosed(GovernanceError):
    """The run was finished (its ``with`` block exited, or ``finish`` was called): a check or
    report on it is a bug in the agent, refused before anything is sent."""

    # Nothing was sent, so neither the service nor a retry has a say.
    reason = "run_closed"
    user_message = "The agent acted in a run it had already ended, so nothing was run."
    user_next = ("Trying again will not help: tell the agent's developer (the agent used a "
                 "run after finishing it).")


class GovernanceStop(GovernanceError):
    """A stop raised as an exception where a framework needs one (the OpenAI Agents
    integration's handoff with ``raise_on_stop=True``): ``decision`` is the stop, and
    ``user_notice()`` its notice, as the run's output has it."""

    def __init__(self, decision: Any, notice: str) -> None:
        super().__init__(notice)
        self.decision = decision
        self.reason = str(getattr(decision, "reason", None) or self.reason)
        self.notice = notice

    def user_notice(self) -> str:
        return self.notice


_BY_CODE: dict[str, type[ApiError]] = {
    "invalid_request": InvalidRequest,
    "kill_switch_engaged": KillSwitchEngaged,
    "run_finished": RunFinished,
    "approval_pending": ApprovalPending,
    "parent_finished": ParentFinished,
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


# -- The agent key's form ------------------------------------------------------------------
# A key copied with a trailing space or newline (a file read with its newline, a .env line, a
# paste) used to reach httpx, which refused the header ("Illegal header value b'Bearer gov_...'",
# the whole key in the text) on every attempt: the client took that for an outage, so a
# fail-open agent ran every action ungoverned and logged the key (found by a tester). It is a
# mistake on this machine, refused when the client is made, in words that never repeat the key.

_NAMED = {" ": "a space", "\t": "a tab", "\n": "a line break", "\r": "a carriage return",
          "\u00a0": "a no-break space"}


def _named(char: str) -> str:
    return _NAMED.get(char) or (f"a control character (U+{ord(char):04X})" if char.isascii()
                                else f"a character that is not ASCII (U+{ord(char):04X})")


def agent_key_problem(key: object) -> str | None:
    """What makes ``key`` unusable as an agent key (which is sent as an HTTP header, so it is
    printable ASCII without spaces: ``gov_<prefix>_<secret>``), or None. The words name the
    character and where it is, never the key. Surrounding whitespace is refused rather than
    stripped: a key that is not the one issued may be a wrong one, and a client that
    silently edits secrets hides where they are mangled."""
    if not isinstance(key, str):
        return f"the agent key must be a string, not {type(key).__name__}"
    if not key:
        return "the agent key is empty"
    return secret_form_problem(key, "the agent key")


def secret_form_problem(secret: str, what: str) -> str | None:
    """What character makes ``secret`` no HTTP header value (visible ASCII, as every key and
    token is), and where, in words that never show it: ``what`` names it ("the agent key",
    "the token"); None when there is none. One place for the client and `govctl`."""
    for index, char in enumerate(secret):
        if "!" <= char <= "~":
            continue
        if index >= len(secret.rstrip()) or index == len(secret) - 1:
            where = "at its end"
        elif index < len(secret) - len(secret.lstrip()) or index == 0:
            where = "at its start"
        else:
            where = f"inside it (character {index + 1} of {len(secret)})"
        return f"{what} has {_named(char)} {where}"
    return None


def masked_key(key: str) -> str:
    """The key as an error message or a log line may show it: its first characters
    (``gov_0743…``, part of the public prefix the dashboard lists), never the secret."""
    return f"{key[:8]}…" if len(key) >= 24 else "…"
