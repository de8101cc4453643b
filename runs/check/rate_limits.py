"""The store's side of SPEC 12's rate limits: what a rule has counted, under which lock, with
which clock. The decision itself (full or not, retry_after_s) is
`governance_client.rules.rate_wait`, from the RateWindow of every matching rule.

A rule needs one stamp to be decided: that of the `max`-th most recent action it counted in
its scope (`rules.window_of`). So each rule keeps, per scope (a run, an agent name, the
team), a count `n` (RateCount) and a ring of its last `max` stamps (RateSlot): the n-th
counted action's stamp is in slot (n - 1) % max, so the `max`-th most recent one is in slot
n % max. Reading a window is two primary-key lookups per rule, whatever the traffic; the
count is exact, with nothing approximated (SPEC 10: "a check's rate-limit cost does not grow
with the hits in the window").

PostgreSQL is the authority, with nothing but itself in the way:
- a rule is counted for once it is registered (RateRule, with its pattern as a regular
  expression): when a policy version that has it is saved (`register_saved_rules`), and
  by every check that reads it. From then on every counted action of the team whose name
  matches it bumps its count, whatever the action's policy (SPEC 12: an agent's actions
  count "whatever the policy of its runs"). Registered by its first check only, a new rule
  missed the actions of the team's other policies until then (found by a tester: a
  `per: team` rule with `max: 1` allowed a second action in its window);
- every action counted like an allow bumps, in the check's own write, the count of each
  registered rule of its team that it matches and writes its stamp into the ring, stamped
  with the database's clock (`clock_timestamp()`) once the count's row is locked: the stamps
  of one ring are in the order of its counts, which is what makes slot n % max the
  `max`-th most recent;
- a check whose action matches a rule takes a transaction-level advisory lock per rule key
  (team, scope, scope value, pattern) after the run's row lock, in ascending key order: the
  checks that count against one rule are serialized across every server process, and no two
  checks can wait for each other's locks in a cycle (the run lock always comes first, the
  rule locks in one global order, the count rows last, in key order). A run-scoped rule
  needs no lock of its own: the run lock already serializes that run's checks;
- the wait for those locks is bounded (`RATE_LIMIT_LOCK_WAIT_MS`, SPEC 10): a check that
  does not get them in time answers `wait` with a short `retry_after_s` (BUSY_RETRY_S) and is
  decided again when the agent sends it again, instead of holding its thread;
- the windows are read by a statement that starts after those locks are granted, so under
  READ COMMITTED it sees every count committed by the previous holder.

Redis is not used: a Redis counter would have to be confirmed by this count anyway to stay
exact, so it could only add a round trip and a failure mode. Exactness covers the checks
whose policy carries the rule; an action of the same agent under a policy without that rule
is counted once committed, but is not serialized against the rule (it takes no lock for a
rule it does not have): see docs/policies.md.

The write repeats `fnmatch.fnmatchcase` as a regular expression (`glob_regex`);
tests/test_rate_limits.py checks that they agree. The embedded store (SQLite, serialized by
BEGIN IMMEDIATE) reads and counts through the ORM with fnmatch (`windows_in_python`,
`count_in_python`), on the same tables; tests/test_rate_limit_counts.py checks that both
ways give `rules.window_of`'s answer.
"""

from __future__ import annotations

import functools
import hashlib
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import F
from governance_client.rules import (
    Policy,
    RateLimit,
    RateWindow,
    compile_glob,
    glob_tokens,
)

# Counts older than the longest window any rule may have can never count again.
MAX_WINDOW_S = 86_400
# How long a check that did not get its rules' locks in time is told to wait.
BUSY_RETRY_S = 0.1
# A rule's registration records its last read to this precision: one write an hour per rule,
# not one per check.
READ_REFRESH = timedelta(hours=1)


def lock_wait_ms() -> int:
    """The longest a check waits for its rules' advisory locks (SPEC 10); 1 ms at least, so
    that an uncontended lock is always taken."""
    return max(1, int(settings.RATE_LIMIT_LOCK_WAIT_MS))


