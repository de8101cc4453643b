"""tests/on_this_thread.py: a half-read streaming answer collected in the middle of a test
that calls the WSGI application on its own thread leaves the test's connection open (it
closed it under Django's way, the request signals disconnected, and the scenario's next
check answered 503 "Cannot operate on a closed database")."""

from __future__ import annotations

import gc

import httpx
import pytest
from django.http import StreamingHttpResponse
from django.test.client import closing_iterator_wrapper

from policies.models import Team
from runs.models import Run
from tests.on_this_thread import keeps_the_test_connection

pytestmark = pytest.mark.django_db


def test_a_stream_collected_mid_test_leaves_the_test_connection_open(
        team: Team, agent_token: str) -> None:
    from governance.wsgi import application

    answer = StreamingHttpResponse(iter(["a", "b"]))
    unread = closing_iterator_wrapper(iter(answer.streaming_content), answer.close)
    next(unread)
    leaked = [unread]
    leaked.append(leaked)  # a cycle: only the collector ends it, at a moment of its own
    del unread, leaked
    with keeps_the_test_connection(), httpx.Client(
            transport=httpx.WSGITransport(app=application), base_url="http://127.0.0.1",
            headers={"Authorization": f"Bearer {agent_token}"}) as http:
        first = http.post("/api/v1/runs", json={"agent": "bot"})
        gc.collect()  # the iterator's `finally` connects the request signals' receivers again
        second = http.post("/api/v1/runs", json={"agent": "bot"})
    assert (first.status_code, second.status_code) == (201, 201), second.text
    assert Run.objects.filter(team=team).count() == 2
