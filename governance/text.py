"""What text can be stored: the one rule every input surface applies (the API's bodies, the
dashboard's forms and query strings, policy documents), so that a value PostgreSQL cannot
hold is refused as the caller's error and never reaches the database as a 500."""

from __future__ import annotations

from typing import Any


def text_problem(text: str) -> str | None:
    """Why a string cannot be stored as given, or None. PostgreSQL refuses NUL in text and
    jsonb, and a lone surrogate cannot be encoded to UTF-8: both would otherwise surface
    as a store error (503) or a crash instead of a 422 naming the field."""
    if "\x00" in text:
        return "must not contain NUL characters (\\u0000)"
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return "must be valid Unicode (no lone surrogate code points)"
    return None


def first_text_problem(value: Any, path: str = "") -> tuple[str, str] | None:
    """The first string (a key or a value) anywhere in `value` that cannot be stored, as
    (its dotted path, why), or None."""
    if isinstance(value, str):
        problem = text_problem(value)
        return (path, problem) if problem is not None else None
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            problem = text_problem(str(key))
            if problem is not None:
                return where, problem
            found = first_text_problem(item, where)
            if found is not None:
                return found
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found = first_text_problem(item, f"{path}.{index}" if path else str(index))
            if found is not None:
                return found
    return None
