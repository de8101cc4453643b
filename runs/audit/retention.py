"""Retention of the audit logs: export, then delete, what is older than a team's
``retention_days`` (docs/reliability.md).

The audit tables are append-only in the database (runs/migrations/0002_audit_append_only.py);
this module holds the one controlled way past that guard, ``audit_maintenance()``. What goes:

- runs that are over (stopped, killed, completed, failed) and ended before the cutoff, with
  all their decisions: a run and its audit trail leave together, so no run is ever left with
  counters its audit log cannot explain;
- the team's operator events older than the cutoff.

A running run is never touched, however old. Every record is written to a JSON-lines file and
fsynced before the transaction that deletes it commits, so a crash loses nothing: at worst the
next prune exports a batch a second time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import IO, Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import connections, transaction
from django.utils import timezone
from governance_client.rules import TERMINAL

from policies.models import GLOBAL_EVENT_ACTIONS, OperatorEvent, Team
from runs.models import Decision, Run

MAINTENANCE_SETTING = "governance.audit_maintenance"
BATCH = 500


@contextmanager
def audit_maintenance(using: str = "default") -> Iterator[None]:
    """A transaction in which the audit tables accept DELETE and TRUNCATE (never UPDATE).

    The setting is transaction-local (``set_config(..., true)``, i.e. SET LOCAL): it cannot
    leak to later work on the same pooled connection. It is switched off again before the
    block ends, so that inside a caller's larger transaction it covers this block only.
    """
    connection = connections[using]
    with transaction.atomic(using=using):
        if connection.vendor != "postgresql":
            yield  # SQLite has no triggers to open (see the migration)
            return
        with connection.cursor() as cursor:
            cursor.execute("SELECT set_config(%s, 'on', true)", [MAINTENANCE_SETTING])
        yield
        with connection.cursor() as cursor:
            cursor.execute("SELECT set_config(%s, 'off', true)", [MAINTENANCE_SETTING])


@dataclass
class PruneResult:
    team: str
    cutoff: datetime
    runs: int = 0
    decisions: int = 0
    operator_events: int = 0
    export: Path | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"team": self.team, "cutoff": self.cutoff.isoformat(), "runs": self.runs,
                "decisions": self.decisions, "operator_events": self.operator_events,
                "export": str(self.export) if self.export else None}


@dataclass
class _Export:
    """The team's export file, created on the first record so an empty prune leaves none."""

    directory: Path
    stamp: str
    path: Path | None = None
    _file: IO[str] | None = field(default=None, repr=False)

    def write(self, kind: str, record: dict[str, Any]) -> None:
        if self._file is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.path, self._file = _create_unique(self.directory, f"audit-{self.stamp}")
        line = json.dumps({"kind": kind, **record}, cls=DjangoJSONEncoder, ensure_ascii=False)
        self._file.write(line + "\n")

    def sync(self) -> None:
        """Durable before the deleting transaction commits."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _create_unique(directory: Path, stem: str) -> tuple[Path, IO[str]]:
    # Never append to or overwrite an earlier export: two prunes in one second get two files.
    for n in range(1, 1000):
        path = directory / (f"{stem}.jsonl" if n == 1 else f"{stem}-{n}.jsonl")
        try:
            return path, path.open("x", encoding="utf-8")
        except FileExistsError:
            continue
    raise FileExistsError(f"no free export file name for {stem} in {directory}")


def _run_record(run: Run, team: str) -> dict[str, Any]:
    return {
        "team": team, "run_id": run.pk, "agent": run.agent, "status": run.status,
        "stop_reason": run.stop_reason, "steps": run.steps, "tool_calls": run.tool_calls,
        "cost_usd": run.cost_usd, "started_at": run.started_at, "ended_at": run.ended_at,
        "finished_at": run.finished_at, "policy_version_id": run.policy_version_id,
        "task": run.task, "metadata": run.metadata, "external_id": run.external_id,
        "output": run.output,
    }


def _decision_record(d: Decision) -> dict[str, Any]:
    # Every column, in the model's order: the export is the whole audit record.
    return {f.attname: getattr(d, f.attname) for f in Decision._meta.concrete_fields}


def _event_record(e: OperatorEvent) -> dict[str, Any]:
    return {
        "id": e.pk, "team_id": e.team_id, "actor_id": e.actor_id, "actor_label": e.actor_label,
        "action": e.action, "target": e.target, "detail": e.detail, "at": e.at,
    }


def prunable_runs(team: Team, cutoff: datetime) -> Any:
    """The team's runs whose records may go: over, and ended before the cutoff."""
    return Run.objects.filter(team=team, status__in=TERMINAL, ended_at__lt=cutoff)


