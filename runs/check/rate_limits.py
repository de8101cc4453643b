"""The store's side of SPEC 12's rate limits: which counted actions a rule sees, under which
lock, with which clock. The decision itself (full or not, retry_after_s) is
`governance_client.rules.rate_wait`, from the RateWindow of every matching rule.

PostgreSQL is the authority, with nothing but itself in the way:
- every action counted like an allow inserts a `runs_ratehit` row in the check's own write,
  stamped with the database's clock (`clock_timestamp()`), so a count never depends on the
  web servers' clocks;
- a check whose action matches a rule takes a transaction-level advisory lock per rule key
  (team, scope, scope value, pattern) after the run's row lock, in ascending key order: the
  checks that count against one rule are serialized across every server process, and no two
  checks can wait for each other's locks in a cycle (the run lock always comes first, the
  rule locks in one global order). A run-scoped rule needs no lock of its own: the run lock
  already serializes that run's checks;
- the window is read by a statement that starts after those locks are granted, so under
  READ COMMITTED it sees every hit committed by the previous holder.

Redis is not used: a Redis counter would have to be confirmed by this count anyway to stay
exact, so it could only add a round trip and a failure mode (docs/performance.md has the cost
of the count). Exactness covers the checks whose policy carries the rule; an action of the
same agent under a policy without that rule is counted once committed, but is not serialized
against the rule (it takes no lock for a rule it does not have): see the README.

The SQL below repeats `rules.window_of` (the max-th most recent stamp inside the window) and
`fnmatch.fnmatchcase` (as a regular expression); tests/test_rate_limits.py checks that they
agree. The embedded store (SQLite, serialized by BEGIN IMMEDIATE) uses the Python versions.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from governance_client.rules import RateLimit, RateWindow, window_of

# Hits older than the longest window any rule may have can never count again.
MAX_WINDOW_S = 86_400


def glob_regex(pattern: str) -> str:
    """`fnmatch.fnmatchcase(name, pattern)` as a PostgreSQL regular expression (ARE),
    anchored: `*` any run of characters, `?` one character, `[...]` / `[!...]` a set.

    The bracket handling is CPython's `fnmatch.translate`, step for step (a set without its
    closing bracket is a literal "[", descending ranges are dropped, an emptied set matches
    nothing), with ARE escaping: a backslash before every character that is not a letter or
    a digit, which in an ARE means that character itself, inside brackets too.
    """
    out = ["^"]
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        i += 1
        if c == "*":
            out.append(".*")
        elif c == "?":
            out.append(".")
        elif c == "[":
            j = i
            if j < n and pattern[j] == "!":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 1
            if j >= n:
                out.append(r"\[")
                continue
            negate = pattern[i] == "!"
            out.append(_bracket(pattern, i, j, negate))
            i = j + 1
        else:
            out.append(_esc(c))
    out.append("$")
    return "".join(out)


def _bracket(pattern: str, i: int, j: int, negate: bool) -> str:
    """The set pattern[i:j] (without its brackets), split as fnmatch.translate splits it."""
    chunks: list[str] = []
    k = i + 2 if negate else i + 1
    while True:
        k = pattern.find("-", k, j)
        if k < 0:
            break
        chunks.append(pattern[i:k])
        i = k + 1
        k = k + 3
    chunk = pattern[i:j]
    if chunk:
        chunks.append(chunk)
    elif chunks:
        chunks[-1] += "-"
    for k in range(len(chunks) - 1, 0, -1):
        if chunks[k - 1][-1] > chunks[k][0]:
            chunks[k - 1] = chunks[k - 1][:-1] + chunks[k][1:]
            del chunks[k]
    if negate:
        chunks[0] = chunks[0][1:]
    # Between chunks a hyphen makes a range; every other character is escaped.
    body = "-".join("".join(_esc(ch) for ch in chunk) for chunk in chunks)
    if not body:
        # "[z-a]" matches nothing, "[!z-a]" any one character (as in fnmatch).
        return "." if negate else "$.^"
    return "[" + ("^" if negate else "") + body + "]"


def _esc(c: str) -> str:
    # Every ARE metacharacter is ASCII punctuation; a backslash before a letter or a digit
    # would make an escape (\d, \w...), so those and non-ASCII characters stay bare.
    return c if c.isalnum() or not c.isascii() else "\\" + c


def scope_value(rule: RateLimit, *, team_id: int, agent: str, run_id: Any) -> str:
    if rule.per == "run":
        return str(run_id)
    if rule.per == "agent":
        return f"{team_id}:{agent}"
    return str(team_id)


def lock_key(rule: RateLimit, *, team_id: int, agent: str, run_id: Any) -> int:
    """A signed 64-bit advisory lock key for the rule's counter. A collision only makes two
    unrelated counters share a lock (slower, never wrong)."""
    text = f"governance.rate|{team_id}|{rule.per}|" \
           f"{scope_value(rule, team_id=team_id, agent=agent, run_id=run_id)}|{rule.match}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big",
                          signed=True)


def lock_keys(rules: Sequence[RateLimit], *, team_id: int, agent: str, run_id: Any
              ) -> list[int]:
    """The advisory locks a check takes, deduplicated and in the one order every check uses."""
    return sorted({lock_key(r, team_id=team_id, agent=agent, run_id=run_id)
                   for r in rules if r.per != "run"})


_SCOPE_SQL = {
    "run": "h.run_id = %s",
    "agent": "h.team_id = %s AND h.agent = %s",
    "team": "h.team_id = %s",
}


def _scope_params(rule: RateLimit, *, team_id: int, agent: str, run_id: Any) -> list[Any]:
    if rule.per == "run":
        return [run_id]
    if rule.per == "agent":
        return [team_id, agent]
    return [team_id]


_SCOPE_TYPES = {"run": ["uuid"], "agent": ["bigint", "text"], "team": ["bigint"]}


def _windows_body(rules: Sequence[RateLimit], placeholder: Any) -> str:
    columns = []
    for rule in rules:
        pieces = _SCOPE_SQL[rule.per].split("%s")
        scope = pieces[0] + "".join(placeholder() + piece for piece in pieces[1:])
        columns.append(
            f"(SELECT h.at FROM runs_ratehit h WHERE {scope}"
            f" AND h.at > c.now - make_interval(secs => {placeholder()})"
            f" AND h.action_name ~ {placeholder()}"
            f" ORDER BY h.at DESC OFFSET {placeholder()} LIMIT 1)")
    return ("WITH c AS MATERIALIZED (SELECT clock_timestamp() AS now) SELECT c.now, "
            + ", ".join(columns) + " FROM c")


def windows_params(rules: Sequence[RateLimit], *, team_id: int, agent: str, run_id: Any
                   ) -> list[Any]:
    params: list[Any] = []
    for rule in rules:
        params += [*_scope_params(rule, team_id=team_id, agent=agent, run_id=run_id),
                   rule.window_s, glob_regex(rule.match), rule.max - 1]
    return params


def windows_sql(rules: Sequence[RateLimit], *, team_id: int, agent: str, run_id: Any
                ) -> tuple[str, list[Any]]:
    """One statement reading the database clock and, per rule, the stamp of the rule's
    max-th most recent matching hit inside its window (`rules.window_of` in SQL)."""
    return (_windows_body(rules, lambda: "%s"),
            windows_params(rules, team_id=team_id, agent=agent, run_id=run_id))


def windows_prepared(rules: Sequence[RateLimit]) -> tuple[str, str]:
    """The same statement to PREPARE once per connection: its name (one per sequence of
    scopes, the only thing that changes the SQL) and its PREPARE. Planning it costs
    PostgreSQL more than running it, as for the check's own statements."""
    scopes = [r.per for r in rules]
    name = "governance_rate_" + hashlib.blake2b("_".join(scopes).encode(),
                                                digest_size=6).hexdigest()
    types = [t for per in scopes for t in [*_SCOPE_TYPES[per], "double precision", "text",
                                             "bigint"]]
    counter = iter(range(1, len(types) + 1))
    body = _windows_body(rules, lambda: f"${next(counter)}")
    return name, f"PREPARE {name}({', '.join(types)}) AS {body}"