def glob_regex(pattern: str) -> str:
    """`fnmatch.fnmatchcase(name, pattern)` as a PostgreSQL regular expression (ARE),
    anchored: `*` any run of characters, `?` one character, `[...]` / `[!...]` a set.

    The pattern is read as `fnmatch.translate` reads it (`rules.glob_tokens`: a set without
    its closing bracket is a literal "[", descending ranges are dropped, an emptied set
    matches nothing), with ARE escaping: a backslash before every character that is not a
    letter or a digit, which in an ARE means that character itself, inside brackets too; a
    run of stars is one ".*".
    """
    out = ["^"]
    for kind, value in glob_tokens(pattern):
        if kind == "*":
            # A run of stars is one star (as fnmatch.translate has it): PostgreSQL's engine
            # takes about 30 ms to match a pattern of 190 ".*" in a row, and a team's 200
            # rules of them made each of its checks' writes take 6 s, 40 s under concurrency
            # (found by an attacker).
            if out[-1] != ".*":
                out.append(".*")
        elif kind == "?":
            out.append(".")
        elif kind == "set":
            out.append(_bracket(*value))
        else:
            out.append(_esc(value))
    out.append("$")
    return "".join(out)


def _bracket(negate: bool, chunks: list[str]) -> str:
    """A set, split as `rules.glob_tokens` splits it, in ARE."""
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


# --- Keys --------------------------------------------------------------------------------------

def scope_value(rule: RateLimit, *, agent: str, run_id: Any) -> str:
    """Whose actions the rule counts together, within its team (the rule's key has the team):
    the write computes the same in SQL (COUNT_CTES)."""
    if rule.per == "run":
        return str(run_id)
    if rule.per == "agent":
        return agent
    return ""


def rule_key(rule: RateLimit, *, team_id: int) -> uuid.UUID:
    """The key of a rule's counts: the rules of a team with the same scope, max and pattern
    count the same actions into the same rings (the window is applied when reading). 128 bits,
    so that two rules never share counts by a collision."""
    text = f"governance.rate|{team_id}|{rule.per}|{rule.max}|{rule.match}"
    return uuid.UUID(bytes=hashlib.blake2b(text.encode(), digest_size=16).digest())


def lock_key(rule: RateLimit, *, team_id: int, agent: str, run_id: Any) -> int:
    """A signed 64-bit advisory lock key for the rule's counter. A collision only makes two
    unrelated counters share a lock (slower, never wrong)."""
    text = f"governance.rate|{team_id}|{rule.per}|" \
           f"{scope_value(rule, agent=agent, run_id=run_id)}|{rule.match}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big",
                          signed=True)


def lock_keys(rules: Sequence[RateLimit], *, team_id: int, agent: str, run_id: Any
              ) -> list[int]:
    """The advisory locks a check takes, deduplicated and in the one order every check uses."""
    return sorted({lock_key(r, team_id=team_id, agent=agent, run_id=run_id)
                   for r in rules if r.per != "run"})


# --- The bounded lock wait (PostgreSQL) --------------------------------------------------------

# Takes the keys' advisory locks in the given order, waiting at most wait_ms for all of them
# together; false when that was not enough (the locks it got are released with the block's
# subtransaction, and lock_timeout is back to what it was). Created by runs/migrations/0011.
LOCK_FUNCTION_SQL = """
CREATE OR REPLACE FUNCTION governance_rate_lock(keys bigint[], wait_ms integer)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    deadline timestamptz := clock_timestamp() + make_interval(secs => wait_ms / 1000.0);
    previous text := current_setting('lock_timeout');
    k bigint;
BEGIN
    FOREACH k IN ARRAY keys LOOP
        PERFORM set_config('lock_timeout', greatest(1, ceil(extract(epoch FROM
            deadline - clock_timestamp()) * 1000))::bigint || 'ms', true);
        PERFORM pg_advisory_xact_lock(k);
    END LOOP;
    PERFORM set_config('lock_timeout', previous, true);
    RETURN true;
EXCEPTION WHEN lock_not_available THEN
    RETURN false;
END
$$;
"""
DROP_LOCK_FUNCTION_SQL = "DROP FUNCTION IF EXISTS governance_rate_lock(bigint[], integer);"


