"""The application's one error: a refusal with an HTTP status and a SPEC 5.3 code.

The services raise it for whatever they refuse (an unknown run, a finished run, a decided
approval, a kill switch's bad scope, a webhook test already pending, a poll over its cap);
each edge says it its own way: the agent API as the JSON envelope (runs/check/api.py), the
dashboard as a message or a page with the status, a management command as its error. The
message is written for whoever reads that edge (an agent's author, an operator, an admin).
"""

from __future__ import annotations


class AppError(Exception):
    """A refusal. ``fields`` names the request's fields at fault (SPEC 5.3);
    ``retry_after_s``, when set, tells the client when to ask again (a Retry-After header)."""

    def __init__(self, status: int, code: str, message: str,
                 fields: dict[str, str] | None = None, *, retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.fields = status, code, message, fields or {}
        self.retry_after_s = retry_after_s
