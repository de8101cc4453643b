"""Live run pages at scale (docs/performance.md "Live pages at scale"): a check wakes only the
streams of its run, a process skips its own Redis messages, and the run pages' step looks are
served together on the look lane, in a constant number of queries."""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client, RequestFactory
from django.test.signals import template_rendered
from django.utils import timezone

from policies.models import Role, Team
from runs.dashboard.stream import RunSource, _look, _step_looks, encode
from runs.killswitch.services import killswitch_engage
from runs.live import events, looks
from runs.live.events import CHANNEL_PREFIX, LocalBroker
from runs.models import Run
from tests.test_dashboard_runs import check, run_finish, start
from tests.test_dashboard_runs import events as parse_events
from tests.test_events import unused_team_id


def test_a_run_watch_wakes_for_its_run_and_team_wide_changes_only() -> None:
    broker = LocalBroker()
    team_id = unused_team_id()

    async def watched() -> list[Any]:
        watch = broker.watch_run(team_id, "mine")
        seen = []
        broker.publish(team_id, frozenset({"other"}))  # another run's check
        seen.append(await watch.next(0.05))
        broker.publish(team_id, frozenset({"other", "mine"}))
        seen.append(await watch.next(5))
        broker.publish(team_id)  # a kill switch: anything may have changed
        seen.append(await watch.next(5))
        # Woken from another thread (a check answered by a thread of the API pool).
        threading.Timer(0.1, broker.publish, args=[team_id, frozenset({"mine"})]).start()
        seen.append(await watch.next(5))
        watch.close()
        return seen

    assert asyncio.run(watched()) == [frozenset(), frozenset({"mine"}), None,
                                      frozenset({"mine"})]
    assert team_id not in broker._watches  # closed: nothing kept for the team


def test_many_changes_of_other_runs_never_turn_into_anything_changed() -> None:
    # The team's log remembers 256 changes; a run's watch does not depend on it.
    broker = LocalBroker()
    team_id = unused_team_id()

    async def watched() -> Any:
        watch = broker.watch_run(team_id, "mine")
        for i in range(LocalBroker.LOG_SIZE * 2):
            broker.publish(team_id, frozenset({f"run-{i}"}))
        broker.publish(team_id, frozenset({"mine"}))
        changes = await watch.next(5)
        watch.close()
        return changes

    assert asyncio.run(watched()) == frozenset({"mine"})


@pytest.mark.redis
def test_the_listener_skips_this_process_messages_and_relays_the_others() -> None:
    team_id = unused_team_id()
    events.redis_listener.ensure_running()
    client = events.redis_client()
    deadline = time.monotonic() + 5  # the listener's subscription is confirmed
    while time.monotonic() < deadline and client.execute_command("PUBSUB", "NUMPAT") == 0:
        time.sleep(0.05)
    # A check answered here: its streams hear of it at once, and once only.
    events.publish_run_event(SimpleNamespace(pk="run-here", team_id=team_id))
    assert events.redis_publisher.flush(timeout=5)
    # Another process's message, sent after ours: once it has arrived, ours has too.
    client.publish(f"{CHANNEL_PREFIX}{team_id}", b"from:another runs:run-there")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and events.local_broker.seq(team_id) < 2:
        time.sleep(0.02)
    time.sleep(0.2)
    assert events.local_broker.seq(team_id) == 2
    assert events.local_broker.changes_since(team_id, 1) == (2, frozenset({"run-there"}))


@pytest.mark.django_db(transaction=True)  # on PostgreSQL a look sets its read deadline
def test_looks_to_be_served_together_are_one_call_taking_the_viewers_in_turn() -> None:
    lane = looks.LookLane()
    calls: list[list[str]] = []

    def together(names: list[str]) -> list[str]:
        calls.append(list(names))
        return [name.upper() for name in names]

    async def crowd() -> list[Any]:
        # A plain look holds the lane while the others queue behind it.
        first = asyncio.ensure_future(lane.run(lambda: time.sleep(0.3) or "slow", "x"))
        await asyncio.sleep(0.1)
        mine = [asyncio.ensure_future(lane.run(f"a{i}", "a", together=together))
                for i in range(4)]
        theirs = [asyncio.ensure_future(lane.run(f"b{i}", "b", together=together))
                  for i in range(2)]
        return await asyncio.gather(first, *mine, *theirs)

    try:
        answers = asyncio.run(crowd())
    finally:
        lane.stop(timeout=5)
    assert answers == ["slow", "A0", "A1", "A2", "A3", "B0", "B1"]
    assert calls == [["a0", "b0", "a1", "b1", "a2", "a3"]]  # one turn, viewers in turn


