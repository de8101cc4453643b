"""The agents' bulk calls never take a check's thread (SPEC 10: no tenant slows another).

Found by an attacker: with one team's agent key, 16 concurrent uploads of 1,000 local
decisions (or 8 reads of a run's 1,000 largest decisions) took every thread of the API's pool,
and another team's checks waited 1 to 6 s, its kill switch answered 4.6 s late. The bulk
calls now have a pool of their own (governance/pools.py), of which one key holds at most its
share: past it, 429 with Retry-After at once, which the client retries. And together they
take at most a share of the process's time (`WEB_AGENT_BULK_SHARE`): found by an attacker
after that, four keys reading a run's 1,000 decisions of 60 KB over and over still made
another team's check p99 12x (the benchmark's `heavy_reads` attack)."""

from __future__ import annotations

import itertools
import socket
import threading
import time
import uuid
from typing import Any

import httpx
import pytest

from governance.pools import paced_only, pool_name
from policies.models import Team
from policies.services import agent_key_create
from tests.conftest import Server, server_env, start_server

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

UPLOADERS = 16
# SPEC 10: a valid check is answered within 2 s whatever another team does.
DEADLINE_S = 2.0


def test_bulk_paths_have_their_own_pool() -> None:
    assert pool_name("/api/v1/runs/x/decisions") == "agent-bulk"
    assert pool_name("/api/v1/runs/x/local-decisions/", "POST") == "agent-bulk"
    assert pool_name("/api/v1/runs", "GET") == pool_name("/api/v1/runs/") == "agent-bulk"
    assert pool_name("/api/v1/runs", "POST") == "api"  # a run's start is an agent's step
    assert pool_name("/api/v1/runs/x/check", "POST") == "api"
    # One run's or one decision's read: paced with its team's bulk calls (a hundred a second
    # from one key on the checks' pool made another team's check p99 14x, 16 to 39x before
    # they were made cheap: found by an attacker), but never refused for the calls in
    # progress: capped at one per key and process, an agent reading its runs from a few
    # threads got 429s (tests/test_key_revocation_e2e.py).
    for path in ("/api/v1/runs/x", "/api/v1/runs/x/", "/api/v1/decisions/7"):
        assert pool_name(path) == pool_name(path, "head") == "agent-bulk"
        assert paced_only(path)
    assert not paced_only("/api/v1/runs/x/decisions") and not paced_only("/api/v1/runs")
    assert pool_name("/api/v1/runs/x/finish", "POST") == "api"
    # The OpenAPI document is built once per process and then costs next to nothing: on
    # the bulk pool anonymous callers shared one slot, and one of them refused the rest.
    assert pool_name("/api/v1/openapi.json") == "api"


@pytest.mark.parametrize("method", ["get", "Get", "HEAD", "head"])
def test_the_runs_list_is_bulk_however_its_method_is_spelt(method: str) -> None:
    # Django serves a lowercase `get` as GET, and the API serves HEAD as GET (the whole
    # list, its body left out): found by an attacker, both escaped to the checks' pool.
    assert pool_name("/api/v1/runs", method) == pool_name("/api/v1/runs/", method) \
        == "agent-bulk"
    assert pool_name("/api/v1/runs", method.replace("e", "o").replace("E", "O")) == "api"


