"""The check's JSON (governance/fastjson.py): orjson where it can, the standard library for
what orjson refuses, the same values either way, and never an error for what a client may
send."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import pytest

from governance import fastjson
from runs.models import Decision


def test_the_values_of_a_check_come_out_as_the_standard_library_writes_them() -> None:
    run = uuid.uuid4()
    document = {
        "run_id": run, "at": datetime(2026, 12, 1, 17, 0, 0, 123, tzinfo=UTC),
        "whole_second": datetime(2026, 12, 1, 17, 0, tzinfo=UTC),
        "elsewhere": datetime(2026, 12, 1, 17, 0, tzinfo=timezone(timedelta(hours=2))),
        "cost_usd": Decimal("0.001500"), "args": {"q": "café ☕", "n": [1, 2.5, None, True]},
    }
    made = fastjson.dumps(document)
    assert isinstance(made, str)
    assert json.loads(made) == json.loads(json.dumps(document, default=fastjson._scalar))
    assert json.loads(made)["at"] == "2026-12-01T17:00:00.000123+00:00"
    assert json.loads(made)["elsewhere"] == "2026-12-01T17:00:00+02:00"
    assert json.loads(made)["cost_usd"] == "0.001500"
    assert json.loads(made)["run_id"] == str(run)


@pytest.mark.parametrize("value", [10**30, -(10**20), "\ud800 alone"],
                         ids=["big integer", "big negative", "lone surrogate"])
def test_what_orjson_refuses_falls_back_to_the_standard_library(value: Any) -> None:
    made = fastjson.dumps({"args": {"v": value}})
    assert json.loads(made) == {"args": {"v": value}}


def test_an_unknown_type_is_still_a_type_error() -> None:
    with pytest.raises(TypeError):
        fastjson.dumps({"x": object()})


@pytest.mark.django_db(transaction=True)  # on PostgreSQL, the check's own two-statement path
def test_a_check_with_an_integer_beyond_64_bits_in_its_args_is_answered_and_audited(
        api: Any) -> None:
    run_id = api.post("/api/v1/runs", {"agent": "bot"},
                      content_type="application/json").json()["run_id"]
    response = api.post(f"/api/v1/runs/{run_id}/check",
                        json.dumps({"action": {"name": "calc", "args": {"n": 10**30}}}),
                        content_type="application/json")
    assert response.status_code == 200, response.content
    assert response.json()["decision"] == "allow"
    assert Decision.objects.get(run_id=run_id).args == {"n": 10**30}
