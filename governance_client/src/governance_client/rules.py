"""The decision rules of SPEC section 4, as pure functions.

Policy + run state + check + clock in; decision + new state out. Nothing here touches Django,
the database or the network, so every rule can be tested exhaustively and the same rules serve
the HTTP check, the kill-switch fan-out and the model-based tests.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal
from fnmatch import translate
from itertools import pairwise
from typing import Any

from .keys import canonical, normalize_text, repeat_key

RUNNING = "running"
STOPPED = "stopped"
KILLED = "killed"
COMPLETED = "completed"
FAILED = "failed"
TERMINAL = frozenset({STOPPED, KILLED, COMPLETED, FAILED})

# An agent's name (SPEC 5.1), as the API, the dashboard, the commands and the client check it
# (with fullmatch). The dash is escaped so the same text is also a valid HTML pattern.
AGENT_NAME_PATTERN = r"[A-Za-z0-9._\-]{1,100}"
AGENT_NAME = re.compile(AGENT_NAME_PATTERN)

ALLOW = "allow"
STOP = "stop"
WOULD_STOP = "would_stop"
WAIT = "wait"  # SPEC 12: a rate limit is full; nothing is counted, the agent sends it again
PENDING = "pending"  # SPEC 11: an answer, an audited outcome and an approval's status

STEP_OK = "step_ok"
REASONS = (
    "killed",
    "max_steps",
    "tool_denied",
    "max_seconds",
    "max_usd",
    "max_tool_calls",
    "loop_detected",
    "no_progress",
    "repeated_error",
)
RUN_FINISHED = "run_finished"
AGENT_STOPPED = "agent_stopped"
RATE_LIMITED = "rate_limited"
ABANDONED = "abandoned"  # SPEC 14: no activity for budgets.max_idle_seconds
PARENT_STOPPED = "parent_stopped"  # SPEC 20: an ancestor of the run is over
MAX_DEPTH = 5  # SPEC 20: a root is depth 0, its deepest descendant depth 5
SCOPES = ("run", "agent", "team")  # rate_limits[].per
APPROVAL_REQUIRED = "approval_required"
APPROVAL_DENIED = "approval_denied"
APPROVAL_EXPIRED = "approval_expired"

# The life of an approval request (SPEC 11): pending, then exactly one of the others.
APPROVED = "approved"
DENIED = "denied"
EXPIRED = "expired"
CANCELLED = "cancelled"
APPROVAL_STATUSES = (PENDING, APPROVED, DENIED, EXPIRED, CANCELLED)

DEFAULT_REDACT = ("password", "api_key", "token", "secret", "authorization")
REDACTED = "[redacted]"

NEXT_ACTION = {
    "killed": "Stop now and return the partial response: an operator engaged the kill switch.",
    "max_steps": "Return the partial response, then split the task or relaunch with a narrower "
    "scope.",
    "tool_denied": "Do not run this tool: return the partial response or use an allowed tool in "
    "a new run.",
    "max_seconds": "Return the partial response; the run's time budget is spent. Relaunch with a "
    "narrower scope.",
    "max_usd": "Return the partial response; the run's money budget is spent. Relaunch with a "
    "narrower scope.",
    "max_tool_calls": "Return the partial response; the run's tool-call budget is spent. Relaunch "
    "with a narrower scope.",
    "loop_detected": "Return the partial response, then reformulate the request or relaunch with "
    "a narrower scope.",
    "no_progress": "Return the partial response; recent steps found nothing new. Reformulate the "
    "request or relaunch with another scope.",
    "repeated_error": "Return the partial response; the same error keeps coming back. Change "
    "approach or abandon this subtask.",
    "agent_stopped": "The agent stopped this run: start a new run for new work.",
    RATE_LIMITED: "Do not run the action yet: wait retry_after_s seconds, then send the same "
    "check again.",
    ABANDONED: "The run was ended for inactivity: start a new run for new work.",
    PARENT_STOPPED: "Stop now and return the partial response to the parent agent: a run "
    "this sub-agent belongs to is over.",
    RUN_FINISHED: "The run is over: do not execute the action; start a new run for new work.",
    APPROVAL_REQUIRED: "Do not run the action yet: wait for an operator's decision "
    "(GET /api/v1/approvals/{id}?wait=60, or send this check again with the same check_id), "
    "then act on the final answer.",
    APPROVAL_DENIED: "Do not run this action: an operator denied it. Return the partial "
    "response, or start a new run for a different approach.",
    APPROVAL_EXPIRED: "Do not run this action: nobody approved it in time. Return the partial "
    "response, or relaunch when an operator is available.",
}


_WILDCARD_RUN = re.compile(r"[*?]{2,}")


def compile_glob(pattern: str) -> re.Pattern[str]:
    """``pattern`` (fnmatch's glob, case-sensitive) as the compiled expression that
    `fnmatch.fnmatchcase` would match with, a run of ``*`` and ``?`` written as its ``?``
    then one ``*`` (the same names: "*?*?" is "??*"), which takes compiling a pathological
    pattern from 1.6 ms to 0.1 ms. Compiled per policy, never in fnmatch's process-wide
    cache (`Policy.matches`)."""
    if "[" not in pattern:  # a set may hold "*" or "?" as themselves: left as written
        pattern = _WILDCARD_RUN.sub(
            lambda run: "?" * run.group().count("?") + ("*" if "*" in run.group() else ""),
            pattern)
    return re.compile(translate(pattern))


class _KeptGlobs:
    """The patterns compiled in this process, every policy's and rule's together, bounded in
    characters: each holder (a `Policy`, a `RateLimit`) keeps its own compiled patterns, and
    the holders that compiled first lose theirs once the total passes ``budget`` (they
    compile them again at their next use). A compiled pattern takes about 30 bytes a
    character, and a store keeps thousands of policy versions, which a team can make at will
    (found by a review: 4,096 versions at the pattern bounds would have kept 2 GB a process).
    First in, first out: a holder is registered when it compiles, never when it matches, so
    another team's rotation of versions makes a policy compile its patterns again once per
    ``budget`` characters compiled, not at every check.

    No lock (the rules take none, an import contract): the threads of a process that compile
    at once may miscount a pattern or evict a holder twice, which only makes the bound
    approximate; the total is counted again from the holders every ``RECOUNT`` compiles, so
    an error never lasts, and a match is always made with a compiled pattern."""

    RECOUNT = 4096  # compiles between two counts of the total from the holders

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._held: dict[int, tuple[Any, int]] = {}  # id(holder): (holder, its characters)
        self._total = 0
        self._compiles = 0

    def compiled(self, holder: Any, pattern: str) -> re.Pattern[str]:
        glob: re.Pattern[str] | None = holder._globs.get(pattern)
        if glob is None:
            glob = holder._globs[pattern] = compile_glob(pattern)
            self._keep(holder, len(pattern))
        return glob

    def _keep(self, holder: Any, chars: int) -> None:
        _, before = self._held.pop(id(holder), (holder, 0))
        self._held[id(holder)] = (holder, before + chars)  # kept alive: its id stays its own
        self._total += chars
        self._compiles += 1
        if self._compiles % self.RECOUNT == 0:  # not at every compile: thousands of holders
            self._total = sum(its for _, its in list(self._held.values()))
        while self._total > self.budget and len(self._held) > 1:
            try:
                gone, its = self._held.pop(next(iter(self._held)))
            except (StopIteration, KeyError, RuntimeError):  # another thread evicts
                return
            gone._globs.clear()
            self._total -= its


# About 30 MB of compiled patterns a process: 60 policies at the document's bounds, a
# thousand of a few dozen tool names.
KEPT_GLOBS = _KeptGlobs(budget=1_000_000)


# What a set holding a character past U+00FF counts in `glob_set_span`: about the code
# points its table costs to build.
SET_PAST_LATIN1 = 2_048


def glob_tokens(pattern: str) -> Iterator[tuple[str, Any]]:
    """``pattern`` read as `fnmatch.translate` reads it, step for step: ("*", None),
    ("?", None), ("char", c), and ("set", (negate, chunks)) for a set, its body split at
    the hyphens that make ranges, a descending range dropped (so a range joins the last
    character of a chunk to the first of the next), the "!" of a negated set taken off. A
    "[" without its closing bracket is a "char". One reading for the SQL form of a rate-limit
    rule (runs/check/rate_limits.py) and for what compiling a pattern costs
    (`glob_set_span`)."""
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        i += 1
        if c in "*?":
            yield c, None
            continue
        if c != "[":
            yield "char", c
            continue
        j = glob_set_end(pattern, i)
        if j < 0:
            yield "char", "["
            continue
        negate = pattern[i] == "!"
        yield "set", (negate, _set_chunks(pattern, i, j, negate))
        i = j + 1


def glob_set_end(pattern: str, i: int) -> int:
    """Where the set whose "[" is just before ``pattern[i]`` closes, as fnmatch finds it (a
    "]" first, or after the "!", is a member), or -1: that "[" is then a character."""
    j, n = i, len(pattern)
    if j < n and pattern[j] == "!":
        j += 1
    if j < n and pattern[j] == "]":
        j += 1
    j = pattern.find("]", j)
    return j


def _set_chunks(pattern: str, i: int, j: int, negate: bool) -> list[str]:
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
        if chunks[k - 1][-1] > chunks[k][0]:  # a descending range: dropped
            chunks[k - 1] = chunks[k - 1][:-1] + chunks[k][1:]
            del chunks[k]
    if negate:
        chunks[0] = chunks[0][1:]
    return chunks


def glob_set_span(pattern: str) -> int:
    """How many code points the ranges of ``pattern``'s sets (``[a-z]``) span, below U+10000.
    Compiling a range makes Python's `re` visit each of those code points one at a time,
    about 65 ns each, whatever the pattern's length: a set of 66 ranges from U+0100 to
    U+FFFF, 200 characters, took 260 ms to compile, so this span, not the length, is the
    cost of compiling a pattern's sets (policies/document.py bounds it). A set holding a
    character past U+00FF counts at least `SET_PAST_LATIN1`."""
    span = 0
    for kind, value in glob_tokens(pattern):
        if kind != "set":
            continue
        chunks = value[1]
        ranges = sum(max(0, min(ord(high[0]), 0xFFFF) - ord(low[-1]) + 1)
                     for low, high in pairwise(chunks))
        if any(ord(ch) > 0xFF for chunk in chunks for ch in chunk):
            # Past Latin-1, re builds a table for the set, 0.1 to 0.2 ms whatever its size
            # (found by an attacker: 3,240 sets of 3 such characters, 0.35 s a version).
            ranges = max(ranges, SET_PAST_LATIN1)
        span += ranges
    return span


@dataclass(frozen=True, slots=True)
class RateLimit:
    """One rule of ``rate_limits`` (SPEC 12): at most ``max`` actions whose name matches
    ``match`` in any ``window_s`` seconds, counted over the same run, agent or team."""

    match: str
    per: str  # run | agent | team
    max: int
    window_s: int
    # Its pattern compiled at its first use and kept with it (`KEPT_GLOBS`), not in fnmatch's
    # process-wide cache, which one team's patterns could fill for every team.
    _globs: dict[str, re.Pattern[str]] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def matches(self, name: str) -> bool:
        return KEPT_GLOBS.compiled(self, self.match).match(name) is not None

    def describe(self) -> str:
        return (f"rate_limits rule match='{self.match}' per={self.per} max={self.max} "
                f"window_s={self.window_s}")


@dataclass(frozen=True, slots=True)
class Policy:
    """One policy version's limits, already validated (see policies/document.py)."""

    mode: str = "enforce"
    max_steps: int = 18
    max_repeat_action: int = 3
    no_progress_window: int = 4
    max_seconds: float | None = 45
    max_usd: Decimal | None = Decimal("1.00")
    max_tool_calls: int | None = None
    allow: tuple[str, ...] | None = None
    deny: tuple[str, ...] = ()
    ignore_args: tuple[str, ...] = ()
    error_threshold: int = 3
    error_action: str = "nudge"
    redact_args: tuple[str, ...] = DEFAULT_REDACT
    # SPEC 14; None = never. A version stored before the field existed reads as None.
    max_idle_seconds: float | None = 3600
    rate_limits: tuple[RateLimit, ...] = ()
    approval_tools: tuple[str, ...] = ()
    approval_timeout_s: int = 900
    # SPEC 16 warnings; None = off. A new policy's values; a version stored before the block
    # existed has none (`from_document` reads an absent block as null).
    warn_repeat_action: int | None = 2
    warn_no_progress: int | None = 3
    warn_budget_fraction: float | None = 0.8
    # The policy's identity, for the `rule` of an answer (SPEC 16): its name and version.
    name: str = "default"
    version: int = 0
    # The patterns of its lists compiled, each at its first use, kept with the policy (a
    # store keeps one per version) within the process's bound (`KEPT_GLOBS`): not fnmatch's
    # process-wide cache of 32,768 patterns, which one team's versions could fill, so that
    # every team's checks compiled their patterns again at every check (found by an
    # attacker: 45 versions of 768 patterns made that team's checks take 2.7 s and another
    # team's p99 40 times longer, SPEC 10).
    _globs: dict[str, re.Pattern[str]] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def matches(self, name: str, pattern: str) -> bool:
        """Whether the action ``name`` matches ``pattern``, one of this policy's own."""
        return KEPT_GLOBS.compiled(self, pattern).match(name) is not None

    @classmethod
    def from_document(cls, doc: Mapping[str, Any]) -> Policy:
        """Build from one policy of the policy document (SPEC section 3): normalized, as the
        server stores it, or as written in a file, where every omitted field takes a new
        policy's default (SPEC 3). Except ``max_idle_seconds``: absent, it reads as None,
        since a version stored before it existed has none (a file's loader fills it).

        The one parse of a policy: the client reads a run's ``policy`` as the API shows it
        (SPEC 5.1, the document's sections without ``redact_args`` and ``rate_limits``) here
        too. A stored document is validated; what a client is sent may not be, so a missing
        or empty mode, a step limit that is not a whole number and a null list keep the
        defaults, as they did in the client's own reading."""
        new = cls()
        steps = doc.get("step_limits") or {}
        budgets = doc.get("budgets") or {}
        tools = doc.get("tools") or {}
        on_error = doc.get("on_repeated_error") or {}
        max_usd = budgets.get("max_usd", new.max_usd)
        allow = tools.get("allow", new.allow)
        redact = doc.get("redact_args")
        # Versions saved before SPEC 11 have no approvals block: they require none.
        approvals = doc.get("approvals") or {}
        # Versions saved before SPEC 16 have no warnings (a null block, policies/0008).
        warnings = doc.get("warnings") or {}
        version = doc.get("version")

        def step(name: str) -> Any:
            value = steps.get(name)
            return value if isinstance(value, int) else getattr(new, name)

        return cls(
            mode=doc.get("mode") or new.mode,
            max_steps=step("max_steps"),
            max_repeat_action=step("max_repeat_action"),
            no_progress_window=step("no_progress_window"),
            max_seconds=budgets.get("max_seconds", new.max_seconds),
            max_usd=None if max_usd is None else Decimal(str(max_usd)),
            max_tool_calls=budgets.get("max_tool_calls", new.max_tool_calls),
            allow=None if allow is None else tuple(allow),
            deny=tuple(tools.get("deny") or ()),
            ignore_args=tuple((doc.get("repeat_key") or {}).get("ignore_args") or ()),
            error_threshold=on_error.get("threshold", new.error_threshold),
            error_action=on_error.get("action", new.error_action),
            redact_args=new.redact_args if redact is None else tuple(redact),
            max_idle_seconds=budgets.get("max_idle_seconds"),
            rate_limits=tuple(
                RateLimit(match=r["match"], per=r["per"], max=r["max"], window_s=r["window_s"])
                for r in doc.get("rate_limits") or ()
            ),
            approval_tools=tuple(approvals.get("tools") or ()),
            approval_timeout_s=int(approvals.get("timeout_s") or new.approval_timeout_s),
            warn_repeat_action=warnings.get("repeat_action"),
            warn_no_progress=warnings.get("no_progress"),
            warn_budget_fraction=warnings.get("budget_fraction"),
            name=str(doc.get("name") or new.name),
            version=version if isinstance(version, int) else new.version,
        )

    def limits(self) -> dict[str, Any]:
        return {
            "max_steps": self.max_steps,
            "max_repeat_action": self.max_repeat_action,
            "no_progress_window": self.no_progress_window,
            "max_seconds": self.max_seconds,
            "max_usd": None if self.max_usd is None else float(self.max_usd),
            "max_tool_calls": self.max_tool_calls,
        }


@dataclass(frozen=True, slots=True)
class LastResult:
    status: str  # "ok" | "error"
    digest: str | None = None
    error: str | None = None
    summary: str | None = None

    @property
    def error_text(self) -> str | None:
        """Normalized error text, for ``status: error`` only."""
        return normalize_text(self.error or "") if self.status == "error" else None

    @property
    def signature(self) -> str | None:
        if self.digest:
            return self.digest
        if self.status == "error":
            return "error:" + (self.error_text or "")
        return None


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    type: str = "tool"
    args: Mapping[str, Any] = field(default_factory=dict)
    progress: str | int | float | None = None
    last_result: LastResult | None = None
    cost_usd: Decimal = Decimal(0)
    check_id: str | None = None


MICRO_USD = Decimal("0.000001")  # costs are counted in millionths of a dollar


def usd(value: Any) -> Decimal:
    """A cost as the rules count it: exact millionths of a dollar, rounded half up
    (0.0000025 counts 0.000003), as a check has always recorded it."""
    return Decimal(str(value or 0)).quantize(MICRO_USD, rounding=ROUND_HALF_UP)


def make_check(
    name: str,
    args: Mapping[str, Any] | None,
    *,
    type: str = "tool",
    progress: str | int | float | None = None,
    last_result: Mapping[str, Any] | None = None,
    cost_usd: Any = None,
    check_id: str | None = None,
) -> Check:
    """The rules' view of one check body (SPEC 5.2), the one way it is built: for a check the
    server decides, a local decision it is sent afterwards, and one the client decides itself
    during an outage, so that one cost counts the same everywhere."""
    result = None
    if last_result is not None:
        result = LastResult(
            status=str(last_result.get("status") or "ok"),
            digest=last_result.get("digest"),
            error=last_result.get("error"),
            summary=last_result.get("summary"),
        )
    return Check(name=name, type=type, args=dict(args or {}), progress=progress,
                 last_result=result, cost_usd=usd(cost_usd), check_id=check_id)


def _iso(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


@dataclass(frozen=True, slots=True)
class Pending:
    """The run's open approval request (SPEC 11): what its final answer needs to know."""

    approval_id: str
    check_id: str
    step: int
    action_name: str
    action_type: str
    repeat_key: str
    since: datetime
    expires_at: datetime
    # The normalized error text the check reported (its last_result, status error), if any:
    # the approved allow is that check's allow, and carries its repeated-error nudge (SPEC
    # 4.4, 16). None for a request stored before it was kept.
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"approval_id": self.approval_id, "check_id": self.check_id, "step": self.step,
                "action_name": self.action_name, "action_type": self.action_type,
                "repeat_key": self.repeat_key, "since": self.since.isoformat(),
                "expires_at": self.expires_at.isoformat(), "error": self.error}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Pending:
        return cls(approval_id=data["approval_id"], check_id=data["check_id"],
                   step=int(data["step"]), action_name=data["action_name"],
                   action_type=data["action_type"], repeat_key=data["repeat_key"],
                   since=datetime.fromisoformat(data["since"]),
                   expires_at=datetime.fromisoformat(data["expires_at"]),
                   error=data.get("error"))

    def check(self) -> Check:
        """The check the request holds, as its approved allow's warnings read it."""
        return Check(name=self.action_name, type=self.action_type,
                     last_result=None if self.error is None else LastResult(
                         status="error", error=self.error))

    def summary(self, status: str = PENDING) -> dict[str, str]:
        """The ``approval`` field of a check answer."""
        return {"id": self.approval_id, "status": status, "expires_at": _iso(self.expires_at)}


def paused_seconds(memory: Mapping[str, Any], end: datetime) -> float:
    """Seconds the run spent waiting for approvals up to ``end`` (SPEC 15 active time), from
    its stored memory: the settled waits plus the one still open."""
    paused = float(memory.get("paused_s", 0.0))
    pending = memory.get("pending")
    if pending:
        paused += max(0.0, (end - datetime.fromisoformat(pending["since"])).total_seconds())
    return paused


# --- The run's keyed memory (SPEC 4.1) ---------------------------------------------------------
#
# Four parts of a run's memory grow with its length: the allowed count of every repeat key,
# the progress values and the result signatures seen, and the count of every error text. A
# check reads and writes at most one entry of each: its own repeat key, progress value, result
# signature and error text (`keyed_reads`). So a store may keep them as keyed rows and hand the
# rules a state holding only those entries: every rule below answers the same as with the whole
# memory, and `keyed_changes` of the two states is what the store must write
# (tests/test_rules_keyed.py proves both for evaluate, settle, record_outcome and the rest).

REPEAT = "repeat"
PROGRESS = "progress"
SIGNATURE = "signature"
ERROR = "error"
KEYED_KINDS = (REPEAT, PROGRESS, SIGNATURE, ERROR)
Entry = tuple[str, str]  # (kind, text)


def keyed_reads(check: Check, key: str) -> tuple[Entry, ...]:
    """The entries of the keyed memory that deciding ``check`` (whose repeat key is ``key``)
    reads or writes, whatever the policy: a rule that does not apply reads one entry less."""
    entries: list[Entry] = [(REPEAT, key)]
    if check.progress is not None:
        entries.append((PROGRESS, progress_token(check.progress)))
    if check.last_result is not None:
        signature = check.last_result.signature
        if signature is not None:
            entries.append((SIGNATURE, signature))
        error = check.last_result.error_text
        if error is not None:
            entries.append((ERROR, error))
    return tuple(entries)


def settle_reads(pending: Pending) -> tuple[Entry, ...]:
    """The entries of the keyed memory that settling ``pending`` reads or writes (`settle`):
    its repeat key, and the count of the error its check reported (the approved allow's
    repeated-error nudge)."""
    entries: list[Entry] = [(REPEAT, pending.repeat_key)]
    if pending.error is not None:
        entries.append((ERROR, pending.error))
    return tuple(entries)


def keyed_changes(before: RunState, after: RunState) -> dict[Entry, int]:
    """The entries of ``after`` that ``before`` does not have with the same value: what a
    store keeping the keyed memory apart writes (the rules only ever add entries or raise
    counts). Proportional to the states' sizes: small for states loaded with `keyed_reads`."""
    old = before.keyed()
    return {entry: n for entry, n in after.keyed().items() if old.get(entry) != n}


@dataclass(slots=True)
class RunState:
    started_at: datetime
    status: str = RUNNING
    stop_reason: str | None = None
    ended_at: datetime | None = None
    steps: int = 0
    tool_calls: int = 0
    cost_usd: Decimal = Decimal(0)
    repeat_counts: dict[str, int] = field(default_factory=dict)
    progress_seen: set[str] = field(default_factory=set)
    signatures_seen: set[str] = field(default_factory=set)
    no_progress_streak: int = 0
    error_counts: dict[str, int] = field(default_factory=dict)
    # SPEC 14: when the run is abandoned unless something happens first (None: never).
    idle_deadline: datetime | None = None
    # SPEC 11 / 15: time spent waiting for settled approvals, and the approval still open.
    paused_s: float = 0.0
    pending: Pending | None = None
    # SPEC 16: the budgets the run was already warned about (a budget warning is sent once
    # per budget per run); kept in the fixed memory, so the check's one write stores it.
    budget_warned: frozenset[str] = frozenset()
    #: What ended a stopped or killed run, in the words of its stop (the limit and its
    #: value, or the switch and the operator's reason), and its rule (SPEC 16: a later check
    #: names the rule that stopped the run, as its stop did); not part of the memory: the
    #: caller fills them from the stop's audit record when it answers a later check.
    stop_detail: str | None = None
    stop_rule: Mapping[str, Any] | None = None

    def copy(self) -> RunState:
        return replace(
            self,
            repeat_counts=dict(self.repeat_counts),
            progress_seen=set(self.progress_seen),
            signatures_seen=set(self.signatures_seen),
            error_counts=dict(self.error_counts),
        )

    def elapsed_s(self, now: datetime) -> float:
        """Active time (SPEC 15): wall time since the start minus the time spent pending."""
        return elapsed_seconds(started_at=self.started_at, ended_at=self.ended_at,
                               status=self.status, now=now, paused_s=self.paused_s,
                               pending_since=self.pending.since if self.pending else None)

    def usage(self, now: datetime) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "tool_calls": self.tool_calls,
            "cost_usd": float(self.cost_usd),
            "elapsed_s": round(self.elapsed_s(now), 3),
        }

    def memory(self) -> dict[str, Any]:
        """The per-run memory that is not a column of its own, as JSON-ready data."""
        return {
            "repeat_counts": self.repeat_counts,
            "progress_seen": sorted(self.progress_seen),
            "signatures_seen": sorted(self.signatures_seen),
            "error_counts": self.error_counts,
            **self.fixed_memory(),
        }

    def fixed_memory(self) -> dict[str, Any]:
        """The memory without its keyed parts (see `keyed`): what stays the same size however
        long the run lasts."""
        return {
            "no_progress_streak": self.no_progress_streak,
            "paused_s": self.paused_s,
            "pending": self.pending.to_json() if self.pending is not None else None,
            **({"budget_warned": sorted(self.budget_warned)} if self.budget_warned else {}),
        }

    def keyed(self) -> dict[Entry, int]:
        """The keyed parts of the memory as entries: (kind, text) -> the allowed count of a
        repeat key, the times an error text was reported, 1 for a progress token or a result
        signature seen."""
        entries: dict[Entry, int] = {(REPEAT, k): n for k, n in self.repeat_counts.items()}
        entries.update(((PROGRESS, token), 1) for token in self.progress_seen)
        entries.update(((SIGNATURE, sig), 1) for sig in self.signatures_seen)
        entries.update(((ERROR, text), n) for text, n in self.error_counts.items())
        return entries

    def load_keyed(self, entries: Mapping[Entry, int]) -> RunState:
        """Add entries (as `keyed` gives them) to the memory: a store that keeps them apart
        loads the ones `keyed_reads` names for the check at hand."""
        for (kind, text), count in entries.items():
            if kind == REPEAT:
                self.repeat_counts[text] = count
            elif kind == PROGRESS:
                self.progress_seen.add(text)
            elif kind == SIGNATURE:
                self.signatures_seen.add(text)
            elif kind == ERROR:
                self.error_counts[text] = count
            else:
                raise ValueError(f"unknown kind of memory entry {kind!r}")
        return self

    def load_memory(self, memory: Mapping[str, Any]) -> RunState:
        self.repeat_counts = dict(memory.get("repeat_counts", {}))
        self.progress_seen = set(memory.get("progress_seen", ()))
        self.signatures_seen = set(memory.get("signatures_seen", ()))
        self.no_progress_streak = int(memory.get("no_progress_streak", 0))
        self.error_counts = dict(memory.get("error_counts", {}))
        self.paused_s = float(memory.get("paused_s", 0.0))
        pending = memory.get("pending")
        self.pending = Pending.from_json(pending) if pending else None
        self.budget_warned = frozenset(memory.get("budget_warned") or ())
        return self


