"""Schemathesis against the running server's own /api/v1/openapi.json: generated requests,
valid and invalid, to every operation, and sequences that follow a started run through the
OpenAPI links (runs/check/api.py). No 5xx, and every answer conforms to the published schema."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import FlakyStrategyDefinition
from schemathesis import GenerationMode
from schemathesis.checks import negative_data_rejection, positive_data_acceptance

from policies.models import Team
from tests.conftest import Server, set_policy

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

# Bounded for CI: a few hundred requests in all, well under a minute on a small machine.
EXAMPLES_PER_OPERATION = 25
SCENARIOS = 30
QUIET = settings(deadline=None, database=None, suppress_health_check=list(HealthCheck))


@pytest.fixture
def schema(server: Server, team: Team) -> Any:
    # Long runs: generated checks must meet running runs, not only max_steps stops.
    set_policy(team, step_limits={"max_steps": 10000, "max_repeat_action": 1000,
                                  "no_progress_window": 1000}, budgets={"max_seconds": None})
    # NUL characters are drawn too: the API refuses them (no PostgreSQL text column stores
    # one) and the schema says so, `"not": {"pattern": "\\u0000"}` on every text and on
    # every key and string of `args` and `metadata`. Unknown query parameters are ignored,
    # like unknown body fields (SPEC 5.2), not refused. 413 is a right answer to any body
    # over its size cap (64 KiB for a check, SPEC 5.3), which a JSON schema cannot state.
    config = schemathesis.Config.from_dict({
        "generation": {"allow-x00": True, "allow-extra-parameters": False},
        "checks": {
            "positive_data_acceptance": {
                "expected-statuses": ["2xx", "401", "404", "409", "413"]},
            "negative_data_rejection": {
                "expected-statuses": ["400", "401", "404", "405", "409", "413", "422"]},
        },
    })
    return schemathesis.openapi.from_url(f"{server.url}/api/v1/openapi.json", config=config)


def existing_policy(case: Any) -> Any:
    """`policy` names one of the team's policies, like a foreign key: a schema-valid name
    that does not exist is refused with 422 by contract (SPEC 5.1), so valid requests use
    the one that does."""
    if starts_a_valid_run(case) and case.body.get("policy") is not None:
        case.body["policy"] = "default"
    return case


def starts_a_valid_run(case: Any) -> bool:
    """A schema-valid start: invalid ones are left alone, to be refused as drawn."""
    meta = case.meta
    return (case.operation.label == "POST /api/v1/runs" and isinstance(case.body, dict)
            and (meta is None or meta.generation.mode == GenerationMode.POSITIVE))


@pytest.fixture
def auth(agent_token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {agent_token}"}


def test_the_schema_publishes_links_from_a_started_run(schema: Any) -> None:
    responses = schema.raw_schema["paths"]["/api/v1/runs"]["post"]["responses"]
    assert set(responses["201"]["links"]) == {"GetRun", "ListDecisions", "Check", "FinishRun"}


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_operation_answers_within_its_schema(schema: Any, auth: dict[str, str],
                                                    mode: GenerationMode) -> None:
    # The agent API's; the operator API's (SPEC 17) take a token: the test below.
    operations = [result.ok() for result in schema.exclude(tag="operator")
                  .get_all_operations()]
    assert len(operations) == 9  # the six of SPEC 5, GET /approvals/{id} (SPEC 11),
    # POST runs/{id}/local-decisions (the fail-open upload) and GET /decisions/{id} (SPEC 16)
    for operation in operations:
        strategy = operation.as_strategy(generation_mode=mode)
        if mode == GenerationMode.POSITIVE:
            strategy = strategy.map(existing_policy)

        # A query string carries no types: a "wrong-typed" negative value (an array where a
        # string is expected) is sent as text that can be a perfectly valid agent name or
        # number (`?agent=false`), so refusing it is not required. Such operations still
        # must never answer 5xx and must answer within the schema.
        excluded = ([negative_data_rejection]
                    if mode == GenerationMode.NEGATIVE and operation.method.upper() == "GET"
                    else [])

        _calls(strategy, auth, excluded)()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_operator_operation_answers_within_its_schema(schema: Any, users: Any,
                                                             mode: GenerationMode) -> None:
    """The operator API (SPEC 17) with a team admin's token: no 5xx, answers in the schema.
    A valid body can still be refused by a rule no schema states (a kill switch's scope
    without its team: 422; an approval or run that does not exist: 404; a confirmation:
    409), so those are right answers here too."""
    from policies.tokens import operator_token_create

    token = operator_token_create(user=users["admin"], name="fuzz", role="admin").secret
    operator = {"Authorization": f"Bearer {token}"}
    for operation in [result.ok() for result in schema.include(tag="operator")
                      .get_all_operations()]:
        excluded = [negative_data_rejection] if mode == GenerationMode.NEGATIVE and \
            operation.method.upper() == "GET" else []
        excluded += [positive_data_acceptance]
        _operator_calls(operation.as_strategy(generation_mode=mode), operator, excluded)()


def _operator_calls(strategy: Any, headers: dict[str, str], excluded: list[Any]) -> Any:
    @given(case=strategy)
    @settings(QUIET, max_examples=10)
    def call(case: Any) -> None:
        case.call_and_validate(headers=headers, excluded_checks=excluded)

    return call


def _calls(strategy: Any, auth: dict[str, str], excluded: list[Any]) -> Any:
    @given(case=strategy)
    @settings(QUIET, max_examples=EXAMPLES_PER_OPERATION)
    def call(case: Any) -> None:
        case.call_and_validate(headers=auth, excluded_checks=excluded)

    return call


def test_runs_followed_through_their_links_answer_within_the_schema(
        schema: Any, auth: dict[str, str]) -> None:
    # Scenarios start from a new run and follow its links. The listing is left out of them:
    # what it returns depends on earlier scenarios, and Hypothesis needs each scenario to
    # depend on its own draws only (it is covered above, statelessly).
    with _post_runs_is_a_root():
        machine = (schema.exclude(operation_id="list_runs").exclude(tag="operator")
                   .as_state_machine())

    class Workflow(machine):  # type: ignore[misc, valid-type]
        def before_call(self, case: Any) -> None:
            existing_policy(case)
            deadline = case.body.get("deadline_ms") if isinstance(case.body, dict) else None
            if isinstance(deadline, int | float) and not isinstance(deadline, bool) \
                    and 1 <= deadline <= 600_000:
                # A short deadline (an integer or not) makes the answer depend on the clock
                # (expired or not), and Hypothesis needs a scenario's answers to depend on its
                # draws only.
                case.body["deadline_ms"] = 600_000
            if starts_a_valid_run(case) and isinstance(case.body.get("external_id"), str):
                # An external_id drawn by an earlier scenario would answer 200 with that
                # scenario's run instead of 201: same reason as above.
                case.body["external_id"] = f"{case.body['external_id'][:150]}-{uuid.uuid4()}"

        def get_call_kwargs(self, case: Any) -> dict[str, Any]:
            return {"headers": auth}

    scenarios = settings(QUIET, max_examples=SCENARIOS, stateful_step_count=6)
    try:
        Workflow.run(settings=scenarios)
    except FlakyStrategyDefinition:
        # Hypothesis met one prefix of draws with two sets of enabled links: an answer that
        # decided which links a scenario may follow differed between two tries of the same
        # draws (a CI run saw it once in many, after many green ones; the draws it names are
        # not printed, so the cause is not known). That says nothing of the API: 5xx and
        # answers outside the schema fail the test as check failures, never as this. One
        # more run with fresh draws, which must pass.
        Workflow.run(settings=scenarios)


@contextmanager
def _post_runs_is_a_root() -> Iterator[None]:
    """Schemathesis starts scenarios only from operations it believes need no existing
    resource; it reads `external_id` as a reference to an "External" resource nobody makes,
    so it would never start a run and our links would go unused. Starting a run needs
    nothing: say so. (A private hook: if a release renames it, the scenarios still run from
    the run listing, and this test says nothing false.)"""
    from schemathesis.specs.openapi import stateful

    original = getattr(stateful, "is_likely_root_transition", None)
    if original is None:
        yield
        return

    def likely_root(operation: Any, *args: Any) -> bool:
        return operation.label == "POST /api/v1/runs" or original(operation, *args)

    with mock.patch.object(stateful, "is_likely_root_transition", likely_root):
        yield


# --- Where the document and the behaviour once disagreed (issue 24) --------------------------

def conforms(schema: Any, component: str, body: Any) -> bool:
    """Whether `body` is valid against a component of the published document, formats
    included (jsonschema_rs is the validator Schemathesis itself uses)."""
    import jsonschema_rs

    document = {"$ref": f"#/components/schemas/{component}",
                "components": schema.raw_schema["components"]}
    return bool(jsonschema_rs.validator_for(document, validate_formats=True).is_valid(body))


def call(schema: Any, auth: dict[str, str], method: str, path: str, body: Any,
         **path_parameters: str) -> Any:
    """One request, checked by Schemathesis against the document: its status documented for
    the operation, its body conforming to that status's schema."""
    case = schema[path][method].Case(body=body, path_parameters=path_parameters or None)
    return case.call_and_validate(headers=auth)