def page(team: Team, run_id: Any, after: int, *, seen: str = "", role: Role = Role.VIEWER
         ) -> RunSource:
    request = RequestFactory().get("/")
    request.user = User.objects.get(username=role.value)
    request.team, request.role, request.session = team, role, {}  # type: ignore[attr-defined]
    return RunSource(request, team, run_id, after, seen=seen)


def test_run_pages_step_looks_are_served_in_a_constant_number_of_queries(
        team, users, django_assert_max_num_queries):
    runs = [start(team) for _ in range(5)]
    firsts = [check(team, run)["decision_id"] for run in runs]
    pages = [page(team, run.pk, after) for run, after in zip(runs, firsts, strict=True)]
    for p in pages:
        first = parse_events("".join(encode(f) for f in p.frames()))  # the full first look
        assert {"run-header", "run-controls", "chrome"} <= {e["event"] for e in first}
    seconds = [check(team, run, "crm.lookup", {"id": i})["decision_id"]
               for i, run in enumerate(runs)]
    # The runs, their new rows, the approvals count, the team's engaged switches, which runs
    # have a child; and the read deadline set and reset.
    with django_assert_max_num_queries(7):
        texts = _step_looks(pages)
    for text, second in zip(texts, seconds, strict=True):
        sent = parse_events(text)
        assert [int(e["id"]) for e in sent if e["event"] == "step"] == [second]
        assert any(e["event"] == "run-counters" and "2 / 18" in e["data"] for e in sent)
        assert "chrome" not in {e["event"] for e in sent}  # the team-wide parts: full looks


def test_a_look_without_a_check_renders_nothing_the_time_counter_ticks_in_the_browser(
        team, users):
    """Most of a page's looks are the periodic ones (every DASHBOARD_STREAM_LOOK_S) of a run
    that had no check since: they render no template, and the counters they would have sent
    again only because a second passed say where the browser ticks the time from."""
    run = start(team)
    p = page(team, run.pk, check(team, run)["decision_id"])
    first = parse_events("".join(encode(f) for f in p.frames()))
    [counters] = [e["data"] for e in first if e["event"] == "run-counters"]
    assert 'data-counter="time" data-ticks-from="' in counters
    _step_looks([p])  # the navigation's approvals count, once
    rendered: list[str] = []

    def seen(sender: Any, template: Any, **kw: Any) -> None:
        rendered.append(template.name)

    template_rendered.connect(seen)
    try:
        assert _step_looks([p]) == [""]
        assert rendered == []
        second = check(team, run, "crm.lookup")["decision_id"]
        [text] = _step_looks([p])
    finally:
        template_rendered.disconnect(seen)
    sent = parse_events(text)
    assert [int(e["id"]) for e in sent if e["event"] == "step"] == [second]
    assert any(e["event"] == "run-counters" and "2 / 18" in e["data"] for e in sent)
    assert "runs/_approvals_count.html" not in rendered  # the count did not change
    run_finish(run, status="completed", output="done")
    [text] = _step_looks([p])
    [counters] = [e["data"] for e in parse_events(text) if e["event"] == "run-counters"]
    assert "data-ticks-from" not in counters  # an ended run's time stands still


def test_a_step_look_of_a_run_that_ended_is_a_full_one(team, users):
    run = start(team)
    p = page(team, run.pk, check(team, run)["decision_id"])
    p.frames()
    run_finish(run, status="completed", output="the answer")
    [text] = _step_looks([p])
    sent = parse_events(text)
    banner = [e for e in sent if e["event"] == "run-banner"]
    assert banner and "the answer" in banner[0]["data"]
    assert p.finished()