@dataclass(frozen=True, slots=True)
class Decision:
    outcome: str  # as audited: allow | stop | would_stop | pending | wait
    reason: str
    step: int
    repeat_key: str
    repeat_count: int
    message: str | None = None
    next_action: str | None = None
    directive: dict[str, str] | None = None
    shadow: dict[str, str] | None = None
    retry_after_s: float | None = None  # a wait only
    approval: dict[str, str] | None = None
    # SPEC 16: the rule that decided, as the rules know it: {"name", "limit", "observed"}
    # (answers.rule_of adds the policy, its version and the scope); None for a plain allow.
    rule: dict[str, Any] | None = None
    #: SPEC 20: the id of the ancestor run whose limit or end stopped this check (None: the
    #: run's own rule). SPEC 16's ``rule.scope`` is this id, or "run" when None.
    scope: str | None = None

    @property
    def answer(self) -> str:
        """What the agent is told: a shadow would-stop still runs."""
        if self.outcome in (STOP, WAIT, PENDING):
            return self.outcome
        return ALLOW


def _plain(value: Decimal | float) -> str:
    """A limit as people write it: ``45``, ``0.25``, ``31536000``, never ``3.1536e+07``; a
    tiny one past a millionth as ``5e-324``, not the 300 digits of its expansion (found by an
    attacker: a max_seconds of 5e-324 is valid, and every stop message spelt it out)."""
    plain = Decimal(str(value)).normalize()
    if plain and plain.adjusted() < -6:
        return f"{plain:e}".replace("E", "e")
    return f"{plain:f}"


