"""The project's WSGI application called on the test's own thread (what `runserver` and
any WSGI server call), inside the test's transaction.

Django's request signals close a connection whose autocommit differs from its settings'
(``close_old_connections``), which the test's connection, inside its transaction, always
does: closed there, its next statement fails with "Cannot operate on a closed database".
Django's test client disconnects those receivers around each request; that is not enough
for a test that calls the application itself: a streaming answer that an earlier test left
half read connects them again when the garbage collector closes its iterator (the test
client's ``closing_iterator_wrapper``), which may happen in the middle of a later test (a
503 at a scenario's fourth check, once in CI). So the receivers stay connected, and this
thread's connections are the ones that ignore them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def keeps_the_test_connection() -> Iterator[None]:
    """While inside, the request signals' housekeeping leaves this thread's connections
    open."""
    from django.db import connections

    mine = list(connections.all())
    for wrapper in mine:
        wrapper.close_if_unusable_or_obsolete = lambda: None
    try:
        yield
    finally:
        for wrapper in mine:
            del wrapper.close_if_unusable_or_obsolete
