"""Backtest (SPEC 13): what a draft's rate limits and approvals would have cost, and the
draft's effect in one line. Pure, like the replay beside it.

The replay (replay.py) decides each recorded run on its own, so it cannot simulate a rate
limit, which counts other runs' actions too, nor an operator. This module estimates both
from the replayed runs' recorded times, once every run was replayed:

- **Approval requests**: the checks the draft's rules answer ``pending`` (or, in shadow
  mode, would: ``would_stop`` / ``approval_required``), per agent and per hour.
- **Rate-limit waits**: the actions the draft counts like an allow (`rules.RATE_COUNTED`)
  are played again in time order across all the runs, at the times the agents meant them
  (`intended_times`: without the waits and approval holds recorded), each rule's window
  read by `rules.window_of` and the wait by `rules.rate_wait`, the check's own functions.
  An action that would wait is sent again after its ``retry_after_s`` (as a client does), and
  the rest of its run moves by as much, keeping its recorded spacing; so one action can wait
  more than once when other runs take the room first, as it would with the server.

Both are estimates (docs/backtest.md says where they fall short): only the replayed runs are
counted (a per-agent or per-team rule also counts the runs of other policies), an
approval is taken to be decided at once, and an agent made to wait is taken to act as
recorded afterwards. A pathological draft (a huge ``max`` over a huge window) is bounded by
`MAX_WAITS` and `MAX_WORK`: past them the counts are lower bounds (``complete`` false).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

from .replay import PENDING, WAIT, Outcome, Recorded, recorded_stop
from .rules import (
    APPROVAL_REQUIRED,
    RATE_COUNTED,
    WOULD_STOP,
    Decision,
    Policy,
    RateLimit,
    RateWindow,
    rate_limits_matching,
    rate_wait,
    window_of,
)

# Bounds of the rate-limit play: the waits it counts, and the stamps it hands `window_of`.
MAX_WAITS = 100_000
MAX_WORK = 5_000_000
MICRO_USD = Decimal("0.000001")  # costs are stored to the micro-dollar


@dataclass
class Tally:
    """What the draft would cause for one agent, or in one hour."""

    rate_limit_waits: int = 0
    wait_s: float = 0.0
    approval_requests: int = 0

    def as_json(self) -> dict[str, Any]:
        return {"rate_limit_waits": self.rate_limit_waits, "wait_s": round(self.wait_s, 3),
                "approval_requests": self.approval_requests}


@dataclass(frozen=True, slots=True)
class Counted:
    """An action the draft counts against its rate limits, at its recorded time."""

    at: datetime
    name: str
    step: int = 0  # the recorded check's step


@dataclass(frozen=True, slots=True)
class Wait:
    """A rate-limit wait the draft would answer: to which run, when, and for how long."""

    run: Hashable
    agent: str
    at: datetime
    seconds: float


@dataclass(frozen=True, slots=True)
class RunEffect:
    """What the draft changes of one recorded run: stopped before its recorded end (with the
    steps and cost after that stop), or let on past a recorded stop."""

    stopped_earlier: bool = False
    let_on: bool = False
    # Stopped no earlier than recorded but otherwise: later, or at the same step for another
    # reason (a change too, SPEC 13; its steps and cost are the recorded run's).
    stopped_otherwise: bool = False
    steps_removed: int = 0
    cost_removed: Decimal = Decimal(0)


def hour_of(moment: datetime) -> str:
    """The UTC hour a moment falls in, as the JSON keys it: ``2026-12-03T17:00Z``."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:00Z")


def moment_of(rec: Recorded, started_at: datetime) -> datetime:
    """When a recorded check was decided; before decisions were read with their time, the
    run's start plus its elapsed seconds (what the check counted)."""
    return rec.at if rec.at is not None else started_at + timedelta(seconds=rec.elapsed_s)


def intended_times(steps: Sequence[Recorded], started_at: datetime) -> list[datetime]:
    """When each recorded decision would have been made without the holds its run had: the
    recorded rate-limit waits and the operators' time on approval requests. A check held at
    a step (a ``wait``, then maybe a ``pending``) is placed where it was first held, and every
    later decision of the run moves back by as much. The estimate plays the draft from these
    times, adding the holds the draft itself makes: otherwise a recording made under a rate
    limit would show its own waits as room, and a draft without it would seem to save
    nothing."""
    removed = timedelta(0)
    held: dict[int, datetime] = {}  # step -> when its check was first held
    out = []
    for rec in steps:
        moment = moment_of(rec, started_at)
        if rec.outcome != WAIT and rec.step in held:
            removed += max(timedelta(0), moment - held.pop(rec.step))
        if rec.outcome in (WAIT, PENDING):
            held.setdefault(rec.step, moment)
        out.append(moment - removed)
    return out


