"""A revoked agent key is refused on the very next request, by every process of the
multi-process server: keys are looked up on each request, never cached per process."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from policies.models import Team
from policies.services import agent_key_create, agent_key_revoke
from runs.models import Decision
from tests.conftest import Server, set_policy

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

REQUESTS = 40


def fresh_connection_statuses(server: Server, token: str, run_id: str) -> list[int]:
    """Each request on its own TCP connection, from several threads, so that the server's
    worker processes all take their share."""
    def one(i: int) -> int:
        headers = {"Authorization": f"Bearer {token}", "Connection": "close"}
        with httpx.Client(base_url=server.url, timeout=30, headers=headers) as http:
            if i % 2:
                return http.get(f"/api/v1/runs/{run_id}").status_code
            return http.post(f"/api/v1/runs/{run_id}/check",
                             json={"action": {"name": "search", "args": {"i": i}}}).status_code

    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(one, range(REQUESTS)))


def test_a_revoked_key_is_refused_by_every_server_process_at_once(server: Server, team: Team):
    set_policy(team, step_limits={"max_steps": 1000, "max_repeat_action": 1000},
               budgets={"max_seconds": None})
    new = agent_key_create(team=team, name="soon-revoked")
    with httpx.Client(base_url=server.url, timeout=30,
                      headers={"Authorization": f"Bearer {new.token}"}) as kept_alive:
        run_id = kept_alive.post("/api/v1/runs", json={"agent": "bot"}).json()["run_id"]
        # Every process has now served (and could have cached) this key.
        assert fresh_connection_statuses(server, new.token, run_id) == [200] * REQUESTS
        audited = Decision.objects.filter(run_id=run_id).count()

        agent_key_revoke(key=new.key, actor=None)

        assert fresh_connection_statuses(server, new.token, run_id) == [401] * REQUESTS
        # A connection opened before the revocation is refused too.
        refused = kept_alive.post(f"/api/v1/runs/{run_id}/check", json={"action": {"name": "x"}})
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "unauthorized"
    assert Decision.objects.filter(run_id=run_id).count() == audited