def start(schema: Any, auth: dict[str, str]) -> str:
    return str(call(schema, auth, "POST", "/api/v1/runs", {"agent": "bot"}).json()["run_id"])


def local_allow(**fields: Any) -> dict[str, Any]:
    return {"decisions": [{"check_id": "l1", "action": {"name": "search"}, "decision": "allow",
                           "reason": "step_ok", **fields}]}


@pytest.mark.parametrize("at", [0, 1767268800, 1767268800.5, True, "0", "1767268800",
                                "2026-05-01", "2026-05-01T12:00:00", "12:00:00Z",
                                "2026-05-01 12:00:00Z"])
def test_an_uploaded_decisions_time_must_be_a_date_time_string(schema: Any, auth: dict[str, str],
                                                               at: Any) -> None:
    body = local_allow(at=at)
    assert not conforms(schema, "LocalDecisionsIn", body)
    response = call(schema, auth, "POST", "/api/v1/runs/{run_id}/local-decisions", body,
                    run_id=start(schema, auth))
    assert response.status_code == 422
    assert "date-time" in response.json()["error"]["fields"]["decisions.0.at"]


@pytest.mark.parametrize("at", ["2026-05-01T12:00:00Z", "2026-05-01t12:00:00.250+02:00"])
def test_an_uploaded_decisions_date_time_is_kept(schema: Any, auth: dict[str, str],
                                                 at: str) -> None:
    body = local_allow(at=at)
    assert conforms(schema, "LocalDecisionsIn", body)
    response = call(schema, auth, "POST", "/api/v1/runs/{run_id}/local-decisions", body,
                    run_id=start(schema, auth))
    assert response.status_code == 200 and response.json()["recorded"] == 1