def effect_of(steps: Sequence[Recorded], outcome: Outcome, *, recorded_steps: int,
              recorded_cost: Decimal) -> RunEffect:
    """Where the draft stops a run before its recorded end, the steps after its stop and the
    cost registered after it (the run's recorded cost less what the checks up to that stop
    registered: a wait registers nothing). A run it lets on past its recorded stop changes no
    count here: what the agent would have done next was never recorded."""
    before = recorded_stop(steps)
    if outcome.step is None:
        return RunEffect(let_on=before is not None)
    if before is not None and outcome.step >= before[1]:
        return RunEffect(stopped_otherwise=outcome.stop != before)
    kept = sum((rec.cost_usd for rec in steps if rec.step <= outcome.step
                and rec.outcome != WAIT), Decimal(0))
    return RunEffect(stopped_earlier=True,
                     steps_removed=max(0, recorded_steps - outcome.step),
                     cost_removed=max(Decimal(0), recorded_cost - kept))


def _asks_approval(decision: Decision) -> bool:
    return decision.outcome == PENDING or (
        decision.outcome == WOULD_STOP and (decision.shadow or {}).get("reason")
        == APPROVAL_REQUIRED)


def _scope(rule: RateLimit, run: Hashable, agent: str) -> tuple[Hashable, ...]:
    """Whose actions the rule counts together (SPEC 12 `per`)."""
    if rule.per == "run":
        return ("run", run)
    if rule.per == "agent":
        return ("agent", agent)
    return ("team",)


def rate_limit_waits(draft: Policy,
                     runs: Sequence[tuple[Hashable, str, Sequence[Counted]]], *,
                     max_waits: int = MAX_WAITS, max_work: int = MAX_WORK,
                     played: list[tuple[Hashable, datetime, str]] | None = None,
                     deadlines: Sequence[datetime | None] | None = None,
                     out_of_time: list[tuple[Hashable, datetime, int]] | None = None,
                     ) -> tuple[list[Wait], bool]:
    """The waits the draft's rate limits would answer to ``runs`` ((run, agent, its counted
    actions in time order)), and whether the play got to the end within its bounds.

    Every action is played at its recorded time plus the waits its run already had, earliest
    first across the runs; each rule keeps the ``max`` most recent stamps of each scope,
    which is all `window_of` needs. In shadow mode nothing waits: a would-be wait is counted
    and the action runs at its recorded time (SPEC 12). ``played``, when given, receives
    each action as it was counted: (run, when, name).

    ``deadlines`` (one per run, or None) is when each run's time budget runs out under the
    draft (its start plus ``max_seconds``; the times played are active time, the recorded
    holds taken out): a wait longer than the time left is a stop at once (SPEC 12,
    `rules.wait_past_budget`), and an action its waits pushed past the deadline is stopped
    by the check's max_seconds rule; either way nothing more of that run is played, and
    ``out_of_time``, when given, receives (run, when, the action's step)."""
    if not draft.rate_limits:
        return [], True
    shadow = draft.mode == "shadow"
    heap = [(actions[0].at, index, 0) for index, (_, _, actions) in enumerate(runs) if actions]
    heapq.heapify(heap)
    shift = [timedelta(0)] * len(runs)
    stamps: dict[tuple[RateLimit, tuple[Hashable, ...]], deque[datetime]] = {}
    waits: list[Wait] = []
    work = 0
    while heap:
        now, index, position = heapq.heappop(heap)
        run, agent, actions = runs[index]
        # Nothing waits in shadow mode, so no wait runs a run out of time.
        deadline = None if shadow or deadlines is None else deadlines[index]
        if deadline is not None and now > deadline:
            if out_of_time is not None:
                out_of_time.append((run, now, actions[position].step))
            continue
        # Two equal rules count the same stamps: one window of them is enough.
        scopes = list(dict.fromkeys(
            (rule, _scope(rule, run, agent))
            for rule in rate_limits_matching(draft, actions[position].name)))
        windows: list[RateWindow] = []
        for key in scopes:
            recent = stamps.get(key, ())
            work += len(recent)
            windows.append(window_of(key[0], recent, now))
        limited = rate_wait(windows)
        if limited is not None and deadline is not None and \
                limited[1] > (deadline - now).total_seconds():
            # The check answers stop / max_seconds rather than a wait the run's time cannot
            # cover: no wait, and the run goes no further.
            if out_of_time is not None:
                out_of_time.append((run, now, actions[position].step))
            continue
        if limited is not None:
            waits.append(Wait(run=run, agent=agent, at=now, seconds=limited[1]))
            if len(waits) >= max_waits or work > max_work:
                return waits, False
            if not shadow:
                # The agent sends the same check again after retry_after_s; everything it
                # does afterwards moves by as much.
                delay = timedelta(seconds=limited[1])
                shift[index] += delay
                heapq.heappush(heap, (now + delay, index, position))
                continue
        for rule, scope in scopes:
            stamps.setdefault((rule, scope), deque(maxlen=rule.max)).append(now)
        if played is not None:
            played.append((run, now, actions[position].name))
        if position + 1 < len(actions):
            heapq.heappush(heap, (actions[position + 1].at + shift[index], index,
                                  position + 1))
        if work > max_work:
            return waits, False
    return waits, True


