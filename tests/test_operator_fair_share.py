"""The operator API's pools are every team's (SPEC 10, 21): one credential may hold only its
share of them, and a kill switch has a pool of its own. Found by an attacker: one viewer's
64 concurrent reads of 500 runs each made another team's kill switch through the operator
API wait 2 to 4 s (p50 2.2 s), and its checks' p99 rise 10x."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from bench.backtest import generate
from policies.models import Team
from policies.tokens import operator_token_create
from runs.models import KillSwitch
from tests.conftest import Server

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

READERS = 32
# Generous: what a user would call "at once" on a loaded 2-core machine.
DEADLINE_S = 2.0


def test_one_viewers_flood_of_reads_neither_holds_the_pool_nor_delays_a_kill_switch(
        server: Server, team: Team, other_team: Team, users: dict[str, Any],
        attack_turn: None) -> None:
    generate(team, runs=1500)
    # One viewer's tokens, each header spelled several ways ("bEARER" authenticates too), and
    # invalid tokens, all from another address than the other team's admin.
    tokens = [operator_token_create(user=users["viewer"], name=f"ci{i}", role="viewer").secret
              for i in range(4)]
    headers = [f"{scheme} {token}" for token in tokens
               for scheme in ("Bearer", "bearer", "bEARER", "BEARER")]
    headers += [f"Bearer gov_op_{i:012x}_nope" for i in range(8)]
    outsider = operator_token_create(user=users["outsider"], name="pager", role="admin").secret
    statuses: list[int] = []
    refusals: list[httpx.Response] = []
    stop = threading.Event()

    def read(header: str) -> None:
        with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": header},
                          transport=httpx.HTTPTransport(local_address="127.0.0.2")) as http:
            while not stop.is_set():
                answer = http.get("/api/v1/teams/support/runs", params={"limit": 500})
                statuses.append(answer.status_code)
                if answer.status_code == 429:
                    refusals.append(answer)

    readers = [threading.Thread(target=read, args=(headers[i % len(headers)],))
               for i in range(READERS)]
    for thread in readers:
        thread.start()
    slowest = 0.0
    try:
        time.sleep(1.0)  # the flood is on
        with httpx.Client(base_url=server.url, timeout=30,
                          headers={"Authorization": f"Bearer {outsider}"}) as pager:
            for action in ("engage", "release", "engage", "release"):
                began = time.monotonic()
                answer = pager.post("/api/v1/killswitch", json={
                    "action": action, "scope": "team", "team": other_team.slug,
                    "reason": "on call"})
                slowest = max(slowest, time.monotonic() - began)
                assert answer.status_code == 200, answer.text
                began = time.monotonic()
                listed = pager.get(f"/api/v1/teams/{other_team.slug}/policies")
                slowest = max(slowest, time.monotonic() - began)
                assert listed.status_code == 200, listed.text
    finally:
        stop.set()
        for thread in readers:
            thread.join()
    assert slowest < DEADLINE_S, f"another team's operator call took {slowest:.2f} s"
    assert KillSwitch.objects.filter(team=other_team, active=False).count() == 2
    # The flood was answered, the reads past its share refused at once, saying why.
    assert 200 in statuses and refusals
    body = refusals[0].json()["error"]
    assert body["code"] == "too_many_requests" and refusals[0].headers["Retry-After"] == "1"