@pytest.mark.django_db(transaction=True)  # killswitch_engage commits on its own
def test_a_step_look_takes_a_full_look_when_the_banner_is_not_the_team_s(team, users):
    """A kill switch whose wake-up was lost (the page never heard it: `concerned` is not
    called here) is on the page at its next step look, not at the backstop's."""
    start(team, agent="other-bot")
    watched = start(team)
    p = page(team, watched.pk, check(team, watched)["decision_id"])
    p.frames()
    killswitch_engage(scope="agent", team=team, agent="other-bot", reason="looping")
    [text] = _step_looks([p])
    chrome = [e for e in parse_events(text) if e["event"] == "chrome"]
    assert chrome and "other-bot" in chrome[0]["data"]
    # Told once: the next step look is a step look again.
    assert "chrome" not in {e["event"] for e in parse_events(_step_looks([p])[0])}


def test_a_run_s_first_child_shows_in_its_tree_at_the_next_step_look(team, users):
    parent = start(team)
    p = page(team, parent.pk, check(team, parent)["decision_id"])
    p.frames()
    assert "run-tree" not in {e["event"] for e in parse_events(_step_looks([p])[0])}
    response = Client().post("/api/v1/runs", {"agent": "helper", "parent_run_id": str(parent.pk)},
                             content_type="application/json",
                             HTTP_AUTHORIZATION=f"Bearer {parent.token}")  # type: ignore[attr-defined]
    assert response.status_code == 201, response.content
    [text] = _step_looks([p])
    tree = [e for e in parse_events(text) if e["event"] == "run-tree"]
    assert tree and "helper" in tree[0]["data"]


def test_a_step_look_of_a_run_past_its_deadline_ends_it_on_the_page(team, users):
    run = start(team)
    p = page(team, run.pk, check(team, run)["decision_id"])
    p.frames()
    Run.objects.filter(pk=run.pk).update(idle_deadline=timezone.now() - timedelta(seconds=1))
    [text] = _step_looks([p])
    banner = [e for e in parse_events(text) if e["event"] == "run-banner"]
    stopped = Run.objects.get(pk=run.pk)
    assert stopped.status == "stopped" and banner and stopped.stop_reason in banner[0]["data"]


WHOLE = {"run-header", "run-controls", "run-banner", "chrome"}


@pytest.mark.django_db(transaction=True)  # killswitch_engage commits on its own
def test_a_resumed_stream_takes_a_step_look_only_while_its_page_state_holds(team, users):
    run = start(team)
    after = check(team, run)["decision_id"]
    first = page(team, run.pk, after)
    assert {e["event"] for e in parse_events(_look(first))} >= WHOLE
    seen = first.resume_id().partition("~")[2]

    def resumed_look(**kw: Any) -> set[str]:
        [text] = _step_looks([page(team, run.pk, after, seen=seen, **kw)])
        return {e["event"] for e in parse_events(text)}

    assert resumed_look() == {"run-counters", "approvals-count"}
    assert resumed_look(role=Role.ADMIN) >= WHOLE  # another role's controls
    killswitch_engage(scope="agent", team=team, agent="other-bot", reason="looping")
    assert resumed_look() >= WHOLE  # the banner the page shows is not the team's any more


@pytest.mark.django_db(transaction=True)
def test_a_look_to_be_served_together_goes_before_the_other_looks_queued() -> None:
    lane = looks.LookLane()
    served: list[str] = []

    def alone(name: str) -> Any:
        def look() -> str:
            served.append(name)
            time.sleep(0.05 if name == "hold" else 0)
            return name
        return look

    def together(names: list[str]) -> list[str]:
        served.extend(names)
        return names

    async def crowd() -> None:
        held = asyncio.ensure_future(lane.run(alone("hold"), "x"))
        await asyncio.sleep(0.02)  # the lane is busy: the rest queue in this order
        fulls = [asyncio.ensure_future(lane.run(alone(f"full-{i}"), "x")) for i in range(4)]
        step = asyncio.ensure_future(lane.run("step", "x", together=together))
        await asyncio.gather(held, *fulls, step)

    try:
        asyncio.run(crowd())
    finally:
        lane.stop(timeout=5)
    assert served.index("step") <= 2  # not behind the four full looks queued before it