def money(amount: Decimal) -> str:
    """Dollars as the pages write them (the `money` filter): cents always, and up to four
    decimals for fractions of a cent ("$4.20", "$0.009")."""
    text = f"{amount.quantize(Decimal('0.0001'), rounding=ROUND_HALF_UP):,f}"
    whole, _, fraction = text.partition(".")
    return f"${whole}.{fraction.rstrip('0').ljust(2, '0')}"


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n:,} {one if n == 1 else (many or one + 's')}"


@dataclass
class Estimate:
    """The draft's effect over every replayed run and its estimated waits and approval
    requests, per agent and per hour (`as_json`, `summary`)."""

    shadow: bool = False
    runs: int = 0
    effect_stopped_earlier: int = 0
    effect_let_on: int = 0
    effect_stopped_otherwise: int = 0
    steps_removed: int = 0
    cost_removed: Decimal = Decimal(0)
    recorded_waits: int = 0
    recorded_approval_requests: int = 0
    # Runs the draft's rate limits would stop out of time (a wait past the time left).
    out_of_time_stops: int = 0
    # Of those, the runs their recording did not stop there so (run -> the step of the stop):
    # what `policies.impact` counts as stopped by the draft (docs/policies.md).
    out_of_time_changes: dict[Hashable, int] = field(default_factory=dict)
    # The rest: runs whose recorded stop (stop / max_seconds at that step, a wait past the
    # time left) the draft's rate limits make again, though the replay of one run, which
    # cannot see rate limits, let them on. They are no change (`effect_let_on` leaves them
    # out; the selector drops them from the changes).
    reproduced: set[Hashable] = field(default_factory=set)
    total: Tally = field(default_factory=Tally)
    by_agent: dict[str, Tally] = field(default_factory=dict)
    by_hour: dict[str, Tally] = field(default_factory=dict)
    complete: bool = True

    def _tallies(self, agent: str, moment: datetime) -> tuple[Tally, ...]:
        return (self.total, self.by_agent.setdefault(agent, Tally()),
                self.by_hour.setdefault(hour_of(moment), Tally()))

    def as_json(self) -> dict[str, Any]:
        return {
            "effect": {"runs": self.runs, "stopped_earlier": self.effect_stopped_earlier,
                       "let_on": self.effect_let_on,
                       "stopped_otherwise": self.effect_stopped_otherwise,
                       "steps_removed": self.steps_removed,
                       "cost_removed_usd": str(self.cost_removed.quantize(MICRO_USD))},
            "estimate": {
                "shadow": self.shadow, "complete": self.complete,
                **self.total.as_json(), "max_seconds_stops": self.out_of_time_stops,
                "recorded": {"rate_limit_waits": self.recorded_waits,
                             "approval_requests": self.recorded_approval_requests},
                "by_agent": {k: v.as_json() for k, v in sorted(self.by_agent.items())},
                "by_hour": {k: v.as_json() for k, v in sorted(self.by_hour.items())},
            },
            "summary": self.summary(),
        }

    def summary(self) -> str:
        """One line: the runs the draft stops earlier, the steps and cost that removes, the
        stopped runs it lets on, and the waits and approval requests it would cause."""
        if not self.runs:
            return "No ended run to replay: this draft changes nothing that was recorded."
        stopped = self.effect_stopped_earlier
        parts = [f"stop {stopped:,} of {_count(self.runs, 'run')} earlier"
                 + (f", removing {_count(self.steps_removed, 'step')} and "
                    f"{money(self.cost_removed)} of cost" if stopped else "")
                 if stopped else f"stop none of the {_count(self.runs, 'run')} earlier"]
        if self.effect_let_on:
            parts.append(f"let {_count(self.effect_let_on, 'stopped run')} go on")
        if self.effect_stopped_otherwise:
            parts.append(f"stop {_count(self.effect_stopped_otherwise, 'run')} later or for "
                         "another reason")
        about = "~" if self.complete else "at least "
        if self.out_of_time_stops:
            parts.append(f"stop {about}{_count(self.out_of_time_stops, 'run')} out of time "
                         "(max_seconds) where a rate-limit wait would outlast it")
        waits, requests = self.total.rate_limit_waits, self.total.approval_requests
        caused = (f"{about}{_count(waits, 'rate-limit wait')} ({about}"
                  f"{round(self.total.wait_s):,} s of waiting)" if waits else
                  "no rate-limit wait") + " and " + (
            _count(requests, "approval request") if requests else "no approval request")
        if self.shadow:
            parts.append(f"report {caused} without holding any action back (shadow mode)")
        else:
            parts.append(f"cause {caused}")
        return "This draft would " + "; ".join(parts[:-1]) + "; and " + parts[-1] + "."


