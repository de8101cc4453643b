"""The decision rules of SPEC section 4, as pure functions.

Policy + run state + check + clock in; decision + new state out. Nothing here touches Django,
the database or the network, so every rule can be tested exhaustively and the same rules serve
the HTTP check, the kill-switch fan-out and the model-based tests.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from decimal import Decimal
from fnmatch import fnmatchcase
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
SCOPES = ("run", "agent", "team")  # rate_limits[].per

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
    RUN_FINISHED: "The run is over: do not execute the action; start a new run for new work.",
}


@dataclass(frozen=True, slots=True)
class RateLimit:
    """One rule of ``rate_limits`` (SPEC 12): at most ``max`` actions whose name matches
    ``match`` in any ``window_s`` seconds, counted over the same run, agent or team."""

    match: str
    per: str  # run | agent | team
    max: int
    window_s: int

    def matches(self, name: str) -> bool:
        return fnmatchcase(name, self.match)

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

    @classmethod
    def from_document(cls, doc: Mapping[str, Any]) -> Policy:
        """Build from one normalized policy of the policy document (SPEC section 3)."""
        steps, budgets, tools = doc["step_limits"], doc["budgets"], doc["tools"]
        max_usd = budgets["max_usd"]
        return cls(
            mode=doc["mode"],
            max_steps=steps["max_steps"],
            max_repeat_action=steps["max_repeat_action"],
            no_progress_window=steps["no_progress_window"],
            max_seconds=budgets["max_seconds"],
            max_usd=None if max_usd is None else Decimal(str(max_usd)),
            max_tool_calls=budgets["max_tool_calls"],
            allow=None if tools["allow"] is None else tuple(tools["allow"]),
            deny=tuple(tools["deny"]),
            ignore_args=tuple(doc["repeat_key"]["ignore_args"]),
            error_threshold=doc["on_repeated_error"]["threshold"],
            error_action=doc["on_repeated_error"]["action"],
            redact_args=tuple(doc["redact_args"]),
            max_idle_seconds=budgets.get("max_idle_seconds"),
            rate_limits=tuple(
                RateLimit(match=r["match"], per=r["per"], max=r["max"], window_s=r["window_s"])
                for r in doc.get("rate_limits") or ()
            ),
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

    def copy(self) -> RunState:
        return replace(
            self,
            repeat_counts=dict(self.repeat_counts),
            progress_seen=set(self.progress_seen),
            signatures_seen=set(self.signatures_seen),
            error_counts=dict(self.error_counts),
        )

    def elapsed_s(self, now: datetime) -> float:
        return elapsed_seconds(started_at=self.started_at, ended_at=self.ended_at,
                               status=self.status, now=now)

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
            "no_progress_streak": self.no_progress_streak,
            "error_counts": self.error_counts,
        }

    def load_memory(self, memory: Mapping[str, Any]) -> RunState:
        self.repeat_counts = dict(memory.get("repeat_counts", {}))
        self.progress_seen = set(memory.get("progress_seen", ()))
        self.signatures_seen = set(memory.get("signatures_seen", ()))
        self.no_progress_streak = int(memory.get("no_progress_streak", 0))
        self.error_counts = dict(memory.get("error_counts", {}))
        return self


@dataclass(frozen=True, slots=True)
class Decision:
    outcome: str  # as audited: allow | stop | would_stop
    reason: str
    step: int
    repeat_key: str
    repeat_count: int
    message: str | None = None
    next_action: str | None = None
    directive: dict[str, str] | None = None
    shadow: dict[str, str] | None = None
    retry_after_s: float | None = None  # a wait only

    @property
    def answer(self) -> str:
        """What the agent is told: a shadow would-stop still runs."""
        if self.outcome in (STOP, WAIT):
            return self.outcome
        return ALLOW


def _plain(value: Decimal | float) -> str:
    """A limit as people write it: ``45``, ``0.25``, ``31536000``, never ``3.1536e+07``."""
    return f"{Decimal(str(value)).normalize():f}"


def _denied(policy: Policy, name: str) -> str | None:
    for pattern in policy.deny:
        if fnmatchcase(name, pattern):
            return f"{name} matches the deny pattern '{pattern}'."
    if policy.allow is not None and not any(fnmatchcase(name, p) for p in policy.allow):
        return f"{name} matches no pattern of the allow list {list(policy.allow)}."
    return None


def _first_stop(
    policy: Policy, state: RunState, check: Check, key: str, now: datetime, kill: str | None
) -> tuple[str, str] | None:
    """The first rule of SPEC 4.4 that stops this check, as (reason, message)."""
    if kill is not None:
        return "killed", f"Stopped by a kill switch: {kill}."
    if state.steps > policy.max_steps:
        return "max_steps", f"Step {state.steps} exceeds max_steps={policy.max_steps}."
    denied = _denied(policy, check.name)
    if denied:
        return "tool_denied", f"Tool denied by the policy: {denied}"
    elapsed = state.elapsed_s(now)
    if policy.max_seconds is not None and elapsed > policy.max_seconds:
        return "max_seconds", (
            f"The run has lasted {elapsed:.1f} s, over "
            f"max_seconds={_plain(policy.max_seconds)}."
        )
    if policy.max_usd is not None and state.cost_usd >= policy.max_usd:
        return "max_usd", (
            f"The run has spent ${_plain(state.cost_usd)}, reaching "
            f"max_usd={_plain(policy.max_usd)}."
        )
    if (
        policy.max_tool_calls is not None
        and check.type == "tool"
        and state.tool_calls >= policy.max_tool_calls
    ):
        return "max_tool_calls", (
            f"The run has made {state.tool_calls} tool calls "
            f"(max_tool_calls={policy.max_tool_calls})."
        )
    count = state.repeat_counts.get(key, 0)
    if count >= policy.max_repeat_action:
        return "loop_detected", (
            f"{check.name} was called {count} times with the same arguments "
            f"(max_repeat_action={policy.max_repeat_action})."
        )
    if state.no_progress_streak >= policy.no_progress_window:
        return "no_progress", (
            f"{state.no_progress_streak} informative checks in a row brought nothing new "
            f"(no_progress_window={policy.no_progress_window})."
        )
    error = check.last_result.error_text if check.last_result else None
    if policy.error_action == "stop" and error is not None:
        seen = state.error_counts.get(error, 0)
        if seen >= policy.error_threshold:
            return "repeated_error", (
                f"The error '{error}' occurred {seen} times "
                f"(on_repeated_error.threshold={policy.error_threshold})."
            )
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
    return {
        "type": "inject_message",
        "role": "user",
        "content": f"The error '{error}' occurred {count} times. "
        "Change approach radically or abandon this subtask.",
    }


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


def rate_limits_matching(policy: Policy, name: str) -> tuple[RateLimit, ...]:
    """The rules of the policy that apply to this action name (every one applies)."""
    return tuple(rule for rule in policy.rate_limits if rule.matches(name))


def window_of(rule: RateLimit, stamps: Iterable[datetime], now: datetime) -> RateWindow:
    """The RateWindow of a rule from the stamps of its scope's counted matching actions."""
    start = now - timedelta(seconds=rule.window_s)
    recent = sorted((t for t in stamps if t > start), reverse=True)
    return RateWindow(rule, recent[rule.max - 1] if len(recent) >= rule.max else None, now)


