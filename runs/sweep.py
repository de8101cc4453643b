"""One row at a time, for the loops that settle or show many rows: the beat sweeps, the
"whoever looks first" settling of the pages and the API's lists, the cards of a page.

SPEC 10 ("No impossible states"): a sweep or a page that meets one bad row logs it and goes
on. A row written by an older version, or damaged by hand, must not stop every other row's
expiry or make a team's screens answer 500 for everyone. A store that is down is no bad row:
that error goes up as it would anywhere else (the API answers 503, the task is retried).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TypeVar

from django.db import InterfaceError, OperationalError

log = logging.getLogger(__name__)

Row = TypeVar("Row")
Result = TypeVar("Result")


def one_by_one(rows: Iterable[Row], act: Callable[[Row], Result], *, what: str,
               key: Callable[[Row], object] = lambda row: getattr(row, "pk", row)
               ) -> list[Result]:
    """``act`` on each row, in order: the results of the rows it succeeded on. A row it
    fails on is logged, with ``what`` and the row's ``key``, and left out. Each ``act`` that
    writes must be atomic on its own (a savepoint inside a caller's transaction), so that a
    failure leaves nothing of its row half done."""
    results = []
    for row in rows:
        try:
            results.append(act(row))
        except (OperationalError, InterfaceError):
            raise
        except Exception:
            log.exception("%s %s could not be handled; left as it is, going on", what, key(row))
    return results