def lock_statement(keys: Sequence[int]) -> str:
    """The statement taking these locks (its one row: whether it got them in time). The keys
    are integers, and the wait is an integer: nothing to quote."""
    return (f"SELECT governance_rate_lock('{{{','.join(str(int(k)) for k in keys)}}}'"
            f"::bigint[], {lock_wait_ms()})")


# --- Reading the windows (PostgreSQL) ----------------------------------------------------------

# A rule's parameters in the window read, in order, with their types for PREPARE.
_PARAMS = (("key", "uuid"), ("team_id", "bigint"), ("per", "text"), ("match", "text"),
           ("regex", "text"), ("max", "integer"), ("scope", "text"),
           ("window_s", "double precision"))


def _windows_body(count: int, ph: Callable[[int, str], str]) -> str:
    """The window read for `count` rules; ph(i, name) is the placeholder of rule i's
    parameter `name`. It registers the rules (a rule already known costs an index lookup),
    records a read at most once an hour, and reads each ring's `max`-th most recent stamp:
    one row per rule, in order. One subquery for all the rules, so that planning the
    statement (its first executions on a connection) costs little more for 50 rules than
    for one. Neither write can be in a cycle with another check's: the new rules are
    inserted in key order (two checks registering the same rules wait in one order), and the
    read is recorded only on the rows no other check holds (SKIP LOCKED: that one records
    it)."""
    values = ", ".join(
        f"({i}, " + ", ".join(ph(i, name) for name, _ in _PARAMS) + ")" for i in range(count))
    names = ", ".join(name for name, _ in _PARAMS)
    return (
        "WITH c AS MATERIALIZED (SELECT clock_timestamp() AS now), "
        f"v AS MATERIALIZED (SELECT * FROM (VALUES {values}) AS v(i, {names})), "
        "fresh AS (INSERT INTO runs_raterule (key, team_id, per, match, regex, max, read_at) "
        "SELECT v.key, v.team_id, v.per, v.match, v.regex, v.max, c.now FROM v, c "
        "ORDER BY v.key ON CONFLICT (key) DO NOTHING), "
        "seen AS (UPDATE runs_raterule r SET read_at = c.now FROM c WHERE r.key IN ("
        "SELECT o.key FROM runs_raterule o JOIN v ON o.key = v.key, c AS t "
        f"WHERE o.read_at < t.now - interval '{int(READ_REFRESH.total_seconds())} seconds' "
        "FOR UPDATE OF o SKIP LOCKED)) "
        "SELECT c.now, (SELECT s.at FROM runs_ratecount k JOIN runs_rateslot s"
        " ON s.rule_key = k.rule_key AND s.scope = k.scope AND s.slot = mod(k.n, v.max)"
        " WHERE k.rule_key = v.key AND k.scope = v.scope AND k.n >= v.max"
        " AND s.at > c.now - make_interval(secs => v.window_s)) "
        "FROM v, c ORDER BY v.i")


def _rule_params(rule: RateLimit, *, team_id: int, agent: str, run_id: Any) -> dict[str, Any]:
    return {"key": rule_key(rule, team_id=team_id), "team_id": team_id, "per": rule.per,
            "match": rule.match, "regex": glob_regex(rule.match), "max": rule.max,
            "scope": scope_value(rule, agent=agent, run_id=run_id),
            "window_s": float(rule.window_s)}


def windows_params(rules: Sequence[RateLimit], *, team_id: int, agent: str, run_id: Any
                   ) -> list[Any]:
    """The prepared window read's parameters, in order."""
    out: list[Any] = []
    for rule in rules:
        values = _rule_params(rule, team_id=team_id, agent=agent, run_id=run_id)
        out += [values[name] for name, _ in _PARAMS]
    return out


