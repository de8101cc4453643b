"""A page of the runs list (`GET /api/v1/runs`, the operator API's `.../runs`) is bounded in
bytes, whatever the runs recorded (SPEC 10): past RUNS_PAGE_BYTES it stops and names the next
page's `after` (`next_after`), and paging on gives every run exactly once, newest first. Found
by an attacker: 500 runs of a 10,000-emoji task and a 100,000-emoji output made one read of
`?limit=500` 660 MB of JSON, 7 s, and the worker's memory 1.2 GB."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone
from ninja.responses import NinjaJSONEncoder

from policies.models import Team
from policies.services import agent_key_create
from policies.tokens import operator_token_create
from runs.audit import selectors
from runs.check.schemas import RunsOut
from runs.models import Run
from tests.conftest import set_policy

EMOJI = "\U0001f600"
TASK = EMOJI * 10_000  # the longest task a start takes (SPEC 5.1's `task`, runs/check/schemas.py)
OUTPUT = EMOJI * 100_000  # the longest output a finish takes
BOUND = 4 * 2**20  # RUNS_PAGE_BYTES, as the docs say it


def big_runs(team: Team, count: int, *, agent: str = "big-out", same_start: bool = False
             ) -> list[str]:
    """``count`` finished runs with the longest texts, newest first; ``same_start``: all
    started at the same moment (the run id orders them)."""
    version = team.policies.get(name="default").current
    now = timezone.now()
    runs = Run.objects.bulk_create([
        Run(team=team, agent=agent, policy_version=version, status="completed",
            started_at=now - timedelta(seconds=0 if same_start else i), ended_at=now,
            task=TASK, output=OUTPUT) for i in range(count)])
    return [str(r.pk) for r in sorted(runs, key=lambda r: (r.started_at, str(r.pk)),
                                      reverse=True)]


def every_page(get: Any, path: str) -> tuple[list[str], list[int]]:
    """The run ids of every page of ``path``, paging on with `after`, and each page's size."""
    ids: list[str] = []
    sizes: list[int] = []
    after = ""
    while True:
        answer = get(path + (f"{'&' if '?' in path else '?'}after={after}" if after else ""))
        assert answer.status_code == 200, answer.content[:300]
        assert answer["Content-Type"] == "application/json; charset=utf-8"  # as before
        body = json.loads(answer.content)
        ids += [run["run_id"] for run in body["runs"]]
        sizes.append(len(answer.content))
        assert body["runs"], "a page never comes empty while more follow"
        after = body.get("next_after")  # (none before pages were bounded)
        if after is None:
            return ids, sizes
        assert after == body["runs"][-1]["run_id"]
        assert len(sizes) < 100


def test_a_page_of_big_runs_stays_under_the_bound_and_paging_on_gets_each_once(
        api: Any, team: Team) -> None:
    made = big_runs(team, 24)
    ids, sizes = every_page(api.get, "/api/v1/runs?agent=big-out&limit=500")
    assert ids == made
    assert max(sizes) <= BOUND
    # About 440 KB a run as UTF-8 (1.32 MB with \u escapes): 9 to a 4 MiB page.
    assert len(sizes) == 3


def test_the_operator_api_pages_the_same_way(client: Any, team: Team, users: Any) -> None:
    made = big_runs(team, 12)
    token = operator_token_create(user=users["viewer"], name="lister", role="viewer",
                                  team=team).secret
    ids, sizes = every_page(
        lambda path: client.get(path, HTTP_AUTHORIZATION=f"Bearer {token}"),
        f"/api/v1/teams/{team.slug}/runs?limit=500")
    assert ids == made
    assert max(sizes) <= BOUND


def test_paging_by_limit_gets_each_run_once_even_when_they_started_together(
        api: Any, team: Team) -> None:
    made = big_runs(team, 7, same_start=True)
    ids, sizes = every_page(api.get, "/api/v1/runs?limit=2")
    assert ids == made
    assert len(sizes) == 4
    # The last page of exactly `limit` runs says nothing follows.
    ids, sizes = every_page(api.get, "/api/v1/runs?limit=7")
    assert ids == made and len(sizes) == 1


def test_a_run_bigger_than_the_bound_is_sent_alone(
        api: Any, team: Team, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(selectors, "RUNS_PAGE_BYTES", 100_000)
    made = big_runs(team, 3)
    ids, sizes = every_page(api.get, "/api/v1/runs")
    assert ids == made and len(sizes) == 3


def test_a_listed_run_is_what_the_answers_schema_made_of_it(api: Any, team: Team) -> None:
    """The same values as before the pages (each run through `RunOut`, ninja's encoder):
    times in milliseconds with "Z", a policy's numbers as its fields' types, the one-run
    fields null; text beyond ASCII as UTF-8, not escapes."""
    set_policy(team, mode="shadow", budgets={"max_seconds": 30, "max_usd": 2})
    parent = api.post("/api/v1/runs", {"agent": "bot", "task": "café \"q\" \\ \n\t\x01 ☕"},
                      content_type="application/json").json()["run_id"]
    api.post("/api/v1/runs", {"agent": "bot", "parent_run_id": parent, "task": EMOJI * 3},
             content_type="application/json")
    api.post(f"/api/v1/runs/{parent}/check", {"action": {"name": "search.docs"}},
             content_type="application/json")
    finished = api.post("/api/v1/runs", {"agent": "bot"}, content_type="application/json")
    api.post(f"/api/v1/runs/{finished.json()['run_id']}/finish",
             {"status": "stopped", "output": "partial ✓"}, content_type="application/json")
    answer = api.get("/api/v1/runs")
    now = timezone.now()
    runs = list(Run.objects.filter(team=team).select_related("policy_version")
                .order_by("-started_at", "-pk"))
    before = RunsOut.model_validate(
        {"runs": [selectors.run_json(run, now) for run in runs]}).model_dump()
    expected = json.loads(json.dumps(before, cls=NinjaJSONEncoder))
    listed = json.loads(answer.content)
    assert listed["next_after"] is None
    for run in [*listed["runs"], *expected["runs"]]:
        run.pop("elapsed_s")  # read at another moment
    assert listed["runs"] == expected["runs"]
    assert "☕".encode() in answer.content and b"\\u" not in answer.content.replace(
        b"\\u0001", b"")


def test_after_names_a_run_the_caller_sees(api: Any, team: Team, other_team: Team) -> None:
    """Another team's run, like one that does not exist, is 404 naming `after` (as a
    `parent_run_id`, SPEC 20); so is another agent's for an agent-bound key (SPEC 10)."""
    theirs = big_runs(other_team, 1)[0]
    for after, status in ((theirs, 404), ("not-a-uuid", 422)):
        answer = api.get(f"/api/v1/runs?after={after}")
        assert answer.status_code == status
        assert set(answer.json()["error"]["fields"]) == {"after"}
    mine = big_runs(team, 1, agent="bot2")[0]
    bound = agent_key_create(team=team, name="bot1-key", agent="bot1").token
    answer = api.get(f"/api/v1/runs?after={mine}", HTTP_AUTHORIZATION=f"Bearer {bound}")
    assert answer.status_code == 404
    assert api.get(f"/api/v1/runs?after={mine}").json() == {"runs": [], "next_after": None}