def _dollars(value: Decimal | float) -> str:
    """An amount spent, in words: cents always, and every fraction of a cent it has ("$0.60",
    "$1.20", "$0.000125"), as the dashboard writes money; never rounded, since the words
    sit beside the exact limit."""
    whole, _, fraction = _plain(value).partition(".")
    return f"${whole}.{fraction.ljust(2, '0')}"


def _denied(policy: Policy, name: str) -> str | None:
    for pattern in policy.deny:
        if policy.matches(name, pattern):
            return f"{name} matches the deny pattern '{pattern}'."
    if policy.allow is not None and not any(policy.matches(name, p) for p in policy.allow):
        return f"{name} matches no pattern of the allow list {list(policy.allow)}."
    return None


def tool_denied(policy: Policy, name: str) -> str | None:
    """Why the policy's ``tools`` lists deny the action ``name`` (rule 3 of SPEC 4.4), or
    None; what an MCP gateway leaves out of ``tools/list`` (SPEC 19)."""
    return _denied(policy, name)


def approval_pattern(policy: Policy, name: str) -> str | None:
    """The first ``approvals.tools`` pattern the action's name matches (SPEC 11)."""
    for pattern in policy.approval_tools:
        if policy.matches(name, pattern):
            return pattern
    return None


def policy_violation(policy: Policy, name: str) -> str | None:
    """Why running the action ``name`` without the service's answer broke the policy (SPEC
    10, "Uploaded local decisions"): a denied tool, or an action that needs an operator's
    approval; None when neither. A fail-open client's uploaded allow is kept (the action
    ran) and flagged with this. A shadow policy enforces neither, so breaks nothing."""
    if policy.mode == "shadow":
        return None
    denied = _denied(policy, name)
    if denied is not None:
        return f"tool_denied: {denied}"
    pattern = approval_pattern(policy, name)
    if pattern is not None:
        return f"{APPROVAL_REQUIRED}: {_approval_message(name, pattern, policy)}"
    return None


def local_violation(policy: Policy, state: RunState, check: Check, *, now: datetime,
                    tree: Sequence[Ancestor] = ()) -> str | None:
    """Why an uploaded local allow broke the run's policy, ``state`` being the run's before
    it: a denied tool or an action needing approval (`policy_violation`), else the first of
    the run's limits, or its ancestors' (SPEC 4.4, 21), that the service would have stopped
    it by: a client whose local rules were looser than the policy (an old policy, or none)
    ran 40 steps of a run whose max_steps is 18, and nothing said so (found by an attacker).
    None when it broke nothing. A shadow policy's own rules enforce nothing, so break
    nothing; an enforcing ancestor's limits bind a shadow run all the same (found by an
    attacker: a shadow child's upload past its enforcing parent's max_steps was not
    flagged, where the service's check stopped it)."""
    broke = policy_violation(policy, check.name)
    if broke is not None:
        return broke
    if state.status in TERMINAL and state.ended_at is not None and state.ended_at <= now:
        # Decided after the run had ended: the service would have answered its stop, in
        # any mode (a terminal run answers its stop; a kill is enforced in shadow mode).
        return (f"{state.stop_reason or RUN_FINISHED}: the run was already {state.status} "
                "when this action was allowed, but it ran")
    new = state.copy()
    new.steps += 1
    _register(new, check)
    key = repeat_key(check.name, check.args, policy.ignore_args)
    # An ancestor is read as it was at `now`: one that ended after the client decided did
    # not stop this action (found by an attacker: an allow decided 0.5 s before its parent's
    # finish was flagged parent_stopped).
    then = [replace(a, state=replace(a.state, status=RUNNING, stop_reason=None, ended_at=None))
            if a.state.ended_at is not None and a.state.ended_at > now else a for a in tree]
    # Only what is enforced was broken: a shadow ancestor's limit breaks nothing.
    stop, _ = _first_stops(_stops(policy, new, check, key, now, None, tree=in_tree(then, check)),
                           policy, then)
    if stop is None:
        return None
    reason, _, fired, scope = stop
    whose = "the run's" if scope is None else f"ancestor run {scope}'s"
    observed = ", ".join(f"{name} {value}" for name, value in fired["observed"].items())
    limit = ", ".join(f"{name} {value}" for name, value in fired["limit"].items())
    return (f"{reason}: {whose} policy would have stopped this action ({observed}; "
            f"{limit}), but it ran")


def approval_pending(pending: Pending) -> tuple[str, dict[str, str]]:
    """The 409 ``approval_pending`` of a check sent while the run waits for an approval
    (SPEC 11): its message and fields, naming the request and the check to resend."""
    return (f"The run is waiting for approval {pending.approval_id} of "
            f"{pending.action_name} (check_id {pending.check_id!r}): resend that check, "
            f"or wait with GET /api/v1/approvals/{pending.approval_id}.",
            {"approval_id": pending.approval_id, "check_id": pending.check_id})


def check_id_missing(policy: Policy, state: RunState, check: Check, *, kill: str | None
                     ) -> str | None:
    """Why this check is refused (422 naming ``check_id``) before anything is counted: in
    enforce mode, a check of a running run whose action needs approval must carry a
    ``check_id``, so that it can be resumed. A killed run answers its stop instead."""
    if (policy.mode != "enforce" or state.status in TERMINAL or kill is not None
            or check.check_id):
        return None
    pattern = approval_pattern(policy, check.name)
    if pattern is None:
        return None
    return (f"{check.name} matches the approvals pattern '{pattern}': send a check_id so the "
            "check can be resumed once an operator decides.")


# (reason, message, rule: name, limit, observed; scope: None for the run's own rule, else the
# id of the ancestor whose limit or end stopped it, SPEC 20)
Stop = tuple[str, str, dict[str, Any], str | None]


def rule(name: str, limit: Mapping[str, Any], observed: Mapping[str, Any]) -> dict[str, Any]:
    """The rules' part of an answer's ``rule`` (SPEC 16): which rule, its limit and the
    values observed; answers.rule_of adds the policy, its version and the scope."""
    return {"name": name, "limit": dict(limit), "observed": dict(observed)}


def _times(n: int) -> str:
    return "1 time" if n == 1 else f"{n} times"


def _money(value: Decimal | float | None) -> float | None:
    return None if value is None else float(value)


def _denied_rule(policy: Policy, name: str) -> dict[str, Any]:
    for pattern in policy.deny:
        if policy.matches(name, pattern):
            return rule("tool_denied", {"deny": pattern}, {"action": name})
    return rule("tool_denied", {"allow": list(policy.allow or ())}, {"action": name})


@dataclass(frozen=True, slots=True)
class Ancestor:
    """An ancestor of the checked run (SPEC 20), as the caller read it under its lock (the
    root first): its id, its policy and its state before this check."""

    run_id: str
    policy: Policy
    state: RunState


