"""A tree's writers other than the check itself (an upload of local decisions, an operator's
approval): a child run's ancestors locked and written through the ORM, in the tree's lock
order, the root first and before the run (runs/check/tree.py says why). Apart from the
check's store, so the services that settle approvals need nothing of the check's SQL."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime
from typing import Any

from governance_client import rules
from runs.check.policy_cache import rules_for_version
from runs.check.states import RUN_COLUMNS, columns_of, state_of
from runs.models import Run


def lock_lineage(*, team_id: int, run_id: Any) -> list[rules.Ancestor]:
    """A child run's ancestors locked root first, by the ORM, inside the caller's
    transaction, before the caller locks the run (the tree's lock order), as the rules read
    them. For a writer other than the check (an upload of local decisions, a finish)."""
    ids = (Run.objects.filter(team_id=team_id, pk=run_id)
           .values_list("ancestors", flat=True).first()) or []
    found = []
    for ancestor_id in ids:
        row = (Run.objects.select_for_update().filter(pk=ancestor_id, team_id=team_id)
               .only(*RUN_COLUMNS).first())
        if row is not None:
            found.append(rules.Ancestor(run_id=str(row.pk),
                                        policy=rules_for_version(row.policy_version_id),
                                        state=state_of(row)))
    return found


def read_lineage(ancestor_ids: list[str]) -> list[rules.Ancestor]:
    """A run's ancestors (``ancestor_ids``, the root first) as the rules read them, without
    locks: for a question asked before any lock is taken (is the tree over?), which the
    answer under the locks settles."""
    rows = {str(row.pk): row for row in Run.objects.filter(pk__in=ancestor_ids)
            .only(*RUN_COLUMNS)}
    return [rules.Ancestor(run_id=run_id, policy=rules_for_version(row.policy_version_id),
                           state=state_of(row))
            for run_id in ancestor_ids if (row := rows.get(run_id)) is not None]


def counted_on(tree: list[rules.Ancestor], decision: rules.Decision, check: rules.Check,
               *, now: datetime) -> list[rules.Ancestor]:
    """The ancestors after one more decision of their descendant (`rules.count_in_tree`)."""
    after = rules.count_in_tree(tree, decision, check, now=now)
    return [replace(ancestor, state=state) for ancestor, state in zip(tree, after, strict=True)]


def write_counters(tree: list[rules.Ancestor], fields: tuple[str, ...]) -> None:
    """The ancestors' counters ``fields`` as ``tree`` has them (their locks are held)."""
    for ancestor in tree:
        Run.objects.filter(pk=ancestor.run_id).update(**columns_of(ancestor.state, fields))