def retry_after_s(window: RateWindow) -> float | None:
    """Seconds until the rule has room again, rounded up to the millisecond (None: it has)."""
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
    return (f"{name} is rate limited by the {rule.describe()}: {rule.max} actions in the "
            f"last {rule.window_s} s already; retry in {wait:.3f} s.")


# --- Abandoned runs (SPEC 14) -----------------------------------------------------------------

def idle_deadline(policy: Policy, at: datetime) -> datetime | None:
    """When a run whose last activity (start, check, wait) was at ``at`` is abandoned."""
    if policy.max_idle_seconds is None:
        return None
    return at + timedelta(seconds=policy.max_idle_seconds)


def abandon(state: RunState, *, now: datetime) -> RunState | None:
    """The run ended as abandoned, when it is running and past its idle deadline; else None.
    ``ended_at`` is the deadline itself, not the moment somebody noticed."""
    if state.status != RUNNING or state.idle_deadline is None or now < state.idle_deadline:
        return None
    new = state.copy()
    new.status, new.stop_reason, new.ended_at = STOPPED, ABANDONED, state.idle_deadline
    return new


def abandoned_message(policy: Policy) -> str:
    idle = "?" if policy.max_idle_seconds is None else _plain(policy.max_idle_seconds)
    return (f"No check, wait, start or finish for {idle} s: the run was abandoned "
            f"(max_idle_seconds={idle}).")