def in_tree(tree: Sequence[Ancestor], check: Check) -> list[Ancestor]:
    """The ancestors as this check counts on them (SPEC 20): a step and the check's cost
    each, before the rules read their limits."""
    counted = []
    for ancestor in tree:
        state = replace(ancestor.state, steps=ancestor.state.steps + 1,
                        cost_usd=ancestor.state.cost_usd + check.cost_usd)
        counted.append(replace(ancestor, state=state))
    return counted


def ended_ancestor(tree: Sequence[Ancestor], now: datetime) -> tuple[Ancestor, str] | None:
    """The first ancestor (the root first) that is over, or past its idle deadline, with the
    reason it ended for (SPEC 20, ``parent_stopped``)."""
    for ancestor in tree:
        state = ancestor.state
        if state.status == RUNNING and state.pending is None:
            over = abandon(state, now=now, policy=ancestor.policy)
            state = over if over is not None else state
        if state.status in TERMINAL:
            return ancestor, state.stop_reason or state.status
    return None


def _parent_stopped(ancestor: Ancestor, reason: str, *,
                    then: str = "; the action was not run") -> Stop:
    status = ancestor.state.status
    # "is completed", not "is completed (reason: completed)": a finish's reason is its status.
    why = f" (reason: {reason})" if reason != status else ""
    message = (f"Ancestor run {ancestor.run_id} is {status}{why}: this run "
               f"stops with it{then}."
               if status != RUNNING else
               f"Ancestor run {ancestor.run_id} is over (reason: {reason}): this run stops "
               f"with it{then}.")
    return PARENT_STOPPED, message, rule(PARENT_STOPPED, {"ancestor": ancestor.run_id},
                                         {"status": status, "reason": reason}), \
        ancestor.run_id


def _tree_limit(name: str, policy: Policy, state: RunState, check: Check, now: datetime
                ) -> tuple[str, dict[str, Any]] | None:
    """One of the tree's rules (SPEC 20: 2, 4, 5 and 6) that ``state`` passes under
    ``policy``, as (message, rule), else None. The words say "the run"; an ancestor's are
    reworded by the caller. Each message says the value observed, the limit and what happens
    now (SPEC 16)."""
    if name == "max_steps" and state.steps > policy.max_steps:
        return (f"Step {state.steps} is past max_steps={policy.max_steps}: the action was not "
                "run and the run is stopped."), rule(
            "max_steps", {"max_steps": policy.max_steps}, {"steps": state.steps})
    if name == "max_seconds":
        elapsed = state.elapsed_s(now)
        if policy.max_seconds is not None and elapsed > policy.max_seconds:
            return (f"The run has lasted {elapsed:.1f} s, over "
                    f"max_seconds={_plain(policy.max_seconds)}: the action was not run and "
                    "the run is stopped."), rule(
                "max_seconds", {"max_seconds": policy.max_seconds},
                {"elapsed_s": round(elapsed, 3)})
    if name == "max_usd" and policy.max_usd is not None and state.cost_usd >= policy.max_usd:
        return (f"The run has spent {_dollars(state.cost_usd)}, reaching "
                f"max_usd={_plain(policy.max_usd)}: the action was not run and the run is "
                "stopped."), rule("max_usd", {"max_usd": _money(policy.max_usd)},
                                  {"cost_usd": _money(state.cost_usd)})
    if (name == "max_tool_calls" and policy.max_tool_calls is not None
            and check.type == "tool" and state.tool_calls >= policy.max_tool_calls):
        return (f"The run has already made {state.tool_calls} tool calls, all that "
                f"max_tool_calls={policy.max_tool_calls} allows: this call was not run and "
                "the run is stopped."), rule(
            "max_tool_calls", {"max_tool_calls": policy.max_tool_calls},
            {"tool_calls": state.tool_calls})
    return None


def _limits_in_tree(name: str, policy: Policy, state: RunState, check: Check, now: datetime,
                    tree: Sequence[Ancestor]) -> Iterator[Stop]:
    """Rule ``name`` passed by the run itself first, then by each ancestor from the root down
    (SPEC 21): scope None for the run's own limit, else the ancestor's id."""
    own = _tree_limit(name, policy, state, check, now)
    if own is not None:
        yield name, own[0], own[1], None
    for ancestor in tree:
        passed = _tree_limit(name, ancestor.policy, ancestor.state, check, now)
        if passed is not None:
            yield _ancestors_stop(name, ancestor, passed)


def _ancestors_stop(name: str, ancestor: Ancestor, passed: tuple[str, dict[str, Any]]
                    ) -> Stop:
    """An ancestor's limit `_tree_limit` found passed, as the descendant's stop: the words
    say the tree and name the ancestor; the rule names the ancestor's policy and version
    (answers.rule_of), not the run's; the scope is the ancestor."""
    words = passed[0].replace("The run has", "The tree has").replace(
        "Step ", "Tree step ", 1).replace("the run is stopped", "this run is stopped")
    fired = {**passed[1], "policy": (ancestor.policy.name, ancestor.policy.version)}
    # Two sentences: the limit's own words follow whole (found by a newcomer: "...'s limit:
    # Tree step 19 ... is stopped. (an ancestor's budget ...)" read as one broken sentence).
    return name, (f"Ancestor run {ancestor.run_id}'s limit bounds its sub-agents' runs. "
                  f"{words}"), fired, ancestor.run_id


def _enforced(stop: Stop, policy: Policy, tree: Sequence[Ancestor]) -> bool:
    """Whether ``stop`` stops the run, or is a shadow would-stop: a kill and an ended
    ancestor always stop; an ancestor's limit is enforced as the ancestor's policy says,
    the run's own rules as its own does. (Found by an attacker: a child started on a
    shadow policy under an enforcing parent ran past the parent's max_steps, max_usd and
    max_tool_calls, each only a would-stop.)"""
    reason, _, _, scope = stop
    if reason in ("killed", PARENT_STOPPED):
        return True
    if scope is not None:
        for ancestor in tree:
            if ancestor.run_id == scope:
                return ancestor.policy.mode != "shadow"
    return policy.mode != "shadow"


def _stops(
    policy: Policy, state: RunState, check: Check, key: str, now: datetime, kill: str | None,
    kill_rule: Mapping[str, Any] | None = None, tree: Sequence[Ancestor] = (),
) -> Iterator[Stop]:
    """Every rule of SPEC 4.4 (21 for a run with ancestors) that stops this check, in that
    order, as (reason, message, rule, scope): scope None for the run's own rule, else the
    ancestor's id. ``tree``: the ancestors as this check counts on them (`in_tree`), the
    root first. Lazy: the caller reads as far as the first one that is enforced."""
    if kill is not None:
        yield "killed", f"Stopped by a kill switch: {kill}.", rule(
            "killed", (kill_rule or {}).get("limit", {}),
            (kill_rule or {}).get("observed", {})), None
    ended = ended_ancestor(tree, now)
    if ended is not None:
        yield _parent_stopped(*ended)
    yield from _limits_in_tree("max_steps", policy, state, check, now, tree)
    denied = _denied(policy, check.name)
    if denied:
        yield "tool_denied", (
            f"Tool denied by the policy: {denied} The action was not run and the run is "
            "stopped."), _denied_rule(policy, check.name), None
    for name in ("max_seconds", "max_usd", "max_tool_calls"):
        yield from _limits_in_tree(name, policy, state, check, now, tree)
    stop = _own_stop(policy, state, check, key)
    if stop is not None:
        yield (*stop, None)


def _first_stops(stops: Iterable[Stop], policy: Policy, tree: Sequence[Ancestor]
                 ) -> tuple[Stop | None, Stop | None]:
    """The first of ``stops`` that is enforced, and the first would-stop before it (SPEC
    4.4, 20): a would-stop is not the end of the rules. A shadow ancestor's passed limit
    leaves the run's own rules and an enforcing ancestor's limits enforced (found by an
    attacker: under a shadow parent past its max_steps, an enforcing child's denied tools,
    loops, budgets, rate limits and approvals were all answered allow)."""
    would = None
    for stop in stops:
        if _enforced(stop, policy, tree):
            return stop, would
        would = would or stop
    return None, would


def _own_stop(policy: Policy, state: RunState, check: Check, key: str
              ) -> tuple[str, str, dict[str, Any]] | None:
    """Rules 7 to 9 of SPEC 4.4, which stay per run (SPEC 20), as (reason, message, rule)."""
    count = state.repeat_counts.get(key, 0)
    if count >= policy.max_repeat_action:
        return "loop_detected", (
            f"{check.name} was already called {_times(count)} with the same arguments, all "
            f"that max_repeat_action={policy.max_repeat_action} allows: this call was not "
            "run and the run is stopped."
        ), rule("loop_detected", {"max_repeat_action": policy.max_repeat_action},
                {"repeat_count": count})
    if state.no_progress_streak >= policy.no_progress_window:
        return "no_progress", (
            f"{state.no_progress_streak} steps in a row reported no new progress or result, "
            f"reaching no_progress_window={policy.no_progress_window}: the action was not "
            "run and the run is stopped."
        ), rule("no_progress", {"no_progress_window": policy.no_progress_window},
                {"no_progress_streak": state.no_progress_streak})
    error = check.last_result.error_text if check.last_result else None
    if policy.error_action == "stop" and error is not None:
        seen = state.error_counts.get(error, 0)
        if seen >= policy.error_threshold:
            return "repeated_error", (
                f"The error '{error}' occurred {seen} times, reaching "
                f"on_repeated_error.threshold={policy.error_threshold}: the action was not "
                "run and the run is stopped."
            ), rule("repeated_error", {"on_repeated_error.threshold": policy.error_threshold},
                    {"error_count": seen})
    return None


def progress_token(progress: str | int | float) -> str:
    """Progress values are compared by canonical value: ``1 == 1.0``, ``"1" != 1``."""
    return json.dumps(canonical(progress), ensure_ascii=False)


def _register(state: RunState, check: Check) -> None:
    """Record cost, progress and the reported result (SPEC 4.3) before any rule runs."""
    state.cost_usd += check.cost_usd
    signature = check.last_result.signature if check.last_result else None
    informative = check.progress is not None or signature is not None
    if informative:
        new = False
        if check.progress is not None:
            token = progress_token(check.progress)
            new = token not in state.progress_seen
            state.progress_seen.add(token)
        if signature is not None:
            new = new or signature not in state.signatures_seen
            state.signatures_seen.add(signature)
        state.no_progress_streak = 0 if new else state.no_progress_streak + 1
    error = check.last_result.error_text if check.last_result else None
    if error is not None:
        state.error_counts[error] = state.error_counts.get(error, 0) + 1


def nudge(error: str, count: int) -> dict[str, str]:
    """The repeated-error nudge of SPEC 4.4 / 5.2: a warning with code ``repeated_error``."""
    return _directive(REPEATED_ERROR, f"The error '{error}' occurred {count} times. "
                      "Change approach radically or abandon this subtask.")


# --- Warnings before stops (SPEC 16) ----------------------------------------------------------
#
# Chosen last, on an allow only (a shadow would-stop included: the action runs), from the
# state after the allow was counted. Choosing one changes no counter: only `budget_warned`,
# the budgets already warned about, since a budget warning is sent once per budget per run.
# A child run is warned of its ancestors' budgets too (SPEC 20: they bound it, and they are
# what stops it): an ancestor's budget is remembered as "<ancestor id>:<budget>".

REPEAT_ACTION = "repeat_action"
NO_PROGRESS = "no_progress"
BUDGET = "budget"
REPEATED_ERROR = "repeated_error"
WARNING_CODES = (REPEATED_ERROR, REPEAT_ACTION, NO_PROGRESS, BUDGET)
BUDGETS = ("max_steps", "max_seconds", "max_usd", "max_tool_calls")
_WRAP_UP = "Wrap up: finish the task or return the partial response."


DEFAULT_WARNINGS: dict[str, Any] = {"repeat_action": 2, "no_progress": 3,
                                    "budget_fraction": 0.8}