def windows_sql(rules: Sequence[RateLimit], *, team_id: int, agent: str, run_id: Any
                ) -> tuple[str, dict[str, Any]]:
    """One statement reading, per rule, the database clock and the stamp of the rule's
    max-th most recent counted action inside its window (`rules.window_of` in SQL)."""
    params = {f"r{i}_{name}": value for i, rule in enumerate(rules)
              for name, value in _rule_params(rule, team_id=team_id, agent=agent,
                                              run_id=run_id).items()}
    return _windows_body(len(rules), lambda i, name: f"%(r{i}_{name})s"), params


def windows_positional(count: int) -> tuple[str, list[str], str]:
    """The window read for `count` rules with positional placeholders ($1, $2, ... in
    `windows_params` order): its statement name (one per number of rules, the only thing that
    changes the SQL), the placeholders' types, and the statement."""
    position = {name: index for index, (name, _) in enumerate(_PARAMS)}
    types = [kind for _ in range(count) for _, kind in _PARAMS]
    body = _windows_body(count, lambda i, n: f"${i * len(_PARAMS) + position[n] + 1}")
    return f"governance_rate_{count}", types, body


def windows_prepared(rules: Sequence[RateLimit]) -> tuple[str, str]:
    """The same statement to PREPARE once per connection: its name and its PREPARE. Planning
    it costs PostgreSQL more than running it, as for the check's own statements."""
    name, types, body = windows_positional(len(rules))
    return name, f"PREPARE {name}({', '.join(types)}) AS {body}"


def windows_from_rows(rules: Sequence[RateLimit], rows: Sequence[Sequence[Any]], *,
                      locked: bool = True) -> list[RateWindow]:
    """The windows of a read (one row per rule, in order); `locked` False: the check did not
    get its rules' locks in time, so every rule that needed one is busy (the run-scoped ones
    were read under the run's lock)."""
    return [RateWindow(rule, at, now, None if locked or rule.per == "run" else BUSY_RETRY_S)
            for rule, (now, at) in zip(rules, rows, strict=True)]


# --- Counting (PostgreSQL) ---------------------------------------------------------------------

# An action is counted for at most this many of its team's registered rules, the most
# recently read (a policy save caps a team's current rules at MAX_RATE_RULES_PER_TEAM, but a
# rule stays registered a day after its last read: a team that keeps replacing its rules
# registered 2,200, and every action of it bumped each, so its checks took seconds and
# another team's p99 rose 19x). Past it, a team's oldest registrations stop counting: its
# own rate limits' exactness is what it spends, never another team's time.
COUNTED_RULES = 200


def count_ctes(hits: str) -> str:
    """The data-modifying CTEs that count the actions in `hits` (a jsonb array of {team_id,
    agent, run_id, action_name}, empty: nothing counted) for every registered rule of their
    team that their name matches: the count row first, in key order (the one order every
    writer locks them in), then the stamp, taken once the row is locked, into the ring's
    slot."""
    return f"""counted AS (
    INSERT INTO runs_ratecount AS k (rule_key, scope, n, last_at)
    SELECT r.key, CASE r.per WHEN 'run' THEN h.run_id::text WHEN 'agent' THEN h.agent
                  ELSE '' END, 1, clock_timestamp()
    FROM jsonb_to_recordset({hits}) AS h(team_id bigint, agent text, run_id uuid,
                                         action_name text)
    JOIN LATERAL (SELECT key, per, regex FROM runs_raterule WHERE team_id = h.team_id
                  ORDER BY read_at DESC, key LIMIT {COUNTED_RULES}) r
      ON h.action_name ~ r.regex
    ORDER BY 1, 2
    ON CONFLICT (rule_key, scope) DO UPDATE SET n = k.n + 1, last_at = clock_timestamp()
    RETURNING k.rule_key, k.scope, k.n, k.last_at
), stamped AS (
    INSERT INTO runs_rateslot AS s (rule_key, scope, slot, at)
    SELECT c.rule_key, c.scope, mod(c.n - 1, r.max), c.last_at
    FROM counted c JOIN runs_raterule r ON r.key = c.rule_key
    ORDER BY 1, 2
    ON CONFLICT (rule_key, scope, slot) DO UPDATE SET at = EXCLUDED.at
)"""


