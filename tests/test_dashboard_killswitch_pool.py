"""No page, however many are asked for or however long each takes, is in front of a kill
switch engaged from the dashboard (SPEC 6, 10). Found by an attacker: one team's viewers
looping a policy's history diff (two versions of a 220 KB policy, 0.2 s a view) on 32
connections delayed another team's engage from the dashboard by 2 to 6 s, since every page
and form waited in arrival order for the dashboard pool's threads. The kill switch forms now
have a pool of their own (governance/pools.py `DASHBOARD_KILLSWITCH`)."""

from __future__ import annotations

import secrets
import threading
import time
from typing import Any

import httpx
import pytest

from governance.pools import pool_name
from policies.document import default_policy, parse_policy
from policies.models import Team
from policies.services import policy_save
from runs.models import KillSwitch
from tests.conftest import server_env, start_server
from tests.test_approvals_e2e import signed_in

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

PAGE_LOOPS = 40
# SPEC 10: a kill switch is answered at once whatever another team does; generous.
DEADLINE_S = 2.0


def test_the_kill_switch_forms_have_a_pool_of_their_own() -> None:
    for path in ("/teams/support/killswitch/engage", "/teams/support/killswitch/release",
                 "/killswitch/engage", "/killswitch/release",
                 "/teams/support/runs/0b7e8a52-4a53-4c6e-9a8e-0d1f4c3b2a10/kill"):
        assert pool_name(path, "POST") == pool_name(path, "post") == "dashboard-killswitch"
        assert pool_name(path, "GET") == "dashboard"  # the confirmation page is a page
    for path in ("/teams/support/killswitch/", "/teams/support/killswitch/stream",
                 "/teams/support/killswitch/webhook-test", "/teams/support/policies/x/save"):
        assert pool_name(path, "POST") == "dashboard"


def big_policy() -> dict[str, Any]:
    # As large as a document may be: its tool patterns up to their 16,384 characters
    # (policies/document.py MAX_PATTERN_CHARS), its lists of argument names of 256 long ones.
    def patterns(count: int) -> list[str]:
        return [f"{secrets.token_hex(90)}.*" for _ in range(count)]
    return {**default_policy("big"),
            "tools": {"allow": ["*", *patterns(44)], "deny": patterns(45)},
            "repeat_key": {"ignore_args": [secrets.token_hex(99) for _ in range(256)]},
            "redact_args": [secrets.token_hex(99) for _ in range(256)]}


def test_another_teams_pages_never_delay_a_dashboard_kill_switch(
        team: Team, other_team: Team, users: dict[str, Any], attack_turn: None) -> None:
    for _ in range(2):  # two versions whose diff is heavy to show
        policy_save(team=team, document=parse_policy(big_policy()), actor=None, source="test")
    server = start_server(workers=1, env=server_env(WEB_DASHBOARD_THREADS="1"))
    stop = threading.Event()
    served: list[int] = []
    loops: list[threading.Thread] = []
    history = f"/teams/{team.slug}/policies/big/history?a=1&b=2"
    try:
        viewer = signed_in(server, "viewer")
        outsider = signed_in(server, "outsider")  # an admin of the other team only
        began = time.monotonic()
        assert viewer.get(history).status_code == 200
        page_s = time.monotonic() - began

        def view() -> None:
            with httpx.Client(base_url=server.url, timeout=120,
                              cookies=viewer.cookies) as http:
                while not stop.is_set():
                    served.append(http.get(history).status_code)

        loops += [threading.Thread(target=view) for _ in range(PAGE_LOOPS)]
        for thread in loops:
            thread.start()
        time.sleep(1.0)  # the pages are queued on the dashboard's one thread
        began = time.monotonic()
        engaged = outsider.post(f"/teams/{other_team.slug}/killswitch/engage", data={
            "scope": "agent", "agent": "billing-bot", "reason": "incident", "confirmed": "1"})
        took = time.monotonic() - began
    finally:
        stop.set()
        for thread in loops:
            thread.join()
        server.stop()
    said = f"engage took {took:.2f} s; a page {page_s:.2f} s, {len(served)} served meanwhile"
    assert engaged.status_code in (200, 302), engaged.text
    assert KillSwitch.objects.filter(team=other_team, agent="billing-bot", active=True).exists()
    assert took < DEADLINE_S, said
    # The pages are served too, paced as their team's (a page past the team's longest wait
    # is a 429 with the wait: tests/test_dashboard_pacing.py).
    assert 200 in served and set(served) <= {200, 429}, said
