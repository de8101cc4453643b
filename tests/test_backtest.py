"""`manage.py backtest` (SPEC 13) on runs recorded by real checks through the API: what a
draft would have stopped, where and why, and the exact `--json` shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime, timedelta
from decimal import Decimal
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.core.management import CommandError, call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from governance.celery import app as celery_app
from policies.models import Team
from runs.killswitch.services import killswitch_engage
from runs.models import Decision, Run
from tests.conftest import set_policy

pytestmark = pytest.mark.django_db


class Clock:
    """The server's clock, moved by the test: recorded times without waiting."""

    def __init__(self) -> None:
        self.now = timezone.now() - timedelta(hours=1)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr("django.utils.timezone.now", fake)
    return fake


@pytest.fixture(autouse=True)
def eager_celery() -> Iterator[None]:
    before = celery_app.conf.task_always_eager
    celery_app.conf.task_always_eager = True
    yield
    celery_app.conf.task_always_eager = before


def start(api: Any) -> str:
    response = api.post("/api/v1/runs", {"agent": "support-bot"},
                        content_type="application/json")
    assert response.status_code == 201, response.content
    return response.json()["run_id"]


def check(api: Any, run_id: str, name: str = "search.docs", args: dict[str, Any] | None = None,
          **body: Any) -> dict[str, Any]:
    response = api.post(f"/api/v1/runs/{run_id}/check",
                        {"action": {"name": name, "args": args or {}}, **body},
                        content_type="application/json")
    assert response.status_code == 200, response.content
    return response.json()


def finish(api: Any, run_id: str, status: str = "completed") -> None:
    response = api.post(f"/api/v1/runs/{run_id}/finish", {"status": status},
                        content_type="application/json")
    assert response.status_code == 200, response.content


def record(api: Any, checks: list[dict[str, Any]], *, clock: Clock | None = None,
           every_s: float = 0.0) -> str:
    """A run that sends these checks (kwargs of `check`) until one is stopped, then ends."""
    run_id = start(api)
    for body in checks:
        if clock is not None:
            clock.advance(every_s)
        if check(api, run_id, **body)["decision"] == "stop":
            return run_id
    finish(api, run_id)
    return run_id


def draft_file(tmp_path: Path, team: Team, **changes: Any) -> str:
    """The team's default policy with these changes, as an apply_policies document."""
    document = {**team.policies.get(name="default").current.document}
    if "step_limits" in changes and "warnings" not in changes:
        document.pop("warnings", None)  # the warnings new step limits get (SPEC 16)
    for key, value in changes.items():
        document[key] = {**document[key], **value} if isinstance(value, dict) else value
    path = tmp_path / "draft.yaml"
    path.write_text(yaml.safe_dump({"teams": [{"slug": team.slug, "policies": [document]}]}))
    return str(path)


def backtest(team: Team, *args: str) -> dict[str, Any]:
    out = StringIO()
    call_command("backtest", "--team", team.slug, "--policy", "default", "--json", *args,
                 stdout=out)
    return json.loads(out.getvalue().strip().splitlines()[-1])


def only_change(result: dict[str, Any]) -> dict[str, Any]:
    assert result["changed"] == 1, result
    return result["changes"][0]


NO_BUDGETS = {"max_seconds": None, "max_usd": None, "max_tool_calls": None}


# --- The SPEC's examples ---------------------------------------------------------------------

def test_a_lower_repeat_limit_stops_ten_identical_calls_at_step_4(api, team, tmp_path):
    set_policy(team, step_limits={"max_steps": 50, "max_repeat_action": 1000},
               budgets=NO_BUDGETS)
    run_id = record(api, [{"args": {"q": "refund"}}] * 10)
    result = backtest(team, "--file", draft_file(tmp_path, team,
                                                 step_limits={"max_repeat_action": 3}))
    assert only_change(result) == {
        "run_id": run_id,
        "recorded": {"status": "completed", "stop_reason": None, "steps": 10},
        "draft": {"status": "stopped", "stop_reason": "loop_detected", "step": 4},
    }
    assert result["by_reason"] == {"loop_detected": 1}
    assert result["runs"] == 1