# The same as a statement of its own, for the ORM path on PostgreSQL. (No "%" in the SQL
# above: this one is formatted with a parameter.)
COUNT_SQL = f"WITH {count_ctes('%s::jsonb')} SELECT count(*) FROM counted"


# --- The embedded store: the same through the ORM ----------------------------------------------

def _register(rules: Sequence[RateLimit], *, team_id: int, now: datetime) -> None:
    from runs.models import RateRule

    keys = [rule_key(rule, team_id=team_id) for rule in rules]
    RateRule.objects.bulk_create(
        [RateRule(key=key, team_id=team_id, per=rule.per, match=rule.match,
                  regex=glob_regex(rule.match), max=rule.max, read_at=now)
         for key, rule in zip(keys, rules, strict=True)], ignore_conflicts=True)
    RateRule.objects.filter(key__in=keys, read_at__lt=now - READ_REFRESH).update(read_at=now)


def register_saved_rules(version: Any) -> None:
    """Register the rate-limit rules of a policy version just saved (policies' PolicyVersion,
    connected in runs/apps.py): the team's actions under every policy count for them from the
    save on, not from the first check that reads them."""
    from django.utils import timezone

    rules = Policy.from_document(version.document).rate_limits
    if rules:
        _register(rules, team_id=version.policy.team_id, now=timezone.now())


# When this process last registered the current policies' rules again (`keep_current_rules`).
_kept_at: datetime | None = None


def keep_current_rules(*, now: datetime) -> None:
    """Register again the rules of every team's current policy versions, so that the prune
    forgets only rules no current policy has: a current rule no check had read for a day
    would be forgotten, and the other policies' actions then not counted until its next
    read. At most once per READ_REFRESH per process, the precision a registration's read is
    kept to: the prune runs every minute."""
    from policies.models import Policy as PolicyRow
    from runs.models import RateRule

    global _kept_at
    if _kept_at is not None and timedelta(0) <= now - _kept_at < READ_REFRESH:
        return
    _kept_at = now
    current = (PolicyRow.objects.filter(current__isnull=False)
               .exclude(current__document__rate_limits=[])
               .values_list("team_id", "current__document"))
    for team_id, document in current:
        rules = Policy.from_document(document).rate_limits
        if rules:
            _register(rules, team_id=team_id, now=now)
            # A rule registered in the SQL form of an older version (a process of the
            # previous release during an upgrade, after runs/0021 rewrote the rest) takes
            # this version's form here, within the hour; never on a check's path, whose
            # registration takes no row lock (ON CONFLICT DO NOTHING).
            for rule in rules:
                regex = glob_regex(rule.match)
                RateRule.objects.filter(key=rule_key(rule, team_id=team_id)).exclude(
                    regex=regex).update(regex=regex)


def windows_in_python(rules: Sequence[RateLimit], *, team_id: int, agent: str, run_id: Any,
                      now: datetime) -> list[RateWindow]:
    """The windows through the ORM, for the embedded store (whose BEGIN IMMEDIATE is the lock
    and whose clock is the server's)."""
    from runs.models import RateCount, RateSlot

    _register(rules, team_id=team_id, now=now)
    out = []
    for rule in rules:
        key, scope = rule_key(rule, team_id=team_id), scope_value(rule, agent=agent,
                                                                  run_id=run_id)
        n = RateCount.objects.filter(rule_key=key, scope=scope).values_list("n", flat=True)
        count = n.first() or 0
        nth = None
        if count >= rule.max:
            nth = (RateSlot.objects.filter(rule_key=key, scope=scope, slot=count % rule.max,
                                           at__gt=now - timedelta(seconds=rule.window_s))
                   .values_list("at", flat=True).first())
        out.append(RateWindow(rule, nth, now))
    return out


