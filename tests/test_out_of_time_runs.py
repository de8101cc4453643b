"""Issue 26: a running run whose time budget (max_seconds of active time, SPEC 15) ran out
with no check to stop it can only be stopped. The idle sweep ends it `stopped` /
`max_seconds` as of the moment its time ran out, audited like an abandonment (SPEC 14), and
no running filter or "Running now" lists it. A rate-limit wait longer than the time left is
a stop at once. Budgets are moved into the past in the database rather than waited for."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest
from django.utils import timezone

from policies.models import Team
from runs import first_look
from runs.check.abandon import abandon_idle_runs, sweep_idle_runs
from runs.check.tasks import idle_sweep_task
from runs.models import Decision, Run
from tests.conftest import set_policy
from tests.test_abandoned_runs import check, start
from tests.test_bounded_looks import at, ms

# Plain django_db tests of these run on both check stores (tests/conftest.py).
pytestmark = pytest.mark.both_stores


def out_of_time(rid: str, *, over: float = 8, budget: float = 45) -> datetime:
    """Make the run one started ``budget + over`` s ago, with the deadline its start wrote
    (its budget's, which comes before its idle one): ``over`` s past it. Returns it."""
    started = timezone.now() - timedelta(seconds=budget + over)
    deadline = started + timedelta(seconds=budget)
    Run.objects.filter(pk=rid).update(started_at=started, idle_deadline=deadline)
    return deadline


def assert_out_of_time(rid: str, deadline: datetime, steps: int) -> None:
    run = Run.objects.get(pk=rid)
    assert (run.status, run.stop_reason, run.ended_at, run.steps) == (
        "stopped", "max_seconds", deadline, steps)
    records = list(Decision.objects.filter(run_id=rid, outcome="stop"))
    assert len(records) == 1
    record = records[0]
    assert (record.reason, record.action_name, record.step) == ("max_seconds", "", steps)
    answer = record.answer
    assert (answer["decision"], answer["reason"]) == ("stop", "max_seconds")
    assert "max_seconds=45" in answer["message"]
    assert answer["next_action"].startswith("Return the partial response; the run's time")
    # Its active time is its budget: "45 s / 45 s", not "53 s / 45 s".
    assert answer["usage"]["elapsed_s"] == pytest.approx(45, abs=0.01)


@pytest.mark.django_db
def test_the_stored_deadline_is_the_budgets_when_it_comes_before_the_idle_one(
        api: Any, team: Team) -> None:
    rid = start(api)
    run = Run.objects.get(pk=rid)
    assert run.idle_deadline == run.started_at + timedelta(seconds=45)
    check(api, rid)
    assert Run.objects.get(pk=rid).idle_deadline == run.started_at + timedelta(seconds=45)
    set_policy(team, budgets={"max_seconds": 7200, "max_idle_seconds": 60})
    later = start(api)
    run = Run.objects.get(pk=later)
    assert run.idle_deadline == run.started_at + timedelta(seconds=60)


@pytest.mark.django_db
def test_the_sweep_ends_a_run_out_of_time_stopped_max_seconds(api: Any, team: Team) -> None:
    rid, busy = start(api), start(api)
    check(api, rid)
    deadline = out_of_time(rid)
    assert idle_sweep_task()["abandoned"] == 1
    assert_out_of_time(rid, deadline, steps=1)
    assert Run.objects.get(pk=busy).status == "running"
    assert sweep_idle_runs() == []  # idempotent
    # Its next check answers its stop, counting nothing.
    late = check(api, rid)
    assert (late["decision"], late["reason"], late["step"]) == ("stop", "max_seconds", 1)


@pytest.mark.django_db
def test_a_run_out_of_time_never_reads_as_running(api: Any, team: Team) -> None:
    rid = start(api)
    deadline = out_of_time(rid)
    body = api.get(f"/api/v1/runs/{rid}").json()
    assert (body["status"], body["stop_reason"]) == ("stopped", "max_seconds")
    assert at(body["ended_at"]) == ms(deadline)
    assert_out_of_time(rid, deadline, steps=0)


@pytest.mark.django_db
def test_running_filters_and_the_overview_leave_out_runs_out_of_time_in_sql(
        api: Any, client: Any, team: Team, users: dict[str, Any], monkeypatch: Any) -> None:
    """Even when the look ends none of them (its share spent), a running filter lists no run
    out of time and every list shows it as it will be."""
    monkeypatch.setattr(first_look, "abandon_idle_runs", lambda **_: [])
    runs = [start(api) for _ in range(3)]
    deadlines = {rid: out_of_time(rid) for rid in runs}
    going = start(api)
    listed = api.get("/api/v1/runs?status=running").json()["runs"]
    assert [row["run_id"] for row in listed] == [going]
    for row in api.get("/api/v1/runs").json()["runs"]:
        if row["run_id"] in deadlines:
            assert (row["status"], row["stop_reason"]) == ("stopped", "max_seconds")
            assert at(row["ended_at"]) == ms(deadlines[row["run_id"]])
    client.force_login(users["viewer"])
    page = client.get(f"/teams/{team.slug}/runs/?status=running")
    assert [str(r.pk) for r in page.context["runs"]] == [going]
    overview = client.get(f"/teams/{team.slug}/")
    assert [str(r.pk) for r in overview.context["running"]] == [going]
    assert overview.context["running_count"] == 1
    assert Run.objects.filter(status="running").count() == 4  # nothing was written


@pytest.mark.django_db
def test_the_run_page_shows_the_stop_naming_the_budget(client: Any, api: Any, team: Team,
                                                       users: dict[str, Any]) -> None:
    rid = start(api)
    out_of_time(rid)
    client.force_login(users["viewer"])
    page = client.get(f"/teams/{team.slug}/runs/{rid}/")
    assert page.status_code == 200
    text = page.content.decode()
    assert "No check came before the run&#x27;s time budget ran out" in text
    assert "max_seconds=45" in text
    assert "(no action: the time budget ran out)" in text
    assert "(no action: kill switch)" not in text


@pytest.mark.django_db
def test_a_look_ends_runs_out_of_time(api: Any, team: Team) -> None:
    rid = start(api)
    deadline = out_of_time(rid)
    assert api.get("/api/v1/runs?status=running").json()["runs"] == []
    assert_out_of_time(rid, deadline, steps=0)


@pytest.mark.django_db
def test_a_finish_after_the_budget_finds_the_run_stopped(api: Any, team: Team) -> None:
    rid = start(api)
    deadline = out_of_time(rid)
    response = api.post(f"/api/v1/runs/{rid}/finish", {"status": "completed", "output": "late"},
                        content_type="application/json")
    assert response.status_code == 200
    body = response.json()
    assert (body["status"], body["stop_reason"], body["output"]) == (
        "stopped", "max_seconds", "late")
    assert_out_of_time(rid, deadline, steps=0)


@pytest.mark.django_db
def test_a_check_after_the_budget_is_stopped_by_the_budget_rule_not_abandoned(
        api: Any, team: Team) -> None:
    rid = start(api)
    check(api, rid)
    out_of_time(rid)
    answer = check(api, rid, name="next")
    assert (answer["decision"], answer["reason"], answer["step"]) == ("stop", "max_seconds", 2)
    assert not Decision.objects.filter(run_id=rid, reason="abandoned").exists()
    assert Decision.objects.filter(run_id=rid, outcome="stop").count() == 1


@pytest.mark.django_db
def test_idleness_first_still_abandons(api: Any, team: Team) -> None:
    set_policy(team, budgets={"max_idle_seconds": 30})
    rid = start(api)
    started = timezone.now() - timedelta(seconds=40)
    Run.objects.filter(pk=rid).update(started_at=started,
                                      idle_deadline=started + timedelta(seconds=30))
    assert abandon_idle_runs() == [rid]
    run = Run.objects.get(pk=rid)
    assert (run.stop_reason, run.ended_at) == ("abandoned", started + timedelta(seconds=30))


@pytest.mark.django_db
def test_a_shadow_run_is_never_ended_for_its_time(api: Any, team: Team) -> None:
    set_policy(team, mode="shadow")
    rid = start(api)
    run = Run.objects.get(pk=rid)
    assert run.idle_deadline == run.started_at + timedelta(seconds=3600)
    Run.objects.filter(pk=rid).update(started_at=timezone.now() - timedelta(seconds=600))
    assert sweep_idle_runs() == []
    assert api.get(f"/api/v1/runs/{rid}").json()["status"] == "running"


# --- A rate-limit wait longer than the time left (issue 26) ----------------------------------

@pytest.mark.django_db
def test_a_rate_limit_wait_longer_than_the_time_left_is_a_stop(api: Any, team: Team) -> None:
    set_policy(team, rate_limits=[{"match": "http.*", "per": "run", "max": 1,
                                   "window_s": 60}])
    rid = start(api)
    assert check(api, rid, name="http.get")["decision"] == "allow"
    answer = check(api, rid, name="http.get", args={"page": 2})
    assert (answer["decision"], answer["reason"], answer["step"]) == ("stop", "max_seconds", 2)
    assert answer["retry_after_s"] is None
    message = answer["message"]
    assert "would have to wait 60.000 s" in message or "would have to wait 59." in message
    assert "s left of the run's time budget (max_seconds=45)" in message
    # Not "the run's time budget is spent": a second of it was used (found by a newcomer).
    assert "wait" in answer["next_action"] and "spent" not in answer["next_action"]
    run = Run.objects.get(pk=rid)
    assert (run.status, run.stop_reason) == ("stopped", "max_seconds")
    # A later check is told the same.
    later = check(api, rid, name="search")
    assert (later["decision"], later["next_action"]) == ("stop", answer["next_action"])


@pytest.mark.django_db
def test_a_rate_limit_wait_inside_the_time_left_is_still_a_wait(api: Any, team: Team) -> None:
    set_policy(team, rate_limits=[{"match": "http.*", "per": "run", "max": 1,
                                   "window_s": 30}])
    rid = start(api)
    check(api, rid, name="http.get")
    answer = check(api, rid, name="http.get", args={"page": 2})
    assert (answer["decision"], answer["reason"]) == ("wait", "rate_limited")
    assert 0 < answer["retry_after_s"] <= 30


@pytest.mark.django_db
def test_at_the_very_moment_its_budget_is_spent_a_run_is_not_out_of_time(
        api: Any, team: Team, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rule 4 stops a check when the active time is *over* max_seconds, so a check at
    exactly max_seconds is allowed; a finish at that same moment completes the run, and a
    look then leaves it running. Found by the backtest's property test: the finish ended the
    run out of time, an audit record no check had made, one instant after an allow."""
    now = timezone.now()
    monkeypatch.setattr("django.utils.timezone.now", lambda: now)
    set_policy(team, budgets={"max_seconds": 5})
    rid, other = start(api), start(api)
    now += timedelta(seconds=5)
    for run_id in (rid, other):
        assert check(api, run_id)["decision"] == "allow"
    assert abandon_idle_runs(team_id=team.pk) == []
    finished = api.post(f"/api/v1/runs/{rid}/finish", {"status": "completed"},
                        content_type="application/json")
    assert finished.status_code == 200, finished.content
    assert (finished.json()["status"], finished.json()["stop_reason"]) == ("completed", None)
    assert list(Decision.objects.filter(run_id=rid).values_list("outcome", flat=True)) == [
        "allow"]
    now += timedelta(microseconds=1)
    assert abandon_idle_runs(team_id=team.pk) == [other]
    assert Run.objects.get(pk=other).stop_reason == "max_seconds"
