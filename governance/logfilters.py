"""Logging filters named by settings.LOGGING."""

from __future__ import annotations

import logging


class RefusalsWithoutTraceback(logging.Filter):
    """Django logs a PermissionDenied or Http404 with the exception's traceback; for a
    response under 500 that is a refusal the server meant, so keep the line, drop the trace."""

    def filter(self, record: logging.LogRecord) -> bool:
        status = getattr(record, "status_code", None)
        if isinstance(status, int) and status < 500:
            record.exc_info = None
            record.exc_text = None
        return True
