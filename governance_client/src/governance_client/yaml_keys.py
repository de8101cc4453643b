"""YAML's safe loader, refusing a key written twice in one mapping: YAML's loaders keep the
last one without a word, so `mode: shadow` above `mode: enforce` would be applied as enforce
while its reader believed the first. A merge (`<<`) may still be overridden by the mapping's
own keys, as YAML says.

One definition for the server's policy reader (policies/document.py) and `govctl`, so a file
`govctl` applies is read as the server reads it. Needs PyYAML (a server dependency; the
client's `cli` extra)."""

from __future__ import annotations

from typing import Any

import yaml

MERGE_TAG = "tag:yaml.org,2002:merge"


def unique_keys(base: Any) -> Any:
    """A subclass of the loader ``base`` (SafeLoader or CSafeLoader) that refuses a key
    written twice in one mapping with a ConstructorError at that key."""

    class Loader(base):  # type: ignore[misc, valid-type]
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: set[Any] = set()
            for key_node, _value in getattr(node, "value", ()):
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == MERGE_TAG:
                    continue
                key = self.construct_object(key_node)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"found the key {key!r} twice in one mapping",
                        key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    Loader.__name__ = Loader.__qualname__ = f"UniqueKeys{base.__name__}"
    return Loader


def yaml_problem(exc: Exception, source: str) -> str:
    """A YAML reader's error in words a newcomer can act on: "found character that cannot
    start any token" does not say that the character is a tab, and YAML indents with spaces
    only. ``source``: the text that was read."""
    text = str(exc)
    mark = getattr(exc, "problem_mark", None)
    if mark is not None:
        lines = source.splitlines()
        line = lines[mark.line] if 0 <= mark.line < len(lines) else ""
        if line[mark.column:mark.column + 1] == "\t":
            text += "\n(a tab character: YAML indents with spaces, never tabs)"
    return text
