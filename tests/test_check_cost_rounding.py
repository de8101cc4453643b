"""One parse for one input (issue 25): a check, an uploaded local decision and a decision the
client makes itself during an outage count one cost the same way, in millionths of a dollar
rounded half up (`rules.make_check`). 0.0000025 once counted 0.000002 when uploaded."""

from __future__ import annotations

import json
from decimal import Decimal

import pytest
from django.test import Client

from governance_client import local, rules

pytestmark = pytest.mark.django_db


def start(api: Client) -> str:
    response = api.post("/api/v1/runs", {"agent": "support-bot"},
                        content_type="application/json")
    assert response.status_code == 201, response.content
    return response.json()["run_id"]


def run_cost(api: Client, run_id: str) -> float:
    return api.get(f"/api/v1/runs/{run_id}").json()["cost_usd"]


def test_a_checked_and_an_uploaded_cost_round_alike(api: Client) -> None:
    checked, uploaded = start(api), start(api)
    response = api.post(f"/api/v1/runs/{checked}/check",
                        {"action": {"name": "x"}, "cost_usd": 0.0000025},
                        content_type="application/json")
    assert response.status_code == 200, response.content
    response = api.post(f"/api/v1/runs/{uploaded}/local-decisions", json.dumps({"decisions": [
        {"check_id": "l-1", "action": {"name": "x"}, "cost_usd": 0.0000025,
         "decision": "allow", "reason": "step_ok"}]}), content_type="application/json")
    assert response.status_code == 200, response.content

    assert run_cost(api, checked) == run_cost(api, uploaded) == 0.000003


def test_the_client_counts_a_cost_as_the_service_does() -> None:
    assert local.make_check("x", None, cost_usd=0.0000025).cost_usd == Decimal("0.000003")
    assert rules.usd(None) == Decimal(0)