NUL_BODIES = [
    ("/api/v1/runs", "RunStartIn", {"agent": "bot", "task": "a\x00b"}, "task"),
    ("/api/v1/runs", "RunStartIn", {"agent": "bot", "external_id": "\x00"}, "external_id"),
    ("/api/v1/runs", "RunStartIn", {"agent": "bot", "metadata": {"k": ["ok", {"deep": "\x00"}]}},
     "metadata"),
    ("/api/v1/runs", "RunStartIn", {"agent": "bot", "metadata": {"k\x00": 1}}, "metadata"),
    ("/api/v1/runs/{run_id}/check", "CheckIn", {"action": {"name": "x", "args": {"a": "\x00"}}},
     "action.args"),
    ("/api/v1/runs/{run_id}/check", "CheckIn", {"action": {"name": "x"}, "progress": "\x00"},
     "progress"),
    ("/api/v1/runs/{run_id}/finish", "FinishIn", {"status": "completed", "output": "\x00"},
     "output"),
]


@pytest.mark.parametrize(("path", "component", "body", "field"), NUL_BODIES)
def test_nul_is_refused_where_the_document_says_so(schema: Any, auth: dict[str, str], path: str,
                                                   component: str, body: dict[str, Any],
                                                   field: str) -> None:
    assert not conforms(schema, component, body)
    run_id = {"run_id": start(schema, auth)} if "{run_id}" in path else {}
    response = call(schema, auth, "POST", path, body, **run_id)
    assert response.status_code == 422
    assert "NUL" in response.json()["error"]["fields"][field]
    clean = json.loads(json.dumps(body).replace("\\u0000", "-"))
    assert conforms(schema, component, clean)


