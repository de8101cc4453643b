"""SPEC 10 ("Bounded work per request"): a page's reads and a live screen's looks have a
deadline on PostgreSQL (DASHBOARD_STATEMENT_TIMEOUT_MS, governance/deadlines.py). A read
past it is cancelled by PostgreSQL: the page answers a 503 that says so, never a 500, and a
stream's look sends nothing and goes on. A slow read is made with pg_sleep."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from django.db import OperationalError, connection, transaction
from django.http import HttpRequest, HttpResponse
from django.test import RequestFactory

from governance.deadlines import read_deadline
from governance.middleware import ReadDeadlineMiddleware
from runs.dashboard import selectors as dashboard
from runs.dashboard.stream import Frame, Source, _look
from runs.live import looks

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

SLEEP_S = 5  # longer than any deadline below: a test that waits it out has failed


def sleep_in_the_database(*args: Any, **kwargs: Any) -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_sleep(%s)", [SLEEP_S])
    return 0


def statement_timeout() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SHOW statement_timeout")
        return str(cursor.fetchone()[0])


@pytest.fixture
def deadline(settings: Any) -> int:
    settings.DASHBOARD_STATEMENT_TIMEOUT_MS = 300
    return 300


def test_a_page_whose_read_takes_too_long_answers_503_saying_so(
        client: Any, team: Any, users: dict[str, Any], deadline: int, monkeypatch: Any) -> None:
    client.force_login(users["viewer"])
    before = statement_timeout()
    monkeypatch.setattr(dashboard, "would_stop_count", sleep_in_the_database)
    started = time.monotonic()
    page = client.get(f"/teams/{team.slug}/")
    took = time.monotonic() - started
    assert page.status_code == 503, page.content[:300]
    assert "This page took too long to read" in page.content.decode()
    assert page["Retry-After"]
    assert took < SLEEP_S - 1, f"the page waited for its read: {took:.1f} s"
    # The connection's next request (a form, say) has its own timeout again.
    assert statement_timeout() == before
    monkeypatch.undo()
    assert client.get(f"/teams/{team.slug}/").status_code == 200


def test_behind_a_pooler_in_transaction_mode_each_read_has_the_deadline_in_its_transaction(
        client: Any, team: Any, users: dict[str, Any], deadline: int, settings: Any,
        monkeypatch: Any) -> None:
    """DATABASE_POOLER=transaction: no session to set the deadline in, so each statement of
    the page gets it in its own transaction (the pooler may give the next statement another
    server connection). It once was off there: the page waited for its read."""
    settings.DATABASE_POOLER = "transaction"
    client.force_login(users["viewer"])
    before = statement_timeout()
    monkeypatch.setattr(dashboard, "would_stop_count", sleep_in_the_database)
    started = time.monotonic()
    page = client.get(f"/teams/{team.slug}/")
    assert page.status_code == 503, page.content[:300]
    assert time.monotonic() - started < SLEEP_S - 1
    assert statement_timeout() == before  # nothing was set on the session
    # Inside a transaction of the block's own, as outside one.
    with read_deadline(), pytest.raises(OperationalError), transaction.atomic():
        sleep_in_the_database()
    monkeypatch.undo()
    assert client.get(f"/teams/{team.slug}/").status_code == 200


def test_only_reads_get_the_deadline(deadline: int) -> None:
    seen: dict[str, str] = {}

    def view(request: HttpRequest) -> HttpResponse:
        seen[request.method or ""] = statement_timeout()
        return HttpResponse()

    before = statement_timeout()
    middleware = ReadDeadlineMiddleware(view)
    factory = RequestFactory()
    for request in (factory.get("/"), factory.head("/"), factory.post("/")):
        middleware(request)
    assert seen == {"GET": "300ms", "HEAD": "300ms", "POST": before}
    assert statement_timeout() == before


class SlowSource(Source):
    def __init__(self) -> None:
        self.team_id = 0

    def frames(self) -> list[Frame]:
        sleep_in_the_database()
        return [Frame("never", "")]


def test_a_streams_look_that_takes_too_long_sends_nothing_and_the_stream_goes_on(
        deadline: int) -> None:
    before = statement_timeout()
    started = time.monotonic()
    assert _look(SlowSource()) == ""
    assert time.monotonic() - started < SLEEP_S - 1
    assert statement_timeout() == before


def test_a_look_on_the_lane_is_cancelled_at_the_deadline(deadline: int) -> None:
    """The lane's thread serves every stream and long poll of the process: one slow look
    holds it (and all of them) no longer than the deadline."""
    lane = looks.LookLane()

    def slow_look() -> int:
        try:
            return sleep_in_the_database()
        finally:
            connection.close()  # the lane's thread's own connection: the test ends with it

    started = time.monotonic()
    with pytest.raises(OperationalError):
        asyncio.run(lane.run(slow_look, "viewer"))
    assert time.monotonic() - started < SLEEP_S - 1


def test_behind_a_pooler_in_transaction_mode_the_deadline_sets_nothing_in_the_session(
        settings: Any) -> None:
    """A session SET would stay on whichever server connection ran it, for another client's
    statements (docs/deploy.md, "PgBouncer"): there each statement has the deadline in its
    own transaction, and the session keeps its own."""
    settings.DATABASE_POOLER = "transaction"
    settings.DASHBOARD_STATEMENT_TIMEOUT_MS = 300
    before = statement_timeout()
    with read_deadline():
        assert statement_timeout() == "300ms"
        with connection.cursor() as cursor:  # the session, past the block's wrapper
            cursor.cursor.execute("SHOW statement_timeout")
            assert cursor.cursor.fetchone()[0] == before
    assert statement_timeout() == before
