"""The walks of a check's args (the repeat key's canonical form, the redaction) tell JSON's
own types apart by their exact type before the generic tests, which cost an ABC's isinstance
per value (a check of 30,000 numbers: 25 ms for the key, 12 ms for the redaction, CPU one
team's checks took from another's, SPEC 10). The answers must be exactly the generic
walks': here against those walks as they were written, on any JSON value and on the Python
types a client may pass (tuples, mappings that are not dicts, str and int subclasses)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from governance_client.keys import canonical, normalize_text
from governance_client.rules import REDACTED, redact


def canonical_before(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): canonical_before(v)
                for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, list | tuple):
        return [canonical_before(v) for v in value]
    if isinstance(value, str):
        return normalize_text(value)
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def redact_before(value: Any, lowered: frozenset[str]) -> Any:
    if isinstance(value, Mapping):
        return {k: REDACTED if str(k).lower() in lowered else redact_before(v, lowered)
                for k, v in value.items()}
    if isinstance(value, list):
        return [redact_before(v, lowered) for v in value]
    return value


class Text(str):
    pass


class Count(int):
    pass


scalars = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
           | st.text(alphabet=" \tab\u00a0PaSsWoRd", max_size=8)
           | st.sampled_from([1.0, -0.0, 2.5e16, Text(" a  b "), Count(3), True]))
keys = st.text(alphabet="aPsWoRdTkn ", max_size=8) | st.sampled_from(["password", "TOKEN"])
values = st.recursive(
    scalars,
    lambda inner: (st.lists(inner, max_size=5) | st.tuples(inner, inner)
                   | st.dictionaries(keys, inner, max_size=5)
                   | st.dictionaries(keys, inner, max_size=3).map(OrderedDict)
                   | st.dictionaries(keys, inner, max_size=3).map(MappingProxyType)),
    max_leaves=30)


def same(a: Any, b: Any) -> bool:
    """Equal, and of the same types all the way down (1 == 1.0 == True in Python)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b or (a != a and b != b)


@settings(max_examples=400, deadline=None)
@given(values)
def test_the_canonical_form_is_the_generic_walks(value: Any) -> None:
    assert same(canonical(value), canonical_before(value))


@settings(max_examples=400, deadline=None)
@given(values)
def test_the_redaction_is_the_generic_walks(value: Any) -> None:
    lowered = frozenset({"password", "token"})
    assert same(redact(value, lowered), redact_before(value, lowered))