def test_a_run_stopped_by_max_steps_5_is_not_stopped_under_50(api, team, tmp_path):
    set_policy(team, step_limits={"max_steps": 5})
    run_id = record(api, [{"args": {"q": i}} for i in range(10)])
    assert Run.objects.get(pk=run_id).stop_reason == "max_steps"
    result = backtest(team, "--file", draft_file(tmp_path, team, step_limits={"max_steps": 50}))
    assert only_change(result) == {
        "run_id": run_id,
        "recorded": {"status": "stopped", "stop_reason": "max_steps", "steps": 6},
        "draft": {"status": None, "stop_reason": None, "step": None},
    }
    assert result["by_reason"] == {"none": 1}


def test_the_current_version_changes_nothing(api, team):
    set_policy(team, step_limits={"max_steps": 5})
    record(api, [{"args": {"q": i}} for i in range(10)])
    record(api, [{"args": {"q": "same"}}] * 5)
    record(api, [{"args": {"q": i}} for i in range(3)])
    result = backtest(team)
    assert (result["runs"], result["changed"], result["changes"]) == (3, 0, [])


# --- Budgets, progress, tools, errors ---------------------------------------------------------

def test_a_money_budget_stops_where_the_recorded_costs_reach_it(api, team, tmp_path):
    set_policy(team, budgets=NO_BUDGETS)
    run_id = record(api, [{"args": {"q": i}, "cost_usd": 0.1} for i in range(6)])
    result = backtest(team, "--file", draft_file(tmp_path, team, budgets={"max_usd": 0.3}))
    assert only_change(result)["draft"] == {"status": "stopped", "stop_reason": "max_usd",
                                            "step": 3}
    assert only_change(result)["run_id"] == run_id


def test_a_time_budget_uses_the_recorded_times(api, team, tmp_path, clock):
    set_policy(team, budgets=NO_BUDGETS)
    record(api, [{"args": {"q": i}} for i in range(6)], clock=clock, every_s=10)
    assert list(Decision.objects.order_by("id").values_list("elapsed_s", flat=True)) == [
        10.0, 20.0, 30.0, 40.0, 50.0, 60.0]
    result = backtest(team, "--file", draft_file(tmp_path, team, budgets={"max_seconds": 25}))
    assert only_change(result)["draft"] == {"status": "stopped", "stop_reason": "max_seconds",
                                            "step": 3}


def test_decisions_recorded_before_elapsed_s_replay_their_wall_clock_times(team, tmp_path):
    """Rows of migration 0002's era have no elapsed_s: `at - started_at` stands in."""
    started = timezone.now() - timedelta(hours=2)
    run = Run.objects.create(team=team, agent="old-bot", started_at=started, status="completed",
                             ended_at=started + timedelta(seconds=60),
                             policy_version=team.policies.get(name="default").current)
    for step in range(1, 7):
        Decision.objects.create(run=run, step=step, outcome="allow", reason="step_ok",
                                action_name="search", action_type="tool", args={"q": step},
                                repeat_key=f"search:{step}", repeat_count=1,
                                at=started + timedelta(seconds=10 * step), elapsed_s=None)
    result = backtest(team, "--file", draft_file(tmp_path, team, budgets={"max_seconds": 35}))
    assert only_change(result)["draft"] == {"status": "stopped", "stop_reason": "max_seconds",
                                            "step": 4}


def test_a_no_progress_window_counts_the_recorded_progress(api, team, tmp_path):
    set_policy(team, step_limits={"no_progress_window": 1000})
    record(api, [{"args": {"q": i}, "progress": "page-1"} for i in range(6)])
    result = backtest(team, "--file", draft_file(tmp_path, team,
                                                 step_limits={"no_progress_window": 2}))
    # Step 1 is new; steps 2 and 3 bring nothing: the streak reaches 2 at step 3.
    assert only_change(result)["draft"] == {"status": "stopped", "stop_reason": "no_progress",
                                            "step": 3}


