"""JSON text for the check's hot path: the answer sent to the agent and the documents its
write statement unpacks (runs/check/check_store.py).

orjson makes JSON of the same values as the standard library (compact separators, RFC 3339
datetimes with their offset as `isoformat()` writes them, canonical UUIDs; non-ASCII text as
UTF-8 rather than escapes) in a fraction of the time: JSON encoding was 5.7% of a
check's Python under load before, 0.9% after (docs/performance.md "Python cuts of issue 17,
measured"). What orjson refuses and the standard library takes, an agent's integer beyond 64
bits in its args or a lone surrogate in a string, falls back to the standard library, so no
value a client may send turns into an error here.
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
    except orjson.JSONEncodeError:  # a TypeError, as the fallback's own refusal
        return json.dumps(document, separators=(",", ":"), default=_scalar)
