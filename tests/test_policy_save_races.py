"""Saves of one new policy at once (PostgreSQL's row locks, real threads): found by an
attacker, concurrent `PUT /api/v1/teams/{slug}/policies/{name}` of a name the team did not
have answered 503 "The store refused the write" for one to three of 16, with an
IntegrityError's traceback in the log: each save found no policy, waited for the team's lock
and created it, and the ones after the first broke the unique name."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from threading import Barrier
from typing import Any

import pytest
from django.db import connection

from policies.document import default_policy
from policies.models import Policy, PolicyVersion, Team
from policies.services import policy_save

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

SAVES = 16


def test_saves_of_one_new_policy_at_once_make_it_once_and_each_change_a_version(
        team: Team, users: dict[str, Any]) -> None:
    barrier = Barrier(SAVES)

    def save(i: int) -> int | None:
        document = {**default_policy(), "name": "burst"}
        document["step_limits"] = {**document["step_limits"], "max_steps": 100 + i}
        try:
            barrier.wait()
            version = policy_save(team=team, document=document, actor=users["admin"],
                                  source="api", note=f"n{i}")
            return version.version if version is not None else None
        finally:
            connection.close()

    with ThreadPoolExecutor(SAVES) as pool:
        versions = list(pool.map(save, range(SAVES)))
    assert Policy.objects.filter(team=team, name="burst").count() == 1
    # Every document differs from the one before it: each save made its own version.
    assert sorted(versions) == list(range(1, SAVES + 1)), versions  # type: ignore[type-var]
    assert PolicyVersion.objects.filter(policy__team=team, policy__name="burst").count() == SAVES


def test_concurrent_puts_each_answer_the_version_they_made(team: Team,
                                                           users: dict[str, Any]) -> None:
    """The operator API's answer is the save's own version: read again after the commit,
    two of 16 PUTs answered version 5 (another's) and none named version 4."""
    from django.test import Client

    from policies.tokens import operator_token_create

    token = operator_token_create(user=users["admin"], name="ci", role="admin").secret
    barrier = Barrier(SAVES)

    def put(i: int) -> tuple[int, dict[str, Any]]:
        body = {"note": f"n{i}", "confirm_stops": True,
                "step_limits": {"max_steps": 100 + i, "max_repeat_action": 3,
                                "no_progress_window": 4}}
        try:
            client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")
            barrier.wait()
            answer = client.put(f"/api/v1/teams/{team.slug}/policies/burst", body,
                                content_type="application/json")
            return i, {"status": answer.status_code, **answer.json()}
        finally:
            connection.close()

    with ThreadPoolExecutor(SAVES) as pool:
        answers = list(pool.map(put, range(SAVES)))
    assert all(answer["status"] == 200 for _, answer in answers), answers
    assert sorted(answer["version"] for _, answer in answers) == list(range(1, SAVES + 1))
    for i, answer in answers:  # each answer is the document its own PUT sent
        assert answer["document"]["step_limits"]["max_steps"] == 100 + i, (i, answer)
        assert answer["note"] == f"n{i}" and answer["changed"] is True
