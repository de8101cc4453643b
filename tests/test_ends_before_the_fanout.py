"""An upload of local decisions or a finish sent between a kill switch's engage and its
fan-out (SPEC 6: every running covered run becomes killed, with an audit record; SPEC 10: a
local allow the run's state forbids is flagged). Found by an attacker: both ended the run
`stopped` or `completed` with no kill recorded, the uploaded allows not flagged, and the
fan-out then passed the run by, so an agent could erase its kill. Now each kills a covered
run first, under the run's lock, exactly as the fan-out would; a check already did
(tests/test_approvals_api.py). Both stacks."""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
from django.test import Client

from policies.models import Team
from runs.killswitch.fanout import killswitch_fanout
from runs.killswitch.services import killswitch_engage
from runs.models import Decision, Run
from tests.test_local_decisions_after_end import post, start

pytestmark = pytest.mark.django_db


def engaged_not_fanned_out(**target: Any) -> int:
    # The fan-out is a Celery task: not run yet (a busy broker, or the usual few ms).
    with mock.patch("runs.killswitch.services._enqueue_fanout"):
        return killswitch_engage(reason="runaway", **target).pk


def upload() -> dict[str, Any]:
    entries = [{"check_id": f"local-{i}", "decision": "allow", "reason": "step_ok",
                "action": {"name": "search", "args": {"i": i}, "type": "tool"}}
               for i in range(3)]
    entries.append({"check_id": "local-stop", "decision": "stop", "reason": "no_progress",
                    "action": {"name": "search", "args": {"i": 9}, "type": "tool"}})
    return {"decisions": entries}


def killed_once(run_id: str) -> None:
    run = Run.objects.get(pk=run_id)
    assert (run.status, run.stop_reason) == ("killed", "killed")
    kills = Decision.objects.filter(run_id=run_id, reason="killed", outcome="stop")
    assert kills.count() == 1, list(kills.values("outcome", "reason", "answer"))


@pytest.mark.parametrize("scope", ["run", "agent", "team"])
def test_an_upload_before_the_fanout_finds_the_run_killed(api: Client, team: Team,
                                                          scope: str) -> None:
    run_id = start(api)
    target: dict[str, Any] = {"run": Run.objects.get(pk=run_id)} if scope == "run" else \
        {"team": team, "agent": "support-bot" if scope == "agent" else ""}
    switch = engaged_not_fanned_out(scope=scope, **target)

    body = post(api, f"/api/v1/runs/{run_id}/local-decisions", upload())
    assert body["http"] == 200 and body["recorded"] == 4, body
    killed_once(run_id)
    uploaded = {d.check_id: d for d in Decision.objects.filter(run_id=run_id,
                                                                check_id__startswith="local-")}
    listed = {d["id"]: d for d in api.get(f"/api/v1/runs/{run_id}/decisions").json()[
        "decisions"]}
    for i in range(3):  # each local allow was decided after the kill: flagged
        page = listed[uploaded[f"local-{i}"].pk]
        assert page["local"] is True and page["policy_violation"] is True, page
    # The fan-out comes later and finds nothing left to kill.
    assert killswitch_fanout(switch_id=switch).killed == []
    killed_once(run_id)


def test_a_finish_before_the_fanout_finds_the_run_killed(api: Client, team: Team) -> None:
    run_id = start(api)
    assert post(api, f"/api/v1/runs/{run_id}/check",
                {"action": {"name": "search", "args": {}}})["decision"] == "allow"
    switch = engaged_not_fanned_out(scope="agent", team=team, agent="support-bot")

    body = post(api, f"/api/v1/runs/{run_id}/finish", {"status": "completed"})
    assert body["http"] == 200, body
    assert (body["status"], body["stop_reason"]) == ("killed", "killed"), body
    killed_once(run_id)
    assert Run.objects.get(pk=run_id).finished_at is not None
    assert killswitch_fanout(switch_id=switch).killed == []


def test_a_childs_finish_and_upload_under_its_parents_switch(api: Client, team: Team) -> None:
    parent = start(api)
    children = [start(api, parent_run_id=parent) for _ in range(2)]
    engaged_not_fanned_out(scope="run", team=team, run=Run.objects.get(pk=parent))

    assert post(api, f"/api/v1/runs/{children[0]}/finish", {"status": "completed"})["status"] \
        == "killed"
    assert post(api, f"/api/v1/runs/{children[1]}/local-decisions", upload())["http"] == 200
    for child in children:
        killed_once(child)


def test_with_no_switch_a_finish_and_an_upload_end_the_run_as_before(api: Client) -> None:
    finished, uploaded = start(api), start(api)
    assert post(api, f"/api/v1/runs/{finished}/finish", {"status": "completed"})["status"] \
        == "completed"
    assert post(api, f"/api/v1/runs/{uploaded}/local-decisions", upload())["http"] == 200
    run = Run.objects.get(pk=uploaded)
    assert (run.status, run.stop_reason, run.steps) == ("stopped", "no_progress", 4)