def test_a_denied_tool_stops_the_run_where_it_was_called(api, team, tmp_path):
    record(api, [{"args": {"q": 1}}, {"name": "shell.exec", "args": {"cmd": "ls"}},
                 {"args": {"q": 2}}])
    result = backtest(team, "--file", draft_file(tmp_path, team, tools={"deny": ["shell.*"]}))
    assert only_change(result)["draft"] == {"status": "stopped", "stop_reason": "tool_denied",
                                            "step": 2}


def test_a_repeated_error_stop_counts_the_recorded_errors(api, team, tmp_path):
    error = {"status": "error", "error": "  Timeout   talking to CRM "}
    record(api, [{"args": {"q": 0}}] + [{"args": {"q": i}, "last_result": error}
                                        for i in range(1, 5)])
    result = backtest(team, "--file", draft_file(
        tmp_path, team, on_repeated_error={"threshold": 2, "action": "stop"}))
    assert only_change(result)["draft"] == {"status": "stopped",
                                            "stop_reason": "repeated_error", "step": 3}


def test_a_shadow_draft_stops_nothing(api, team, tmp_path):
    run_id = record(api, [{"args": {"q": "same"}}] * 6)
    assert Run.objects.get(pk=run_id).stop_reason == "loop_detected"
    result = backtest(team, "--file", draft_file(tmp_path, team, mode="shadow"))
    assert only_change(result) == {
        "run_id": run_id,
        "recorded": {"status": "stopped", "stop_reason": "loop_detected", "steps": 4},
        "draft": {"status": None, "stop_reason": None, "step": None},
    }


# --- Kill switches -----------------------------------------------------------------------------

def test_recorded_rate_limit_waits_register_nothing(api, team, tmp_path):
    """A wait (SPEC 12) is audited without a check_id and at no cost; the replay skips it, so
    a draft counts only the checks that were decided."""
    set_policy(team, step_limits={"max_steps": 50, "max_repeat_action": 1000},
               budgets=NO_BUDGETS,
               rate_limits=[{"match": "search.*", "per": "run", "max": 2, "window_s": 600}])
    run_id = start(api)
    answers = [check(api, run_id, args={"q": i}, cost_usd=1, check_id=f"c{i}")["decision"]
               for i in range(4)]
    assert answers == ["allow", "allow", "wait", "wait"]
    assert check(api, run_id, name="http.get")["decision"] == "allow"
    finish(api, run_id)
    waits = Decision.objects.filter(run_id=run_id, outcome="wait")
    assert [(w.check_id, w.cost_usd) for w in waits] == [(None, 0), (None, 0)]
    assert backtest(team)["changed"] == 0
    # Three decided checks: a draft allowing three steps changes nothing (five would stop).
    result = backtest(team, "--file", draft_file(tmp_path, team, step_limits={"max_steps": 3}))
    assert (result["runs"], result["changed"]) == (1, 0)


def test_a_kill_by_the_fanout_is_kept(api, team, tmp_path, django_capture_on_commit_callbacks):
    run_id = start(api)
    for i in range(3):
        check(api, run_id, args={"q": i})
    with django_capture_on_commit_callbacks(execute=True):
        killswitch_engage(scope="run", run=Run.objects.get(pk=run_id), reason="runaway")
    assert Run.objects.get(pk=run_id).status == "killed"
    relaxed = draft_file(tmp_path, team, step_limits={"max_steps": 500})
    assert backtest(team, "--file", relaxed)["changed"] == 0
    # A draft that stops the run before the kill changes it: the kill never came.
    strict = draft_file(tmp_path, team, step_limits={"max_steps": 2})
    assert only_change(backtest(team, "--file", strict))["draft"] == {
        "status": "stopped", "stop_reason": "max_steps", "step": 3}


