"""The lock statement's row is read by name: every value is found at the position its name
has in the select list (check_store.LOCK_SELECT), so the list can change without any reading
of the row going stale."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from decimal import Decimal

from runs.check import check_store
from runs.check.states import RUN_COLUMNS, STATE_COLUMNS

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def test_the_select_list_names_each_column_once_and_builds_the_statement() -> None:
    names = [name for name, _ in check_store.LOCK_SELECT]
    assert len(names) == len(set(names)) == len(check_store.LOCK_AT)
    expressions = ", ".join(expression for _, expression in check_store.LOCK_SELECT)
    assert f"SELECT {expressions}\nFROM policies_agentkey k" in check_store.LOCK_SQL
    assert {f"run_{name}" for name in RUN_COLUMNS if name != "team_id"} <= set(names)


def test_each_value_is_read_from_its_named_column() -> None:
    """A row whose every value is placed by its name reads back as those values."""
    run_id = uuid.uuid4()
    values = {
        "key_id": 7, "key_hash": "hash", "key_last_used_at": NOW, "team_id": 3,
        "team_slug": "support", "run_id": run_id, "run_agent": "bot",
        "run_policy_version_id": 11, "run_status": "running", "run_stop_reason": None,
        "run_steps": 4, "run_tool_calls": 2, "run_cost_usd": Decimal("0.5"),
        "run_started_at": NOW, "run_ended_at": None, "run_memory": '{"last": []}',
        "run_idle_deadline": None, "switch_scope": "agent", "switch_agent": "bot",
        "switch_reason": "enough", "switch_engaged_by_label": "ops", "switch_run_id": None,
        "earlier_id": "42",
        "earlier_answer": '{"decision": "allow"}',
        "run_ancestors": '["root-id", "parent-id"]',
    }
    assert set(values) == set(check_store.LOCK_AT)
    row = [None] * len(check_store.LOCK_SELECT)
    for name, value in values.items():
        row[check_store.LOCK_AT[name]] = value
    locked = check_store._locked_of(tuple(row), windows=None, keyed={"abc": 2})
    assert (locked.key_id, locked.key_hash, locked.key_last_used_at) == (7, "hash", NOW)
    assert (locked.team_id, locked.team_slug) == (3, "support")
    assert locked.run is not None
    assert (locked.run.id, locked.run.team_id, locked.run.agent,
            locked.run.policy_version_id) == (run_id, 3, "bot", 11)
    assert (locked.run.state.steps, locked.run.state.tool_calls,
            locked.run.state.cost_usd, locked.run.state.started_at) == (4, 2, Decimal("0.5"), NOW)
    assert locked.switch == check_store.SwitchSeen(scope="agent", agent="bot",
                                                   reason="enough", engaged_by_label="ops",
                                                   run_id=None)
    assert locked.earlier_answer == (42, {"decision": "allow"})
    assert locked.keyed == {"abc": 2}
    assert locked.run.ancestors == ("root-id", "parent-id")
    assert STATE_COLUMNS[0] == "status" and locked.run.state.status == "running"


def test_a_key_without_the_run_reads_no_run_switch_or_answer() -> None:
    row = [None] * len(check_store.LOCK_SELECT)
    for name, value in {"key_id": 1, "key_hash": "h", "team_id": 2, "team_slug": "t"}.items():
        row[check_store.LOCK_AT[name]] = value
    locked = check_store._locked_of(tuple(row), windows=None, keyed=None)
    assert locked.run is None and locked.switch is None and locked.earlier_answer is None
    assert locked.keyed is None
