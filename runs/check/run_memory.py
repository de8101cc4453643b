"""A run's keyed memory (SPEC 4.1) as rows of `RunMemory`: the allowed count of every repeat
key, the progress values and result signatures seen, the count of every error text.

These grow with the run's length; a check reads and writes only its own entries
(`rules.keyed_reads`), looked up by a digest of kind and text, so it costs the same at step
5,000 as at step 10 (docs/performance.md). The rest of the memory (the no-progress streak,
time paused, the approval waited for) stays in the run's small `memory` document,
`RunState.fixed_memory()`.

The check's own transaction reads and writes the rows inside its two statements
(runs/check/check_store.py); everything else that changes a run's counters under its lock
(approvals, local decisions uploaded by a fail-open client) uses `load` and `save` here.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from governance_client import rules
from runs.models import RunMemory


def digest(entry: rules.Entry) -> str:
    """The entry's lookup key (migration 0007 writes the same)."""
    kind, text = entry
    return hashlib.sha256(f"{kind}:{text}".encode()).hexdigest()


def digests(wanted: Iterable[rules.Entry]) -> dict[str, rules.Entry]:
    return {digest(entry): entry for entry in wanted}


def found(wanted: Mapping[str, rules.Entry], counts: Mapping[str, int]) -> dict[rules.Entry, int]:
    """The entries the store has, from their counts by digest."""
    return {wanted[d]: n for d, n in counts.items() if d in wanted}


def rows(changes: Mapping[rules.Entry, int]) -> list[dict[str, Any]]:
    """The changed entries as the check's write sends them (runs_runmemory's columns)."""
    return [{"digest": digest(entry), "kind": entry[0], "text": entry[1], "count": n}
            for entry, n in changes.items()]


def counts(run_id: uuid.UUID, keyed: Iterable[str]) -> dict[str, int]:
    """The counts of the run's entries with these digests (those it has)."""
    return dict(RunMemory.objects.filter(run_id=run_id, digest__in=list(keyed))
                .values_list("digest", "count"))


def read(run_id: uuid.UUID, wanted: Mapping[str, rules.Entry]) -> dict[rules.Entry, int]:
    """The entries of ``wanted`` (by digest) that the run has."""
    return found(wanted, counts(run_id, wanted)) if wanted else {}


def load(state: rules.RunState, run_id: uuid.UUID, wanted: Iterable[rules.Entry]
         ) -> rules.RunState:
    """The state with these entries of the run loaded (one query)."""
    return state.load_keyed(read(run_id, digests(wanted)))


def upsert(run_id: uuid.UUID, changed: list[dict[str, Any]]) -> None:
    """Write changed entries (`rows`); the caller holds the run's lock, so the counts are
    the new values themselves, not increments."""
    if changed:
        RunMemory.objects.bulk_create(
            [RunMemory(run_id=run_id, **row) for row in changed],
            update_conflicts=True, unique_fields=["run", "digest"], update_fields=["count"])


def save(run_id: uuid.UUID, before: rules.RunState, after: rules.RunState) -> None:
    """Write what the rules changed between two states of the run (under its lock)."""
    upsert(run_id, rows(rules.keyed_changes(before, after)))


def entries(run_id: uuid.UUID) -> dict[rules.Entry, int]:
    """Every entry of the run (inspection and tests; no check reads them all)."""
    return {(kind, text): count for kind, text, count in
            RunMemory.objects.filter(run_id=run_id).values_list("kind", "text", "count")}
