"""The reads of a backtest (SPEC 13): the team's ended runs of one policy and their
decisions, read once, in chunks, then replayed in process by the pure
`governance_client.replay`. No query per decision, and nothing written: no expiry or
idleness is settled by looking (the read takes the rows as they are).
"""

from __future__ import annotations

import itertools
import re
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.db.models import Case, JSONField, Value, When
from django.db.models.fields.json import KT
from django.http import Http404
from django.utils import timezone

from governance_client import estimate as estimates
from governance_client import replay, rules
from policies.models import Policy, PolicyVersion, Team
from runs.check.policy_cache import rules_for_version
from runs.models import Decision, Run

from .models import Backtest

# Runs whose decisions one query reads: big enough that the round trips do not matter,
# small enough that a chunk's rows stay a few megabytes.
CHUNK_RUNS = 500

Progress = Callable[[int, int], None]  # (runs replayed, runs in all)


@dataclass(frozen=True, slots=True)
class RecordedRun:
    id: uuid.UUID
    status: str
    stop_reason: str | None
    steps: int
    started_at: datetime
    policy_version_id: int
    agent: str = ""
    cost_usd: Decimal = Decimal(0)


@dataclass
class Change:
    run_id: str
    recorded: dict[str, Any]
    draft: dict[str, Any]


@dataclass
class Report:
    """The outcome of one backtest; `as_json` is the `--json` line of SPEC 13."""

    policy: str
    runs: int = 0
    changes: list[Change] = field(default_factory=list)
    decisions: int = 0  # recorded decisions read (for the benchmark's rate)
    key_fallbacks: int = 0  # checks whose recorded key stood in for a recomputed one
    # The draft's effect and its estimated rate-limit waits and approval requests
    # (governance_client.estimate); None until the replay is over.
    estimate: estimates.Estimate | None = None

    @property
    def changed(self) -> int:
        return len(self.changes)

    @property
    def by_reason(self) -> dict[str, int]:
        counts = Counter(c.draft["stop_reason"] or "none" for c in self.changes)
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    @property
    def summary(self) -> str:
        """The one-line effect (docs/backtest.md): runs stopped earlier, steps and cost
        removed, rate-limit waits and approval requests caused."""
        return (self.estimate or estimates.Estimate(runs=self.runs)).summary()

    def as_json(self) -> dict[str, Any]:
        # SPEC 13's keys first, as they were; then the effect, the estimate and the summary.
        return {
            "policy": self.policy,
            "runs": self.runs,
            "changed": self.changed,
            "by_reason": self.by_reason,
            "changes": [{"run_id": c.run_id, "recorded": c.recorded, "draft": c.draft}
                        for c in self.changes],
            "not_simulated": list(replay.NOT_SIMULATED),
            **(self.estimate or estimates.Estimate(runs=self.runs)).as_json(),
        }


def policy_of(team: Team, name: str) -> Policy | None:
    return Policy.objects.filter(team=team, name=name).select_related("current").first()


def runs_to_replay(team: Team, policy: Policy, *, since: timedelta, limit: int,
                   now: datetime | None = None) -> list[RecordedRun]:
    """The team's ended runs that used ``policy`` (any of its versions) and started within
    ``since``, newest first, at most ``limit``."""
    cutoff = (now or timezone.now()) - since
    versions = PolicyVersion.objects.filter(policy=policy).values_list("pk", flat=True)
    rows = (Run.objects.filter(team=team, policy_version_id__in=list(versions),
                               status__in=sorted(rules.TERMINAL), started_at__gte=cutoff)
            .order_by("-started_at", "-id")
            .values_list("id", "status", "stop_reason", "steps", "started_at",
                         "policy_version_id", "agent", "cost_usd")[:limit])
    return [RecordedRun(*row) for row in rows]


_DECISION_FIELDS = ("run_id", "outcome", "reason", "step", "action_name", "action_type",
                    "args", "repeat_key", "progress", "last_result", "cost_usd", "elapsed_s",
                    "at", "stop_scope", "stop_message")
# SPEC 20: a stop's scope (SPEC 16's `rule.scope`, where the answer has it) and message, read
# for stops only (a run has one or a few): whether a sub-agent's run was stopped by its tree.
_STOP_ONLY = {"stop_scope": Case(When(outcome=rules.STOP, then=KT("answer__rule__scope")),
                                 default=Value(None)),
              "stop_message": Case(When(outcome=rules.STOP, then=KT("answer__message")),
                                   default=Value(None))}
# The words of a stop by an ancestor's limit (governance_client.rules `_ancestors_stop`).
_ANCESTOR = re.compile(r"^Ancestor run ([0-9a-f-]{36})'s limit")


# A replay of the first step only (`recorded_decisions`' per_run): a check's args and the
# result it reports decide nothing there (no repeat, no progress, no error can have been
# counted before it), and are up to 64 KiB each, so they are not read.
_FIRST_STEP_FIELDS = tuple("no_args" if f == "args" else "no_result" if f == "last_result"
                           else f for f in _DECISION_FIELDS)


