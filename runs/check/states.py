"""A run's state columns, named once (SPEC 4): which columns of `runs_run` make the rules'
`RunState`, the one translation from them (`run_state`, `state_of`) and the one translation
back (`columns_of`). Every writer of a run's state takes its values from `columns_of`, naming
the columns it changes: the check (runs/check/check_store.py, its prepared statement and its
ORM twin), the upload of local decisions (runs/check/local.py) and the finish
(runs/check/lifecycle.py), an abandonment (runs/check/abandon.py), an approval's settlement
(runs/approvals/services.py) and the kill switch's fan-out (runs/killswitch/fanout.py, its
SQL and its ORM batch).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from decimal import Decimal
from typing import Any

from governance_client.rules import RunState

from runs.models import Run

# A run's columns that make its state as the rules see it (rules.RunState), in the order the
# lock statement returns them; the rest of what the check reads of a run never changes (its
# id, team, agent, policy version). The lock statement, the ORM's read and the write take
# their column lists from here, and `state_of` is the one translation into a RunState.
STATE_COLUMNS = ("status", "stop_reason", "steps", "tool_calls", "cost_usd", "started_at",
                 "ended_at", "memory", "idle_deadline")
RUN_COLUMNS = ("id", "team_id", "agent", "policy_version_id", *STATE_COLUMNS, "ancestors")
# What a descendant's check changes on each ancestor (SPEC 20, runs/check/tree.py).
TREE_FIELDS = ("steps", "tool_calls", "cost_usd", "idle_deadline")
# What a check may change: everything of the state but its start.
UPDATE_FIELDS = tuple(name for name in STATE_COLUMNS if name != "started_at")
# What ending a run changes (a finish, a kill): the counters stay as the last check left them.
ENDED = ("status", "stop_reason", "ended_at")


def run_state(*, status: str, stop_reason: str | None, steps: int, tool_calls: int,
              cost_usd: Decimal, started_at: datetime, ended_at: datetime | None,
              memory: dict[str, Any] | None, idle_deadline: datetime | None) -> RunState:
    """The rules' view of a run, from its STATE_COLUMNS."""
    return RunState(
        started_at=started_at, status=status, stop_reason=stop_reason, ended_at=ended_at,
        steps=steps, tool_calls=tool_calls, cost_usd=Decimal(cost_usd),
        idle_deadline=idle_deadline,
    ).load_memory(memory or {})


def state_of(run: Run) -> RunState:
    """The rules' view of a run read by the ORM."""
    return run_state(**{name: getattr(run, name) for name in STATE_COLUMNS})


def columns_of(state: RunState, names: Iterable[str]) -> dict[str, Any]:
    """The run's columns ``names`` (of STATE_COLUMNS) as ``state`` has them, for an UPDATE:
    its memory is the state's fixed part (the keyed entries are rows of their own,
    runs/check/run_memory.py), the rest attributes."""
    return {name: state.fixed_memory() if name == "memory" else getattr(state, name)
            for name in names}


def set_columns(run: Run, columns: dict[str, Any]) -> None:
    """The same values on a run the caller holds, once they are written."""
    for name, value in columns.items():
        setattr(run, name, value)