def evaluate(
    policy: Policy, state: RunState, check: Check, *, now: datetime, kill: str | None = None,
    rate: Sequence[RateWindow] = (), key: str | None = None,
) -> tuple[Decision, RunState]:
    """Decide one check. ``kill`` describes an engaged kill switch covering the run, if any;
    ``rate`` holds the windows of `rate_limits_matching(policy, check.name)`, read by the
    caller (under its locks) for a running run. ``key`` is the check's repeat key when the
    caller already knows it: a backtest replays the recorded key of a check whose args were
    stored redacted (replay.py).

    The input state is left untouched; the returned state is what must be stored.
    """
    if key is None:
        key = repeat_key(check.name, check.args, policy.ignore_args)
    abandoned = abandon(state, now=now)
    if abandoned is not None:
        return terminal_decision(abandoned, key), abandoned
    if state.status in TERMINAL:
        return terminal_decision(state, key), state

    new = state.copy()
    new.steps += 1
    _register(new, check)
    stop = _first_stop(policy, new, check, key, now, kill)
    if stop is None:
        limited = rate_wait(rate)
        if limited is not None:
            window, wait = limited
            message = _rate_message(check.name, window, wait)
            if policy.mode != "shadow":
                # A wait registers nothing: the agent sends the same body again. It is
                # activity all the same (SPEC 14).
                waited = state.copy()
                waited.idle_deadline = idle_deadline(policy, now)
                return Decision(
                    outcome=WAIT, reason=RATE_LIMITED, step=state.steps + 1, repeat_key=key,
                    repeat_count=state.repeat_counts.get(key, 0), message=message,
                    next_action=NEXT_ACTION[RATE_LIMITED], retry_after_s=wait,
                ), waited
            stop = (RATE_LIMITED, message)
    new.idle_deadline = idle_deadline(policy, now)

    if stop is not None and (policy.mode != "shadow" or stop[0] == "killed"):
        reason, message = stop
        new.status = KILLED if reason == "killed" else STOPPED
        new.stop_reason = reason
        new.ended_at = now
        decision = Decision(
            outcome=STOP,
            reason=reason,
            step=new.steps,
            repeat_key=key,
            repeat_count=new.repeat_counts.get(key, 0),
            message=message,
            next_action=NEXT_ACTION[reason],
        )
        return decision, new

    # An allow, or a shadow-mode would-stop that is counted like one because the action runs.
    new.repeat_counts[key] = new.repeat_counts.get(key, 0) + 1
    if check.type == "tool":
        new.tool_calls += 1
    directive = None
    error = check.last_result.error_text if check.last_result else None
    if error is not None and policy.error_action == "nudge":
        count = new.error_counts[error]
        if count >= policy.error_threshold:
            directive = nudge(error, count)
    decision = Decision(
        outcome=ALLOW if stop is None else WOULD_STOP,
        reason=STEP_OK,
        step=new.steps,
        repeat_key=key,
        repeat_count=new.repeat_counts[key],
        directive=directive,
        shadow=None if stop is None else {"reason": stop[0], "message": stop[1]},
    )
    return decision, new


def terminal_decision(state: RunState, key: str) -> Decision:
    """The answer to any check of a run that is over: no counter moves."""
    if state.status in (STOPPED, KILLED):
        reason = state.stop_reason or state.status
        message = f"The run is already {state.status} (reason: {reason})."
    else:
        reason = RUN_FINISHED
        message = f"The run is already {state.status}."
    return Decision(
        outcome=STOP,
        reason=reason,
        step=state.steps,
        repeat_key=key,
        repeat_count=state.repeat_counts.get(key, 0),
        message=message,
        next_action=NEXT_ACTION.get(reason, NEXT_ACTION[RUN_FINISHED]),
    )


def elapsed_seconds(*, started_at: datetime, ended_at: datetime | None, status: str,
                    now: datetime) -> float:
    """A run's time so far: until it ended if it is over, else until ``now``. The budget's
    clock (max_seconds) and every screen's "Time"."""
    end = ended_at if status in TERMINAL and ended_at else now
    return max(0.0, (end - started_at).total_seconds())


def replay_allowed(state: RunState, first: Decision | str | None) -> bool:
    """A ``check_id`` replay returns the first answer only while the run is still running,
    or when that first answer was already a stop (SPEC 4.5): no allow leaks after a stop.
    ``first`` is the first decision, or the ``decision`` field of its stored answer."""
    if first is None:
        return False
    answer = first if isinstance(first, str) else first.answer
    return state.status == RUNNING or answer == STOP


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
    return new


def kill(state: RunState, *, now: datetime) -> RunState | None:
    """The fan-out's effect on one run: None when the run is already over (idempotence)."""
    if state.status in TERMINAL:
        return None
    new = state.copy()
    new.status, new.stop_reason, new.ended_at = KILLED, "killed", now
    return new


def redact(value: Any, names: tuple[str, ...] | frozenset[str]) -> Any:
    """Replace the value of every key named in ``names`` (any case, any depth)."""
    lowered = {n.lower() for n in names}
    return _redact(value, lowered)


def _redact(value: Any, lowered: set[str]) -> Any:
    if isinstance(value, Mapping):
        return {
            k: REDACTED if str(k).lower() in lowered else _redact(v, lowered)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_redact(v, lowered) for v in value]
    return value