def test_every_text_of_a_request_states_that_it_holds_no_nul(schema: Any) -> None:
    """A text field added later cannot forget it: every string a request may carry is a
    choice of values, a format or a pattern, or says it holds no NUL (`args` and `metadata`
    at every level, their keys too)."""
    def strings(node: Any, where: str) -> Iterator[tuple[str, dict[str, Any]]]:
        if isinstance(node, dict):
            if node.get("type") == "string":
                yield where, node
            for key, value in node.items():
                yield from strings(value, f"{where}.{key}")
        elif isinstance(node, list):
            for index, value in enumerate(node):
                yield from strings(value, f"{where}[{index}]")

    components = schema.raw_schema["components"]["schemas"]
    inputs = {name: body for name, body in components.items()
              if name.endswith("In") or name == "StorableJsonValue"}
    assert {"RunStartIn", "CheckIn", "LocalAllowIn", "FinishIn"} <= set(inputs)
    for name, body in inputs.items():
        for where, node in strings(body, name):
            assert {"enum", "const", "format", "pattern"} & set(node) \
                or node.get("not") == {"pattern": "\\u0000"}, where


def test_an_unknown_policys_422_is_documented(schema: Any, auth: dict[str, str]) -> None:
    operation = schema.raw_schema["paths"]["/api/v1/runs"]["post"]
    assert "no policy of the key's team" in operation["responses"]["422"]["description"]
    policy = operation["requestBody"]["content"]["application/json"]["schema"]
    assert "$ref" in policy  # the field's own description says it too
    assert "422" in schema.raw_schema["components"]["schemas"]["RunStartIn"]["properties"][
        "policy"]["description"]
    body = {"agent": "bot", "policy": "no-such-policy"}
    assert conforms(schema, "RunStartIn", body)  # valid by the schema, refused by contract
    response = call(schema, auth, "POST", "/api/v1/runs", body)
    assert response.status_code == 422
    assert response.json()["error"]["fields"] == {
        "policy": "no policy named 'no-such-policy' in this team"}


# --- A body over the upload limit: 413 on every operation that takes one ----------------------

OPERATOR_WRITES = [
    ("PUT", "/api/v1/teams/{slug}/policies/{name}", {"slug": "support", "name": "default"}),
    ("POST", "/api/v1/teams/{slug}/policies/{name}/backtest",
     {"slug": "support", "name": "default"}),
    ("POST", "/api/v1/killswitch", {}),
    ("POST", "/api/v1/approvals/{approval_id}/decide",
     {"approval_id": "00000000-0000-0000-0000-000000000000"}),
]


@pytest.mark.parametrize(("method", "path", "path_parameters"), OPERATOR_WRITES)
def test_an_operator_body_over_the_upload_limit_is_a_documented_413(
        schema: Any, users: Any, method: str, path: str, path_parameters: dict[str, str]) -> None:
    """The API's middleware refuses any body over Django's upload limit (1 MiB) with 413
    before a view runs (SPEC 5.3), the operator API's too: the document says so for its
    operations as it does for the agent API's."""
    from django.conf import settings as django_settings

    from policies.tokens import operator_token_create

    token = operator_token_create(user=users["admin"], name="big", role="admin").secret
    body = {"note": "x" * django_settings.DATA_UPLOAD_MAX_MEMORY_SIZE}
    response = call(schema, {"Authorization": f"Bearer {token}"}, method, path, body,
                    **path_parameters)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "payload_too_large"