def prune_team(*, team: Team, export_dir: Path, now: datetime, dry_run: bool = False,
               batch: int = BATCH) -> PruneResult:
    cutoff = now - timedelta(days=team.retention_days)
    result = PruneResult(team=team.slug, cutoff=cutoff)
    events = OperatorEvent.objects.filter(team=team, at__lt=cutoff)
    if dry_run:
        runs = prunable_runs(team, cutoff)
        result.runs = runs.count()
        result.decisions = Decision.objects.filter(run__in=runs).count()
        result.operator_events = events.count()
        return result

    export = _Export(directory=export_dir / team.slug, stamp=now.strftime("%Y%m%dT%H%M%SZ"))
    try:
        while True:
            with audit_maintenance():
                # Locked before anything is read: a late check of one of these runs (a
                # terminal run's check is still audited) waits, then finds no run (404),
                # so no decision can slip in between the export and the delete.
                runs = list(prunable_runs(team, cutoff).select_for_update()
                            .order_by("ended_at", "id")[:batch])
                if not runs:
                    break
                ids = [run.pk for run in runs]
                for run in runs:
                    export.write("run", _run_record(run, team.slug))
                decisions = Decision.objects.filter(run_id__in=ids).order_by("run_id", "id")
                for decision in decisions.iterator(chunk_size=2000):
                    export.write("decision", _decision_record(decision))
                    result.decisions += 1
                export.sync()
                Decision.objects.filter(run_id__in=ids).delete()
                Run.objects.filter(pk__in=ids).delete()
                result.runs += len(ids)
        result.operator_events += _prune_events(events, export, batch)
    finally:
        export.close()
    result.export = export.path
    return result


def _prune_events(events: Any, export: _Export, batch: int) -> int:
    """Export, then delete, these operator events, ``batch`` at a time; how many."""
    pruned = 0
    while True:
        with audit_maintenance():
            rows = list(events.order_by("id")[:batch])
            if not rows:
                return pruned
            for event in rows:
                export.write("operator_event", _event_record(event))
            export.sync()
            OperatorEvent.objects.filter(pk__in=[e.pk for e in rows]).delete()
            pruned += len(rows)


NO_TEAM = "(no team)"
NO_TEAM_DIR = "_no-team"


def prune_without_team(*, export_dir: Path, now: datetime, dry_run: bool = False,
                       batch: int = BATCH) -> PruneResult:
    """The operator events without a team that are a person's, not every team's (a token for
    all of its owner's teams reading, SSO's account events), past the longest retention of
    any team (90 days without a team): they grew without end, a row a read. The global kill
    switch's events (GLOBAL_EVENT_ACTIONS) are every team's history and stay."""
    days = max(Team.objects.values_list("retention_days", flat=True), default=90)
    cutoff = now - timedelta(days=days)
    result = PruneResult(team=NO_TEAM, cutoff=cutoff)
    events = OperatorEvent.objects.filter(team__isnull=True, at__lt=cutoff).exclude(
        action__in=GLOBAL_EVENT_ACTIONS)
    if dry_run:
        result.operator_events = events.count()
        return result
    export = _Export(directory=export_dir / NO_TEAM_DIR, stamp=now.strftime("%Y%m%dT%H%M%SZ"))
    try:
        result.operator_events += _prune_events(events, export, batch)
    finally:
        export.close()
    result.export = export.path
    return result


def prune_audit(*, export_dir: Path, now: datetime | None = None,
                teams: Iterable[str] | None = None, dry_run: bool = False) -> list[PruneResult]:
    """Prune every team (or the named ones), each by its own retention_days; with every
    team, the events without a team that are a person's too (`prune_without_team`)."""
    now = now or timezone.now()
    selected = Team.objects.order_by("slug")
    if teams is not None:
        selected = selected.filter(slug__in=list(teams))
    results = [prune_team(team=team, export_dir=export_dir, now=now, dry_run=dry_run)
               for team in selected]
    if teams is None:
        results.append(prune_without_team(export_dir=export_dir, now=now, dry_run=dry_run))
    return results