# The registered rules' patterns compiled once per process for the embedded store's count,
# which reads them as rows at every counted check (found by a review: a rule made anew from
# its row compiled its pattern anew, 37 ms a check for 200 long rules).
_rule_glob = functools.lru_cache(maxsize=4 * COUNTED_RULES)(compile_glob)


def count_in_python(*, team_id: int, agent: str, run_id: Any, action_name: str,
                    at: datetime) -> int:
    """Count one action for every registered rule of its team that its name matches (the
    write's COUNT_CTES through the ORM); the number of rules that counted it."""
    from runs.models import RateCount, RateRule, RateSlot

    counted = 0
    newest = (RateRule.objects.filter(team_id=team_id).order_by("-read_at", "key")
              .values_list("key", "per", "match", "max")[:COUNTED_RULES])
    for key, per, match, size in sorted(newest):  # in key order, as the write locks them
        if _rule_glob(match).match(action_name) is None:
            continue
        rule = RateLimit(match=match, per=per, max=size, window_s=1)
        scope = scope_value(rule, agent=agent, run_id=run_id)
        rows = RateCount.objects.filter(rule_key=key, scope=scope)
        if not rows.update(n=F("n") + 1, last_at=at):
            RateCount.objects.create(rule_key=key, scope=scope, n=1, last_at=at)
        n = rows.values_list("n", flat=True).get()
        RateSlot.objects.update_or_create(rule_key=key, scope=scope, slot=(n - 1) % size,
                                          defaults={"at": at})
        counted += 1
    return counted


# --- Forgetting --------------------------------------------------------------------------------

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


# A count and its ring go together, once no window can reach its last stamp: a ring's stamps
# are only overwritten, never aged out one by one (no index on their stamps to maintain on
# every count). On PostgreSQL the sweep skips the counts a check holds (SKIP LOCKED) rather
# than wait for them; holding a count, it holds the only way to its ring's stamps, so it
# never waits for a check and can never be in a cycle with a check's locks.
_PRUNE_COUNTS_SQL = """
WITH gone AS (
    DELETE FROM runs_ratecount WHERE (rule_key, scope) IN (
        SELECT rule_key, scope FROM runs_ratecount WHERE last_at <= %(cutoff)s
        FOR UPDATE SKIP LOCKED)
    RETURNING rule_key, scope
)
DELETE FROM runs_rateslot s USING gone g
WHERE s.rule_key = g.rule_key AND s.scope = g.scope AND s.at <= %(cutoff)s
"""
_PRUNE_RULES_SQL = """
DELETE FROM runs_raterule WHERE key IN (
    SELECT key FROM runs_raterule WHERE read_at <= %(cutoff)s FOR UPDATE SKIP LOCKED)
"""


def prune_hits(*, now: datetime) -> int:
    """Forget the counts whose last action no window can reach any more, with their rings,
    and the rules no current policy has and no check has read for longer than that (the beat
    sweep calls this). Returns the stamps forgotten. A forgotten count starts again from zero;
    a forgotten rule is registered again by the next check that reads it."""
    from django.db import connection

    from runs.models import RateCount, RateRule, RateSlot

    cutoff = now - timedelta(seconds=MAX_WINDOW_S)
    rule_cutoff = cutoff - READ_REFRESH
    keep_current_rules(now=now)
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(_PRUNE_COUNTS_SQL, {"cutoff": cutoff})
            forgotten = cursor.rowcount
            cursor.execute(_PRUNE_RULES_SQL, {"cutoff": rule_cutoff})
        return forgotten
    forgotten = 0
    old = RateCount.objects.filter(last_at__lte=cutoff)
    for key, scope in old.values_list("rule_key", "scope"):
        forgotten += RateSlot.objects.filter(rule_key=key, scope=scope,
                                             at__lte=cutoff).delete()[0]
    old.delete()
    RateRule.objects.filter(read_at__lte=rule_cutoff).delete()
    return forgotten
