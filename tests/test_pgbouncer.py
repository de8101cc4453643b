"""The agent API's contract cases (tests/test_api_e2e.py), and some of the rate limits' and
approvals' (tests/test_rate_limits.py, tests/test_approvals_e2e.py), through a real PgBouncer in
transaction pooling mode, started by the test (deploy/stack.py PgBouncer: its configuration in a
temporary directory, its own port), with the server told so (DATABASE_POOLER=transaction,
docs/deploy.md "PgBouncer"). Without that setting the check PREPAREs its statements once per
connection, which a pooler in transaction mode cannot keep: the test at the end shows that
failure, which is why the setting exists."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from deploy.stack import PgBouncer
from tests.conftest import Server, server_env, set_policy, start_server
from tests.conftest import test_database_url as database_url
from tests.test_api_e2e import *  # noqa: F403 (the contract cases, run again through PgBouncer)
from tests.test_approvals_e2e import (  # noqa: F401 (approvals: the ORM path, Redis wake-ups)
    approving,
    test_the_long_poll_answers_as_soon_as_the_approval_is_decided,
)
from tests.test_rate_limits import (  # noqa: F401 (rate limits: advisory locks, window reads)
    test_a_full_rule_answers_wait_with_every_common_field,
    test_the_window_slides,
)

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture(scope="module")
def pgbouncer(django_db_setup: Any) -> Iterator[PgBouncer]:
    why = PgBouncer.available()
    if why:
        pytest.skip(why)
    with PgBouncer(database_url(), pool_size=4) as bouncer:
        yield bouncer


@pytest.fixture(scope="module")
def server(pgbouncer: PgBouncer, django_db_blocker: Any) -> Iterator[Server]:
    """The production server (2 workers), its database PgBouncer in transaction mode. Fewer
    server connections (4) than the server's threads: transactions of one client connection
    do land on different server connections."""
    srv = start_server(env=server_env(DATABASE_URL=pgbouncer.url, DATABASE_POOLER="transaction"))
    yield srv
    srv.stop()


def test_without_the_setting_prepared_statements_fail_through_the_pooler(
        pgbouncer: PgBouncer, agent: Any) -> None:
    """The reason for DATABASE_POOLER=transaction: a server that PREPAREs the check's
    statements behind a pooler in transaction mode refuses checks (503) once its threads'
    transactions land on server connections that never saw the PREPARE."""
    runs = [agent.start()["run_id"] for _ in range(8)]
    srv = start_server(workers=1, threads=8, env=server_env(DATABASE_URL=pgbouncer.url))
    try:
        def checks(run_id: str) -> list[int]:
            with httpx.Client(base_url=srv.url, timeout=30,
                              headers={"Authorization": f"Bearer {agent.token}"}) as http:
                return [http.post(f"/api/v1/runs/{run_id}/check",
                                  json={"action": {"name": "search.docs",
                                                   "args": {"query": f"q{i}"}}}).status_code
                        for i in range(10)]

        with ThreadPoolExecutor(len(runs)) as pool:
            statuses = [status for answers in pool.map(checks, runs) for status in answers]
        assert 503 in statuses, statuses
    finally:
        srv.stop()


def test_a_child_runs_checks_count_on_its_parent_through_the_pooler(
        agent: Any, team: Any) -> None:
    """SPEC 20 behind the pooler: a child's check locks its ancestors in the message that
    begins the transaction, then its own run without BEGIN. Sent whole (not prepared), the
    lock went with its BEGIN again and its answer was read from BEGIN's empty result: every
    check of a child run answered 503."""
    set_policy(team, step_limits={"max_steps": 3, "max_repeat_action": 100,
                                  "no_progress_window": 100})
    parent = agent.start("planner")["run_id"]
    first, second = (agent.start("helper", parent_run_id=parent)["run_id"] for _ in range(2))
    answers = [agent.check(run_id, "search", {"i": i})
               for i, run_id in enumerate([first, first, second, second])]
    assert [a["decision"] for a in answers] == ["allow", "allow", "allow", "stop"], answers
    assert answers[-1]["reason"] == "max_steps" and parent in answers[-1]["message"]


def test_a_pages_slow_read_is_cancelled_at_its_deadline_through_the_pooler(
        pgbouncer: PgBouncer, team: Any, users: dict[str, Any], agent: Any) -> None:
    """SPEC 10, "Bounded work per request", behind the pooler: a page's search over a team's
    recorded runs is cancelled at DASHBOARD_STATEMENT_TIMEOUT_MS (a 503 page saying so), as it
    is on PostgreSQL directly. The deadline was off behind a pooler in transaction mode: the
    search held a server connection, shared with every team's checks, as long as it took (7 to
    25 s over 300,000 runs). The server's checks are not cut short."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO runs_run (id, agent, status, steps, tool_calls, cost_usd, started_at,"
            " task, metadata, output, memory, policy_version_id, team_id, ancestors, depth)"
            " SELECT gen_random_uuid(), 'bulk', 'completed', 1, 1, 0, now(),"
            " repeat(md5(i::text), 32), '{}', '', '{}', %s, %s, '[]', 0"
            " FROM generate_series(1, 40000) i",
            [team.policies.get(name="default").current.pk, team.pk])
    srv = start_server(workers=1, env=server_env(
        DATABASE_URL=pgbouncer.url, DATABASE_POOLER="transaction",
        DASHBOARD_STATEMENT_TIMEOUT_MS="5"))
    try:
        with httpx.Client(base_url=srv.url, timeout=30, follow_redirects=False) as http:
            page = http.get("/accounts/login/")
            token = page.text.split('name="csrfmiddlewaretoken" value="')[1].split('"')[0]
            assert http.post("/accounts/login/", data={
                "username": "viewer", "password": "pw-viewer-123",
                "csrfmiddlewaretoken": token}).status_code == 302
            found = http.get(f"/teams/{team.slug}/runs/", params={"q": "no such task"})
            assert found.status_code == 503, found.text[:300]
            assert "took too long to read" in found.text
        with httpx.Client(base_url=srv.url, timeout=30,
                          headers={"Authorization": f"Bearer {agent.token}"}) as api:
            run_id = api.post("/api/v1/runs", json={"agent": "support-bot"}).json()["run_id"]
            answer = api.post(f"/api/v1/runs/{run_id}/check",
                              json={"action": {"name": "search.docs", "args": {}}})
            assert answer.status_code == 200 and answer.json()["decision"] == "allow"
    finally:
        srv.stop()
