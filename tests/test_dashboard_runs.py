"""The overview, the runs list and the run page, and their server-sent event streams."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from asgiref.sync import SyncToAsync
from django.contrib.auth.models import User
from django.db import connections
from django.test import AsyncClient, Client
from django.urls import reverse
from django.utils import timezone

from policies.models import Team
from policies.services import agent_key_create
from runs.check.policy_cache import rules_for_version
from runs.dashboard.stream import Frame, Source, look_lane
from runs.models import Decision, KillSwitch, Run
from tests.conftest import set_policy


@pytest.fixture(autouse=True)
def _fast(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.DASHBOARD_STREAM_SECONDS = 1
    settings.DASHBOARD_STREAM_LOOK_S = 1
    # Version ids are reused after a test's rollback on SQLite; the per-process cache of
    # parsed versions (immutable in real life) must not carry one test's limits into another.
    rules_for_version.cache_clear()


def as_user(users: dict[str, User], name: str = "viewer") -> Client:
    client = Client()
    client.force_login(users[name])
    return client


def start(team: Team, agent: str = "support-bot", **kw: Any) -> Run:
    """Start a run through the agent API (the contract, not the service's internals)."""
    token = agent_key_create(team=team, name=f"k-{agent}").token
    response = Client().post("/api/v1/runs", {"agent": agent, "task": kw.get("task", "refund?")},
                             content_type="application/json",
                             HTTP_AUTHORIZATION=f"Bearer {token}")
    assert response.status_code == 201, response.content
    run = Run.objects.get(pk=response.json()["run_id"])
    run.token = token  # type: ignore[attr-defined]
    return run


def check(team: Team, run: Run, name: str = "search.docs", args: dict[str, Any] | None = None,
          **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"action": {"name": name, "args": args or {}},
                            "cost_usd": float(kw.get("cost", "0.01"))}
    if kw.get("last_result"):
        body["last_result"] = kw["last_result"]
    response = Client().post(f"/api/v1/runs/{run.pk}/check", body,
                             content_type="application/json",
                             HTTP_AUTHORIZATION=f"Bearer {run.token}")  # type: ignore[attr-defined]
    assert response.status_code == 200, response.content
    return response.json()


def run_finish(run: Run, status: str, output: str) -> None:
    response = Client().post(f"/api/v1/runs/{run.pk}/finish",
                             {"status": status, "output": output},
                             content_type="application/json",
                             HTTP_AUTHORIZATION=f"Bearer {run.token}")  # type: ignore[attr-defined]
    assert response.status_code == 200, response.content


def events(text: str) -> list[dict[str, str]]:
    """Parse an event stream into its events (comments and retry lines dropped)."""
    out = []
    for block in text.split("\n\n"):
        event: dict[str, str] = {}
        data = []
        for line in block.splitlines():
            field, _, value = line.partition(": ")
            if field == "data":
                data.append(value)
            elif field in ("event", "id"):
                event[field] = value
        if "event" in event or data:  # an id alone sets the last event id, no event
            event["data"] = "\n".join(data)
            out.append(event)
    return out


def resume_id(text: str) -> str:
    """The last event id a browser keeps after reading this stream (what it sends back as
    Last-Event-ID when it reconnects)."""
    ids = [line[4:] for line in text.splitlines() if line.startswith("id: ")]
    return ids[-1] if ids else ""


def read_all(response: Any) -> str:
    return b"".join(response.streaming_content).decode()


# --- Overview --------------------------------------------------------------------------------

def test_the_overview_shows_running_runs_stops_by_reason_loops_and_switches(team, users):
    running = start(team, "runner")
    looped = start(team, "looper")
    for _ in range(4):
        check(team, looped, "search.docs", {"q": "same"})
    stopped = Run.objects.get(pk=looped.pk)
    assert stopped.stop_reason == "loop_detected"
    KillSwitch.objects.create(scope="agent", team=team, agent="runner", target="agent:x",
                              reason="runaway", engaged_by_label="admin",
                              engaged_at=timezone.now())
    page = as_user(users).get(reverse("runs:overview", kwargs={"slug": team.slug}))
    html = page.content.decode()
    assert page.status_code == 200
    assert reverse("runs:run", kwargs={"slug": team.slug, "run_id": running.pk}) in html
    assert "<svg" in html and "stopped by loop_detected" in html  # the chart's bar title
    assert "search.docs" in html  # top looping tools
    assert "Agent runner" in html and "runaway" in html  # the engaged switch


def test_the_overview_ignores_other_teams_and_released_switches(team, other_team, users):
    start(other_team, "their-bot")
    KillSwitch.objects.create(scope="team", team=other_team, target="team:x", reason="theirs",
                              engaged_by_label="x", engaged_at=timezone.now())
    KillSwitch.objects.create(scope="team", team=team, target="team:y", reason="old",
                              engaged_by_label="x", engaged_at=timezone.now(), active=False)
    html = as_user(users).get(reverse("runs:overview", kwargs={"slug": team.slug})).content.decode()
    assert "their-bot" not in html and "theirs" not in html and "old" not in html
    assert "None engaged" in html


def test_the_overview_stream_sends_its_partials(team, users):
    start(team, "runner")
    response = as_user(users).get(reverse("runs:overview_stream", kwargs={"slug": team.slug}))
    names = {e["event"] for e in events(read_all(response))}
    assert {"overview-running", "overview-chart", "overview-switches", "overview-loops"} <= names


# --- Runs list -------------------------------------------------------------------------------

def test_the_runs_list_filters_by_status_agent_and_stop_reason(team, users):
    a = start(team, "alpha")
    b = start(team, "beta")
    set_policy(team, step_limits={"max_steps": 1})
    c = start(team, "gamma")
    check(team, c)
    check(team, c)  # the second check passes max_steps=1
    client = as_user(users)
    url = reverse("runs:runs", kwargs={"slug": team.slug})
    html = client.get(url).content.decode()
    assert all(str(r.pk)[:8] in html for r in (a, b, c))
    html = client.get(url, {"status": "stopped"}).content.decode()
    assert str(c.pk)[:8] in html and str(a.pk)[:8] not in html
    html = client.get(url, {"agent": "beta"}).content.decode()
    assert str(b.pk)[:8] in html and str(a.pk)[:8] not in html
    html = client.get(url, {"stop_reason": "max_steps"}).content.decode()
    assert str(c.pk)[:8] in html and str(b.pk)[:8] not in html


def test_the_runs_list_is_paginated(team, users):
    runs = [start(team, f"bot-{i:02d}") for i in range(27)]
    client = as_user(users)
    url = reverse("runs:runs", kwargs={"slug": team.slug})
    first = client.get(url).content.decode()
    assert "27 runs" in first
    assert f'id="run-{runs[-1].pk}"' in first and f'id="run-{runs[0].pk}"' not in first
    # Keyset paging: the next page starts after the last row shown.
    after = first.split('href="?after=')[1].split('"')[0].replace("%7E", "~").replace(
        "%3A", ":").replace("%2B", "+")
    second = client.get(url, {"after": after}).content.decode()
    assert f'id="run-{runs[0].pk}"' in second and f'id="run-{runs[-1].pk}"' not in second
    assert second.count('<tr id="run-') == 2 and "Next page" not in second


def test_an_htmx_filter_change_gets_only_the_region(team, users):
    start(team, "alpha")
    response = as_user(users).get(reverse("runs:runs", kwargs={"slug": team.slug}),
                                  {"agent": "alpha"}, HTTP_HX_REQUEST="true",
                                  HTTP_HX_TARGET="runs-region")
    html = response.content.decode()
    assert html.lstrip().startswith('<div id="runs-region"')
    assert "<html" not in html
    assert "runs/stream?agent=alpha" in html  # the stream follows the filters


def test_the_runs_stream_sends_the_table_again_when_a_run_changes(team, users):
    run = start(team, "alpha")
    response = as_user(users).get(reverse("runs:runs_stream", kwargs={"slug": team.slug}))
    chunks: Iterator[bytes] = iter(response.streaming_content)
    assert next(chunks).startswith(b"retry: ")
    first = events(next(chunks).decode())
    assert first[0]["event"] == "runs-table" and "running" in first[0]["data"]
    check(team, run)
    run_finish(run, status="completed", output="done")
    later = events(b"".join(chunks).decode())
    assert any(e["event"] == "runs-table" and "completed" in e["data"] for e in later)


# --- Run page --------------------------------------------------------------------------------

def test_the_run_page_shows_steps_counters_and_the_stop_banner(team, users):
    set_policy(team, step_limits={"max_steps": 3})
    run = start(team)
    check(team, run, "search.docs", {"query": "refund", "password": "hunter2"}, cost="0.25")
    check(team, run, "crm.lookup", {"id": 7},
          last_result={"status": "ok", "summary": "found 3 documents"})
    check(team, run, "crm.lookup", {"id": 8})
    check(team, run, "crm.lookup", {"id": 9})  # step 4 > max_steps 3
    run_finish(run, status="stopped", output="Here is what I found so far")
    html = as_user(users).get(reverse("runs:run", kwargs={"slug": team.slug, "run_id": run.pk})
                              ).content.decode()
    assert "hunter2" not in html and "[redacted]" in html  # args as stored: redacted
    assert "found 3 documents" in html  # the reported result
    assert "Stopped: max_steps" in html
    assert "max_steps=3" in html or "max_steps" in html  # decision.answer["message"]
    message = Decision.objects.filter(run=run, outcome="stop").first().answer["message"]
    assert message in html
    assert "Here is what I found so far" in html  # the partial response
    assert "4 / 3" in html  # steps counter against the limit
    assert "$0.28 / $1.00" in html
    # A finished run has nothing left to stream: only the layout's live banner remains.
    assert f"runs/{run.pk}/stream" not in html and "/live?next=" in html


def test_long_args_are_truncated_with_the_full_value_expandable(team, users):
    run = start(team)
    check(team, run, "search.docs", {"query": "x" * 300})
    html = as_user(users).get(reverse("runs:run", kwargs={"slug": team.slug, "run_id": run.pk})
                              ).content.decode()
    assert "<details>" in html and "…" in html and "x" * 300 in html


def test_the_run_stream_sends_new_steps_live_with_their_decision_id(team, users):
    run = start(team)
    first = check(team, run)
    response = as_user(users).get(
        reverse("runs:run_stream", kwargs={"slug": team.slug, "run_id": run.pk}),
        {"after": first["decision_id"]})
    assert response["Content-Type"] == "text/event-stream"
    chunks = iter(response.streaming_content)
    assert next(chunks).startswith(b"retry: ")
    initial = events(next(chunks).decode())
    assert "step" not in {e["event"] for e in initial}  # the page already shows step 1
    assert {"run-header", "run-counters", "run-banner"} <= {e["event"] for e in initial}
    second = check(team, run, "crm.lookup", {"id": 1})
    frames = events(next(chunks).decode())  # woken up by the check, before the next poll
    steps = [e for e in frames if e["event"] == "step"]
    assert [int(e["id"]) for e in steps] == [second["decision_id"]]
    assert "crm.lookup" in steps[0]["data"]
    assert any(e["event"] == "run-counters" and "2 / 18" in e["data"] for e in frames)


def test_a_reconnect_resumes_after_last_event_id(team, users):
    run = start(team)
    ids = [check(team, run, "step.tool", {"n": i})["decision_id"] for i in range(4)]
    client = as_user(users)
    url = reverse("runs:run_stream", kwargs={"slug": team.slug, "run_id": run.pk})
    everything = [e for e in events(read_all(client.get(url))) if e["event"] == "step"]
    assert [int(e["id"]) for e in everything] == ids
    # The browser sends Last-Event-ID when it reconnects; it wins over the page's `after`.
    resumed = events(read_all(client.get(url, {"after": 0}, HTTP_LAST_EVENT_ID=str(ids[1]))))
    assert [int(e["id"]) for e in resumed if e["event"] == "step"] == ids[2:]


def test_a_stream_resumed_further_back_than_a_page_sends_the_newest_page_after_a_gap_row(
        team, users, monkeypatch):
    """SPEC 10: the cost of a look is bounded, whatever id the stream is asked to resume
    from (found by an attacker: Last-Event-ID 0 on a run of 2,100 large steps rendered them
    all at each reconnect, another team's check p99 13 to 15x)."""
    from runs.dashboard import selectors as dashboard_selectors

    monkeypatch.setattr(dashboard_selectors, "TIMELINE_PAGE", 3)
    run = start(team)
    ids = [check(team, run, "step.tool", {"n": i})["decision_id"] for i in range(7)]
    client = as_user(users)
    url = reverse("runs:run_stream", kwargs={"slug": team.slug, "run_id": run.pk})
    for resumed in (client.get(url, HTTP_LAST_EVENT_ID="0"), client.get(url, {"after": ids[1]})):
        sent = [e for e in events(read_all(resumed)) if e["event"] == "step"]
        assert "not shown here" in sent[0]["data"] and int(sent[0]["id"]) == ids[3]
        assert [int(e["id"]) for e in sent[1:]] == ids[4:]
    # Within a page of the newest step: every step after it, no gap row.
    sent = [e for e in events(read_all(client.get(url, HTTP_LAST_EVENT_ID=str(ids[3]))))
            if e["event"] == "step"]
    assert [int(e["id"]) for e in sent] == ids[4:]


def test_a_reconnect_that_says_what_its_page_shows_resumes_with_a_step_look(team, users):
    run = start(team)
    first = check(team, run)["decision_id"]
    client = as_user(users)
    url = reverse("runs:run_stream", kwargs={"slug": team.slug, "run_id": run.pk})
    whole = {"run-header", "run-controls", "run-banner", "chrome"}
    text = read_all(client.get(url))
    assert whole <= {e["event"] for e in events(text)}  # a page's first stream: a full look
    kept = resume_id(text)
    assert kept.startswith(f"{first}~")
    second = check(team, run, "crm.lookup")["decision_id"]
    # The browser sends the id back (live.js also puts it in `after`, for a new EventSource).
    for resumed in (client.get(url, HTTP_LAST_EVENT_ID=kept), client.get(url, {"after": kept})):
        text = read_all(resumed)
        sent = events(text)
        assert [int(e["id"]) for e in sent if e["event"] == "step"] == [second]
        assert "run-counters" in {e["event"] for e in sent}
        assert not whole & {e["event"] for e in sent}  # the page has them: a step look
        assert resume_id(text) == f"{second}~{kept.partition('~')[2]}"
    # A state the page cannot be showing (made up, or of another time): a full look.
    text = read_all(client.get(url, HTTP_LAST_EVENT_ID=f"{second}~0123456789abcdef"))
    assert whole <= {e["event"] for e in events(text)}
    assert not [e for e in events(text) if e["event"] == "step"]


def test_the_stop_banner_arrives_over_the_stream_and_a_finished_run_ends_it(team, users,
                                                                             settings):
    settings.DASHBOARD_STREAM_SECONDS = 10
    set_policy(team, step_limits={"max_repeat_action": 1})
    run = start(team)
    check(team, run, "same", {"a": 1})
    response = as_user(users).get(
        reverse("runs:run_stream", kwargs={"slug": team.slug, "run_id": run.pk}))
    chunks = iter(response.streaming_content)
    next(chunks), next(chunks)
    check(team, run, "same", {"a": 1})  # a loop: stopped
    frames = events(next(chunks).decode())
    banner = next(e for e in frames if e["event"] == "run-banner")
    assert "loop_detected" in banner["data"]
    run_finish(run, status="stopped", output="partial answer")
    rest = events(b"".join(chunks).decode())
    assert any("partial answer" in e["data"] for e in rest if e["event"] == "run-banner")
    assert rest[-1]["event"] == "end"  # sse-close: the browser stops reconnecting


def test_a_stream_ends_after_its_lifetime_and_tells_the_browser_when_to_retry(team, users,
                                                                              settings):
    settings.DASHBOARD_STREAM_SECONDS = 2
    run = start(team)
    began = time.monotonic()
    text = read_all(as_user(users).get(
        reverse("runs:run_stream", kwargs={"slug": team.slug, "run_id": run.pk})))
    assert 1.5 <= time.monotonic() - began < 5
    assert text.startswith("retry: 1000\n\n")


def test_the_stream_of_another_teams_run_is_404(team, other_team, users):
    theirs = start(other_team)
    response = as_user(users, "admin").get(
        reverse("runs:run_stream", kwargs={"slug": team.slug, "run_id": theirs.pk}))
    assert response.status_code == 404


class _CloseLaneConnection(Source):
    """A 'look' that closes the look lane thread's database connection (its one thread keeps
    it for every stream of the process)."""

    team_id = 0

    def frames(self) -> list[Frame]:
        connections.close_all()
        return []


def check_then_close(*args: Any) -> dict[str, Any]:
    """`check` from a thread that is not Django's: its connection is closed before it ends."""
    try:
        return check(*args)
    finally:
        connections.close_all()


@pytest.mark.django_db(transaction=True)
def test_under_asgi_the_stream_is_async_and_not_buffered(team, users, settings):
    """Django buffers a sync iterator under ASGI: the ASGI path must hand out an async one
    and still deliver a step while the stream is open."""
    # A lifetime far past the wait below: a buffered stream would show the step only at its
    # end. (8 s with a 3 s bound was too near: a CI run took 3.9 s on a busy machine.)
    settings.DASHBOARD_STREAM_SECONDS = 30
    run = start(team)
    client = AsyncClient()
    client.force_login(users["viewer"])
    url = reverse("runs:run_stream", kwargs={"slug": team.slug, "run_id": run.pk})

    async def scenario() -> tuple[float, str]:
        response = await client.get(url)
        assert response.status_code == 200
        assert response.is_async
        stream = response.streaming_content.__aiter__()
        assert (await stream.__anext__()).startswith(b"retry: ")
        await stream.__anext__()  # the initial partials
        began = time.monotonic()
        decided = await asyncio.to_thread(check_then_close, team, run, "async.tool", {})
        seen = ""
        while '"step"' not in seen and f"id: {decided['decision_id']}" not in seen:
            seen += (await asyncio.wait_for(stream.__anext__(), timeout=10)).decode()
        await stream.aclose()
        return time.monotonic() - began, seen

    try:
        took, seen = asyncio.run(scenario())
    finally:
        # The view's sync parts ran in asgiref's one shared thread, whose database connection
        # the test client never closes: left open, it keeps PostgreSQL from dropping the test
        # database at the end of the session.
        SyncToAsync.single_thread_executor.submit(connections.close_all).result()
        # So do the stream's looks, on this process's look lane.
        asyncio.run(look_lane.look(_CloseLaneConnection(), viewer="test"))
    assert "async.tool" in seen
    assert took < 12  # arrived while the stream was open, long before its end


def test_elapsed_time_counts_against_max_seconds(team, users):
    run = start(team)
    Run.objects.filter(pk=run.pk).update(started_at=timezone.now() - timedelta(seconds=40))
    html = as_user(users).get(reverse("runs:run", kwargs={"slug": team.slug, "run_id": run.pk})
                              ).content.decode()
    # 40 s, or a few more on a loaded machine (the page counts to when it is made).
    assert re.search(r"\b4[0-4] s / 45 s", html) and "level-warn" in html


def test_a_finished_runs_banner_says_it_ended_without_a_response(team, users):
    """Found by a newcomer: a run the agent completed without an output read "The agent has
    not reported its response yet", as if more were coming. A stopped run's agent may still
    send its partial response (SPEC 5.1), so there the words stay."""
    done, stopped = start(team), start(team)
    run_finish(done, "completed", "")
    run_finish(stopped, "stopped", "")
    page = as_user(users).get(reverse("runs:run", kwargs={"slug": team.slug,
                                                          "run_id": done.pk}))
    assert "The agent finished the run without a response." in page.content.decode()
    page = as_user(users).get(reverse("runs:run", kwargs={"slug": team.slug,
                                                          "run_id": stopped.pk}))
    assert "finished the run without a response" not in page.content.decode()


def test_a_check_after_the_agents_finish_leaves_the_banner_saying_the_agent_stopped_it(
        team, users):
    """Found by a newcomer: a client's timed-out check reaching the server after the agent
    finished the run as stopped replaced the banner's words with that late refusal's: "The
    rule agent_stopped of policy default v5 stopped this run: status stopped, stop_reason
    agent_stopped reached status running." The banner says what ended the run (the agent's
    finish), and the late check's row that the run was already over."""
    run = start(team, "finish-bot")
    check(team, run)
    run_finish(run, "stopped", "partial")
    late = check(team, run)
    assert (late["decision"], late["reason"]) == ("stop", "agent_stopped")
    html = as_user(users).get(reverse("runs:run", kwargs={"slug": team.slug,
                                                          "run_id": run.pk})).content.decode()
    assert "Stopped: agent_stopped" in html
    assert "Its agent ended this run: it finished it as stopped." in html
    assert "reached status running" not in html and "data-rule" not in html
    # The late refusal's own words are its row's, not the banner's.
    assert "The agent was told" not in html
    assert "agent_stopped: the run was already stopped by its agent" in html


def test_a_check_after_a_completed_run_says_the_run_was_already_completed(team, users):
    run = start(team, "finish-bot")
    check(team, run)
    run_finish(run, "completed", "done")
    assert check(team, run)["reason"] == "run_finished"
    html = as_user(users).get(reverse("runs:run", kwargs={"slug": team.slug,
                                                          "run_id": run.pk})).content.decode()
    assert "run_finished: the run was already completed" in html
    assert "None reached" not in html
    assert "reached status running" not in html


def test_a_check_after_a_limit_stop_leaves_the_banner_on_that_stop(team, users):
    set_policy(team, step_limits={"max_steps": 1})
    run = start(team)
    check(team, run)
    check(team, run)  # step 2 > max_steps 1
    run_finish(run, "stopped", "partial")
    check(team, run)  # late: answered the stop again
    html = as_user(users).get(reverse("runs:run", kwargs={"slug": team.slug,
                                                          "run_id": run.pk})).content.decode()
    assert ("The rule max_steps of policy default v2 stopped this run: steps 2 past "
            "max_steps 1.") in html
