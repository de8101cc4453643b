"""The backtest's estimate of a draft's rate-limit waits and approval requests, and its
one-line effect (docs/backtest.md): the pure play over recorded times, its properties, and
the same numbers through the command and the editor's panel."""

from __future__ import annotations

import itertools
import json
from collections.abc import Hashable, Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.core.management import call_command
from django.db import connection
from django.test import Client
from django.utils import timezone
from governance_client.estimate import (
    Counted,
    Estimate,
    Estimator,
    Tally,
    effect_of,
    hour_of,
    intended_times,
    rate_limit_waits,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from backtests.models import Backtest
from governance.celery import app as celery_app
from governance_client import replay, rules
from policies.models import Team
from runs.models import Decision, Run
from tests.conftest import set_policy

T0 = datetime(2026, 12, 3, 17, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def draft(*limits: tuple[str, str, int, int], mode: str = "enforce",
          approvals: tuple[str, ...] = (), **values: Any) -> rules.Policy:
    """A policy that stops nothing by itself but what the test gives it."""
    quiet: dict[str, Any] = {"max_steps": 1000, "max_repeat_action": 1000,
                             "max_seconds": None, "max_usd": None}
    return rules.Policy(mode=mode, rate_limits=tuple(rules.RateLimit(*rule) for rule in limits),
                        approval_tools=approvals, **{**quiet, **values})


def actions(*times: float, name: str = "search.docs") -> list[Counted]:
    return [Counted(at=at(t), name=name) for t in times]


def play(policy: rules.Policy, runs: list[tuple[Hashable, str, list[Counted]]],
         **bounds: int) -> tuple[list[tuple[Hashable, float, float]], bool,
                                 list[tuple[Hashable, datetime, str]]]:
    played: list[tuple[Hashable, datetime, str]] = []
    waits, complete = rate_limit_waits(policy, runs, played=played, **bounds)
    return ([(w.run, (w.at - T0).total_seconds(), w.seconds) for w in waits], complete,
            played)


# --- The play of the rate limits -------------------------------------------------------------

def test_a_full_window_makes_the_action_wait_and_moves_the_rest_of_its_run():
    waits, complete, played = play(draft(("search.*", "run", 2, 60)),
                                   [("r1", "bot", actions(0, 10, 20, 30))])
    # The third action waits until the first leaves the window (60 s); the fourth keeps its
    # recorded 10 s after the third, and by then the window has room again.
    assert waits == [("r1", 20.0, 40.0)] and complete
    assert [(t - T0).total_seconds() for _, t, _ in played] == [0, 10, 60, 70]


def test_per_agent_counts_the_agents_runs_together_per_run_does_not():
    runs = [("r1", "bot", actions(0)), ("r2", "bot", actions(1))]
    assert play(draft(("search.*", "agent", 1, 10)), runs)[0] == [("r2", 1.0, 9.0)]
    assert play(draft(("search.*", "run", 1, 10)), runs)[0] == []
    other_agents = [("r1", "bot", actions(0)), ("r2", "helper", actions(1))]
    assert play(draft(("search.*", "agent", 1, 10)), other_agents)[0] == []
    assert play(draft(("search.*", "team", 1, 10)), other_agents)[0] == [("r2", 1.0, 9.0)]


def test_an_action_waits_again_when_another_run_takes_the_room_first():
    # r2 and r3 both wait for the room at 10 s; r2 comes first there, so r3 waits again.
    runs = [("r1", "a", actions(0)), ("r2", "b", actions(5)), ("r3", "c", actions(9))]
    waits, _, played = play(draft(("search.*", "team", 1, 10)), runs)
    assert waits == [("r2", 5.0, 5.0), ("r3", 9.0, 1.0), ("r3", 10.0, 10.0)]
    assert [(run, (t - T0).total_seconds()) for run, t, _ in played] == [
        ("r1", 0), ("r2", 10), ("r3", 20)]


def test_only_the_actions_a_rule_matches_are_counted_and_held():
    runs = [("r1", "bot", actions(0, 1, 2, name="http.get") + actions(3, name="search.docs"))]
    assert play(draft(("search.*", "run", 1, 60)), runs)[0] == []
    assert play(draft(("http.*", "run", 2, 60)), runs)[0] == [("r1", 2.0, 58.0)]


def test_every_matching_rule_applies_and_the_longest_wait_wins():
    runs = [("r1", "bot", actions(0, 1, 2))]
    policy = draft(("search.*", "run", 2, 10), ("*", "run", 2, 60))
    assert play(policy, runs)[0] == [("r1", 2.0, 58.0)]


def test_in_shadow_mode_nothing_waits_but_the_would_be_waits_are_counted():
    waits, _, played = play(draft(("search.*", "run", 2, 60), mode="shadow"),
                            [("r1", "bot", actions(0, 10, 20, 30))])
    assert waits == [("r1", 20.0, 40.0), ("r1", 30.0, 40.0)]
    assert [(t - T0).total_seconds() for _, t, _ in played] == [0, 10, 20, 30]


def test_a_wait_longer_than_the_time_left_is_a_stop_and_ends_the_play_of_its_run():
    # SPEC 12 with issue 26: the check answers stop / max_seconds, not a wait, when the
    # wait outlasts the run's time; the estimate counted it as a wait and played on.
    stopped: list[tuple[Hashable, datetime, int]] = []
    waits, complete = rate_limit_waits(
        draft(("search.*", "run", 1, 60)), [("r1", "bot", actions(0, 10, 20))],
        deadlines=[at(45)], out_of_time=stopped)
    assert (waits, complete) == ([], True)
    assert stopped == [("r1", at(10), 0)]
    # A wait that fits is a wait; the run's next action, moved past the deadline by it, is
    # stopped by the check's own max_seconds rule.
    stopped.clear()
    waits, _ = rate_limit_waits(
        draft(("search.*", "run", 2, 30)), [("r1", "bot", actions(0, 10, 20, 40))],
        deadlines=[at(45)], out_of_time=stopped)
    assert [(w.at, w.seconds) for w in waits] == [(at(20), 10.0)]
    assert stopped == [("r1", at(50), 0)]


def test_the_estimator_counts_runs_a_wait_would_stop_out_of_time():
    policy = draft(("search.*", "agent", 1, 3600), max_seconds=45)
    estimator = Estimator(policy)
    for run in ("r1", "r2"):
        steps = checks("search.docs")
        estimator.add_run(run=run, agent="bot", started_at=T0, steps=steps,
                          outcome=replayed(policy, steps), recorded_steps=1,
                          recorded_cost=Decimal("0.1"))
    result = estimator.result()
    assert (result.total.rate_limit_waits, result.out_of_time_stops) == (0, 1)
    assert result.as_json()["estimate"]["max_seconds_stops"] == 1
    assert "stop ~1 run out of time (max_seconds) where a rate-limit wait would outlast it" \
        in result.summary()


def test_without_rate_limits_nothing_is_played():
    assert play(draft(), [("r1", "bot", actions(0, 0, 0))]) == ([], True, [])


def test_the_play_is_bounded_and_then_says_its_counts_are_lower_bounds():
    runs = [(f"r{i}", "bot", actions(0)) for i in range(50)]
    waits, complete, _ = play(draft(("search.*", "team", 1, 60)), runs, max_waits=5)
    assert (len(waits), complete) == (5, False)
    waits, complete, _ = play(draft(("search.*", "team", 1, 60)), runs, max_work=3)
    assert not complete


names = st.sampled_from(["search.docs", "search.web", "http.get"])
limits = st.lists(st.tuples(st.sampled_from(["search.*", "*", "http.get"]),
                            st.sampled_from(["run", "agent", "team"]), st.integers(1, 3),
                            st.integers(1, 30)), min_size=1, max_size=2)
recorded_runs = st.lists(st.tuples(st.sampled_from(["a", "b"]),
                                   st.lists(st.tuples(st.integers(0, 20), names), max_size=6)),
                         min_size=1, max_size=4)


@settings(max_examples=300, deadline=None)
@given(limits=limits, runs=recorded_runs, shadow=st.booleans())
def test_the_play_keeps_every_window_and_every_runs_spacing(limits, runs, shadow):
    """Checked against SPEC 12's definition, not against `window_of`: in every sliding
    window of every rule and scope, at most `max` counted actions; each action counted once;
    each run keeps its order and recorded spacing, moved by exactly its waits."""
    policy = draft(*limits, mode="shadow" if shadow else "enforce")
    given_runs = []
    for index, (agent, gaps) in enumerate(runs):
        moment, acts = 0, []
        for gap, name in gaps:
            moment += gap
            acts.append(Counted(at=at(moment), name=name))
        given_runs.append((index, agent, acts))
    played: list[tuple[Hashable, datetime, str]] = []
    waits, complete = rate_limit_waits(policy, given_runs, played=played)
    assert complete
    agent_of = {index: agent for index, agent, _ in given_runs}
    for index, _, acts in given_runs:
        mine = [moment for run, moment, _ in played if run == index]
        assert len(mine) == len(acts)
        delays = [moment - act.at for moment, act in zip(mine, acts, strict=True)]
        assert all(b >= a >= timedelta(0) for a, b in itertools.pairwise(delays))
        total = sum((timedelta(seconds=w.seconds) for w in waits if w.run == index),
                    timedelta(0))
        assert (delays[-1] if delays else timedelta(0)) == (timedelta(0) if shadow else total)
    if shadow:
        return
    for match, per, most, window in limits:
        rule = rules.RateLimit(match, per, most, window)
        counted = [(run, moment) for run, moment, name in played if rule.matches(name)]
        for run, moment in counted:
            scope = [other for o_run, other in counted
                     if (per == "team" or (per == "run" and o_run == run)
                         or (per == "agent" and agent_of[o_run] == agent_of[run]))
                     and moment - timedelta(seconds=window) < other <= moment]
            assert len(scope) <= most, (rule, run, moment)


# --- One run's effect, and the estimator over replayed runs ---------------------------------

def checks(*names: str, cost: str = "0.10", outcome: str = "allow") -> list[replay.Recorded]:
    return [replay.Recorded(outcome=outcome, reason="step_ok", step=n, name=name,
                            args={"n": n}, cost_usd=Decimal(cost), elapsed_s=float(n),
                            at=at(n))
            for n, name in enumerate(names, start=1)]


def replayed(policy: rules.Policy, steps: list[replay.Recorded]) -> replay.Outcome:
    return replay.replay(policy, steps, started_at=T0, recorded=draft(), trace=True)


def test_a_run_stopped_earlier_loses_the_steps_and_cost_after_its_stop():
    steps = checks(*["search.docs"] * 10)
    outcome = replayed(draft(max_steps=4), steps)
    assert (outcome.stop_reason, outcome.step) == ("max_steps", 5)
    effect = effect_of(steps, outcome, recorded_steps=10, recorded_cost=Decimal("1.00"))
    assert (effect.stopped_earlier, effect.steps_removed, effect.cost_removed) == (
        True, 5, Decimal("0.50"))
    unchanged = effect_of(steps, replayed(draft(), steps), recorded_steps=10,
                          recorded_cost=Decimal("1.00"))
    assert not unchanged.stopped_earlier and unchanged.cost_removed == 0


def test_a_run_the_draft_lets_on_past_its_recorded_stop_is_counted_apart():
    steps = [*checks("a", "b"), replay.Recorded(outcome="stop", reason="max_steps", step=3,
                                                name="c", at=at(3), elapsed_s=3.0)]
    effect = effect_of(steps, replayed(draft(), steps), recorded_steps=3,
                       recorded_cost=Decimal("0.2"))
    assert (effect.let_on, effect.stopped_earlier, effect.steps_removed) == (True, False, 0)


def test_the_estimator_counts_approval_requests_and_waits_per_agent_and_hour():
    policy = draft(("search.*", "agent", 1, 3600), approvals=("pay.*",))
    estimator = Estimator(policy)
    for run, agent in (("r1", "bot"), ("r2", "bot"), ("r3", "helper")):
        steps = checks("search.docs", "pay.refund")
        estimator.add_run(run=run, agent=agent, started_at=T0, steps=steps,
                          outcome=replayed(policy, steps), recorded_steps=2,
                          recorded_cost=Decimal("0.2"))
    result = estimator.result()
    # r2's search waits for r1's to leave the hour's window: 3,600 s.
    assert (result.total.rate_limit_waits, result.total.wait_s,
            result.total.approval_requests) == (1, 3600.0, 3)
    out = result.as_json()["estimate"]
    assert out["by_agent"] == {
        "bot": {"rate_limit_waits": 1, "wait_s": 3600.0, "approval_requests": 2},
        "helper": {"rate_limit_waits": 0, "wait_s": 0.0, "approval_requests": 1}}
    assert out["by_hour"] == {"2026-12-03T17:00Z": {"rate_limit_waits": 1, "wait_s": 3600.0,
                                                    "approval_requests": 3}}
    assert out["recorded"] == {"rate_limit_waits": 0, "approval_requests": 0}


def test_a_shadow_draft_reports_the_approvals_it_would_ask_without_asking():
    policy = draft(approvals=("pay.*",), mode="shadow")
    steps = checks("pay.refund", "pay.refund")
    estimator = Estimator(policy)
    estimator.add_run(run="r1", agent="bot", started_at=T0, steps=steps,
                      outcome=replayed(policy, steps), recorded_steps=2,
                      recorded_cost=Decimal(0))
    result = estimator.result()
    assert result.total.approval_requests == 2 and result.shadow
    assert "without holding any action back (shadow mode)" in result.summary()


def test_recorded_waits_and_requests_are_counted_for_comparison():
    steps = [replay.Recorded(outcome="wait", reason="rate_limited", step=1, name="s", at=at(0)),
             *checks("s"),
             replay.Recorded(outcome="pending", reason="approval_required", step=2, name="pay",
                             at=at(2))]
    estimator = Estimator(draft())
    estimator.add_run(run="r", agent="bot", started_at=T0, steps=steps,
                      outcome=replayed(draft(), steps), recorded_steps=2,
                      recorded_cost=Decimal(0))
    assert estimator.result().as_json()["estimate"]["recorded"] == {
        "rate_limit_waits": 1, "approval_requests": 1}


def test_intended_times_take_out_the_recorded_waits_and_approval_holds():
    def rec(outcome: str, step: int, seconds: float) -> replay.Recorded:
        return replay.Recorded(outcome=outcome, reason="", step=step, name="s", at=at(seconds))

    steps = [rec("allow", 1, 0), rec("wait", 2, 1), rec("wait", 2, 30), rec("allow", 2, 61),
             rec("allow", 3, 62), rec("wait", 4, 63), rec("pending", 4, 70),
             rec("allow", 4, 400), rec("allow", 5, 401)]
    # Step 2 was held 60 s by waits; step 4 was held 7 s by a wait, then 330 s by an operator.
    assert [(t - T0).total_seconds() for t in intended_times(steps, T0)] == [
        0, 1, 30, 1, 2, 3, 3, 3, 4]


def test_a_recording_made_under_a_rate_limit_estimates_its_own_waits_again():
    """Played from the recorded times as they were, the waited actions would find room: the
    estimate starts from where each check was first held."""
    steps = [replay.Recorded(outcome=o, reason="", step=n, name="search.docs", at=at(t),
                             args={"n": n})
             for o, n, t in [("allow", 1, 1), ("allow", 2, 2), ("wait", 3, 3),
                             ("allow", 3, 61), ("allow", 4, 62)]]
    policy = draft(("search.*", "run", 2, 60))
    estimator = Estimator(policy)
    estimator.add_run(run="r", agent="bot", started_at=T0, steps=steps,
                      outcome=replayed(policy, steps), recorded_steps=4,
                      recorded_cost=Decimal(0))
    result = estimator.result()
    assert (result.total.rate_limit_waits, result.total.wait_s, result.recorded_waits) == (
        1, 58.0, 1)
    without = Estimator(draft())
    without.add_run(run="r", agent="bot", started_at=T0, steps=steps,
                    outcome=replayed(draft(), steps), recorded_steps=4,
                    recorded_cost=Decimal(0))
    assert without.result().total.rate_limit_waits == 0


def test_the_summary_says_the_effect_in_one_line():
    estimate = Estimate(runs=259, effect_stopped_earlier=12, steps_removed=340,
                        cost_removed=Decimal("4.2"), total=Tally(85, 1020.4, 14))
    assert estimate.summary() == (
        "This draft would stop 12 of 259 runs earlier, removing 340 steps and $4.20 of cost; "
        "and cause ~85 rate-limit waits (~1,020 s of waiting) and 14 approval requests.")
    estimate.effect_let_on, estimate.complete = 3, False
    estimate.cost_removed = Decimal("0.009")
    assert estimate.summary() == (
        "This draft would stop 12 of 259 runs earlier, removing 340 steps and $0.009 of cost; "
        "let 3 stopped runs go on; and cause at least 85 rate-limit waits (at least 1,020 s "
        "of waiting) and 14 approval requests.")
    assert Estimate(runs=1).summary() == (
        "This draft would stop none of the 1 run earlier; and cause no rate-limit wait and "
        "no approval request.")
    assert Estimate().summary().startswith("No ended run to replay")


def test_hours_are_utc():
    assert hour_of(datetime(2026, 12, 3, 18, 59, 59, tzinfo=UTC)) == "2026-12-03T18:00Z"


# --- Through the command and the editor's panel ---------------------------------------------

@pytest.fixture
def eager() -> Iterator[None]:
    before = celery_app.conf.task_always_eager
    celery_app.conf.task_always_eager = True
    yield
    celery_app.conf.task_always_eager = before


@pytest.fixture
def recorded_hour(api: Any, team: Team, monkeypatch: pytest.MonkeyPatch) -> datetime:
    """Two agents' runs, recorded one check a second within one hour two days ago, under a
    policy without rate limits or approvals: each searches three times, then pays."""
    set_policy(team, step_limits={"max_steps": 50, "max_repeat_action": 1000},
               budgets={"max_seconds": None, "max_usd": None, "max_tool_calls": None})
    hour = (timezone.now() - timedelta(days=2)).replace(minute=5, second=0, microsecond=0)
    clock = [hour]
    monkeypatch.setattr("django.utils.timezone.now", lambda: clock[0])
    for agent in ("billing-bot", "support-bot"):
        response = api.post("/api/v1/runs", {"agent": agent}, content_type="application/json")
        run_id = response.json()["run_id"]
        for n, name in enumerate(["search.docs"] * 3 + ["pay.refund"]):
            clock[0] += timedelta(seconds=1)
            answer = api.post(f"/api/v1/runs/{run_id}/check",
                              {"action": {"name": name, "args": {"q": n}},
                               "cost_usd": 0.25, "check_id": f"{agent}-{n}"},
                              content_type="application/json")
            assert answer.json()["decision"] == "allow"
        api.post(f"/api/v1/runs/{run_id}/finish", {"status": "completed"},
                 content_type="application/json")
    monkeypatch.undo()
    return hour


def command_json(team: Team, tmp_path: Path, **changes: Any) -> dict[str, Any]:
    document = {**team.policies.get(name="default").current.document, **changes}
    path = tmp_path / "draft.yaml"
    path.write_text(yaml.safe_dump({"teams": [{"slug": team.slug, "policies": [document]}]}))
    out = StringIO()
    call_command("backtest", "--team", team.slug, "--policy", "default", "--file", str(path),
                 "--json", stdout=out)
    return json.loads(out.getvalue().splitlines()[-1])


LIMITS = {"rate_limits": [{"match": "search.*", "per": "agent", "max": 2, "window_s": 60}],
          "approvals": {"tools": ["pay.*"], "timeout_s": 900}}


@pytest.mark.django_db
def test_the_command_estimates_the_drafts_waits_and_approvals(team, recorded_hour, tmp_path):
    result = command_json(team, tmp_path, **LIMITS)
    # Per agent: the third search, 2 s after the first, waits the 58 s left of its window.
    estimate = result["estimate"]
    assert (estimate["rate_limit_waits"], estimate["wait_s"],
            estimate["approval_requests"]) == (2, 116.0, 2)
    assert estimate["by_agent"] == {
        agent: {"rate_limit_waits": 1, "wait_s": 58.0, "approval_requests": 1}
        for agent in ("billing-bot", "support-bot")}
    assert estimate["by_hour"] == {hour_of(recorded_hour): {
        "rate_limit_waits": 2, "wait_s": 116.0, "approval_requests": 2}}
    assert estimate["recorded"] == {"rate_limit_waits": 0, "approval_requests": 0}
    assert (result["changed"], result["effect"]["stopped_earlier"]) == (0, 0)
    assert result["summary"] == (
        "This draft would stop none of the 2 runs earlier; and cause ~2 rate-limit waits "
        "(~116 s of waiting) and 2 approval requests.")
    # The recorded policy itself causes none: nothing to estimate.
    current = command_json(team, tmp_path)
    assert (current["estimate"]["rate_limit_waits"],
            current["estimate"]["approval_requests"]) == (0, 0)
    # The table says the same, the summary first.
    out = StringIO()
    call_command("backtest", "--team", team.slug, "--policy", "default", stdout=out)
    assert out.getvalue().splitlines()[1] == current["summary"]


@pytest.mark.django_db
def test_the_effect_counts_the_steps_and_cost_a_stricter_draft_removes(team, recorded_hour,
                                                                        tmp_path):
    document = team.policies.get(name="default").current.document
    result = command_json(team, tmp_path,
                          step_limits={**document["step_limits"], "max_steps": 2})
    # Stopped at step 3 of 4: one step and its $0.25 less per run.
    assert result["effect"] == {"runs": 2, "stopped_earlier": 2, "let_on": 0,
                                "stopped_otherwise": 0, "steps_removed": 2,
                                "cost_removed_usd": "0.500000"}
    assert result["summary"].startswith(
        "This draft would stop 2 of 2 runs earlier, removing 2 steps and $0.50 of cost; ")
    assert Decision.objects.filter(outcome="pending").count() == 0  # nothing written


@pytest.mark.django_db
def test_the_editors_panel_shows_the_summary_and_the_estimate(team, users, recorded_hour,
                                                              tmp_path, eager,
                                                              django_capture_on_commit_callbacks):
    admin = Client()
    admin.force_login(users["admin"])
    form = {"mode": "enforce", "max_steps": "50", "max_repeat_action": "1000",
            "no_progress_window": "4", "max_seconds": "", "max_usd": "", "max_tool_calls": "",
            "tools_deny": "", "ignore_args": "", "error_threshold": "3",
            "error_action": "nudge", "redact_args": "token",
            "rate_limits": "search.* agent 2 60", "approval_tools": "pay.*",
            "approval_timeout_s": "900"}
    with django_capture_on_commit_callbacks(execute=True):
        response = admin.post(f"/teams/{team.slug}/policies/default/backtest", form,
                              HTTP_HX_REQUEST="true")
    assert response.status_code == 200
    job = Backtest.objects.get()
    [result] = job.results
    assert result["report"]["summary"] == command_json(team, tmp_path, **LIMITS)["summary"]
    html = admin.get(f"/teams/{team.slug}/backtests/{job.pk}/").content.decode()
    assert ('class="backtest-effect"><strong>This draft would stop none of the 2 runs '
            "earlier; and cause ~2 rate-limit waits (~116 s of waiting) and 2 approval "
            "requests.</strong>") in html
    for agent in ("billing-bot", "support-bot"):
        assert (f'<tr data-agent="{agent}"><td>{agent}</td><td>1</td><td>58.0 s</td>'
                "<td>1</td></tr>") in html
    assert f'data-hour="{hour_of(recorded_hour)}"' in html


@pytest.mark.django_db
def test_the_recorded_version_estimates_the_waits_and_requests_its_runs_recorded(team,
                                                                               tmp_path):
    """Rows as a run under a rate limit and an approval rule records them: each agent's third
    search waited 58 s, and a payment waited for an operator. Backtesting that version
    estimates what they recorded; a draft without either, nothing."""
    set_policy(team, step_limits={"max_steps": 50, "max_repeat_action": 1000},
               budgets={"max_seconds": None, "max_usd": None, "max_tool_calls": None},
               rate_limits=[{"match": "search.*", "per": "agent", "max": 2, "window_s": 60}],
               approvals={"tools": ["pay.*"], "timeout_s": 900})
    started = (timezone.now() - timedelta(days=1)).replace(minute=0, second=0, microsecond=0)
    for agent in ("billing-bot", "support-bot"):
        run = Run.objects.create(team=team, agent=agent, started_at=started,
                                 status="completed", steps=4,
                                 ended_at=started + timedelta(seconds=500),
                                 policy_version=team.policies.get(name="default").current)
        for step, outcome, reason, name, seconds in [
                (1, "allow", "step_ok", "search.docs", 1),
                (2, "allow", "step_ok", "search.docs", 2),
                (3, "wait", "rate_limited", "search.docs", 3),
                (3, "allow", "step_ok", "search.docs", 61),
                (4, "pending", "approval_required", "pay.refund", 62),
                (4, "allow", "step_ok", "pay.refund", 400)]:
            Decision.objects.create(run=run, step=step, outcome=outcome, reason=reason,
                                    action_name=name, action_type="tool", args={"n": step},
                                    repeat_key=f"{name}:{step}", repeat_count=1,
                                    at=started + timedelta(seconds=seconds),
                                    elapsed_s=float(seconds))
    same = command_json(team, tmp_path)
    assert same["changed"] == 0
    assert {key: same["estimate"][key] for key in
            ("rate_limit_waits", "wait_s", "approval_requests", "recorded")} == {
        "rate_limit_waits": 2, "wait_s": 116.0, "approval_requests": 2,
        "recorded": {"rate_limit_waits": 2, "approval_requests": 2}}
    none = command_json(team, tmp_path, rate_limits=[], approvals={"tools": [],
                                                                    "timeout_s": 900})
    assert (none["estimate"]["rate_limit_waits"], none["estimate"]["approval_requests"]) == (
        0, 0)
    assert none["summary"].endswith("cause no rate-limit wait and no approval request.")


@pytest.mark.django_db
def test_runs_recorded_through_the_api_under_a_rate_limit_estimate_their_waits(
        api, team, tmp_path, monkeypatch):
    """Through the real check path, by an agent that sends a waited check again after its
    retry_after_s: backtesting that same version estimates the waits the runs had; a draft
    without the limit, none. (SQLite: PostgreSQL stamps rate limits with its own clock,
    which the test cannot move; the test above covers that stack with rows.)"""
    if connection.vendor == "postgresql":
        pytest.skip("PostgreSQL stamps rate limits with its own clock")
    set_policy(team, step_limits={"max_steps": 50, "max_repeat_action": 1000},
               budgets={"max_seconds": None, "max_usd": None, "max_tool_calls": None},
               rate_limits=[{"match": "search.*", "per": "agent", "max": 2, "window_s": 30}])
    clock = [(timezone.now() - timedelta(days=1)).replace(microsecond=0)]
    monkeypatch.setattr("django.utils.timezone.now", lambda: clock[0])
    for _ in range(2):
        run_id = api.post("/api/v1/runs", {"agent": "support-bot"},
                          content_type="application/json").json()["run_id"]
        for n in range(4):
            clock[0] += timedelta(seconds=2)
            while True:
                answer = api.post(f"/api/v1/runs/{run_id}/check",
                                  {"action": {"name": "search.docs", "args": {"q": n}},
                                   "check_id": f"{run_id}-{n}"},
                                  content_type="application/json").json()
                if answer["decision"] != "wait":
                    break
                clock[0] += timedelta(seconds=answer["retry_after_s"])
            assert answer["decision"] == "allow"
        api.post(f"/api/v1/runs/{run_id}/finish", {"status": "completed"},
                 content_type="application/json")
    monkeypatch.undo()
    waits = Decision.objects.filter(outcome="wait")
    assert waits.count() >= 2
    same = command_json(team, tmp_path)["estimate"]
    assert same["recorded"]["rate_limit_waits"] == waits.count()
    assert same["rate_limit_waits"] == waits.count()
    assert same["wait_s"] == pytest.approx(
        sum(w.answer["retry_after_s"] for w in waits), abs=0.01)
    assert command_json(team, tmp_path, rate_limits=[])["estimate"]["rate_limit_waits"] == 0


@pytest.mark.django_db
def test_the_page_lists_a_week_of_hours_and_says_where_the_rest_are(team, users):
    """A result of 90 days can hold 2,160 hours: the page lists the first 168."""
    tally = {"rate_limit_waits": 1, "wait_s": 2.0, "approval_requests": 0}
    hours = {hour_of(T0 + timedelta(hours=n)): tally for n in range(200)}
    report = {"policy": "default", "runs": 1, "changed": 0, "by_reason": {}, "changes": [],
              "not_simulated": [], "summary": "This draft would ...",
              "estimate": {"rate_limit_waits": 200, "wait_s": 400.0, "approval_requests": 0,
                           "shadow": False, "complete": True,
                           "recorded": {"rate_limit_waits": 0, "approval_requests": 0},
                           "by_agent": {"bot": tally}, "by_hour": hours}}
    now = timezone.now()
    job = Backtest.objects.create(team=team, created_at=now, source="editor", drafts=[],
                                  since_s=86400, limit=10, heartbeat_at=now, status="done",
                                  results=[{"report": report, "decisions": 1,
                                            "key_fallbacks": 0}])
    viewer = Client()
    viewer.force_login(users["viewer"])
    html = viewer.get(f"/teams/{team.slug}/backtests/{job.pk}/").content.decode()
    assert html.count("<tr data-hour=") == 168
    assert f'data-hour="{hour_of(T0 + timedelta(hours=167))}"' in html
    assert f'data-hour="{hour_of(T0 + timedelta(hours=168))}"' not in html
    assert "Per hour (UTC): 168 of 200 hours with any" in html
    assert "--policy default --json</code> has them all" in html


@pytest.mark.django_db
def test_a_result_stored_before_the_estimate_still_shows(team, users):
    now = timezone.now()
    report = {"policy": "default", "runs": 3, "changed": 0, "by_reason": {}, "changes": [],
              "not_simulated": ["rate_limits", "approvals", "max_idle_seconds"]}
    job = Backtest.objects.create(team=team, created_at=now, source="editor", drafts=[],
                                  since_s=86400, limit=10, heartbeat_at=now, status="done",
                                  results=[{"report": report, "decisions": 1,
                                            "key_fallbacks": 0}])
    viewer = Client()
    viewer.force_login(users["viewer"])
    response = viewer.get(f"/teams/{team.slug}/backtests/{job.pk}/")
    assert response.status_code == 200
    html = response.content.decode()
    assert 'data-runs="3"' in html and "backtest-effect" not in html
    assert "backtest-estimate" not in html


@pytest.mark.django_db
def test_a_stop_the_policys_own_rate_limit_made_is_no_change_under_that_policy(
        api, team, tmp_path):
    # The second check would wait about an hour with 45 s of budget: the check answered
    # stop / max_seconds (issue 26). The replay of one run cannot see the rate limit, so
    # backtesting that same version said the run would go on ("let 1 stopped run go on",
    # one change) while the estimate said it would stop there.
    set_policy(team, step_limits={"max_steps": 50, "max_repeat_action": 1000},
               budgets={"max_seconds": 45},
               rate_limits=[{"match": "search.*", "per": "run", "max": 1, "window_s": 3600}])
    run_id = api.post("/api/v1/runs", {"agent": "support-bot"},
                      content_type="application/json").json()["run_id"]
    answers = [api.post(f"/api/v1/runs/{run_id}/check",
                        {"action": {"name": "search.docs", "args": {"q": n}}},
                        content_type="application/json").json() for n in range(2)]
    assert [(a["decision"], a["reason"]) for a in answers] == [
        ("allow", "step_ok"), ("stop", "max_seconds")]
    same = command_json(team, tmp_path)
    assert (same["changed"], same["effect"]["let_on"]) == (0, 0)
    assert same["estimate"]["max_seconds_stops"] == 1
    # A draft without the limit lets the run go on: that is a change.
    assert command_json(team, tmp_path, rate_limits=[])["changed"] == 1