def default_warning(field: str, limit: int) -> int | None:
    """A new policy's warning ``field`` (repeat_action, no_progress) under its step limit:
    the SPEC 16 value where it comes before the stop, else the last count before it (none
    for a limit of 1). The policy document and the fake's reading of a file both use it."""
    value = int(DEFAULT_WARNINGS[field])
    return value if value < limit else (limit - 1 if limit > 1 else None)


def _directive(code: str, content: str) -> dict[str, str]:
    return {"type": "inject_message", "role": "user", "code": code, "content": content}


@dataclass(frozen=True, slots=True)
class WarningFound:
    """One warning that applies: how near its limit (observed / limit: the highest is
    sent), its directive, its rule, the budget it warns about as `budget_warned` remembers
    it (None: not a budget), and whose limit it is (None: the run's own, else the ancestor's
    id, SPEC 16's ``rule.scope``)."""

    nearness: float
    directive: dict[str, str]
    rule: dict[str, Any]
    budget: str | None = None
    scope: str | None = None


def _warned_key(budget: str, ancestor: str | None) -> str:
    """How `budget_warned` remembers a budget: its name, or "<ancestor id>:<name>"."""
    return budget if ancestor is None else f"{ancestor}:{budget}"


def _budget_warning(policy: Policy, state: RunState, now: datetime, budget: str,
                    fraction: float, ancestor: str | None = None) -> WarningFound | None:
    """The warning of one budget of ``policy`` that ``state`` is past ``fraction`` of (over
    it, not at it): the run's own (``ancestor`` None), or an ancestor's, whose counters are
    its tree's."""
    who = "This run" if ancestor is None else f"Ancestor run {ancestor}'s tree"
    its = "its" if ancestor is None else "this run's"
    if budget == "max_steps":
        limit: Any = policy.max_steps
        observed: Any = state.steps
        past = observed > limit
        counter, words, spent = "steps", (
            f"{who} is at step {observed} of max_steps={limit}: an action past step "
            f"{limit} is not run and stops this run."), f"at step {observed}"
    elif budget == "max_seconds":
        if policy.max_seconds is None:
            return None
        limit, observed = policy.max_seconds, round(state.elapsed_s(now), 3)
        past = observed > limit
        counter, words, spent = "elapsed_s", (
            f"{who} has lasted {observed:.1f} s of max_seconds={_plain(limit)}: past "
            f"{_plain(limit)} s {its} next action is not run and this run is stopped."), (
            f"{observed:.1f} s long")
    elif budget == "max_usd":
        if policy.max_usd is None:
            return None
        limit, observed = float(policy.max_usd), float(state.cost_usd)
        past = state.cost_usd >= policy.max_usd
        counter, words, spent = "cost_usd", (
            f"{who} has spent {_dollars(state.cost_usd)} of max_usd="
            f"{_plain(policy.max_usd)}: once it reaches {_dollars(policy.max_usd)} {its} next "
            "action is not run and this run is stopped."), (
            f"at {_dollars(state.cost_usd)} spent")
    else:
        if policy.max_tool_calls is None:
            return None
        limit, observed = policy.max_tool_calls, state.tool_calls
        past = observed > limit
        counter, words, spent = "tool_calls", (
            f"{who} has made {observed} tool calls of max_tool_calls={limit}: once it has "
            f"made {limit}, {its} next tool call is not run and this run is stopped."), (
            f"at {observed} tool calls")
    if past and policy.mode == "shadow":
        # Only a shadow policy lets a run go past its limit: "is not run" would describe a
        # stop still ahead, where enforcing would have stopped the run already.
        words = (f"{who} is {spent}, past {budget}={_plain(limit)}: an enforcing policy would "
                 "have stopped this run; shadow mode runs its actions and reports each as a "
                 "would-stop.")
    # Past the fraction, not at it (SPEC 16: "the first allow past this fraction"). Rounded:
    # 0.07 x 100 is 7.000000000000001 in floating point, which 7 steps would pass.
    if limit <= 0 or observed <= round(fraction * float(limit), 9):
        return None
    fired = rule(BUDGET, {budget: limit, "warnings.budget_fraction": fraction},
                 {counter: observed})
    if ancestor is not None:
        # The limit is the ancestor's: its rule names the ancestor's policy (answers.rule_of).
        fired["policy"] = (policy.name, policy.version)
    return WarningFound(observed / float(limit), _directive(BUDGET, f"{words} {_WRAP_UP}"),
                        fired, _warned_key(budget, ancestor), ancestor)


def warnings_of(policy: Policy, state: RunState, check: Check, key: str, now: datetime,
                tree: Sequence[Ancestor] = ()) -> list[WarningFound]:
    """Every warning that applies to an allowed check, ``state`` the run's state after it
    was counted (SPEC 16), in the order that breaks a tie of nearness: docs/policies.md's
    table from the bottom up (repeated_error, budget, no_progress, repeat_action). ``tree``:
    the ancestors as this allow counts on them (`in_tree`, and its tool call), the root first:
    their budgets bound the run (SPEC 20), each under its own policy's fraction."""
    found: list[WarningFound] = []
    error = check.last_result.error_text if check.last_result else None
    if error is not None and policy.error_action == "nudge":
        count = state.error_counts.get(error, 0)
        if count >= policy.error_threshold:
            found.append(WarningFound(count / policy.error_threshold, nudge(error, count), rule(
                REPEATED_ERROR, {"on_repeated_error.threshold": policy.error_threshold},
                {"error_count": count})))
    # The run's own budgets, then each running ancestor's (whose counters are its tree's).
    budgeted = [(None, policy, state), *((a.run_id, a.policy, a.state) for a in tree
                                          if a.state.status == RUNNING)]
    for ancestor, owner, counters in budgeted:
        if owner.warn_budget_fraction is None:
            continue
        for budget in BUDGETS:
            if _warned_key(budget, ancestor) in state.budget_warned:
                continue
            warned = _budget_warning(owner, counters, now, budget,
                                     float(owner.warn_budget_fraction), ancestor=ancestor)
            if warned is not None:
                found.append(warned)
    streak, window = state.no_progress_streak, policy.no_progress_window
    if policy.warn_no_progress is not None and streak >= policy.warn_no_progress:
        then = (f"at {window} in a row (no_progress_window={window}) the next action is not "
                "run and this run is stopped" if streak < window or policy.mode != "shadow"
                else f"an enforcing policy would have stopped this run at {window} in a row "
                f"(no_progress_window={window}); shadow mode runs the action")
        found.append(WarningFound(streak / window, _directive(NO_PROGRESS, (
            # Words for the model: "informative" is the contract's term (a check that
            # reported progress or a result), not one a model or a user knows.
            f"{streak} steps in a row reported no new progress or result; {then}. Report new "
            "progress or change approach.")), rule(
                NO_PROGRESS, {"no_progress_window": window,
                              "warnings.no_progress": policy.warn_no_progress},
                {"no_progress_streak": streak})))
    count = state.repeat_counts.get(key, 0)
    limit = policy.max_repeat_action
    if policy.warn_repeat_action is not None and count >= policy.warn_repeat_action:
        left = limit - count
        then = (f"{left} more identical call{'s' if left != 1 else ''} may run, and the one "
                "after is not run and stops this run" if left > 0 else
                "the next identical call is not run and stops this run"
                if left == 0 or policy.mode != "shadow" else
                # Past the limit: only shadow mode runs such a call (see _budget_warning).
                "an enforcing policy would have stopped this run at identical call "
                f"{limit + 1}; shadow mode runs it")
        found.append(WarningFound(count / limit, _directive(REPEAT_ACTION, (
            f"{check.name} was called {_times(count)} with the same arguments; "
            f"max_repeat_action is {limit}: {then}. Use the result you have or change "
            "approach.")), rule(REPEAT_ACTION, {"max_repeat_action": limit,
                                                "warnings.repeat_action":
                                                    policy.warn_repeat_action},
                                {"repeat_count": count})))
    return found


def choose_warning(found: Sequence[WarningFound]) -> WarningFound | None:
    """The warning sent: the one nearest to its limit, the first of a tie."""
    best: WarningFound | None = None
    for warning in found:
        if best is None or warning.nearness > best.nearness:
            best = warning
    return best


def warned_budget(answered: Mapping[str, Any] | None) -> str | None:
    """The budget an answer's ``rule`` (SPEC 16) warned about, as `budget_warned` remembers
    it; None for any other rule. The client's copy of the state follows the service's
    answers with it, so that it does not warn of a budget again during an outage."""
    if not answered or answered.get("name") != BUDGET:
        return None
    budget = next((name for name in answered.get("limit") or {} if name in BUDGETS), None)
    if budget is None:
        return None
    scope = answered.get("scope")
    return _warned_key(budget, None if scope in (None, "run") else str(scope))


def remember_warning(policy: Policy, state: RunState, check: Check,
                     directive: Mapping[str, Any], now: datetime) -> WarningFound | None:
    """The warning ``directive`` a client gave with an allow decided at ``now``, found by
    `local_warning`; a budget's is remembered in ``state`` (the caller's fresh copy, which
    this mutates), so that it is not sent a second time. The run's own budgets only: a
    client decides without the tree (found by an attacker: a parent's budget, nearer its
    limit, was taken as warned, and the child's own warning sent again)."""
    found = local_warning(policy, state, check, str(directive.get("code")), now)
    if found is not None and found.budget is not None:
        state.budget_warned = state.budget_warned | {found.budget}
    return found


def local_warning(policy: Policy, state: RunState, check: Check, code: str, now: datetime
                  ) -> WarningFound | None:
    """The warning of ``code`` a client gave with an allow, as these rules find it on the
    run's state after that allow was counted: its rule for the audit, and the budget to
    remember as warned, so that neither the service nor the client sends a budget's warning
    a second time (SPEC 16). The run's own warnings only: a client decides without the
    run's tree. None where this state shows no such warning (the copy was behind)."""
    key = repeat_key(check.name, check.args, policy.ignore_args)
    return choose_warning([found for found in warnings_of(policy, state, check, key, now)
                           if found.directive["code"] == code])


# --- Rate limits (SPEC 12) ---------------------------------------------------------------------
#
# The store counts, for each rule that matches the action, the actions of the rule's scope
# (run, agent name in the team, or team) whose names match its pattern and that were counted
# like an allow (allowed, shadow-allowed, or taken by a pending approval), stamped by the
# database's clock. What it hands over is one RateWindow per rule: the stamp of the max-th
# most recent such action still inside the window. The rule is full exactly when that stamp
# exists, and it has room again once that action leaves the window. `window_of` computes the
# same from a list of stamps (the embedded store and the client's fake use it; the SQL in
# runs/check/rate_limits.py mirrors it and is tested against it).


@dataclass(frozen=True, slots=True)
class RateWindow:
    rule: RateLimit
    # The stamp of the rule.max-th most recent counted action in the window; None: room.
    nth_recent: datetime | None
    now: datetime  # the clock the window was read with
    # Set when the store could not count the rule in its bounded lock wait (other checks held
    # the rule's lock, SPEC 10): the window is unknown, so the check waits this long and is
    # decided again. None: the window was read.
    busy_retry_s: float | None = None


# The outcomes a rate limit counts (SPEC 12): an action that runs, or that a pending approval
# took (its hit is taken then, not again once approved). The check's write and the
# backtest's estimate (estimate.py) both count these.
RATE_COUNTED = frozenset({ALLOW, WOULD_STOP, PENDING})


def rate_limits_matching(policy: Policy, name: str) -> tuple[RateLimit, ...]:
    """The rules of the policy that apply to this action name (every one applies)."""
    return tuple(rule for rule in policy.rate_limits if rule.matches(name))


def window_of(rule: RateLimit, stamps: Iterable[datetime], now: datetime) -> RateWindow:
    """The RateWindow of a rule from the stamps of its scope's counted matching actions."""
    start = now - timedelta(seconds=rule.window_s)
    recent = sorted((t for t in stamps if t > start), reverse=True)
    return RateWindow(rule, recent[rule.max - 1] if len(recent) >= rule.max else None, now)


