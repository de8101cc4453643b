from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from policies.models import Team
from runs.audit.retention import prune_audit


class Command(BaseCommand):
    help = (
        "Export (JSON lines) and then delete the audit records older than each team's "
        "retention_days: finished runs with their decisions, and operator events. "
        "Running runs are never touched."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--export-dir", type=Path, default=settings.AUDIT_EXPORT_DIR,
                            help="where the exports go, one directory per team "
                                 "(default: %(default)s)")
        parser.add_argument("--team", action="append", dest="teams", metavar="SLUG",
                            help="only this team (repeatable); default: every team")
        parser.add_argument("--dry-run", action="store_true",
                            help="count what would go; write and delete nothing")

    def handle(self, *args: Any, export_dir: Path, teams: list[str] | None, dry_run: bool,
               **options: Any) -> None:
        if teams:
            unknown = set(teams) - set(Team.objects.filter(slug__in=teams)
                                       .values_list("slug", flat=True))
            if unknown:
                raise CommandError(f"no team with slug {', '.join(sorted(unknown))}")
        for r in prune_audit(export_dir=export_dir, teams=teams, dry_run=dry_run):
            verb = "would prune" if dry_run else "pruned"
            line = (f"{r.team}: {verb} {r.runs} runs, {r.decisions} decisions, "
                    f"{r.operator_events} operator events older than {r.cutoff:%Y-%m-%d %H:%M} UTC")
            if r.export is not None:
                line += f" (exported to {r.export})"
            self.stdout.write(line)
