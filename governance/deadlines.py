"""A deadline on the dashboard's database reads (SPEC 10, "Bounded work per request").

A page (the dashboard pool's GET and HEAD requests) and a live screen's look (the look lane,
runs/live/looks.py) read aggregates over a team's recorded traffic: the overview's charts
and breakdowns grow with it. On PostgreSQL every statement they run gets
``DASHBOARD_STATEMENT_TIMEOUT_MS`` (default 2,000; 0: none), after which PostgreSQL cancels
it, so no page holds a connection and a core for long, whatever a team recorded. A page whose
read was cancelled answers a 503 page saying so (governance/middleware.py); a look that was
cancelled sends nothing and looks again later. The API's pool never gets the deadline: the
check has its own bounds.

The deadline is the session's ``statement_timeout``, set when the block starts and reset when
it ends, rather than ``SET LOCAL`` in one transaction around the whole page: the page's
writes (runs/first_look.py ends overdue runs under their row locks) stay in their own short
transactions, and their locks are not held while the page renders.

Behind a pooler in transaction mode (``DATABASE_POOLER=transaction``) there is no session to
set it in: the SET would stay on whichever server connection ran it, for another client's
statements, and the reset would reach another one. There each statement of the block gets the
deadline in its own transaction instead (``set_config(..., true)``, which ends with it): a
statement outside a transaction is run in one of its own, a statement inside one has the
setting made first. That costs a page's statements a few round trips each, and keeps the bound:
with the deadline off there, one team's viewers' searches over 300,000 runs held server
connections for 7 to 25 s each (found by an attacker: another team's check p99 24 to 160 ms
through the pooler), and a live screen's look, charged only the CPU time of its own thread,
could hold its process's look lane in PostgreSQL for as long as its aggregate took.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.conf import settings
from django.db import DatabaseError, connection, transaction

log = logging.getLogger(__name__)

# PostgreSQL's query_canceled: a statement past statement_timeout.
QUERY_CANCELED = "57014"


@contextmanager
def read_deadline(ms: int | None = None) -> Iterator[None]:
    """Every statement of the block on this thread's connection is cancelled after ``ms``
    (default ``DASHBOARD_STATEMENT_TIMEOUT_MS``). On SQLite, with 0, or inside another
    deadline's block: nothing. Behind a pooler in transaction mode: per statement, in its
    own transaction (the module's docstring)."""
    ms = settings.DASHBOARD_STATEMENT_TIMEOUT_MS if ms is None else ms
    if ms <= 0 or connection.vendor != "postgresql" or getattr(connection, "_deadline", False):
        yield
        return
    if settings.DATABASE_POOLER == "transaction":
        connection._deadline = True  # type: ignore[attr-defined]
        try:
            with connection.execute_wrapper(_PerTransaction(f"{ms}ms")):
                yield
        finally:
            connection._deadline = False  # type: ignore[attr-defined]
        return
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT set_config('statement_timeout', %s, false)", [f"{ms}ms"])
    except DatabaseError:
        # The database is down: the block's own reads meet that and answer it as they
        # would anyway (a 503 from /readyz, say), not this.
        yield
        return
    connection._deadline = True  # type: ignore[attr-defined]
    try:
        yield
    finally:
        connection._deadline = False  # type: ignore[attr-defined]
        _reset()


class _PerTransaction:
    """An execute wrapper: each statement runs with ``statement_timeout`` set for its own
    transaction only (a pooler in transaction mode shares no session between them)."""

    SET = "SELECT set_config('statement_timeout', %s, true)"

    def __init__(self, timeout: str) -> None:
        self.timeout = timeout

    def __call__(self, execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        db = context["connection"]
        if db.in_atomic_block:
            context["cursor"].cursor.execute(self.SET, [self.timeout])
            return execute(sql, params, many, context)
        # psycopg reads a statement's rows when it runs it: they are here after the commit.
        with transaction.atomic(using=db.alias):
            context["cursor"].cursor.execute(self.SET, [self.timeout])
            return execute(sql, params, many, context)


def _reset() -> None:
    """The connection's own statement_timeout again: the thread's next request may be a
    write (a form, an engage) that must not be cut short. A connection the block closed
    has nothing to reset: the next one opens with the defaults."""
    if connection.connection is None:
        return
    try:
        with connection.cursor() as cursor:
            cursor.execute("SET statement_timeout TO DEFAULT")
    except DatabaseError:
        # In a transaction that failed, its rollback undoes the SET too. Out of one, what
        # the connection is left with is unknown: the next request opens a fresh one.
        if not connection.in_atomic_block:
            log.warning("could not reset statement_timeout; closing the connection",
                        exc_info=True)
            connection.close()


def timed_out(exc: BaseException) -> bool:
    """Whether a database error is PostgreSQL cancelling a statement past its deadline."""
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    return getattr(cause, "sqlstate", None) == QUERY_CANCELED
