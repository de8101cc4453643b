"""Sub-agent runs (SPEC 20): a child run's check counts on the child and on every ancestor,
and the ancestors' limits bound the whole tree.

The lock order, the one every writer of a tree follows (docs/reliability.md, "The lock
order of a tree"): a check of a child run locks its ancestors first, the root first and then
down the tree, and only then the run itself (runs/check/check_store.py `lock_ancestors`, then
`lock`). Every check of one tree therefore takes the root's lock first, which serializes the
tree's checks: N concurrent checks over the children of a parent with `max_steps: 18` give
exactly 18 allows counted on the parent, in any number of server processes. No writer locks
a run and then an ancestor of it, so no two checks wait on each other in a circle.

A run's ancestors never change, so the check knows them before it locks anything: this
process learned them when it started the run or checked it before (`remember`). A check that
finds, once it holds the run's lock, that the run has ancestors it did not lock first rolls
back and starts again with them (`Relock`): at most once per run and process.

The decision itself is the pure rules' (`governance_client.rules.evaluate` with ``tree``);
here: which ancestors to lock, the kill switch over them, and what the check writes to them.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from governance_client import rules
from runs.check import lineages
from runs.check.check_store import CheckTransaction, RunRow
from runs.check.policy_cache import rules_for_version
from runs.check.states import TREE_FIELDS, columns_of
from runs.killswitch import cover
from runs.live.events import publish_run_event
from runs.models import KillSwitch


class Relock(Exception):
    """The run has ancestors the check did not lock first: start again, locking them."""


@dataclass(slots=True)
class Family:
    """A check's ancestors, locked and read (the root first), with their policies."""

    ids: tuple[str, ...] = ()
    rows: list[RunRow] = field(default_factory=list)
    tree: list[rules.Ancestor] = field(default_factory=list)

    def switch(self) -> KillSwitch | None:
        """The kill switch over an ancestor (SPEC 20: a switch covering a run covers its
        descendants), read after the ancestors' locks: a switch whose engage returned
        before this check began is seen (SPEC 4.5)."""
        if not self.rows:
            return None
        return cover.switch_over_any(self.rows[0].team_id,
                                     [(row.id, row.agent) for row in self.rows])


def lock_ancestors(tx: CheckTransaction, run_id: uuid.UUID) -> Family:
    """Lock the run's known ancestors, the root first (nothing for a root run, or a run this
    process does not know yet: `check_lineage` finds out)."""
    found = lineages.known(run_id)
    if found is None or not found[1]:
        return Family()
    team_id, ids = found
    rows = tx.lock_ancestors(team_id=team_id, ids=ids)
    tree = [rules.Ancestor(run_id=str(row.id), policy=rules_for_version(row.policy_version_id),
                           state=row.state) for row in rows]
    return Family(ids=ids, rows=rows, tree=tree)


def check_lineage(run: RunRow, family: Family) -> None:
    """Under the run's lock: raise Relock when the run has ancestors not locked first."""
    lineages.remember(run.id, run.team_id, run.ancestors)
    if tuple(run.ancestors) != family.ids:
        lineages.relearn(run.id, run.team_id, run.ancestors)
        raise Relock()


def ancestor_writes(family: Family, decision: rules.Decision, check: rules.Check,
                    counted: bool, *, now: datetime
                    ) -> list[tuple[uuid.UUID, dict[str, Any]]]:
    """The ancestors' changed columns after this check (`rules.count_in_tree`), when the
    check counted on the run (``counted``)."""
    if not family.tree or not counted:
        return []
    after = rules.count_in_tree(family.tree, decision, check, now=now)
    return [(row.id, columns_of(state, TREE_FIELDS))
            for row, state in zip(family.rows, after, strict=True) if state is not row.state]


@dataclass(frozen=True, slots=True)
class _Seen:
    pk: str
    team_id: int


def publish_ancestors(run: Any) -> None:
    """The run pages of a run's ancestors show its status in their tree: wake them."""
    for ancestor in run.ancestors or ():
        publish_run_event(_Seen(pk=ancestor, team_id=run.team_id))