def test_bulk_calls_take_turns_within_their_share_of_the_process(
        team: Team, other_team: Team, agent_token: str, attack_turn: None) -> None:
    """A team's bulk call waits until what its last ones took is paid back at the pool's
    share of the process's time; a wait longer than 10 s is refused at once with it as
    Retry-After. The checks never wait for that turn, nor another team's bulk calls (found
    by an attacker: one bucket for the whole process made every team repay one team's
    reads). One worker: each process has its own shares. Timed with the machine to itself
    (`attack_turn`): SPEC 10's 2 s, not what CI's other groups beside it cost."""
    server = start_server(workers=1, env=server_env(WEB_AGENT_BULK_SHARE="0.01"))
    try:
        with httpx.Client(base_url=server.url, timeout=60,
                          headers={"Authorization": f"Bearer {agent_token}"}) as http:
            run_id = http.post("/api/v1/runs", json={"agent": "support-bot"}).json()["run_id"]
            began = time.monotonic()
            assert http.get("/api/v1/runs").status_code == 200
            first_took = time.monotonic() - began
            # Any call takes more than a millisecond: at a hundredth, 0.1 s to pay back.
            began = time.monotonic()
            second = http.get("/api/v1/runs")
            if second.status_code == 429:
                # A busy machine (a CI run): the first call, the view's first in this
                # process, took over 0.1 s, over 10 s to pay back. The server's time is
                # within the client's, so only then may it refuse; after the wait it named,
                # the call is served.
                assert first_took > 0.1, (first_took, second.text)
                assert int(second.headers["Retry-After"]) >= 10
                time.sleep(int(second.headers["Retry-After"]))
                assert http.get("/api/v1/runs").status_code == 200
            else:
                assert second.status_code == 200, second.text
                assert time.monotonic() - began >= 0.1
            # The same on a busy machine: the second call too may have taken over 0.1 s.
            answer = served_after_its_turn(http, "POST", f"/api/v1/runs/{run_id}/local-decisions",
                                           json=upload_body())
            assert answer.status_code == 200, answer.text
            # 1,000 entries take far more than 0.1 s: over 10 s to pay back at a hundredth.
            refused = http.get(f"/api/v1/runs/{run_id}/decisions")
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "too_many_requests"
            assert "share of this server process's time" in refused.json()["error"]["message"]
            assert int(refused.headers["Retry-After"]) >= 10
            theirs = agent_key_create(team=other_team, name="billing-reader").token
            began = time.monotonic()
            listed = http.get("/api/v1/runs", headers={"Authorization": f"Bearer {theirs}"})
            assert listed.status_code == 200, listed.text
            assert time.monotonic() - began < DEADLINE_S
            began = time.monotonic()
            check = http.post(f"/api/v1/runs/{run_id}/check",
                              json={"action": {"name": "search.docs", "args": {"q": "x"}}})
            assert check.status_code == 200, check.text
            assert time.monotonic() - began < DEADLINE_S
    finally:
        server.stop()


def test_a_teams_calls_asked_for_together_start_one_after_another(
        team: Team, other_team: Team) -> None:
    """A call owes what its team's last one took as it starts, not only when it ends. Found
    in the benchmark: counted at the end, every call asked for while others ran found
    nothing owed yet, so a team's queued reads started all at once each time its debt was
    paid back, and another team's check p99 read 10x in a 3 s slice that caught one such
    burst. Now the first call (its cost not known yet) keeps the turn to its end, and each
    next one waits for what the one before it is expected to take: three calls asked for
    together end at least 0.05 s apart (each owes 0.1 s per millisecond at a hundredth) or
    are refused with the wait. Three keys, so no key's share of the threads refuses them."""
    server = start_server(workers=1, env=server_env(WEB_AGENT_BULK_SHARE="0.01",
                                                    WEB_AGENT_BULK_THREADS="4"))
    tokens = [agent_key_create(team=team, name=f"reader-{i}").token for i in range(3)]
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            # Each key's team learned by a call off the bulk pool (a run's start), and the
            # runs list's first call in this process made by another team's key.
            for token in tokens:
                started = http.post("/api/v1/runs", json={"agent": "support-bot"},
                                    headers={"Authorization": f"Bearer {token}"})
                assert started.status_code == 201, started.text
            theirs = agent_key_create(team=other_team, name="warm-up").token
            assert http.get("/api/v1/runs", headers={
                "Authorization": f"Bearer {theirs}"}).status_code == 200
        ready = threading.Barrier(len(tokens))
        answers: list[tuple[float, httpx.Response]] = []

        def read(token: str) -> None:
            with httpx.Client(base_url=server.url, timeout=60,
                              headers={"Authorization": f"Bearer {token}"}) as http:
                http.get("/healthz")  # connected before the three are sent together
                ready.wait()
                answer = http.get("/api/v1/runs")
                answers.append((time.monotonic(), answer))

        readers = [threading.Thread(target=read, args=(token,)) for token in tokens]
        for thread in readers:
            thread.start()
        for thread in readers:
            thread.join()
    finally:
        server.stop()
    answers.sort(key=lambda ended: ended[0])
    said = [(round(at - answers[0][0], 3), answer.status_code) for at, answer in answers]
    served = [at for at, answer in answers if answer.status_code == 200]
    # The first call is served; not necessarily the first answer to reach its thread: a
    # refusal made as that call ends (it took over 0.1 s) can overtake it by a few ms (CI
    # saw [(0.0, 429), (0.005, 200), (0.006, 429)]).
    assert served, said
    for _, answer in answers:
        # Refused only with a wait of 10 s or more (a busy machine: a call over 0.1 s, or the
        # one before it waiting out most of the 10 s its turn may take; CI saw [(0.0, 200),
        # (9.796, 429), (9.802, 200)], a refusal after waiting 10 s for the turn).
        assert answer.status_code == 200 or int(answer.headers["Retry-After"]) >= 10, said
    assert all(later - earlier >= 0.05 for earlier, later in itertools.pairwise(served)), said


