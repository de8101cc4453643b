"""Logging filters named by settings.LOGGING."""

from __future__ import annotations

import logging
import threading
import time

# Refusal lines (answers under 500) one process writes at most a minute; the first line after
# a minute that dropped some says how many.
REFUSALS_PER_MINUTE = 60
_MINUTE_S = 60.0
# Set on a record once this filter has decided it: the filter sits on the django.request
# logger and on the console handler, and a record passes both.
_DECIDED = "_governance_refusal_kept"


class RefusalsWithoutTraceback(logging.Filter):
    """Django logs a PermissionDenied or Http404 with the exception's traceback; for a
    response under 500 that is a refusal the server meant, so keep the line, drop the trace.

    And at most REFUSALS_PER_MINUTE of those lines a minute per process: a client sending
    wrong keys or unknown paths as fast as it can wrote a line each (50 a second under the
    benchmark's `bad_keys` attack), filling the log the product exists to keep small. The
    first refusal logged after a minute that left some out says how many."""

    def __init__(self, name: str = "") -> None:
        super().__init__(name)
        self._lock = threading.Lock()
        self._minute_started = time.monotonic()
        self._logged = 0
        self._left_out = 0

    def forget(self) -> None:
        """A new minute with nothing logged (tests: one test's refusals must not silence the
        next one's)."""
        with self._lock:
            self._minute_started, self._logged, self._left_out = time.monotonic(), 0, 0

    def filter(self, record: logging.LogRecord) -> bool:
        status = getattr(record, "status_code", None)
        if not isinstance(status, int) or status >= 500:
            return True
        record.exc_info = None
        record.exc_text = None
        decided = getattr(record, _DECIDED, None)
        if decided is not None:
            return bool(decided)
        with self._lock:
            now = time.monotonic()
            left_out = 0
            if now - self._minute_started >= _MINUTE_S:
                left_out, self._left_out = self._left_out, 0
                self._minute_started, self._logged = now, 0
            kept = self._logged < REFUSALS_PER_MINUTE
            if kept:
                self._logged += 1
            else:
                self._left_out += 1
        if left_out and isinstance(record.args, tuple):
            record.msg = f"{record.msg} (and %d more refusals not logged in the minute before)"
            record.args = (*record.args, left_out)
        setattr(record, _DECIDED, kept)
        return kept