def windows_from_row(rules: Sequence[RateLimit], row: Sequence[Any]) -> list[RateWindow]:
    now: datetime = row[0]
    return [RateWindow(rule, row[i + 1], now) for i, rule in enumerate(rules)]


def windows_in_python(rules: Sequence[RateLimit], *, team_id: int, agent: str, run_id: Any,
                      now: datetime) -> list[RateWindow]:
    """The same windows through the ORM, matched with fnmatch: the embedded store's way."""
    from runs.models import RateHit

    out = []
    for rule in rules:
        hits = RateHit.objects.filter(at__gt=now - timedelta(seconds=rule.window_s))
        if rule.per == "run":
            hits = hits.filter(run_id=run_id)
        elif rule.per == "agent":
            hits = hits.filter(team_id=team_id, agent=agent)
        else:
            hits = hits.filter(team_id=team_id)
        stamps = [at for name, at in hits.values_list("action_name", "at") if rule.matches(name)]
        out.append(window_of(rule, stamps, now))
    return out


_last_prune = 0.0
PRUNE_EVERY_S = 60.0


def prune_hits_now_and_then(*, now: datetime) -> int:
    """`prune_hits` at most once a minute per process: for the embedded default, which has no
    beat and whose SQLite takes its one write lock for any DELETE, even an empty one."""
    global _last_prune
    if time.monotonic() - _last_prune < PRUNE_EVERY_S:
        return 0
    _last_prune = time.monotonic()
    return prune_hits(now=now)


def prune_hits(*, now: datetime) -> int:
    """Forget the hits no window can reach any more (the beat sweep calls this)."""
    from runs.models import RateHit

    deleted, _ = RateHit.objects.filter(at__lte=now - timedelta(seconds=MAX_WINDOW_S)).delete()
    return deleted
