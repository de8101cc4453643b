"""Size limits on every field and body, and hostile JSON (deep, huge, odd numbers, odd
Unicode): refused with 413 or 422 naming the field, quickly, and nothing is stored; what is
within the limits is accepted, exactly at the limit included. tests/test_api_errors.py has
the first-line cases; these are the edges."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from django.test import Client

from runs.models import Decision, Run

pytestmark = pytest.mark.django_db

# "Never a slow request": far above what any of these takes (milliseconds), far below what an
# unbounded parse of the hostile ones would (a 900 KB number, JSON 100,000 deep: minutes), and
# above a stall of CI's six groups on two cores (a start took 4.6 s once).
FAST_S = 5.0


def post(api: Client, path: str, body: Any) -> Any:
    raw = body if isinstance(body, str | bytes) else json.dumps(body)
    started = time.monotonic()
    response = api.post(path, raw, content_type="application/json")
    assert time.monotonic() - started < FAST_S, f"{path} took too long"
    assert response["Content-Type"].startswith("application/json")
    return response


def refused(response: Any, status: int, field: str | None = None) -> None:
    assert response.status_code == status, response.content
    if field is not None:
        assert field in response.json()["error"]["fields"], response.json()


@pytest.fixture
def run_id(api: Client) -> str:
    # Not timed: a start is no bad input, and under CI's load one took 4.6 s once.
    return api.post("/api/v1/runs", json.dumps({"agent": "bot"}),
                    content_type="application/json").json()["run_id"]


def check(api: Client, run_id: str, **body: Any) -> Any:
    return post(api, f"/api/v1/runs/{run_id}/check", {"action": {"name": "x"}, **body})


# --- Every string field: the limit is accepted, one more is refused ------------------------

@pytest.mark.parametrize(("field", "limit"), [
    ("action.name", 200), ("check_id", 100), ("progress", 256), ("last_result.digest", 128),
    ("last_result.error", 2000), ("last_result.summary", 2000),
])
@pytest.mark.both_stores
def test_each_check_field_takes_exactly_its_limit(
        api: Client, run_id: str, field: str, limit: int) -> None:
    def body(text: str) -> dict[str, Any]:
        if field == "action.name":
            return {"action": {"name": text}}
        if field.startswith("last_result."):
            return {"action": {"name": "x"},
                    "last_result": {"status": "error", field.split(".")[1]: text}}
        return {"action": {"name": "x"}, field: text}

    path = f"/api/v1/runs/{run_id}/check"
    # Multi-byte characters: limits count characters, not bytes.
    assert post(api, path, body("é" * limit)).status_code == 200
    refused(post(api, path, body("é" * (limit + 1))), 422, field)


@pytest.mark.parametrize(("field", "limit"), [("task", 10_000), ("external_id", 200),
                                              ("agent", 100)])
def test_each_start_field_takes_exactly_its_limit(api: Client, field: str, limit: int) -> None:
    value = "a" * limit
    assert post(api, "/api/v1/runs", {"agent": "bot", field: value}).status_code == 201
    refused(post(api, "/api/v1/runs", {"agent": "bot", field: value + "a"}), 422, field)
    assert Run.objects.count() == 1


def test_a_finish_output_of_100000_characters_is_accepted_though_over_64_kib(
        api: Client, run_id: str) -> None:
    # The 64 KiB cap is the check's (SPEC 5.3); a final answer may be longer.
    output = "ü" * 100_000  # 200,000 bytes as UTF-8
    response = api.post(f"/api/v1/runs/{run_id}/finish",
                        json.dumps({"status": "completed", "output": output}, ensure_ascii=False),
                        content_type="application/json")
    assert response.status_code == 200, response.content[:300]
    assert Run.objects.get(pk=run_id).output == output


def test_a_finish_output_over_its_limit_is_refused(api: Client, run_id: str) -> None:
    refused(post(api, f"/api/v1/runs/{run_id}/finish",
                 {"status": "completed", "output": "a" * 100_001}), 422, "output")
    assert Run.objects.get(pk=run_id).finished_at is None


@pytest.mark.parametrize("path", ["/api/v1/runs", "/api/v1/runs/{run}/finish"])
def test_other_bodies_over_1_mib_are_refused_with_413(api: Client, run_id: str, path: str) -> None:
    body = {"agent": "bot", "status": "completed", "task": "t", "output": "o" * (1024 * 1024)}
    refused(post(api, path.format(run=run_id), body), 413)
    assert Run.objects.count() == 1 and Run.objects.get().finished_at is None


# --- Run metadata: size and depth ------------------------------------------------------------

def test_metadata_up_to_16_kib_is_kept_and_more_is_refused(api: Client) -> None:
    small = {"labels": ["x" * 100] * 150}  # about 15.5 KiB as JSON
    assert post(api, "/api/v1/runs", {"agent": "bot", "metadata": small}).status_code == 201
    big = {"labels": ["x" * 100] * 170}
    refused(post(api, "/api/v1/runs", {"agent": "bot", "metadata": big}), 422, "metadata")
    assert [r.metadata for r in Run.objects.all()] == [small]


def test_metadata_nested_deeper_than_32_levels_is_refused(api: Client) -> None:
    def nested(depth: int) -> dict[str, Any]:
        node: dict[str, Any] = {}
        top = node
        for _ in range(depth - 1):
            node["n"] = {}
            node = node["n"]
        return top

    assert post(api, "/api/v1/runs", {"agent": "bot", "metadata": nested(32)}).status_code == 201
    refused(post(api, "/api/v1/runs", {"agent": "bot", "metadata": nested(33)}), 422,
            "metadata")
    assert Run.objects.count() == 1


@pytest.mark.parametrize("where", ["metadata", "args"])
def test_very_deep_json_anywhere_is_refused_fast_without_a_crash(
        api: Client, run_id: str, where: str) -> None:
    deep = '{"a": ' * 100_000 + "1" + "}" * 100_000  # far past any recursion limit
    if where == "metadata":
        raw = '{"agent": "bot", "metadata": ' + deep + "}"
        response = post(api, "/api/v1/runs", raw)
    else:
        raw = '{"action": {"name": "x", "args": ' + '[' * 30_000 + "]" * 30_000 + "}}"
        response = post(api, f"/api/v1/runs/{run_id}/check", raw)
    assert response.status_code in (400, 413, 422)
    assert Run.objects.count() == 1 and not Decision.objects.exists()


# --- Numbers -----------------------------------------------------------------------------------

@pytest.mark.parametrize("cost", ["1e308", "1000000.000001", str(10**30), "1e400", "-0.000001"])
def test_cost_outside_0_to_1_million_is_refused(api: Client, run_id: str, cost: str) -> None:
    raw = '{"action": {"name": "x"}, "cost_usd": ' + cost + "}"
    refused(post(api, f"/api/v1/runs/{run_id}/check", raw), 422, "cost_usd")
    assert not Decision.objects.exists()


@pytest.mark.both_stores
def test_a_tiny_cost_rounds_to_the_micro_dollar(api: Client, run_id: str) -> None:
    assert check(api, run_id, cost_usd=1e-300).json()["usage"]["cost_usd"] == 0
    assert check(api, run_id, cost_usd=0.0000005).json()["usage"]["cost_usd"] == 0.000001


def test_a_number_too_large_to_be_finite_is_refused_in_args_and_metadata(
        api: Client, run_id: str) -> None:
    refused(post(api, f"/api/v1/runs/{run_id}/check",
                 '{"action": {"name": "x", "args": {"n": 1e400}}}'), 422, "action.args")
    refused(post(api, "/api/v1/runs", '{"agent": "bot", "metadata": {"n": -1e999}}'), 422,
            "metadata")
    refused(post(api, f"/api/v1/runs/{run_id}/check",
                 '{"action": {"name": "x"}, "progress": 1e400}'), 422, "progress")
    assert Run.objects.count() == 1 and not Decision.objects.exists()


@pytest.mark.both_stores
def test_big_integers_are_kept_exactly_up_to_what_json_parsing_allows(
        api: Client, run_id: str) -> None:
    huge = 10**4000 + 7
    first = post(api, f"/api/v1/runs/{run_id}/check",
                 json.dumps({"action": {"name": "x", "args": {"n": huge}}, "progress": huge}))
    assert first.status_code == 200
    assert Decision.objects.get(pk=first.json()["decision_id"]).args == {"n": huge}
    again = post(api, f"/api/v1/runs/{run_id}/check",
                 json.dumps({"action": {"name": "x", "args": {"n": huge}}}))
    assert again.json()["repeat_key"] == first.json()["repeat_key"]
    # Past 4300 digits Python will not turn the text into an int (a CPU-exhaustion guard).
    too_many_digits = '{"action": {"name": "x", "args": {"n": ' + "9" * 5000 + "}}}"
    answer = post(api, f"/api/v1/runs/{run_id}/check", too_many_digits)
    refused(answer, 400)
    assert answer.json()["error"] == {"code": "invalid_json", "fields": {},
                                      "message": "A number in the request body has more "
                                                 "than 4300 digits."}
    upload = '{"decisions": [{"check_id": "c", "action": {"name": "x"}, "decision": "allow", ' \
        '"reason": "step_ok", "progress": ' + "9" * 5000 + "}]}"
    answer = post(api, f"/api/v1/runs/{run_id}/local-decisions", upload)
    refused(answer, 400)
    assert "more than 4300 digits" in answer.json()["error"]["message"]
    assert Decision.objects.count() == 2


def test_a_body_nested_too_deeply_to_read_says_so(api: Client, run_id: str) -> None:
    # Valid JSON the parser gives up on: the answer said "not valid JSON" (the operator
    # API's bodies go through the same handler).
    deep = "[" * 5000 + "]" * 5000
    for path in (f"/api/v1/runs/{run_id}/check", "/api/v1/runs"):
        answer = api.post(path, deep, content_type="application/json")
        refused(answer, 400)
        assert answer.json()["error"]["message"] == \
            "The request body nests too deeply to be read.", path


# --- Unicode -----------------------------------------------------------------------------------

@pytest.mark.both_stores
def test_any_unicode_text_is_accepted_and_given_back_as_sent(api: Client, run_id: str) -> None:
    args = {"q": "退款政策 🧾", "ключ": "значение", "rtl": "\u202eevil", "zw": "a\u200bb"}
    answer = check(api, run_id, action={"name": "搜索.docs", "args": args}).json()
    assert answer["decision"] == "allow"
    assert answer["repeat_key"].startswith("搜索.docs:")
    listed = api.get(f"/api/v1/runs/{run_id}/decisions").json()["decisions"]
    assert listed[0]["action"] == {"name": "搜索.docs", "type": "tool", "args": args}


@pytest.mark.parametrize(("raw", "field"), [
    ('{"action": {"name": "x\\ud800"}}', "action.name"),
    ('{"action": {"name": "x", "args": {"q": "\\udfff"}}}', "action.args"),
    ('{"action": {"name": "x", "args": {"\\ud800": 1}}}', "action.args"),
    ('{"action": {"name": "x"}, "check_id": "\\ud800"}', "check_id"),
    ('{"action": {"name": "x"}, "last_result": {"status": "error", "error": "\\udc00"}}',
     "last_result.error"),
])
def test_a_lone_surrogate_is_refused_naming_the_field(
        api: Client, run_id: str, raw: str, field: str) -> None:
    # Valid JSON, but no UTF-8 encoder or database accepts it.
    refused(post(api, f"/api/v1/runs/{run_id}/check", raw), 422, field)
    assert not Decision.objects.exists()


@pytest.mark.both_stores
def test_a_surrogate_pair_is_one_character_and_accepted(api: Client, run_id: str) -> None:
    response = post(api, f"/api/v1/runs/{run_id}/check",
                     '{"action": {"name": "x", "args": {"q": "\\ud83d\\ude00"}}}')
    assert response.status_code == 200
    assert Decision.objects.get().args == {"q": "😀"}


@pytest.mark.parametrize("raw", [
    '{"agent": "bot", "task": "a\\u0000b"}',
    '{"agent": "bot", "metadata": {"k\\u0000": 1}}',
    '{"agent": "bot", "external_id": "\\u0000"}',
])
def test_nul_characters_are_refused_when_starting_a_run(api: Client, raw: str) -> None:
    refused(post(api, "/api/v1/runs", raw), 422)
    assert not Run.objects.exists()


def test_a_lone_surrogate_in_metadata_or_task_is_refused(api: Client) -> None:
    refused(post(api, "/api/v1/runs", '{"agent": "bot", "metadata": {"k": "\\ud800"}}'), 422,
            "metadata")
    refused(post(api, "/api/v1/runs", '{"agent": "bot", "task": "\\ud800"}'), 422, "task")
    assert not Run.objects.exists()


# --- Query strings and headers -----------------------------------------------------------------

@pytest.mark.parametrize("query", [f"limit={10**30}", "limit=1e3", "agent=a%00b",
                                   "agent=" + "a" * 101, "agent=has%20space"])
def test_listing_refuses_odd_query_values(api: Client, query: str) -> None:
    refused(api.get(f"/api/v1/runs?{query}"), 422)


@pytest.mark.parametrize("query", [f"after={10**30}", "after=1.5", f"limit={10**30}"])
def test_decisions_listing_answers_odd_query_values_without_an_error(
        api: Client, run_id: str, query: str) -> None:
    response = api.get(f"/api/v1/runs/{run_id}/decisions?{query}")
    assert response.status_code in (200, 422)
    if response.status_code == 200:
        assert response.json() == {"decisions": []}


def test_a_huge_authorization_header_is_just_unauthorized(client: Client) -> None:
    started = time.monotonic()
    response = client.get("/api/v1/runs", HTTP_AUTHORIZATION="Bearer gov_" + "a" * 60_000)
    assert time.monotonic() - started < FAST_S
    assert response.status_code == 401
