"""A check's arguments are stored as PostgreSQL keeps JSON numbers, written out in full:
5e-324 is 325 characters. A body's numbers may not grow that way past a bound, or one 64 KiB
check became a 2.9 MB decision that every read of the run sends again (found by an
attacker: a read of a run's 300 decisions was 885 MB and left its worker at 2 GB)."""

from __future__ import annotations

import json

import pytest

from runs.check.schemas import NUMBERS_WRITTEN_OUT_MAX, CheckIn, _written_out


def _check(args: dict) -> dict:
    return {"action": {"name": "x", "args": args}}


def test_tiny_and_huge_floats_are_counted_as_written_out() -> None:
    assert _written_out(5e-324) > 300 and _written_out(1e308) > 300
    assert _written_out(0.0) == 0 and _written_out(1.5) == 0 and _written_out(-123456.789) == 0


def test_a_body_of_numbers_stored_many_times_their_size_is_refused() -> None:
    body = '{"action": {"name": "x", "args": {"a": [' + ",".join(["5e-324"] * 9000) + "]}}}"
    assert len(body) < 64 * 1024
    with pytest.raises(ValueError, match="written out in full"):
        CheckIn.model_validate(json.loads(body))


@pytest.mark.parametrize("args", [
    {"a": [1.5, 2.25, 1e-3, 6.02e23, -1e15] * 1000},
    {"a": [0.1] * 5000, "b": {"c": 1e-30, "d": 1e30}},
    {"n": 10 ** 40},  # an integer is stored as sent
])
def test_ordinary_numbers_are_taken(args: dict) -> None:
    assert CheckIn.model_validate(_check(args)).action.args == args


@pytest.mark.django_db
def test_the_api_answers_422_naming_the_args(api) -> None:
    started = api.post("/api/v1/runs", {"agent": "amp-bot"}, content_type="application/json")
    run_id = started.json()["run_id"]
    body = '{"action": {"name": "x", "args": {"a": [' + ",".join(["1e308"] * 9000) + "]}}}"
    answer = api.post(f"/api/v1/runs/{run_id}/check", body, content_type="application/json")
    assert answer.status_code == 422, answer.content
    assert "action.args" in answer.json()["error"]["fields"]
    assert NUMBERS_WRITTEN_OUT_MAX >= 1024
