"""JSON text for the check's hot path: the answer sent to the agent and the documents its
write statement unpacks (runs/check/check_store.py).

orjson makes the same JSON as the standard library for these values (compact separators,
RFC 3339 datetimes with their offset, as `isoformat()`, canonical UUIDs) in about a fifth of
the time: JSON encoding was 5.7% of a check's Python under load before (docs/performance.md
"Where a check's CPU goes"). What orjson refuses and the standard library takes, an agent's
integer beyond 64 bits in its args or a lone surrogate in a string, falls back to the
standard library, so the answer never depends on which encoder made it.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from decimal import Decimal
from typing import Any

import orjson


def _scalar(value: Any) -> str:
    # The only values of a check's documents that are not JSON types: PostgreSQL reads them
    # back from their text form.
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Decimal | uuid.UUID):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def dumps(document: Any) -> str:
    """Compact JSON text of ``document``."""
    try:
        return orjson.dumps(document, default=_scalar).decode()
    except (orjson.JSONEncodeError, UnicodeEncodeError):
        return json.dumps(document, separators=(",", ":"), default=_scalar)