def test_a_kill_answered_to_a_check_is_kept(api, team, tmp_path):
    run_id = start(api)
    check(api, run_id, args={"q": 1})
    # The fan-out is not run (its on_commit never fires in this test's transaction): the
    # next check is the one answered killed.
    killswitch_engage(scope="team", team=team, reason="loops")
    answer = check(api, run_id, args={"q": 2})
    assert (answer["reason"], answer["step"]) == ("killed", 2)
    relaxed = draft_file(tmp_path, team, step_limits={"max_steps": 500})
    assert backtest(team, "--file", relaxed)["changed"] == 0
    strict = draft_file(tmp_path, team, tools={"deny": ["search.*"]})
    assert only_change(backtest(team, "--file", strict))["draft"] == {
        "status": "stopped", "stop_reason": "tool_denied", "step": 1}


# --- ignore_args and redaction -----------------------------------------------------------------

def test_ignoring_an_arg_recomputes_the_keys_from_the_recorded_args(api, team, tmp_path):
    record(api, [{"args": {"q": "refund", "request_id": i}} for i in range(5)])
    result = backtest(team, "--file", draft_file(tmp_path, team,
                                                 repeat_key={"ignore_args": ["request_id"]}))
    assert only_change(result)["draft"] == {"status": "stopped", "stop_reason": "loop_detected",
                                            "step": 4}


def test_a_redacted_arg_keeps_its_recorded_key(api, team, tmp_path):
    """The stored args say `[redacted]` for every token: recomputing would make the five calls
    look identical. The recorded keys (made before redaction) are used instead."""
    record(api, [{"args": {"q": "refund", "token": f"t{i}", "request_id": 1}}
                 for i in range(5)])
    assert Decision.objects.first().args["token"] == "[redacted]"
    out = StringIO()
    path = draft_file(tmp_path, team, repeat_key={"ignore_args": ["request_id"]})
    call_command("backtest", "--team", team.slug, "--policy", "default", "--file", path,
                 stdout=out)
    assert "would change" in out.getvalue() and "0 would change" in out.getvalue()
    assert "5 check(s) kept their recorded repeat key" in out.getvalue()


def test_a_redacted_arg_the_draft_ignores_hides_nothing(api, team, tmp_path):
    record(api, [{"args": {"q": "refund", "token": f"t{i}"}} for i in range(5)])
    result = backtest(team, "--file", draft_file(tmp_path, team,
                                                 repeat_key={"ignore_args": ["token"]}))
    assert only_change(result)["draft"] == {"status": "stopped", "stop_reason": "loop_detected",
                                            "step": 4}


def test_a_nested_redacted_arg_keeps_its_recorded_key(api, team, tmp_path):
    record(api, [{"args": {"q": "x", "auth": {"Password": f"p{i}"}, "n": 1}}
                 for i in range(5)])
    result = backtest(team, "--file", draft_file(tmp_path, team,
                                                 repeat_key={"ignore_args": ["n"]}))
    assert result["changed"] == 0


# --- The command ---------------------------------------------------------------------------------

def test_the_json_is_the_last_line_with_exactly_the_specs_shape(api, team, tmp_path):
    set_policy(team, step_limits={"max_steps": 50, "max_repeat_action": 1000})
    record(api, [{"args": {"q": "same"}}] * 6)
    record(api, [{"args": {"q": i}} for i in range(8)])
    out = StringIO()
    call_command("backtest", "--team", team.slug, "--policy", "default", "--json", "--file",
                 draft_file(tmp_path, team, step_limits={"max_repeat_action": 3,
                                                         "max_steps": 5}), stdout=out)
    lines = out.getvalue().rstrip("\n").split("\n")
    assert len(lines) == 1
    result = json.loads(lines[-1])
    # SPEC 13's keys first, then the effect and the estimate of waits and approvals.
    assert list(result) == ["policy", "runs", "changed", "by_reason", "changes",
                            "not_simulated", "effect", "estimate", "summary"]
    assert result["policy"] == "default"
    assert (result["runs"], result["changed"]) == (2, 2)
    assert result["by_reason"] == {"loop_detected": 1, "max_steps": 1}
    assert {"rate_limits", "approvals"} <= set(result["not_simulated"])
    for change in result["changes"]:
        assert list(change) == ["run_id", "recorded", "draft"]
        assert list(change["recorded"]) == ["status", "stop_reason", "steps"]
        assert list(change["draft"]) == ["status", "stop_reason", "step"]
    # Newest first.
    newest = Run.objects.order_by("-started_at").values_list("pk", flat=True)
    assert [c["run_id"] for c in result["changes"]] == [str(pk) for pk in newest]


