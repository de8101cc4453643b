"""What this process knows of runs' trees (SPEC 20): run id -> (team id, its ancestors' ids,
the root first). A run's ancestors never change, so what a start or a check learned holds;
the check locks them first from it (runs/check/tree.py), and the ASGI application gives a
check its turn by it (`turn_run`). Bounded (cleared when full): a miss costs one restart of a
child run's check, and its first check waits for its own turn instead of its root's.

Small on purpose: the ASGI application (governance/asgi.py) imports it without the check.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

_LINEAGE: dict[uuid.UUID, tuple[int, tuple[str, ...]]] = {}
_LINEAGE_MAX = 20_000


def remember(run_id: uuid.UUID, team_id: int, ancestors: Sequence[str]) -> None:
    """A run's ancestors (root first), kept for this process's next check of it."""
    if run_id not in _LINEAGE:
        if len(_LINEAGE) >= _LINEAGE_MAX:
            _LINEAGE.clear()
        _LINEAGE[run_id] = (team_id, tuple(str(a) for a in ancestors))


def relearn(run_id: uuid.UUID, team_id: int, ancestors: Sequence[str]) -> None:
    """A run's ancestors as read under its lock, over what was known."""
    _LINEAGE[run_id] = (team_id, tuple(str(a) for a in ancestors))


def known(run_id: uuid.UUID) -> tuple[int, tuple[str, ...]] | None:
    return _LINEAGE.get(run_id)


def turn_run(run_id: str) -> str:
    """The run whose turn a check of ``run_id`` waits for (governance/asgi.py `RunTurns`):
    its tree's root when this process knows it, else the run itself. Every check of a tree
    locks the root first, so the checks of its children waited for the root's lock each on
    a thread of the API pool (found by an attacker: 8 to 40 checks over one tree's children
    made another team's check p99 2 to 3 times what the same checks of separate runs did)."""
    try:
        run = uuid.UUID(run_id)
    except (ValueError, TypeError, AttributeError):
        return str(run_id)
    found = _LINEAGE.get(run)
    return found[1][0] if found is not None and found[1] else str(run)
