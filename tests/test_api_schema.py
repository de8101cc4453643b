"""Schemathesis against the running server's own /api/v1/openapi.json: generated requests,
valid and invalid, to every operation, and sequences that follow a started run through the
OpenAPI links (runs/check/api.py). No 5xx, and every answer conforms to the published schema."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import negative_data_rejection

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
    # NUL characters are valid JSON that no PostgreSQL text column stores: the API refuses
    # them with a 422 (tests/test_api_limits.py), a limit the schema cannot express. Unknown
    # query parameters are ignored, like unknown body fields (SPEC 5.2), not refused.
    # 413 is a right answer to any body over its size cap (64 KiB for a check, SPEC 5.3),
    # which a JSON schema cannot state either.
    config = schemathesis.Config.from_dict({
        "generation": {"allow-x00": False, "allow-extra-parameters": False},
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
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 8  # the six of SPEC 5, GET /approvals/{id} (SPEC 11) and
    # POST runs/{id}/local-decisions (the fail-open upload)
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
        machine = schema.exclude(operation_id="list_runs").as_state_machine()

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

    Workflow.run(settings=settings(QUIET, max_examples=SCENARIOS, stateful_step_count=6))


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
