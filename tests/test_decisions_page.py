"""A page of a run's decisions passes each decision's args and progress through as the
database keeps their text (runs/audit/selectors.py `decisions_page`): the values an agent
reads back are the ones it sent, whatever their kind, on both stores and both APIs."""

from __future__ import annotations

import json
from typing import Any

import pytest

from policies.tokens import operator_token_create
from runs.models import Decision

# Each kind of value the decoded path gave back: text beyond ASCII, an integer beyond 64
# bits (orjson's limit), floats, nesting, nulls, booleans, empty containers. (PostgreSQL's
# jsonb keeps a float of 300 digits as their integer, decoded or passed through alike.)
ARGS: list[dict[str, Any]] = [
    {"q": "café ☕ \u00e9\u0301", "n": 2**70, "f": 0.1, "g": 1e-7},
    {"nested": {"list": [1, [2, [3, {"deep": None}]]], "yes": True, "no": False}},
    {},
    {"empty": [], "also": {}, "quote": "a \"quoted\" \\ back\nslash", "zero": 0},
]
PROGRESS: list[Any] = ["page 3", 1.5, 2**70, None]


@pytest.fixture
def run_with_decisions(api: Any) -> str:
    run_id = api.post("/api/v1/runs", {"agent": "pager"}, content_type="application/json"
                      ).json()["run_id"]
    for i, (args, progress) in enumerate(zip(ARGS, PROGRESS, strict=True)):
        body: dict[str, Any] = {"action": {"name": f"tool{i}.call", "args": args}}
        if progress is not None:
            body["progress"] = progress
        answer = api.post(f"/api/v1/runs/{run_id}/check", json.dumps(body),
                          content_type="application/json")
        assert answer.status_code == 200, answer.content
    assert api.post(f"/api/v1/runs/{run_id}/finish", {"status": "completed"},
                    content_type="application/json").status_code == 200
    return run_id


def _as_read(decision: Decision) -> dict[str, Any]:
    """A decision as the page said it before the pass-through: from the decoded row."""
    return {"id": decision.pk, "step": decision.step, "outcome": decision.outcome,
            "reason": decision.reason,
            "action": {"name": decision.action_name, "type": decision.action_type,
                       "args": decision.args} if decision.action_name else None,
            "repeat_key": decision.repeat_key, "repeat_count": decision.repeat_count,
            "progress": decision.progress, "local": False, "policy_violation": False,
            "violation": None,
            "rule": decision.rule}


def test_a_page_gives_back_every_kind_of_value_as_sent(api: Any, run_with_decisions: str):
    answer = api.get(f"/api/v1/runs/{run_with_decisions}/decisions")
    assert answer.status_code == 200
    assert answer["Content-Type"] == "application/json"
    page = answer.json()["decisions"]
    assert [d["action"]["args"] for d in page] == ARGS
    assert [d["progress"] for d in page] == PROGRESS
    stored = Decision.objects.filter(run_id=run_with_decisions).order_by("pk")
    assert [{k: v for k, v in d.items() if k != "at"} for d in page] == [
        _as_read(d) for d in stored]
    # Times as the API's other times: milliseconds and "Z".
    assert all(d["at"].endswith("Z") and len(d["at"]) in (20, 24) for d in page)


def test_the_operator_api_gives_the_same_page(api: Any, run_with_decisions: str, client: Any,
                                              team: Any, users: Any):
    token = operator_token_create(user=users["viewer"], name="pager", role="viewer",
                                  team=team).secret
    first = Decision.objects.filter(run_id=run_with_decisions).order_by("pk").first()
    page = f"decisions?limit=2&after={first.pk}"
    agents = api.get(f"/api/v1/runs/{run_with_decisions}/{page}").json()
    operators = client.get(f"/api/v1/teams/{team.slug}/runs/{run_with_decisions}/{page}",
                           HTTP_AUTHORIZATION=f"Bearer {token}")
    assert operators.status_code == 200, operators.content
    assert operators.json() == agents
    assert [d["step"] for d in agents["decisions"]] == [2, 3]