class Estimator:
    """Collects what each replayed run tells (`add_run`, in any order), then plays the rate
    limits across all of them (`result`). Keeps only the actions some rule of the draft
    matches, so a draft without rate limits keeps nothing per decision."""

    def __init__(self, draft: Policy) -> None:
        self.draft = draft
        self.estimate = Estimate(shadow=draft.mode == "shadow")
        self._counted: list[tuple[Hashable, str, Sequence[Counted]]] = []
        self._deadlines: list[datetime | None] = []
        self._recorded_stops: dict[Hashable, tuple[str, int] | None] = {}
        self._let_on: set[Hashable] = set()

    @property
    def needs_trace(self) -> bool:
        """Whether `add_run` reads the draft's decisions: only a draft with rate limits or
        approvals causes waits or requests, and tracing costs the replay a little."""
        return bool(self.draft.rate_limits or self.draft.approval_tools)

    def add_run(self, *, run: Hashable, agent: str, started_at: datetime,
                steps: Sequence[Recorded], outcome: Outcome, recorded_steps: int,
                recorded_cost: Decimal) -> RunEffect:
        """One run: its recorded decisions and the draft's outcome, replayed with
        ``trace=True`` when `needs_trace` (its decisions are what the draft counts and asks
        approval for)."""
        est = self.estimate
        est.runs += 1
        effect = effect_of(steps, outcome, recorded_steps=recorded_steps,
                           recorded_cost=recorded_cost)
        est.effect_stopped_earlier += effect.stopped_earlier
        est.effect_let_on += effect.let_on
        est.effect_stopped_otherwise += effect.stopped_otherwise
        est.steps_removed += effect.steps_removed
        est.cost_removed += effect.cost_removed
        est.recorded_waits += sum(rec.outcome == WAIT for rec in steps)
        est.recorded_approval_requests += sum(rec.outcome == PENDING for rec in steps)
        counted: list[Counted] = []
        intended = {id(rec): moment for rec, moment in
                    zip(steps, intended_times(steps, started_at), strict=True)} \
            if self.needs_trace else {}
        for rec, decision in (outcome.decisions if self.needs_trace else ()):
            moment = intended.get(id(rec)) or moment_of(rec, started_at)
            if _asks_approval(decision):
                for tally in est._tallies(agent, moment):
                    tally.approval_requests += 1
            if decision.outcome in RATE_COUNTED and rate_limits_matching(self.draft, rec.name):
                counted.append(Counted(at=moment, name=rec.name, step=rec.step))
        if counted:
            counted.sort(key=lambda action: action.at)  # stable: decision order on a tie
            self._counted.append((run, agent, counted))
            self._recorded_stops[run] = recorded_stop(steps)
            if effect.let_on:
                self._let_on.add(run)
            self._deadlines.append(None if self.draft.max_seconds is None else
                                   started_at + timedelta(seconds=float(self.draft.max_seconds)))
        return effect

    def result(self) -> Estimate:
        stopped: list[tuple[Hashable, datetime, int]] = []
        waits, complete = rate_limit_waits(self.draft, self._counted,
                                           deadlines=self._deadlines, out_of_time=stopped)
        est = self.estimate
        est.out_of_time_stops = len(stopped)
        est.out_of_time_changes = {run: step for run, _, step in stopped
                                   if self._recorded_stops.get(run) != ("max_seconds", step)}
        est.reproduced = {run for run, _, _ in stopped
                          if run not in est.out_of_time_changes and run in self._let_on}
        est.effect_let_on -= len(est.reproduced)
        est.complete = complete
        for wait in waits:
            for tally in est._tallies(wait.agent, wait.at):
                tally.rate_limit_waits += 1
                tally.wait_s += wait.seconds
        return est


def estimate(draft: Policy, runs: Iterable[dict[str, Any]]) -> Estimate:
    """`Estimator` over ``runs`` (each the keyword arguments of `Estimator.add_run`)."""
    estimator = Estimator(draft)
    for run in runs:
        estimator.add_run(**run)
    return estimator.result()
