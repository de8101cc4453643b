"""Repeat keys (SPEC 4.2), shared by the server's rules and the client's local fallback.

It lives in the client package, which has no dependencies beyond httpx, so that the key an
agent computes while the service is unreachable is, by construction, the key the server
computes: there is one implementation, not two that might drift apart.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

DIGEST_CHARS = 32


def normalize_text(text: str) -> str:
    """Trim and collapse inner runs of whitespace to one space (case kept)."""
    return " ".join(text.split())


# Values canonical already, by exact type: a list of them is walked without a call each.
_AS_IS = frozenset({int, bool, type(None)})


def _by_key(item: tuple[Any, Any]) -> str:
    return str(item[0])


def canonical(value: Any) -> Any:
    """The value with equivalent spellings made identical: sorted keys, folded strings,
    integral floats as ints (``1 == 1.0``) while booleans stay booleans (``true != 1``).

    JSON's own types are told apart by their exact type first: a check's args of 30,000
    numbers took 25 ms here through the generic tests (an ABC's isinstance per value), CPU
    that one team's checks took from another's (SPEC 10, found by an attacker). Any other
    type takes the generic path, with the same result."""
    kind = type(value)
    if kind is dict:
        return {str(k): canonical(v) for k, v in sorted(value.items(), key=_by_key)}
    if kind is list:
        return [v if type(v) in _AS_IS else canonical(v) for v in value]
    if kind is str:
        return normalize_text(value)
    if kind in _AS_IS:
        return value
    if kind is float:
        return int(value) if value.is_integer() else value
    return _canonical_any(value)


def _canonical_any(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): canonical(v) for k, v in sorted(value.items(), key=_by_key)}
    if isinstance(value, list | tuple):
        return [canonical(v) for v in value]
    if isinstance(value, str):
        return normalize_text(value)
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def canonical_args(args: Mapping[str, Any] | None, ignore_args: Iterable[str] = ()) -> bytes:
    """Compact UTF-8 JSON of the args without the ignored top-level names."""
    ignored = set(ignore_args)
    kept = {k: v for k, v in (args or {}).items() if k not in ignored}
    return json.dumps(
        canonical(kept), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    ).encode("utf-8")


def repeat_key(name: str, args: Mapping[str, Any] | None, ignore_args: Iterable[str] = ()) -> str:
    """``name:<hex sha-256 of the canonical args>``, the digest cut to DIGEST_CHARS."""
    digest = hashlib.sha256(canonical_args(args, ignore_args)).hexdigest()[:DIGEST_CHARS]
    return f"{name}:{digest}"