def served_after_its_turn(http: httpx.Client, method: str, url: str,
                          **kwargs: Any) -> httpx.Response:
    """The answer to a bulk call, waiting out a refusal once: a call before it that took the
    server over 0.1 s owes over 10 s at a hundredth, and is refused at once with that wait as
    Retry-After, after which it is served."""
    answer = http.request(method, url, **kwargs)
    if answer.status_code == 429:
        assert answer.json()["error"]["code"] == "too_many_requests", answer.text
        assert int(answer.headers["Retry-After"]) >= 10, answer.headers
        time.sleep(int(answer.headers["Retry-After"]))
        answer = http.request(method, url, **kwargs)
    return answer


def raw_status(server: Server, request_line: str, token: str) -> tuple[str, dict[str, str]]:
    """The status line and headers the server answers to `request_line` sent as it is (no
    client library sends a lowercase method)."""
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(f"{request_line}\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
                     "Connection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status, *lines = data.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
    return status, {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}


def test_a_runs_list_by_lowercase_get_or_head_is_paced_as_bulk(agent_token: str) -> None:
    """Found by an attacker: `get /api/v1/runs` (which Django serves as GET) and `HEAD
    /api/v1/runs` (served as GET, its body left out) were classified by the method as sent,
    landed on the checks' pool and escaped the bulk pool's caps and pacing: another team's
    check p99 20 to 35x. Both now wait for the team's turn like any bulk call: once an
    upload owes more than 10 s at a hundredth of the process, they are refused with that
    wait, as the GET is."""
    server = start_server(workers=1, env=server_env(WEB_AGENT_BULK_SHARE="0.01"))
    try:
        with httpx.Client(base_url=server.url, timeout=60,
                          headers={"Authorization": f"Bearer {agent_token}"}) as http:
            run_id = http.post("/api/v1/runs", json={"agent": "support-bot"}).json()["run_id"]
            answer = http.post(f"/api/v1/runs/{run_id}/local-decisions", json=upload_body())
            assert answer.status_code == 200, answer.text
            assert http.get("/api/v1/runs").status_code == 429
        for line in ("get /api/v1/runs HTTP/1.1", "HEAD /api/v1/runs HTTP/1.1",
                     "head /api/v1/runs/ HTTP/1.1"):
            status, headers = raw_status(server, line, agent_token)
            assert " 429 " in status, (line, status)
            assert int(headers["retry-after"]) > 10, (line, headers)
    finally:
        server.stop()


def other_teams_calls(server: Server, token: str, seconds: float) -> list[float]:
    """Another team's agent for `seconds`: a run started, three checks of it, again; how
    long each call took. Every answer must be the normal one."""
    took: list[float] = []
    with httpx.Client(base_url=server.url, timeout=30,
                      headers={"Authorization": f"Bearer {token}"}) as http:
        ended = time.monotonic() + seconds
        while time.monotonic() < ended:
            began = time.monotonic()
            run = http.post("/api/v1/runs", json={"agent": "billing-bot"})
            took.append(time.monotonic() - began)
            assert run.status_code == 201, run.text
            for _ in range(3):
                began = time.monotonic()
                answer = http.post(f"/api/v1/runs/{run.json()['run_id']}/check", json={
                    "action": {"name": "search.docs", "args": {"q": str(uuid.uuid4())}}})
                took.append(time.monotonic() - began)
                assert answer.status_code == 200, answer.text
    return sorted(took)


def upload_body() -> dict[str, Any]:
    return {"decisions": [{"check_id": f"local-{uuid.uuid4().hex}",
                           "action": {"name": "search.docs", "args": {"i": i}},
                           "decision": "allow", "reason": "step_ok", "progress": i}
                          for i in range(1000)]}


def test_one_teams_bulk_uploads_do_not_delay_another_teams_checks(
        server: Server, team: Team, other_team: Team, agent_token: str,
        attack_turn: None) -> None:
    theirs = agent_key_create(team=other_team, name="billing-key").token
    statuses: list[int] = []
    refusals: list[httpx.Response] = []
    stop = threading.Event()
    with httpx.Client(base_url=server.url, timeout=30,
                      headers={"Authorization": f"Bearer {agent_token}"}) as http:
        run_id = http.post("/api/v1/runs", json={"agent": "support-bot"}).json()["run_id"]

    def upload() -> None:
        with httpx.Client(base_url=server.url, timeout=60,
                          headers={"Authorization": f"Bearer {agent_token}"},
                          transport=httpx.HTTPTransport(local_address="127.0.0.2")) as http:
            while not stop.is_set():
                answer = http.post(f"/api/v1/runs/{run_id}/local-decisions",
                                   json=upload_body())
                statuses.append(answer.status_code)
                if answer.status_code == 429:
                    refusals.append(answer)

    uploaders = [threading.Thread(target=upload) for _ in range(UPLOADERS)]
    for thread in uploaders:
        thread.start()
    try:
        time.sleep(1.0)  # the uploads are on
        took = other_teams_calls(server, theirs, 4.0)
    finally:
        stop.set()
        for thread in uploaders:
            thread.join()
    assert max(took) < DEADLINE_S, f"another team's call took {max(took):.2f} s"
    # The uploads were served, those past the key's share refused at once, saying why.
    assert 200 in statuses and refusals, statuses
    body = refusals[0].json()["error"]
    assert body["code"] == "too_many_requests" and refusals[0].headers["Retry-After"] == "1"


@pytest.mark.postgres
def test_one_runs_uploads_and_checks_do_not_delay_another_teams_checks(
        server: Server, team: Team, other_team: Team, agent_token: str,
        attack_turn: None) -> None:
    """Found by an attacker: uploads of local decisions held a run's lock for seconds, and
    32 checks of that run, each waiting for it on an API thread, put another team's checks
    3 to 5 s behind. An upload now holds the run 100 entries at a time, and a check waits
    for it at most CHECK_LOCK_WAIT_MS."""
    theirs = agent_key_create(team=other_team, name="billing-key").token
    stop = threading.Event()
    statuses: list[int] = []
    with httpx.Client(base_url=server.url, timeout=30,
                      headers={"Authorization": f"Bearer {agent_token}"}) as http:
        run_id = http.post("/api/v1/runs", json={"agent": "support-bot"}).json()["run_id"]

    def hammer(upload: bool) -> None:
        with httpx.Client(base_url=server.url, timeout=60,
                          headers={"Authorization": f"Bearer {agent_token}"}) as http:
            while not stop.is_set():
                if upload:
                    answer = http.post(f"/api/v1/runs/{run_id}/local-decisions",
                                       json=upload_body())
                else:
                    answer = http.post(f"/api/v1/runs/{run_id}/check", json={
                        "action": {"name": "search.docs", "args": {"q": str(uuid.uuid4())}}})
                statuses.append(answer.status_code)

    threads = [threading.Thread(target=hammer, args=(i < 2,)) for i in range(34)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(1.0)  # the uploads and checks of the one run are on
        took = other_teams_calls(server, theirs, 5.0)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    said = (f"another team's checks: p50 {took[len(took) // 2]:.3f} s, max {took[-1]:.3f} s, "
            f"A's answers {sorted(set(statuses))}")
    assert took[-1] < DEADLINE_S, said
    # Generous: the run's checks waited on the API pool's threads, 0.3 s a check at the median
    # on an idle machine (2 ms since they wait their turn on the event loop).
    assert took[len(took) // 2] < 0.2, said
