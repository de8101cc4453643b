"""Backtest (SPEC 13): what a draft policy would have decided on a recorded run. Pure.

Recorded decisions in, the draft's outcome out: each recorded check is decided again by
`rules.evaluate`, the function the check itself calls, fed with what the audit record holds
(action name and type, repeat key and args, progress, result, cost, and the run's elapsed
seconds as the check counted them). Nothing here touches Django, the database or a clock,
so a replay is exact and as fast as the rules (the server's selector does the one read).

What is not the draft's to decide is replayed as recorded:

- a kill switch: a check that was answered ``killed`` is decided again with the kill, and a
  kill without an action (the fan-out) ends the replay where it happened;
- operators' and the system's decisions: an approval's outcome (approved, denied, expired),
  an abandonment, the sweep's end of a run out of time;
- recorded waits (rate limits) and checks that expired before they were decided (a
  ``deadline_ms`` past) are skipped: they registered nothing;
- steps the run counted that are not its own checks, its sub-agents' (SPEC 20: a
  descendant's check counts on each ancestor), are counted where they were: a recorded
  check whose step is past the replay's next one brings the replay's steps up to it, so a
  parent's step limit and its stops fall at the steps they fell at;
- everything after the recorded run's first stop is skipped: the agent stopped there;
- a sub-agent's run stopped by its tree (SPEC 20: ``parent_stopped``, or an ancestor's
  limit, ``scope`` naming the ancestor) is replayed as its tree recorded it: the draft (the
  child's policy) decides that check first, and if it would not stop it there, the run ends
  there with the tree's reason. The ancestors' policies are not the draft's to change.

The draft's own rate limits and approvals are not simulated (`NOT_SIMULATED`): they depend
on other runs and on people, which a recording of one run cannot tell. `estimate.py` counts
them instead, over all the replayed runs' recorded times.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from .keys import repeat_key
from .rules import (
    AGENT_STOPPED,
    ALLOW,
    EXPIRED,
    KILLED,
    PARENT_STOPPED,
    RUN_FINISHED,
    STOP,
    STOPPED,
    TERMINAL,
    Check,
    Decision,
    LastResult,
    Policy,
    RunState,
    evaluate,
)

WAIT = "wait"  # SPEC 12: registered nothing, decided again when sent again
PENDING = "pending"  # SPEC 11: the check waits for an operator's decision

# Stops that are not the policy's to decide: replayed where and as they happened.
AS_RECORDED = frozenset({"killed", "abandoned", "approval_denied", "approval_expired"})
# Answers to a check of a run that was already over (finished by its agent): the recorded
# run ended before them, no policy stopped it.
RUN_OVER = frozenset({RUN_FINISHED, AGENT_STOPPED})
# The sweep's end of a run whose time budget ran out with no check (SPEC 14, issue 26): a
# record without an action, replayed as recorded like an abandonment (its agent had gone
# silent, so the run ends at that step under any draft). A check's own max_seconds stop
# names its action and is the draft's to decide.
OUT_OF_TIME = "max_seconds"
NOT_SIMULATED = ("rate_limits", "approvals", "max_idle_seconds")
REPLAYED_KILL = "a kill switch (replayed as recorded)"


@dataclass(frozen=True, slots=True)
class Recorded:
    """One audit record of a run, as the replay reads it (runs.models.Decision)."""

    outcome: str
    reason: str
    step: int
    name: str  # "" for a decision without an action: a fan-out kill, an abandonment
    type: str = "tool"
    args: Mapping[str, Any] | None = None  # as stored: redacted per the run's policy
    repeat_key: str = ""  # computed by the check from the args before redaction
    progress: str | int | float | None = None
    last_result: LastResult | None = None
    cost_usd: Decimal = Decimal(0)
    elapsed_s: float = 0.0  # seconds since the run's start, as the check counted them
    # When it was decided (the check's clock): the estimate of the draft's rate limits and
    # approvals reads it (estimate.py). None: unknown.
    at: datetime | None = None
    # SPEC 20: the ancestor whose limit stopped this check (a stop of a sub-agent's run by
    # its tree), else None.
    scope: str | None = None


@dataclass(frozen=True, slots=True)
class Outcome:
    """Where and why the draft stops the run; all None when it would not stop it."""

    status: str | None = None  # stopped | killed
    stop_reason: str | None = None
    step: int | None = None
    # (recorded, the draft's decision) for every check the draft decided, when traced.
    decisions: tuple[tuple[Recorded, Decision], ...] = field(default=())
    # Checks whose recorded key stood in for the draft's, a redacted arg being part of it.
    key_fallbacks: int = 0

    @property
    def stop(self) -> tuple[str, int] | None:
        return None if self.stop_reason is None or self.step is None else (
            self.stop_reason, self.step)


def last_result_of(value: Mapping[str, Any] | None) -> LastResult | None:
    """The check's ``last_result`` as recorded (the request's object) for the rules."""
    if not value or "status" not in value:
        return None
    return LastResult(status=value["status"], digest=value.get("digest"),
                      error=value.get("error"), summary=value.get("summary"))


def recorded_stop(steps: Iterable[Recorded]) -> tuple[str, int] | None:
    """(reason, step) of the recorded run's first stop, or None when nothing stopped it (it
    completed, failed, or its agent stopped it)."""
    for rec in steps:
        if rec.outcome == STOP:
            return None if rec.reason in RUN_OVER else (rec.reason, rec.step)
    return None


def _hides_key_input(args: Mapping[str, Any], redacted: frozenset[str],
                     ignored: frozenset[str]) -> bool:
    """Whether a redacted value of the stored args would be part of the draft's key: then
    the key cannot be recomputed. A redacted top-level arg the draft ignores is dropped
    before keying anyway, so it hides nothing."""
    for name, value in args.items():
        if name in ignored:
            continue
        if str(name).lower() in redacted or _nested_redaction(value, redacted):
            return True
    return False


def _nested_redaction(value: Any, redacted: frozenset[str]) -> bool:
    if isinstance(value, Mapping):
        return any(str(k).lower() in redacted or _nested_redaction(v, redacted)
                   for k, v in value.items())
    if isinstance(value, list):
        return any(_nested_redaction(v, redacted) for v in value)
    return False


class KeyReplay:
    """The repeat key of each recorded check under the draft's ``ignore_args`` (SPEC 13).

    The same ``ignore_args`` as the recording: the recorded key, exact whatever was
    redacted. Others: the key recomputed from the recorded args, except where a redacted
    value would be part of it; there the recorded key is used (docs/backtest.md).
    """

    def __init__(self, draft: Policy, recorded: Policy) -> None:
        self.same = frozenset(draft.ignore_args) == frozenset(recorded.ignore_args)
        self.ignored = frozenset(draft.ignore_args)
        self.redacted = frozenset(n.lower() for n in recorded.redact_args)
        self.draft_ignore = draft.ignore_args
        self.fallbacks = 0  # checks whose recorded key stood in for a recomputed one

    def __call__(self, rec: Recorded) -> str:
        if self.same and rec.repeat_key:
            return rec.repeat_key
        args = rec.args or {}
        if rec.repeat_key and _hides_key_input(args, self.redacted, self.ignored):
            self.fallbacks += 1
            return rec.repeat_key
        return repeat_key(rec.name, args, self.draft_ignore)


def replay(draft: Policy, steps: Iterable[Recorded], *, started_at: datetime,
           recorded: Policy, trace: bool = False) -> Outcome:
    """Decide the recorded run's checks again under ``draft``; ``recorded`` is the policy
    version the run ran with (its ``ignore_args`` made the recorded keys, its
    ``redact_args`` the stored args)."""
    keys = KeyReplay(draft, recorded)
    state = RunState(started_at=started_at)
    decided: list[tuple[Recorded, Decision]] = []
    awaiting: int | None = None  # the step of a pending check whose outcome comes next

    def ended(status: str, reason: str, step: int) -> Outcome:
        return Outcome(status=status, stop_reason=reason, step=step, decisions=tuple(decided),
                       key_fallbacks=keys.fallbacks)

    for rec in steps:
        if rec.outcome in (WAIT, EXPIRED):
            continue
        if awaiting is not None:
            waited, awaiting = awaiting, None
            if rec.step == waited and rec.outcome in (ALLOW, STOP):
                # The operator's (or the expiry's, or a kill's) answer to the pending check,
                # as recorded. Approved: the draft's evaluation already counted it allowed.
                if rec.outcome == STOP:
                    if rec.reason in RUN_OVER:
                        break
                    return ended(KILLED if rec.reason == "killed" else STOPPED, rec.reason,
                                 state.steps)
                continue
        if rec.outcome == STOP and rec.reason in RUN_OVER:
            break
        if rec.outcome == STOP and (
                (rec.reason in AS_RECORDED and not (rec.reason == "killed" and rec.name))
                or (rec.reason in (OUT_OF_TIME, PARENT_STOPPED) and not rec.name)):
            # A fan-out kill, an abandonment, the sweep's end of a run out of time, a
            # finish's end of a sub-agent whose tree was over, an approval outcome seen on
            # its own: no check was decided, the step does not move.
            # Its step is the run's count as recorded, its sub-agents' checks since its own
            # last one included (SPEC 20), as the replay counts them before a check.
            return ended(KILLED if rec.reason == "killed" else STOPPED, rec.reason,
                         max(state.steps, rec.step))
        if rec.step - 1 > state.steps:
            # Its sub-agents' checks, counted on this run between its own (SPEC 20).
            state = replace(state, steps=rec.step - 1)
        check = Check(name=rec.name, type=rec.type, args=rec.args or {},
                      progress=rec.progress, last_result=rec.last_result,
                      cost_usd=rec.cost_usd)
        kill = REPLAYED_KILL if rec.outcome == STOP and rec.reason == "killed" else None
        decision, state = evaluate(
            draft, state, check, now=started_at + timedelta(seconds=rec.elapsed_s),
            kill=kill, key=keys(rec),
            # A retry of a check_id the run had counted, stopped by a switch or its tree
            # (its step did not move): it counts nothing again here either.
            retry=rec.outcome == STOP and 0 < rec.step <= state.steps,
        )
        if trace:
            decided.append((rec, decision))
        if state.status in TERMINAL:
            return ended(state.status, decision.reason, decision.step)
        if rec.outcome == STOP and (rec.reason == PARENT_STOPPED or rec.scope):
            # The tree stopped it, as recorded: not the draft's to undo (SPEC 20).
            return ended(STOPPED, rec.reason, decision.step)
        if rec.outcome == PENDING:
            awaiting = rec.step
        elif rec.outcome == STOP:
            break  # the recorded run's first stop: its agent made no further check
    return Outcome(decisions=tuple(decided), key_fallbacks=keys.fallbacks)


def changed(recorded: tuple[str, int] | None, draft: Outcome) -> bool:
    """SPEC 13: another step, another reason, or no stop where there was one (or the
    reverse)."""
    return recorded != draft.stop