def test_the_table_names_each_changed_run(api, team, tmp_path):
    set_policy(team, step_limits={"max_repeat_action": 1000})
    run_id = record(api, [{"args": {"q": "same"}}] * 6)
    out = StringIO()
    call_command("backtest", "--team", team.slug, "--policy", "default", "--file",
                 draft_file(tmp_path, team, step_limits={"max_repeat_action": 3}), stdout=out)
    text = out.getvalue()
    assert "1 ended run replayed" in text and "1 would change" in text
    assert "By the draft's stop reason: loop_detected 1" in text
    assert f"{run_id}  completed, 6 steps" in text
    assert "stopped (loop_detected) at step 4" in text


def test_since_and_limit_choose_the_newest_runs(api, team, clock):
    ids = []
    for _ in range(3):
        ids.append(record(api, [{"args": {"q": 1}}]))
        clock.advance(3600)
    assert backtest(team, "--since", "90m")["runs"] == 1
    assert backtest(team, "--limit", "2")["runs"] == 2
    assert backtest(team)["runs"] == 3


def test_running_runs_and_other_policies_are_left_out(api, team):
    start(api)  # still running
    from policies.document import default_policy
    from policies.services import policy_save

    policy_save(team=team, document=default_policy("other"), actor=None, source="test")
    response = api.post("/api/v1/runs", {"agent": "bot", "policy": "other"},
                        content_type="application/json")
    finish(api, response.json()["run_id"])
    assert backtest(team)["runs"] == 0


@pytest.mark.parametrize(("args", "message"), [
    (["--team", "nope", "--policy", "default"], "no team 'nope'"),
    (["--team", "support", "--policy", "nope"], "has no policy 'nope'"),
    (["--team", "support", "--policy", "default", "--since", "7"], "--since must be"),
    (["--team", "support", "--policy", "default", "--since", "0d"], "--since must be"),
    (["--team", "support", "--policy", "default", "--limit", "0"], "--limit must be"),
    (["--team", "support", "--policy", "default", "--file", "/nonexistent/draft.yaml"],
     "cannot read the draft"),
])
def test_bad_options_are_refused_with_the_reason(team, args, message):
    with pytest.raises(CommandError, match=message):
        call_command("backtest", *args, stdout=StringIO())


@pytest.mark.parametrize(("text", "message"), [
    ("teams: [", "not valid YAML"),
    ("teams:\n\t- slug: support\n", "YAML indents with spaces, never tabs"),
    ("teams:\n  - slug: support\n    policies:\n      - name: default\n"
     "        step_limits: {max_steps: 0, max_repeat_action: 3, no_progress_window: 4}\n",
     r"teams\[0\].policies\[0\].step_limits.max_steps"),
    ("teams:\n  - slug: billing\n", "no team 'support'"),
    ("teams:\n  - slug: support\n    policies: []\n", "no policy 'default'"),
    ("name: other\nstep_limits: {max_steps: 5, max_repeat_action: 3, no_progress_window: 4}\n",
     "is policy 'other', not 'default'"),
    ("name: default\nstep_limits: {max_steps: 5, max_repeat_action: 3}\n",
     "step_limits.no_progress_window"),
])
def test_an_invalid_draft_is_refused_with_the_reason(team, tmp_path, text, message):
    path = tmp_path / "draft.yaml"
    path.write_text(text)
    with pytest.raises(CommandError, match=message):
        call_command("backtest", "--team", "support", "--policy", "default", "--file",
                     str(path), stdout=StringIO())


