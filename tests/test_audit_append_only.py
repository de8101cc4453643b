"""The audit tables are append-only in PostgreSQL itself (runs/migrations/0002): whatever the
application (or anyone with its credentials) sends, audit rows are never changed or removed,
except DELETE / TRUNCATE inside a maintenance transaction (retention)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import DatabaseError, connection, transaction

from policies.models import OperatorEvent, Team
from policies.services import audit
from runs.audit.retention import audit_maintenance
from runs.models import Decision, Run

pytestmark = [pytest.mark.django_db, pytest.mark.postgres]


@pytest.fixture
def decision(api: Any) -> Decision:
    run = api.post("/api/v1/runs", {"agent": "bot"}, content_type="application/json").json()
    answer = api.post(f"/api/v1/runs/{run['run_id']}/check", {"action": {"name": "search"}},
                      content_type="application/json").json()
    return Decision.objects.get(pk=answer["decision_id"])


def refused(statement: Callable[[], Any]) -> str:
    """Runs a statement that must be refused by the trigger; returns the database's message."""
    with pytest.raises(DatabaseError) as caught, transaction.atomic():
        statement()
    return str(caught.value)


def sql(text: str, params: list[Any] | None = None) -> Callable[[], None]:
    def run() -> None:
        with connection.cursor() as cursor:
            cursor.execute(text, params)
    return run


def test_updating_a_decision_is_refused(decision: Decision) -> None:
    message = refused(lambda: Decision.objects.filter(pk=decision.pk).update(outcome="stop"))
    assert "append-only" in message
    refused(sql("UPDATE runs_decision SET reason = 'edited' WHERE id = %s", [decision.pk]))
    decision.refresh_from_db()
    assert (decision.outcome, decision.reason) == ("allow", "step_ok")


def test_deleting_a_decision_is_refused(decision: Decision) -> None:
    refused(lambda: Decision.objects.filter(pk=decision.pk).delete())
    refused(sql("DELETE FROM runs_decision"))
    assert Decision.objects.filter(pk=decision.pk).exists()


def test_deleting_a_run_with_its_audit_trail_is_refused(decision: Decision) -> None:
    # Django deletes the run's decisions first (cascade): the trigger stops the whole delete.
    refused(lambda: Run.objects.filter(pk=decision.run_id).delete())
    assert Run.objects.filter(pk=decision.run_id).exists()


def test_truncating_the_audit_tables_is_refused(decision: Decision, team: Team) -> None:
    refused(sql("TRUNCATE runs_decision"))
    refused(sql("TRUNCATE runs_run CASCADE"))
    refused(sql("TRUNCATE policies_operatorevent"))
    assert Decision.objects.filter(pk=decision.pk).exists()
    assert OperatorEvent.objects.filter(team=team).exists()


def test_operator_events_cannot_be_edited_or_deleted(team: Team) -> None:
    event = audit(actor=None, action="key.revoke", team=team, target="k")
    refused(lambda: OperatorEvent.objects.filter(pk=event.pk).update(action="key.create"))
    refused(lambda: OperatorEvent.objects.filter(pk=event.pk).update(team=None, target="x"))
    refused(lambda: OperatorEvent.objects.filter(pk=event.pk).delete())
    event.refresh_from_db()
    assert (event.action, event.target, event.team_id) == ("key.revoke", "k", team.pk)


def test_deleting_a_user_keeps_their_events_with_the_label(team: Team) -> None:
    # ON DELETE SET NULL may clear the reference; the label still says who it was.
    user = User.objects.create_user("gone", "gone@example.com", "pw-gone-12345")
    event = audit(actor=user, action="policy.version", team=team, target="default")
    user.delete()
    event.refresh_from_db()
    assert (event.actor_id, event.actor_label, event.action) == (None, "gone", "policy.version")


def test_appending_still_works(decision: Decision) -> None:
    before = Decision.objects.count()
    Decision.objects.create(run_id=decision.run_id, step=1, outcome="stop", reason="killed",
                            at=decision.at)
    assert Decision.objects.count() == before + 1


def test_maintenance_lets_delete_through_but_never_update(decision: Decision) -> None:
    with pytest.raises(DatabaseError), audit_maintenance():
        Decision.objects.filter(pk=decision.pk).update(reason="edited")
    with audit_maintenance():
        Decision.objects.filter(pk=decision.pk).delete()
    assert not Decision.objects.filter(pk=decision.pk).exists()


def test_maintenance_ends_with_its_block(decision: Decision) -> None:
    with audit_maintenance():
        pass
    # Same connection, same outer (test) transaction: the guard is back.
    refused(lambda: Decision.objects.filter(pk=decision.pk).delete())


def test_a_session_setting_by_hand_is_the_documented_escape_hatch_only_for_delete(
        decision: Decision) -> None:
    # The hatch is a setting any session may set: it guards against mistakes and bugs, not
    # against a superuser (docs/reliability.md says so). UPDATE stays refused even then.
    with transaction.atomic():
        sql("SET LOCAL governance.audit_maintenance = 'on'")()
        refused(sql("UPDATE runs_decision SET step = 99 WHERE id = %s", [decision.pk]))