def retry_after_s(window: RateWindow) -> float | None:
    """Seconds until the rule has room again, rounded up to the millisecond (None: it has).
    For a window the store could not read in time, the short retry it asked for."""
    if window.busy_retry_s is not None:
        return max(1, -(-round(window.busy_retry_s * 1_000_000) // 1000)) / 1000
    if window.nth_recent is None:
        return None
    left = window.nth_recent + timedelta(seconds=window.rule.window_s) - window.now
    micros = left // timedelta(microseconds=1)
    # Integer arithmetic: float seconds * 1000 would round 12.345 up to 12.346 now and then.
    return max(1, -(-micros // 1000)) / 1000


def rate_wait(windows: Sequence[RateWindow]) -> tuple[RateWindow, float] | None:
    """The full rule that keeps the action waiting longest, and for how long: the least time
    until every matching rule has room. None when every rule has room."""
    worst: tuple[RateWindow, float] | None = None
    for window in windows:
        wait = retry_after_s(window)
        if wait is not None and (worst is None or wait > worst[1]):
            worst = (window, wait)
    return worst


def _rate_message(name: str, window: RateWindow, wait: float) -> str:
    rule = window.rule
    if window.busy_retry_s is not None:
        return (f"{name} is rate limited by the {rule.describe()}: other checks are being "
                f"counted against it right now; retry in {wait:.3f} s.")
    return (f"{name} is rate limited by the {rule.describe()}: {rule.max} actions in the "
            f"last {rule.window_s} s already; retry in {wait:.3f} s.")


# --- Abandoned runs (SPEC 14) -----------------------------------------------------------------

def idle_deadline(policy: Policy, at: datetime) -> datetime | None:
    """When a run whose last activity (start, check, wait) was at ``at`` is abandoned."""
    if policy.max_idle_seconds is None:
        return None
    return at + timedelta(seconds=policy.max_idle_seconds)


def budget_deadline(policy: Policy, state: RunState) -> datetime | None:
    """When the run's active time (SPEC 15) reaches ``max_seconds``: its start plus
    max_seconds plus the time it spent waiting for approvals. None without a time budget,
    in shadow mode (the budget never stops a shadow run), and while the run waits for an
    approval (its clock stands still until the decision)."""
    if policy.max_seconds is None or policy.mode == "shadow" or state.pending is not None:
        return None
    return state.started_at + timedelta(seconds=float(policy.max_seconds) + state.paused_s)


def next_deadline(policy: Policy, state: RunState, at: datetime) -> datetime | None:
    """What a store keeps as the run's deadline (``RunState.idle_deadline``) after activity
    at ``at``: the first of its idle deadline and its budget deadline. A run that reaches it
    with no check in between can only be stopped, so the sweep ends it then (`overdue`), and
    a read of running runs leaves it out with the same one indexed comparison."""
    found = [d for d in (idle_deadline(policy, at), budget_deadline(policy, state))
             if d is not None]
    return min(found, default=None)


def _out_of_time_first(policy: Policy | None, state: RunState) -> datetime | None:
    """The budget deadline when it comes no later than the stored deadline: the run's time
    budget, not its idleness, is what ends it (None when the idle deadline comes first)."""
    budget = budget_deadline(policy, state) if policy is not None else None
    if budget is not None and (state.idle_deadline is None or budget <= state.idle_deadline):
        return budget
    return None


def abandon(state: RunState, *, now: datetime, policy: Policy | None = None
            ) -> RunState | None:
    """The run ended as abandoned, when it is running and past its idle deadline; else None.
    ``ended_at`` is the deadline itself, not the moment somebody noticed. Given the run's
    ``policy``, a stored deadline that is the run's budget deadline (`next_deadline`) is not
    an abandonment: the time budget ran out first (`out_of_time`; a check is stopped by
    rule 4)."""
    if state.status != RUNNING or state.idle_deadline is None or now < state.idle_deadline:
        return None
    if _out_of_time_first(policy, state) is not None:
        return None
    new = state.copy()
    _end(new, ABANDONED, state.idle_deadline)
    return new


def out_of_time(state: RunState, policy: Policy, *, now: datetime) -> RunState | None:
    """The run ended ``stopped`` / ``max_seconds`` when it is running, not waiting for an
    approval, and its active time is over max_seconds (its budget ran out before its idle
    deadline); else None. ``ended_at`` is the budget deadline, the moment its time ran
    out, as an abandonment's is its idle deadline. A check of such a run is stopped by rule 4 as
    before; this is for the run that sends none (the sweep, whoever looks first, a finish)."""
    if state.status != RUNNING:
        return None
    budget = _out_of_time_first(policy, state)
    # Over it, not at it: rule 4 allows a check at exactly max_seconds, so a finish at that
    # same moment completes the run (found by the backtest's property test).
    if budget is None or now <= budget:
        return None
    new = state.copy()
    _end(new, "max_seconds", budget)
    return new


def overdue(state: RunState, policy: Policy, *, now: datetime) -> RunState | None:
    """What the sweep writes for a running run past its deadline: stopped / max_seconds when
    its time budget ran out first, else stopped / abandoned; None when nothing is due."""
    return out_of_time(state, policy, now=now) or abandon(state, now=now, policy=policy)


def abandoned_message(policy: Policy) -> str:
    idle = "?" if policy.max_idle_seconds is None else _plain(policy.max_idle_seconds)
    return (f"No check, wait, start or finish for {idle} s: the run was abandoned "
            f"(max_idle_seconds={idle}).")


def out_of_time_message(policy: Policy) -> str:
    budget = "?" if policy.max_seconds is None else _plain(policy.max_seconds)
    return (f"No check came before the run's time budget ran out: stopped after {budget} s "
            f"of active time (max_seconds={budget}).")


def wait_past_budget(policy: Policy, state: RunState, name: str, wait: float,
                     now: datetime) -> str | None:
    """Why a rate-limit wait of ``wait`` seconds is a stop instead (SPEC 12, 15): it is longer
    than the time left of the run's budget, so the agent would come back to a run whose time
    has run out. The message names the wait and the time left; None when it fits."""
    if policy.max_seconds is None:
        return None
    left = max(0.0, float(policy.max_seconds) - state.elapsed_s(now))
    if wait <= left:
        return None
    return (f"{name} would have to wait {wait:.3f} s for a rate limit, longer than the "
            f"{left:.1f} s left of the run's time budget (max_seconds="
            f"{_plain(policy.max_seconds)}): stopped now instead of after the wait.")


def evaluate(
    policy: Policy, state: RunState, check: Check, *, now: datetime, kill: str | None = None,
    rate: Sequence[RateWindow] = (), key: str | None = None,
    approval_id: str = "", kill_rule: Mapping[str, Any] | None = None,
    tree: Sequence[Ancestor] = (), retry: bool = False,
) -> tuple[Decision, RunState]:
    """Decide one check. ``kill`` describes an engaged kill switch covering the run, if any;
    ``rate`` holds the windows of `rate_limits_matching(policy, check.name)`, read by the
    caller (under its locks) for a running run. ``key`` is the check's repeat key when the
    caller already knows it: a backtest replays the recorded key of a check whose args were
    stored redacted (replay.py). ``approval_id`` is the id a new approval request gets,
    should this check open one. ``kill_rule``: the covering switch's ``limit`` and
    ``observed`` for the stop's ``rule`` (SPEC 16, answers.kill_rule).

    The order (SPEC 4.4, 11, 12, 14, 15): a run past its idle deadline is abandoned; a
    terminal run answers its stop; rules 1 to 9; rate limits; approvals; allow. The caller
    answers replays and the 409 of a run already waiting for an approval before calling
    this. The input state is left untouched; the returned state is what must
    be stored.

    ``tree``: the run's ancestors, the root first, as read under their locks (SPEC 20): a
    killed ancestor is the caller's ``kill``; an ended one stops the run (``parent_stopped``,
    enforced in shadow mode too, like a kill); their step, time, cost and tool-call limits
    bound the run after its own (SPEC 21). What the check counts on them is `count_in_tree`.

    ``retry``: the check repeats a ``check_id`` the run has counted, decided again because
    its first answer no longer holds (`replay_allowed`: a kill switch or an ended ancestor
    stops the run at this check): its stop counts nothing again (SPEC 5.2: a check_id seen
    already is not counted again; found by a reviewer: a retry after a switch was engaged,
    before its fan-out, stopped the run at step 4 of 3 checks).
    """
    if key is None:
        key = repeat_key(check.name, check.args, policy.ignore_args)
    abandoned = abandon(state, now=now, policy=policy)
    if abandoned is not None:
        return terminal_decision(abandoned, key), abandoned
    if state.status in TERMINAL:
        return terminal_decision(state, key), state

    new = state.copy()
    new.steps += 1
    _register(new, check)
    counted = in_tree(tree, check)
    # `stop`: the first enforced stop; `would`: the first would-stop before it, which a check
    # allowed reports (SPEC 4.4: "Shadow mode reports the first would-stop in this order").
    stop, would = _first_stops(_stops(policy, new, check, key, now, kill, kill_rule, counted),
                               policy, tree)
    if stop is None:
        if policy.mode == "shadow":
            # Nothing waits in shadow mode: a window the store could not read in time is no
            # evidence that the rule would have held the action back.
            rate = [window for window in rate if window.busy_retry_s is None]
        limited = rate_wait(rate)
        if limited is not None:
            window, wait = limited
            message = _rate_message(check.name, window, wait)
            # A wait the run's time cannot cover is a stop now, not a wait that ends in one.
            # A window the store could not read in time is no evidence of a long wait.
            past = None if window.busy_retry_s is not None else wait_past_budget(
                policy, state, check.name, wait, now)
            limited_rule = rule(RATE_LIMITED, {
                "index": policy.rate_limits.index(window.rule) if window.rule in
                policy.rate_limits else None, "match": window.rule.match,
                "per": window.rule.per, "max": window.rule.max,
                "window_s": window.rule.window_s}, {"retry_after_s": wait})
            if past is not None:
                passed: Stop = ("max_seconds", past, rule(
                    "max_seconds", {"max_seconds": policy.max_seconds},
                    {"elapsed_s": round(state.elapsed_s(now), 3), "retry_after_s": wait}),
                    None)
                if policy.mode != "shadow":
                    stop = passed
                else:
                    would = would or passed
            elif policy.mode != "shadow":
                # A wait registers nothing: the agent sends the same body again. It is
                # activity all the same (SPEC 14).
                waited = state.copy()
                waited.idle_deadline = next_deadline(policy, waited, now)
                return Decision(
                    outcome=WAIT, reason=RATE_LIMITED, step=state.steps + 1, repeat_key=key,
                    repeat_count=state.repeat_counts.get(key, 0), message=message,
                    next_action=NEXT_ACTION[RATE_LIMITED], retry_after_s=wait,
                    rule=limited_rule,
                ), waited
            else:
                would = would or (RATE_LIMITED, message, limited_rule, None)
    if stop is None:
        pattern = approval_pattern(policy, check.name)
        if pattern is not None:
            if policy.mode != "shadow":
                # Time pending is not idle (SPEC 14, 15): no deadline until `settle`.
                new.idle_deadline = None
                return _pending(policy, new, check, key, pattern, now, approval_id), new
            # Shadow mode makes no request: the would-be wait is reported and the action runs.
            would = would or (APPROVAL_REQUIRED, _approval_message(check.name, pattern, policy),
                              _approval_rule(policy, check.name, pattern), None)
    new.idle_deadline = next_deadline(policy, new, now)

    if stop is not None:
        reason, message, fired, scope = stop
        if retry:
            new = state.copy()  # the first answer counted the step, its cost and its result
        _end(new, reason, now)
        decision = Decision(
            outcome=STOP,
            reason=reason,
            step=new.steps,
            repeat_key=key,
            repeat_count=new.repeat_counts.get(key, 0),
            message=message,
            next_action=next_action_of(reason, fired),
            rule=fired,
            scope=scope,
        )
        return decision, new

    # An allow, or a shadow-mode would-stop that is counted like one because the action runs.
    new.repeat_counts[key] = new.repeat_counts.get(key, 0) + 1
    if check.type == "tool":
        new.tool_calls += 1
    # The warning, chosen last (SPEC 16, 21): nearest to its limit; a budget's only once.
    # The ancestors count this allow's tool call too (`count_in_tree`).
    if check.type == "tool":
        counted = [replace(a, state=replace(a.state, tool_calls=a.state.tool_calls + 1))
                   for a in counted]
    warning = choose_warning(warnings_of(policy, new, check, key, now, counted))
    if warning is not None and warning.budget is not None:
        new.budget_warned = new.budget_warned | {warning.budget}
    decision = Decision(
        outcome=ALLOW if would is None else WOULD_STOP,
        reason=STEP_OK,
        step=new.steps,
        repeat_key=key,
        repeat_count=new.repeat_counts[key],
        directive=None if warning is None else warning.directive,
        shadow=None if would is None else {"reason": would[0], "message": would[1]},
        # A shadow would-stop names the rule that would have stopped; else the warning's.
        rule=would[2] if would is not None else None if warning is None else warning.rule,
        scope=would[3] if would is not None else None if warning is None else warning.scope,
    )
    return decision, new


def _approval_rule(policy: Policy, name: str, pattern: str) -> dict[str, Any]:
    return rule(APPROVAL_REQUIRED, {"approvals.tools": pattern,
                                    "timeout_s": policy.approval_timeout_s}, {"action": name})


def count_in_tree(tree: Sequence[Ancestor], decision: Decision, check: Check, *,
                  now: datetime) -> list[RunState]:
    """The ancestors' states after this check of their descendant (SPEC 20), in ``tree``'s
    order: every check the run counted counts on each ancestor too (a step and its cost;
    a tool call when the action runs), and is activity for it (its idle deadline moves, so a
    parent waiting for its sub-agent is not abandoned meanwhile). A check that counted
    nothing (a terminal run, a wait) leaves them unchanged (the same objects)."""
    if decision.outcome == WAIT or not tree:
        return [ancestor.state for ancestor in tree]
    runs_action = decision.outcome in (ALLOW, WOULD_STOP)
    # A descendant waiting for an operator is no idleness of its ancestors either (SPEC 14):
    # their idle time starts from the end of its wait at the latest, the request's expiry
    # (found by an attacker: a parent idle for 60 s was abandoned while its child waited for
    # an approval of 600 s, which cancelled the request). Its next check moves them again.
    active_at = now
    if decision.outcome == PENDING and decision.approval is not None:
        active_at = max(now, datetime.fromisoformat(decision.approval["expires_at"]))
    counted = []
    for ancestor in tree:
        state = ancestor.state
        if state.status != RUNNING or abandon(state, now=now, policy=ancestor.policy):
            # Over, or abandoned as of now (its end is written by the next look at it): a
            # descendant's check is no activity for it (found by a tester: a child's check
            # moved an abandoned parent's idle deadline, and the parent's next check was
            # allowed after the child had been stopped for it).
            counted.append(state)
            continue
        new = replace(state, steps=state.steps + 1, cost_usd=state.cost_usd + check.cost_usd,
                      tool_calls=state.tool_calls + (1 if runs_action and check.type == "tool"
                                                     else 0))
        new.idle_deadline = next_deadline(ancestor.policy, new, active_at) \
            if new.pending is None else new.idle_deadline
        counted.append(new)
    return counted


def approved_in_tree(tree: Sequence[Ancestor], pending: Pending) -> list[RunState]:
    """The ancestors' states once an operator approves their descendant's waiting action
    (SPEC 20): the check that asked counted its step and cost on them (`count_in_tree`); the
    tool call counts now, on each running ancestor as on the run (`settle`). Unchanged
    objects when the action is not a tool."""
    if pending.action_type != "tool":
        return [ancestor.state for ancestor in tree]
    return [replace(ancestor.state, tool_calls=ancestor.state.tool_calls + 1)
            if ancestor.state.status == RUNNING else ancestor.state for ancestor in tree]


def _approval_message(name: str, pattern: str, policy: Policy) -> str:
    return (f"{name} matches the approvals pattern '{pattern}': an operator must approve it "
            f"(timeout_s={policy.approval_timeout_s}).")


def _pending(policy: Policy, new: RunState, check: Check, key: str, pattern: str,
             now: datetime, approval_id: str) -> Decision:
    """Open an approval request (SPEC 11). The step is counted and the check's cost,
    progress and result are registered (already done on ``new``); the repeat count and
    ``tool_calls`` wait for the approval. Mutates ``new``, the caller's fresh copy."""
    new.pending = Pending(
        approval_id=approval_id, check_id=check.check_id or "", step=new.steps,
        action_name=check.name, action_type=check.type, repeat_key=key, since=now,
        expires_at=now + timedelta(seconds=policy.approval_timeout_s),
        error=check.last_result.error_text if check.last_result else None,
    )
    return Decision(
        outcome=PENDING,
        reason=APPROVAL_REQUIRED,
        step=new.steps,
        repeat_key=key,
        repeat_count=new.repeat_counts.get(key, 0),
        message=_approval_message(check.name, pattern, policy),
        # The request's own poll, not a template the agent must fill in.
        next_action=NEXT_ACTION[APPROVAL_REQUIRED].replace("{id}", approval_id),
        approval=new.pending.summary(),
        rule=_approval_rule(policy, check.name, pattern),
    )


def tree_stop_of_approval(tree: Sequence[Ancestor], pending: Pending, now: datetime
                          ) -> Stop | None:
    """What stops a descendant's action an operator approves (SPEC 20), as the ancestors
    are now (``tree``, read under their locks): an ancestor that is over (``parent_stopped``)
    or, for a tool, an ancestor's max_tool_calls its other descendants used up while the
    request waited (enforced as that ancestor's policy says). The request's own check counted
    its step and cost on them already (found by an attacker: an approval on a child after its
    parent finished answered allow, and one after its siblings used the parent's tool calls
    put the tree past max_tool_calls)."""
    ended = ended_ancestor(tree, now)
    if ended is not None:
        return _parent_stopped(*ended)
    if pending.action_type != "tool":
        return None
    check = Check(name=pending.action_name, type="tool")
    for ancestor in tree:
        if ancestor.policy.mode == "shadow":
            continue
        passed = _tree_limit("max_tool_calls", ancestor.policy, ancestor.state, check, now)
        if passed is not None:
            return _ancestors_stop("max_tool_calls", ancestor, passed)
    return None


def settle(state: RunState, status: str, *, now: datetime, by: str | None = None,
           note: str = "", kill: str | None = None, policy: Policy | None = None,
           kill_rule: Mapping[str, Any] | None = None, tree: Sequence[Ancestor] = ()
           ) -> tuple[Decision, RunState]:
    """The final answer of the run's pending approval (SPEC 11), for the same step:

    - ``approved``: allow / step_ok; the repeat count and (for a tool) ``tool_calls`` go up now;
      unless the run's ancestors (``tree``) stop it (`tree_stop_of_approval`): then the
      request is ``cancelled`` and the run stopped with that reason;
    - ``denied``: stop / approval_denied, the run stopped, the operator's note in the message;
    - ``expired``: stop / approval_expired, the run stopped as of ``expires_at``;
    - ``cancelled`` by a kill switch (``kill`` describes it): stop / killed, the run killed;
      else by an ancestor that is over (``tree``, SPEC 20): stop / parent_stopped.

    The wait ends: its seconds move to ``paused_s`` (they never count as active time). An
    approved run's idle deadline starts again from ``now`` when ``policy`` is given (time
    pending is not idle, SPEC 14).
    """
    pending = state.pending
    if pending is None or state.status in TERMINAL:
        raise ValueError("the run has no pending approval")
    end = pending.expires_at if status == EXPIRED else now
    new = state.copy()
    new.pending = None
    new.paused_s += max(0.0, (end - pending.since).total_seconds())
    key = pending.repeat_key
    scope: str | None = None  # whose stop ends the request: the run's own (None)
    stopped_by_tree = tree_stop_of_approval(tree, pending, now) if status == APPROVED else None
    if stopped_by_tree is not None:
        reason, message, fired, scope = stopped_by_tree
        _end(new, reason, now)
        return Decision(
            outcome=STOP, reason=reason, step=pending.step, repeat_key=key,
            repeat_count=new.repeat_counts.get(key, 0), message=message,
            next_action=NEXT_ACTION[reason], approval=pending.summary(CANCELLED), rule=fired,
            scope=scope,
        ), new
    if status == APPROVED:
        new.repeat_counts[key] = new.repeat_counts.get(key, 0) + 1
        if pending.action_type == "tool":
            new.tool_calls += 1
        warning = None
        if policy is not None:
            new.idle_deadline = next_deadline(policy, new, now)
            # The approved allow is the allow the warnings are chosen for (SPEC 16, chosen
            # after approvals): its repeat count and tool call counted only now (found by a
            # newcomer: a repeated approved refund reached its warning threshold with no
            # warning, then stopped as a loop). The ancestors as the tool call counts on them.
            counted = [replace(ancestor, state=after) for ancestor, after
                       in zip(tree, approved_in_tree(tree, pending), strict=True)]
            warning = choose_warning(warnings_of(policy, new, pending.check(), key, now,
                                                 counted))
            if warning is not None and warning.budget is not None:
                new.budget_warned = new.budget_warned | {warning.budget}
        return Decision(
            outcome=ALLOW, reason=STEP_OK, step=pending.step, repeat_key=key,
            repeat_count=new.repeat_counts[key], approval=pending.summary(APPROVED),
            directive=None if warning is None else warning.directive,
            rule=None if warning is None else warning.rule,
            scope=None if warning is None else warning.scope,
        ), new
    if status == DENIED:
        reason = APPROVAL_DENIED
        who = f" ({by})" if by else ""
        # The note ends its sentence (found by a newcomer: "...ask a human The action").
        said = note.rstrip()
        said += "" if not said or said.endswith((".", "!", "?")) else "."
        message = (f"An operator{who} denied {pending.action_name}: {said} The action was not "
                   "run and the run is stopped.")
        fired = rule(reason, {"approvals": "required"}, {"decided_by": by, "note": note})
    elif status == EXPIRED:
        reason = APPROVAL_EXPIRED
        waited = round((pending.expires_at - pending.since).total_seconds(), 3)
        message = (f"Nobody decided on {pending.action_name} before the approval expired at "
                   f"{_iso(pending.expires_at)}, {_plain(waited)} s after it was asked: the "
                   "action was not run and the run is stopped.")
        fired = rule(reason, {"timeout_s": waited}, {"expires_at": _iso(pending.expires_at)})
    elif status == CANCELLED and kill is not None:
        reason = "killed"
        message = f"Stopped by a kill switch: {kill}."
        fired = rule(reason, (kill_rule or {}).get("limit", {}),
                     (kill_rule or {}).get("observed", {}))
    elif status == CANCELLED and (ended := ended_ancestor(tree, now)) is not None:
        # The tree is over: the request can never be an allow (found by an attacker: a
        # child's request stayed pending after its parent's finish, and its agent waited
        # for it to expire).
        reason, message, fired, scope = _parent_stopped(*ended)
    else:
        raise ValueError(f"an approval cannot be settled as {status!r} here")
    _end(new, reason, end)
    return Decision(
        outcome=STOP, reason=reason, step=pending.step, repeat_key=key,
        repeat_count=new.repeat_counts.get(key, 0), message=message,
        next_action=NEXT_ACTION[reason], approval=pending.summary(status), rule=fired,
        scope=scope,
    ), new


def _end(state: RunState, reason: str, at: datetime) -> None:
    """A stop makes the run terminal (SPEC 4.4): `killed` for a kill, else `stopped`."""
    state.status = KILLED if reason == "killed" else STOPPED
    state.stop_reason = reason
    state.ended_at = at
    end_wait(state, at)


def end_wait(state: RunState, at: datetime) -> None:
    """A run that ends ends its wait for an approval (SPEC 10, "No impossible states"): the
    wait's seconds move to ``paused_s`` and the run names no pending request any more. The
    store settles the request itself in the same transaction (its final answer is the ended
    run's stop). Mutates ``state``, the caller's fresh copy."""
    if state.pending is not None:
        state.paused_s += max(0.0, (at - state.pending.since).total_seconds())
        state.pending = None


# A rate limit's wait the run's time could not cover (`wait_past_budget`) is a max_seconds
# stop, but the budget is not spent (found by a newcomer: 0.7 s of 45 s used, and the agent
# told its time budget was spent).
WAIT_PAST_BUDGET_NEXT = ("Return the partial response: the rate limit's wait (retry_after_s) "
                         "is longer than the time left of the run's budget (max_seconds). "
                         "Relaunch once the wait is over, or with a larger time budget.")


def waited_past_budget(fired: Mapping[str, Any] | None) -> bool:
    """Whether the rule ``fired`` is a max_seconds stop made of a rate limit's wait that the
    run's time left could not cover (`wait_past_budget`: its observed values carry the
    wait), not of the time spent."""
    observed = fired.get("observed") if isinstance(fired, Mapping) else None
    return isinstance(observed, Mapping) and "retry_after_s" in observed \
        and fired.get("name") == "max_seconds"  # type: ignore[union-attr]


def next_action_of(reason: str, fired: Mapping[str, Any] | None) -> str:
    """What the agent should do after a stop for ``reason`` by the rule ``fired``."""
    if reason == "max_seconds" and waited_past_budget(fired):
        return WAIT_PAST_BUDGET_NEXT
    return NEXT_ACTION.get(reason, NEXT_ACTION[RUN_FINISHED])


def terminal_decision(state: RunState, key: str) -> Decision:
    """The answer to any check of a run that is over: no counter moves."""
    if state.status in (STOPPED, KILLED):
        reason = state.stop_reason or state.status
        why = f" (reason: {reason})" if reason != state.status else ""
        message = f"The run is already {state.status}{why}."
        if state.stop_detail:
            # SPEC 4.4: every stop names the limit and its value. A later check gets the
            # stop that ended the run, in its own words.
            message = f"The run is already {state.status}{why}. Its stop: {state.stop_detail}"
    else:
        reason = RUN_FINISHED
        message = f"The run is already {state.status}."
    again = _stop_rule_again(state, reason)
    return Decision(
        outcome=STOP,
        reason=reason,
        step=state.steps,
        repeat_key=key,
        repeat_count=state.repeat_counts.get(key, 0),
        message=message,
        **again,
        next_action=next_action_of(reason, again["rule"]),
    )


def _stop_rule_again(state: RunState, reason: str) -> dict[str, Any]:
    """A later check's rule and scope: the stop's that ended the run, as its own answer gave
    them (SPEC 16): a kill's switch, a limit with its value, an ancestor's limit with the
    ancestor's policy and id (found by a newcomer: a sub-agent stopped by its parent's
    max_steps answered later checks naming its own policy and scope, limit
    `{"status": "running"}`). A run its agent ended, or a stop not recorded: the status."""
    stored = state.stop_rule
    if stored and stored.get("name") == reason:
        fired = rule(reason, stored.get("limit") or {}, stored.get("observed") or {})
        if stored.get("policy") is not None:
            fired["policy"] = (stored["policy"], stored.get("version"))
        scope = stored.get("scope")
        return {"rule": fired, "scope": scope if isinstance(scope, str) and scope != "run"
                else None}
    return {"rule": rule(reason, {"status": RUNNING}, {"status": state.status,
                                                       "stop_reason": state.stop_reason}),
            "scope": None}


# A check the agent no longer waited for (its deadline_ms passed before it was decided).
DEADLINE_EXPIRED = "deadline_expired"
EXPIRED_MESSAGE = ("The check arrived or waited past its deadline (deadline_ms or "
                   "deadline_at): the agent no longer waited for the answer, so it was not "
                   "decided and nothing was counted.")
EXPIRED_NEXT = "Check the action again if it is still wanted."


def expire(state: RunState, decision: Decision, new: RunState, *, past_deadline: bool
           ) -> tuple[Decision, RunState] | None:
    """A check whose deadline passed before it was decided (the caller tells, from its own
    clock; usually the check waited for the run's lock): the agent gave up on it and will not
    run the action, so a decision that changed the run (``new``, from `evaluate`) does not
    stand. It is audited as expired instead, nothing counted: the expired decision and the
    state before the check. None when the decision stands (in time, or one that changed
    nothing, such as a terminal run's stop, which is answered as decided)."""
    if not past_deadline or new is state:
        return None
    return Decision(outcome=EXPIRED, reason=DEADLINE_EXPIRED, step=state.steps,
                    repeat_key=decision.repeat_key,
                    repeat_count=state.repeat_counts.get(decision.repeat_key, 0),
                    message=EXPIRED_MESSAGE, next_action=EXPIRED_NEXT,
                    rule=rule(DEADLINE_EXPIRED, {}, {"past_deadline": True})), state


def elapsed_seconds(*, started_at: datetime, ended_at: datetime | None, status: str,
                    now: datetime, paused_s: float = 0.0,
                    pending_since: datetime | None = None) -> float:
    """A run's active time so far (SPEC 15): until it ended if it is over, else until ``now``,
    minus the time spent waiting for approvals (``paused_s`` settled, and the wait open
    since ``pending_since``). The budget's clock (max_seconds) and every screen's "Time"."""
    end = ended_at if status in TERMINAL and ended_at else now
    paused = paused_s
    if pending_since is not None:
        paused += max(0.0, (end - pending_since).total_seconds())
    return max(0.0, (end - started_at).total_seconds() - paused)


def record_outcome(
    policy: Policy,
    state: RunState,
    check: Check,
    *,
    allowed: bool,
    reason: str,
    now: datetime,
    message: str | None = None,
) -> tuple[Decision, RunState]:
    """Account for a decision made elsewhere, as ``evaluate`` would have counted it.

    The client's fail-open mode decides locally while the service is unreachable; the actions
    it allowed ran, so when the decisions are uploaded the run's counters must move exactly as
    for an allow (or end the run, for a local stop), whatever the rules would say now. The
    client uses the same function to keep its own copy of the state in step with the answers
    of the service.
    """
    key = repeat_key(check.name, check.args, policy.ignore_args)
    if state.status in TERMINAL:
        # SPEC 4.4: a check on a terminal run changes no counter, and neither does a decision
        # made elsewhere (found by an attacker: allows uploaded to a run stopped at max_steps
        # 2 made it 54 steps and 250 USD, its ancestors' counters with it). It is still
        # audited, at the run's step: the action ran.
        return Decision(
            outcome=ALLOW if allowed else STOP, reason=STEP_OK if allowed else reason,
            step=state.steps, repeat_key=key, repeat_count=state.repeat_counts.get(key, 0),
            message=message,
            next_action=None if allowed else next_action_of(reason, None),
            rule=None if allowed else rule(reason, {}, {"decided": "locally"}),
        ), state.copy()
    new = state.copy()
    new.steps += 1
    _register(new, check)
    if allowed:
        new.repeat_counts[key] = new.repeat_counts.get(key, 0) + 1
        if check.type == "tool":
            new.tool_calls += 1
        outcome, reason = ALLOW, STEP_OK
    else:
        outcome = STOP
        if new.status == RUNNING:
            _end(new, reason, now)
    decision = Decision(
        outcome=outcome,
        reason=reason,
        step=new.steps,
        repeat_key=key,
        repeat_count=new.repeat_counts.get(key, 0),
        message=message,
        next_action=None if allowed else next_action_of(reason, None),
        rule=None if allowed else rule(reason, {}, {"decided": "locally"}),
    )
    return decision, new


def ends_at_this_check(tree: Sequence[Ancestor], now: datetime, *, covered: bool) -> bool:
    """Whether the run stops at this check though its status does not say so yet: a kill
    switch covers it (``covered``) or an ancestor is over (`ended_ancestor`): what
    `replay_allowed` calls ``ends_now``."""
    return covered or ended_ancestor(tree, now) is not None


def replay_allowed(state: RunState, first: Decision | str | None, *,
                   ends_now: bool = False) -> bool:
    """A ``check_id`` replay returns the first answer only while the run is still running,
    or when that first answer was already a stop (SPEC 4.5): no allow leaks after a stop.
    ``first`` is the first decision, or the ``decision`` field of its stored answer.
    ``ends_now``: the run stops at this check, retries included, though its status does not
    say so yet: an engaged kill switch covers it (before its fan-out has marked it killed),
    or an ancestor is over (SPEC 20: its next check answers ``parent_stopped``; found by an
    attacker: a retry after the parent's finish answered its first allow). A pending first
    answer still replays: the request is the run's until it is settled (a kill switch, or
    an ancestor that is over, cancels it before the replay, which then answers the final
    stop), and deciding the check again would answer 409 ``approval_pending`` to it."""
    if first is None:
        return False
    answer = first if isinstance(first, str) else first.answer
    return answer == STOP or (state.status == RUNNING and (not ends_now or answer == PENDING))


class FinishError(Exception):
    pass


def finish(state: RunState, status: str, *, already_finished: bool, now: datetime) -> RunState:
    """SPEC 5.1 finish: a stopped or killed run keeps its status and reason."""
    if already_finished:
        raise FinishError(RUN_FINISHED)
    new = state.copy()
    if new.status == RUNNING:
        new.status = status
        new.stop_reason = AGENT_STOPPED if status == STOPPED else None
        new.ended_at = now
        # Finishing cancels the approval it waited for (SPEC 11): the wait ends now.
        end_wait(new, now)
    return new


def stopped_by_tree(state: RunState, tree: Sequence[Ancestor], now: datetime
                    ) -> tuple[Decision, RunState] | None:
    """A running descendant whose tree is over (SPEC 20), met by its finish rather than its
    next check: it ends ``stopped`` / ``parent_stopped`` now, audited like a kill (stop, no
    action, the step unchanged), and the finish then keeps that status and reason as it
    does any stopped run's. None when the run is over already or its tree is not. (Found
    by a review: a child finished `completed` under a root that had been stopped.)"""
    if state.status != RUNNING:
        return None
    ended = ended_ancestor(tree, now)
    if ended is None:
        return None
    reason, message, fired, scope = _parent_stopped(*ended, then="")
    new = state.copy()
    _end(new, reason, now)
    return Decision(outcome=STOP, reason=reason, step=state.steps, repeat_key="",
                    repeat_count=0, message=message, next_action=NEXT_ACTION[reason],
                    rule=fired, scope=scope), new


def kill(state: RunState, *, now: datetime) -> RunState | None:
    """The fan-out's effect on one run: None when the run is already over (idempotence)."""
    if state.status in TERMINAL:
        return None
    new = state.copy()
    _end(new, "killed", now)
    return new


def redact(value: Any, names: tuple[str, ...] | frozenset[str]) -> Any:
    """Replace the value of every key named in ``names`` (any case, any depth)."""
    return _redact(value, _lowered(names if isinstance(names, tuple | frozenset)
                                   else tuple(names)))


@functools.lru_cache(maxsize=256)
def _lowered(names: tuple[str, ...] | frozenset[str]) -> frozenset[str]:
    # A policy's names, lowered once: the check redacts every action's args with them.
    return frozenset(n.lower() for n in names)


# What `_redact` returns as it is, by exact type (JSON's scalars): a list of them is walked
# without a call each (a check's args of 30,000 numbers took 12 ms through the generic tests).
_SCALARS = frozenset({int, float, str, bool, type(None)})


def _redact(value: Any, lowered: frozenset[str]) -> Any:
    kind = type(value)
    if kind is dict:
        return {k: REDACTED if str(k).lower() in lowered else _redact(v, lowered)
                for k, v in value.items()}
    if kind is list:
        return [v if type(v) in _SCALARS else _redact(v, lowered) for v in value]
    if kind in _SCALARS:
        return value
    if isinstance(value, Mapping):
        return {
            k: REDACTED if str(k).lower() in lowered else _redact(v, lowered)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_redact(v, lowered) for v in value]
    return value
