"""`govctl` (SPEC 17) against the real multi-process server: a policy file applied twice (the
second time nothing changes), a dry run that shows the diff and the backtest, a kill switch
engaged and released, an approval listed and decided, a refusal that exits 1 with its reason."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from governance_client.govctl import main

from policies.document import DocumentError, load_yaml, parse_document
from policies.models import OperatorEvent, PolicyVersion, Team
from policies.tokens import operator_token_create
from runs.models import KillSwitch
from tests.conftest import Agent, Server, set_policy
from tests.workers import Worker, new_worker, workers_fixture  # noqa: F401 (fixture)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

FILE = """\
teams:
  - slug: support
    name: Customer support
    policies:
      - name: default
        step_limits: {max_steps: 2, max_repeat_action: 3, no_progress_window: 4}
        approvals: {tools: ["payments.*"], timeout_s: 600}
      - name: strict
        step_limits: {max_steps: 5, max_repeat_action: 2, no_progress_window: 3}
"""


def govctl(server: Server, token: str, *args: str) -> tuple[int, str, str]:
    out = io.StringIO()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["--url", server.url, "--token", token, *args], out=out)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def admin_token(users: dict[str, Any]) -> str:
    return operator_token_create(user=users["admin"], name="ci", role="admin").secret


def test_apply_twice_and_a_dry_run_with_its_backtest(server: Server, agent: Agent, team: Team,
                                                     admin_token: str, tmp_path: Path,
                                                     workers: list[Worker]):
    if not settings.CELERY_TASK_ALWAYS_EAGER:
        new_worker(workers)  # the backtest is replayed on the workers' bulk queue
    # Recorded runs for the backtest: three steps each, completed.
    for _ in range(2):
        run = agent.start()
        for i in range(3):
            agent.check(run["run_id"], args={"i": i})
        agent.http.post(f"/api/v1/runs/{run['run_id']}/finish", json={"status": "completed"})
    path = tmp_path / "policies.yaml"
    path.write_text(FILE)

    code, out, err = govctl(server, admin_token, "policies", "apply", str(path), "--dry-run")
    assert code == 0, err
    assert "policy support/default: would change" in out
    assert "+  max_steps: 2" in out or "max_steps: 2" in out
    assert ("backtest: 2 of the 2 ended runs of support/default started within 30 days (the "
            "newest 1,000 at most), replayed whole, would change (2 stopped by max_steps).") \
        in out
    assert "policy support/strict: new" in out
    assert not PolicyVersion.objects.filter(policy__name="strict").exists()

    code, out, err = govctl(server, admin_token, "policies", "apply", str(path))
    assert code == 0, err
    assert "policy support/default: version" in out and "policy support/strict: version 1" in out
    event = OperatorEvent.objects.filter(action="policy.version").order_by("-id").first()
    assert event.detail["token"]["name"] == "ci"

    code, out, err = govctl(server, admin_token, "policies", "apply", str(path))
    assert (code, out.strip()) == (0, "nothing changed"), err

    code, exported, err = govctl(server, admin_token, "policies", "export", "--team", "support")
    assert code == 0 and "name: strict" in exported and "max_steps: 2" in exported
    again = tmp_path / "exported.yaml"
    again.write_text(exported)
    assert govctl(server, admin_token, "policies", "apply", str(again))[1].strip() == \
        "nothing changed"


def test_refusals_exit_1_with_the_reason(server: Server, team: Team, users: dict[str, Any],
                                         admin_token: str, tmp_path: Path):
    viewer = operator_token_create(user=users["viewer"], name="ro", role="viewer").secret
    path = tmp_path / "policies.yaml"
    path.write_text(FILE)
    code, _, err = govctl(server, viewer, "policies", "apply", str(path))
    assert code == 1 and "forbidden (403)" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text(FILE.replace("max_steps: 2", "max_steps: -2"))
    code, _, err = govctl(server, admin_token, "policies", "apply", str(bad))
    assert code == 1 and "step_limits.max_steps" in err
    code, _, err = govctl(server, "gov_op_000000000000_nope", "approvals", "list",
                          "--team", "support")
    assert code == 1 and "unauthorized (401)" in err
    code, _, err = govctl(server, admin_token, "approvals", "list", "--team", "nope")
    assert code == 1 and "not_found (404)" in err
    nowhere = tmp_path / "nowhere.yaml"
    nowhere.write_text(FILE.replace("slug: support", "slug: no-such-team"))
    code, _, err = govctl(server, admin_token, "policies", "apply", str(nowhere))
    assert code == 1 and "not_found (404)" in err, err
    assert "the token sees no team 'no-such-team'" in err and "apply_policies" in err


def test_a_file_with_one_refused_policy_saves_none_of_it(server: Server, team: Team,
                                                          admin_token: str, tmp_path: Path,
                                                          workers: list[Worker]):
    """All or nothing: the valid `default` before the invalid `strict` is not saved either,
    and a dry run says the apply would be refused (a new policy is validated too)."""
    if not settings.CELERY_TASK_ALWAYS_EAGER:
        new_worker(workers)  # the dry run's backtest is replayed on the workers' bulk queue
    before = PolicyVersion.objects.filter(policy__team=team, policy__name="default").count()
    bad = tmp_path / "half.yaml"
    bad.write_text(FILE.replace("max_steps: 5", "max_steps: -5"))
    code, out, err = govctl(server, admin_token, "policies", "apply", str(bad))
    assert code == 1, out
    assert "policy support/strict: invalid_request (422)" in err and "step_limits" in err
    assert "nothing saved: 1 of 2 policies refused" in err
    assert PolicyVersion.objects.filter(policy__team=team, policy__name="default").count() \
        == before
    assert not PolicyVersion.objects.filter(policy__name="strict").exists()
    # The dry run shows the valid change, then the refusal, and fails as the apply would.
    code, out, err = govctl(server, admin_token, "policies", "apply", str(bad), "--dry-run")
    assert code == 1 and "policy support/default: would change" in out
    assert "policy support/strict: invalid_request (422)" in err
    assert PolicyVersion.objects.filter(policy__team=team, policy__name="default").count() \
        == before


@pytest.mark.parametrize("extra", ["dry_run: true", "note: from the file",
                                   "confirm_stops: true"])
def test_a_policys_request_key_is_an_unknown_field_as_apply_policies_says(
        server: Server, team: Team, admin_token: str, tmp_path: Path, extra: str):
    """Found by a tester: a policy's `dry_run: true` made govctl's save a dry run, and it
    printed "version 1" of a policy the server saved nowhere. Refused as `manage.py
    apply_policies` refuses the file, in its words, and nothing sent."""
    path = tmp_path / "p.yaml"
    path.write_text(FILE.replace("      - name: strict\n",
                                 f"        {extra}\n      - name: strict\n"))
    with pytest.raises(DocumentError) as refused:
        parse_document(load_yaml(path.read_text()))
    (said,) = [f"{field}: {problem}" for field, problem in refused.value.errors.items()]
    before = PolicyVersion.objects.count()
    code, out, err = govctl(server, admin_token, "policies", "apply", str(path))
    assert code == 1 and f"govctl: {said}" in err, err
    assert "version" not in out and PolicyVersion.objects.count() == before
    assert not OperatorEvent.objects.filter(action="token.dry_run").exists()


def test_a_change_to_confirm_names_the_flag_and_a_dry_run_fails_on_it(
        server: Server, agent: Agent, team: Team, admin_token: str, tmp_path: Path,
        workers: list[Worker]):
    if not settings.CELERY_TASK_ALWAYS_EAGER:
        new_worker(workers)  # the dry run's backtest is replayed on the workers' bulk queue
    for _ in range(3):  # recent runs that a deny-all would stop at their first step
        run = agent.start()
        agent.check(run["run_id"], name="search.docs")
        agent.http.post(f"/api/v1/runs/{run['run_id']}/finish", json={"status": "completed"})
    deny_all = tmp_path / "deny.yaml"
    deny_all.write_text("teams:\n  - slug: support\n    policies:\n      - name: default\n"
                        "        step_limits: {max_steps: 50, max_repeat_action: 3, "
                        "no_progress_window: 4}\n        tools: {deny: ['*']}\n")
    for extra in ((), ("--dry-run",)):
        code, out, err = govctl(server, admin_token, "policies", "apply", str(deny_all),
                                *extra)
        assert code == 1 and "confirmation_required (409)" in err, err
        assert "--confirm-stops" in err and "first step: tool_denied 3." in err, err
        # The numbers once (found by a newcomer: the impacts repeated the message's).
        assert err.count("would stop 3 of") == 1, err
        # One instruction, govctl's (found by a newcomer: the API's JSON field was named too).
        assert "confirm_stops" not in err, err
    # The dry run shows the change it could not make without the flag: its diff and backtest
    # (found by a newcomer: it showed the refusal alone).
    assert "policy support/default: would change" in out and "+  - '*'" in out, out
    assert "backtest: " in out, out
    # Counted once, as refused (found by a newcomer: "1 of 2 policies refused" of one).
    assert "1 policy would change only with --confirm-stops" in out, out
    assert "nothing saved: 1 of 1 policy refused" in err and "the save's own check" in err, err
    code, out, err = govctl(server, admin_token, "policies", "apply", str(deny_all),
                            "--confirm-stops")
    assert code == 0 and "policy support/default: version" in out, err


def test_killswitch_engage_and_release(server: Server, agent: Agent, team: Team,
                                       admin_token: str):
    args = ["--scope", "agent", "--team", "support", "--agent", "support-bot"]
    code, out, err = govctl(server, admin_token, "killswitch", "engage", *args,
                            "--reason", "runaway bot")
    assert code == 0 and "engaged" in out, err
    assert agent.http.post("/api/v1/runs", json={"agent": "support-bot"}).status_code == 409
    code, out, _ = govctl(server, admin_token, "killswitch", "engage", *args, "--reason", "x")
    # Whose switch it is and why: the second on-call's reason was not recorded.
    assert "already engaged by admin (token ci)" in out and ": runaway bot" in out, out
    assert "nothing changed" in out
    code, out, err = govctl(server, admin_token, "killswitch", "release", *args,
                            "--reason", "fixed")
    assert code == 0 and "released" in out, err
    assert not KillSwitch.objects.filter(active=True).exists()
    assert agent.http.post("/api/v1/runs", json={"agent": "support-bot"}).status_code == 201


def test_approvals_list_and_decide(server: Server, agent: Agent, team: Team, admin_token: str):
    set_policy(team, approvals={"tools": ["payments.*"], "timeout_s": 600})
    run = agent.start()
    answer = agent.check(run["run_id"], name="payments.refund", args={"order": 7},
                         check_id="pay")
    assert answer["decision"] == "pending"
    approval_id = answer["approval"]["id"]
    code, out, err = govctl(server, admin_token, "approvals", "list", "--team", "support")
    assert code == 0 and approval_id in out and "payments.refund" in out, err
    # When it expires, to the second in UTC as a person reads it (the API's microseconds
    # stay in --json).
    assert re.search(r"expires \d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ$", out.strip()), out
    code, out, err = govctl(server, admin_token, "approvals", "decide", approval_id, "approve",
                            "--note", "ok from chat")
    assert (code, out.strip()) == (0, f"{approval_id}: approved"), err
    code, _, err = govctl(server, admin_token, "approvals", "decide", approval_id, "deny",
                          "--note", "too late")
    assert code == 1 and "approval_decided (409)" in err
    assert govctl(server, admin_token, "approvals", "list", "--team", "support")[1].strip() \
        == "no pending approvals"


def test_runs_list(server: Server, agent: Agent, team: Team, admin_token: str):
    # Found by a newcomer: the operator API lists runs, govctl had no command for it.
    done = agent.start()["run_id"]
    agent.http.post(f"/api/v1/runs/{done}/finish", json={"status": "completed"})
    running = agent.start()["run_id"]
    code, out, err = govctl(server, admin_token, "runs", "list", "--team", "support")
    assert code == 0, err
    lines = out.splitlines()
    assert [line.split()[0] for line in lines] == [running, done]
    assert lines[0].split()[1] == "running" and lines[1].split()[1] == "completed"
    assert all(re.search(r"started \d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ$", line)
               for line in lines), out
    code, out, err = govctl(server, admin_token, "runs", "list", "--team", "support",
                            "--status", "running", "--json")
    assert code == 0, err
    assert [r["run_id"] for r in json.loads(out)] == [running]
    code, _, err = govctl(server, admin_token, "runs", "list", "--team", "support",
                          "--limit", "0")
    assert code == 1 and "invalid_request (422)" in err and "limit" in err


def test_runs_show_and_decisions(server: Server, agent: Agent, team: Team, admin_token: str):
    # Found by a newcomer: reading a run's decisions, and why each was made, took curl.
    set_policy(team, step_limits={"max_steps": 2})
    run = agent.start()["run_id"]
    answers = [agent.check(run, args={"i": i}) for i in range(3)]
    code, out, err = govctl(server, admin_token, "runs", "show", run, "--team", "support")
    assert code == 0, err
    shown = json.loads(out)
    assert (shown["run_id"], shown["status"], shown["stop_reason"]) == (run, "stopped", "max_steps")
    code, out, err = govctl(server, admin_token, "runs", "decisions", run, "--team", "support")
    assert code == 0, err
    lines = out.splitlines()
    assert [int(line.split()[0]) for line in lines] == [a["decision_id"] for a in answers]
    assert lines[0].split()[3:6] == ["allow", "step_ok", "search.docs"]
    assert "[max_steps: limit max_steps=2; observed steps=3]" in lines[2], lines[2]
    code, out, err = govctl(server, admin_token, "runs", "decisions", run, "--team", "support",
                            "--after", str(answers[0]["decision_id"]), "--json")
    assert code == 0, err
    assert [d["rule"] for d in json.loads(out)] == [a["rule"] for a in answers[1:]]
    code, _, err = govctl(server, admin_token, "runs", "decisions", "../x", "--team", "support")
    assert code == 1 and "not a name the API has" in err


def test_a_policy_that_denies_every_tool_is_said_out_loud(server: Server, team: Team,
                                                         admin_token: str, tmp_path: Path):
    # Found by a newcomer: `tools: {allow: []}` showed as one line of the policy, unexplained.
    def lockdown(allow: str) -> Path:
        path = tmp_path / "lockdown.yaml"
        path.write_text("teams:\n  - slug: support\n    policies:\n      - name: lockdown\n"
                        "        step_limits: {max_steps: 9, max_repeat_action: 3, "
                        "no_progress_window: 4}\n"
                        f"        tools: {{allow: {allow}}}\n")
        return path

    for extra in (["--dry-run"], []):
        code, out, err = govctl(server, admin_token, "policies", "apply", str(lockdown("[]")),
                                *extra)
        assert code == 0, err
        assert "every tool of every run of this policy is denied" in out, out
    code, out, err = govctl(server, admin_token, "policies", "apply",
                            str(lockdown("[search.*]")))
    assert code == 0 and "version 2" in out and "is denied" not in out, (out, err)


def test_a_team_name_or_webhook_url_govctl_does_not_apply_is_said_so(
        server: Server, team: Team, admin_token: str, tmp_path: Path, workers: list[Worker]):
    """A repository's new webhook URL is not applied by govctl (the team's settings are its
    admins'): the apply says so instead of a bare "nothing changed"."""
    if not settings.CELERY_TASK_ALWAYS_EAGER:
        new_worker(workers)  # the dry run's backtest is replayed on the workers' bulk queue
    path = tmp_path / "policies.yaml"
    path.write_text(FILE.replace("name: Customer support",
                                 "name: Support\n    webhook_url: https://hooks.example.com/new"))
    code, out, err = govctl(server, admin_token, "policies", "apply", str(path), "--dry-run")
    assert code == 0, err
    assert ("team support: name and webhook_url in the file differ from the server's and are "
            "not changed by govctl") in out
    code, out, err = govctl(server, admin_token, "policies", "apply", str(path))
    assert code == 0, err
    assert "webhook_url in the file differ" in out
    team.refresh_from_db()
    assert (team.name, team.webhook_url) == ("Customer support", None)
    # The file as the server has it: not a word.
    path.write_text(FILE)
    code, out, err = govctl(server, admin_token, "policies", "apply", str(path))
    assert code == 0, err
    assert "differ" not in out and out.strip() == "nothing changed"
