"""Which paths are the operator API's (SPEC 17): the server routes them to its operator pool,
never to the agents' API pool (governance/pools.py), so an operator call never takes a
check's thread (SPEC 21). Small on purpose: the server imports it without the views."""

from __future__ import annotations

import re

PATH_PREFIXES = ("/api/v1/teams", "/api/v1/killswitch")
# `POST /api/v1/teams/{slug}/policies/{name}/backtest`: its request waits for a replay on
# the workers, on a pool of its own (governance/pools.py), never on the operator pool.
BACKTEST = re.compile(r"/api/v1/teams/[^/]+/policies/[^/]+/backtest/?")


def serves(path: str) -> bool:
    """``/api/v1/teams...``, ``/api/v1/killswitch`` and ``/api/v1/approvals/{id}/decide``
    (``/api/v1/approvals/{id}`` alone is the agents' long poll)."""
    return path.startswith(PATH_PREFIXES) or (
        path.startswith("/api/v1/approvals/") and path.endswith("/decide"))


def waits_for_backtest(path: str) -> bool:
    return BACKTEST.fullmatch(path) is not None


def engages_a_switch(path: str) -> bool:
    """``POST /api/v1/killswitch``: served on a pool of its own (governance/pools.py)."""
    return path.rstrip("/") == "/api/v1/killswitch"