def test_a_single_policy_document_is_a_draft(api, team, tmp_path):
    set_policy(team, step_limits={"max_repeat_action": 1000})
    record(api, [{"args": {"q": "same"}}] * 6)
    path = tmp_path / "one.yaml"
    path.write_text("name: default\nstep_limits: {max_steps: 18, max_repeat_action: 2, "
                    "no_progress_window: 4}\n")
    assert only_change(backtest(team, "--file", str(path)))["draft"]["step"] == 3


def test_it_writes_nothing_and_reads_in_a_few_queries(api, team, tmp_path):
    set_policy(team, step_limits={"max_repeat_action": 1000, "max_steps": 100})
    for n in (5, 20, 40):
        record(api, [{"args": {"q": "same"}}] * n)
    before = (list(Run.objects.order_by("pk").values()),
              list(Decision.objects.order_by("pk").values()))
    with CaptureQueriesContext(connection) as queries:
        result = backtest(team, "--file", draft_file(tmp_path, team,
                                                     step_limits={"max_repeat_action": 3}))
    assert result["changed"] == 3
    statements = [q["sql"].lstrip().split()[0].upper() for q in queries.captured_queries]
    # (DECLARE: PostgreSQL's server-side cursor, which streams the decisions.)
    assert set(statements) <= {"SELECT", "DECLARE"}, statements
    # The team, the policy, its versions, the runs, one chunk of decisions, the recorded
    # version: a fixed few, never one per run or per decision (65 of them here).
    reads = [q["sql"] for q in queries.captured_queries]
    assert len(reads) <= 7, reads
    assert len([sql for sql in reads if '"runs_decision"' in sql]) == 1
    after = (list(Run.objects.order_by("pk").values()),
             list(Decision.objects.order_by("pk").values()))
    assert before == after


def test_money_is_replayed_to_the_micro_dollar(api, team, tmp_path):
    set_policy(team, budgets=NO_BUDGETS)
    record(api, [{"args": {"q": i}, "cost_usd": 0.1000005} for i in range(4)])
    assert Decision.objects.first().cost_usd == Decimal("0.100001")
    result = backtest(team, "--file", draft_file(tmp_path, team, budgets={"max_usd": 0.300003}))
    assert only_change(result)["draft"]["step"] == 3


# --- What the check records -----------------------------------------------------------------

@pytest.mark.django_db(transaction=True)
def test_the_production_check_path_records_the_elapsed_seconds(agent):
    """Over HTTP, on the server's own path (raw SQL on PostgreSQL): every decision carries
    the run's elapsed seconds as the check counted them."""
    run_id = agent.start()["run_id"]
    answers = [agent.check(run_id, args={"q": i}) for i in range(3)]
    rows = list(Decision.objects.filter(run_id=run_id).order_by("id"))
    elapsed = [row.elapsed_s for row in rows]
    assert all(e is not None and e >= 0 for e in elapsed) and elapsed == sorted(elapsed)
    for row, answer in zip(rows, answers, strict=True):
        assert round(row.elapsed_s, 3) == answer["usage"]["elapsed_s"]
        run = Run.objects.get(pk=run_id)
        assert row.elapsed_s == pytest.approx((row.at - run.started_at).total_seconds())


@pytest.mark.postgres
def test_the_elapsed_seconds_are_append_only_too(api, team):
    from django.db import DatabaseError, transaction

    run_id = start(api)
    decision_id = check(api, run_id)["decision_id"]
    with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
        Decision.objects.filter(pk=decision_id).update(elapsed_s=999)
    assert Decision.objects.get(pk=decision_id).elapsed_s < 999