def recorded_decisions(runs: list[RecordedRun], *, per_run: int | None = None
                       ) -> Iterator[tuple[RecordedRun, list[replay.Recorded]]]:
    """Each run with its decisions in decision order, CHUNK_RUNS runs per query; or, with
    ``per_run``, each run's first ``per_run`` decisions without their args and results (for
    what a draft decides at the first step), one bounded index range per run."""
    if per_run is not None:
        for run in runs:
            rows = (Decision.objects.filter(run_id=run.id).order_by("id").annotate(
                **_STOP_ONLY, no_args=Value(None, output_field=JSONField()),
                no_result=Value(None, output_field=JSONField()))
                .values_list(*_FIRST_STEP_FIELDS)[:per_run])
            yield run, [_recorded(row, run.started_at) for row in rows]
        return
    for start in range(0, len(runs), CHUNK_RUNS):
        chunk = runs[start:start + CHUNK_RUNS]
        by_id = {run.id: run for run in chunk}
        rows = (Decision.objects.filter(run_id__in=list(by_id)).order_by("run_id", "id")
                .annotate(**_STOP_ONLY)
                .values_list(*_DECISION_FIELDS).iterator(chunk_size=5000))
        found: dict[uuid.UUID, list[replay.Recorded]] = {}
        for run_id, group in itertools.groupby(rows, key=lambda row: row[0]):
            found[run_id] = [_recorded(row, by_id[run_id].started_at) for row in group]
        for run in chunk:
            yield run, found.get(run.id, [])


def _recorded(row: tuple[Any, ...], started_at: datetime) -> replay.Recorded:
    (_, outcome, reason, step, name, type_, args, key, progress, last_result, cost,
     elapsed, at, stop_scope, stop_message) = row
    ancestor = _ANCESTOR.match(stop_message or "")
    scope = stop_scope if stop_scope and stop_scope != "run" else (
        ancestor.group(1) if ancestor else None)
    if elapsed is None:
        # Recorded before decisions carried it (runs migration 0003): the wall-clock time
        # since the start, which is what the check counted while nothing paused a run.
        elapsed = max(0.0, (at - started_at).total_seconds())
    return replay.Recorded(
        outcome=outcome, reason=reason, step=step, name=name, type=type_ or "tool",
        args=args, repeat_key=key, progress=progress,
        last_result=replay.last_result_of(last_result),
        cost_usd=cost if isinstance(cost, Decimal) else Decimal(str(cost)), elapsed_s=elapsed,
        at=at, scope=scope,
    )


def replay_runs(runs: list[RecordedRun], draft: rules.Policy, *, policy: str,
                progress: Progress | None = None, per_run: int | None = None) -> Report:
    """Replay ``runs`` under ``draft`` (pure, in process) and report what would change, with
    the draft's effect and its estimated waits and approval requests (`Report.estimate`).
    ``per_run``: replay each run's first decisions only (`recorded_decisions`)."""
    report = Report(policy=policy, runs=len(runs))
    estimator = estimates.Estimator(draft)
    done = 0
    for run, steps in recorded_decisions(runs, per_run=per_run):
        recorded = rules_for_version(run.policy_version_id)
        # Traced when the estimate reads what the draft decided at each check.
        outcome = replay.replay(draft, steps, started_at=run.started_at, recorded=recorded,
                                trace=estimator.needs_trace)
        estimator.add_run(run=run.id, agent=run.agent, started_at=run.started_at, steps=steps,
                          outcome=outcome, recorded_steps=run.steps,
                          recorded_cost=Decimal(run.cost_usd))
        report.decisions += len(steps)
        report.key_fallbacks += outcome.key_fallbacks
        before = replay.recorded_stop(steps)
        if replay.changed(before, outcome):
            report.changes.append(Change(
                run_id=str(run.id),
                recorded={"status": run.status, "stop_reason": run.stop_reason,
                          "steps": run.steps},
                draft={"status": outcome.status, "stop_reason": outcome.stop_reason,
                       "step": outcome.step},
            ))
        done += 1
        if progress is not None and done % CHUNK_RUNS == 0:
            progress(done, len(runs))
    report.estimate = estimator.result()
    if report.estimate.reproduced:
        # Stops the draft's own rate limits make again (a wait past the time left): the
        # replay of one run, which cannot see rate limits, listed them as let on.
        again = {str(run) for run in report.estimate.reproduced}
        report.changes = [c for c in report.changes if c.run_id not in again]
    if progress is not None:
        progress(done, len(runs))
    return report


def backtest(team: Team, policy: Policy, document: dict[str, Any], *, since: timedelta,
             limit: int, progress: Progress | None = None, per_run: int | None = None
             ) -> Report:
    """SPEC 13: replay the team's ended runs of ``policy`` through the draft ``document``
    (a normalized policy document). ``per_run``: each run's first decisions only."""
    runs = runs_to_replay(team, policy, since=since, limit=limit)
    return replay_runs(runs, rules.Policy.from_document(document), policy=policy.name,
                       progress=progress, per_run=per_run)


def backtest_of(team: Team, job_id: Any) -> Backtest:
    job = Backtest.objects.filter(team=team, pk=job_id).first()
    if job is None:
        raise Http404("No such backtest.")
    return job
