"""Migration 0009: a run's decisions have one index, `check_id_per_run` on (run, check_id),
unique where a check_id is set, as before, and no longer partial; the foreign key's own index
is gone. Both ways, on both databases, with decisions already recorded."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.db import IntegrityError, connection, transaction
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

from policies.models import Team

pytestmark = pytest.mark.django_db(transaction=True)

BEFORE = [("runs", "0008_run_team_ended")]
AFTER = [("runs", "0009_decision_one_run_index")]


def migrate(target: list[tuple[str, str]]) -> Any:
    executor = MigrationExecutor(connection)
    executor.migrate(target)
    return executor.loader.project_state(target).apps


@pytest.fixture
def at_the_end() -> Iterator[None]:
    yield
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())


def indexes() -> dict[str, tuple[list[str], bool]]:
    with connection.cursor() as cursor:
        found = connection.introspection.get_constraints(cursor, "runs_decision")
    return {name: (c["columns"], c["unique"]) for name, c in found.items()
            if c["index"] or c["unique"]}


def decide(apps: Any, run: Any, check_id: str | None) -> None:
    apps.get_model("runs", "Decision").objects.create(
        run_id=run.pk, step=1, outcome="allow", reason="step_ok", check_id=check_id,
        at=timezone.now())


def the_same_rules_hold(apps: Any, run: Any, check_id: str) -> None:
    decide(apps, run, None)  # any number of decisions without a check_id
    decide(apps, run, check_id)
    with pytest.raises(IntegrityError) as refused, transaction.atomic():
        decide(apps, run, check_id)
    if connection.vendor == "postgresql":  # the name the check's write recognizes
        assert refused.value.__cause__.diag.constraint_name == "check_id_per_run"


def test_both_ways_with_decisions_recorded(team: Team, at_the_end: None) -> None:
    old = migrate(BEFORE)
    Run = old.get_model("runs", "Run")
    version = old.get_model("policies", "Policy").objects.get(team_id=team.pk,
                                                                name="default").current_id
    run = Run.objects.create(team_id=team.pk, agent="bot", policy_version_id=version,
                             started_at=timezone.now())
    for check_id in (None, None, "a", "b"):
        decide(old, run, check_id)
    before = indexes()
    assert any(columns == ["run_id"] for columns, _ in before.values())

    new = migrate(AFTER)
    after = indexes()
    runs_indexes = {name: v for name, v in after.items() if "run_id" in v[0]}
    assert runs_indexes == {"check_id_per_run": (["run_id", "check_id"], True)}
    assert new.get_model("runs", "Decision").objects.filter(run_id=run.pk).count() == 4
    the_same_rules_hold(new, run, "after")

    old = migrate(BEFORE)
    assert indexes().keys() == before.keys()
    the_same_rules_hold(old, Run.objects.get(pk=run.pk), "back")
