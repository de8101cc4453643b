from __future__ import annotations

import getpass
import uuid
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from policies.models import Team
from runs.killswitch import cover
from runs.killswitch.selectors import covered_running
from runs.killswitch.services import (
    KillSwitchError,
    killswitch_engage,
    killswitch_release,
    resolve_target,
)
from runs.models import Run, Scope


def _operator_label() -> str:
    """Who ran the command, for the audit log: there is no dashboard user here."""
    try:
        user = getpass.getuser()
    except Exception:  # no login name in some containers
        user = "unknown"
    return f"manage.py killswitch ({user})"


class Command(BaseCommand):
    help = (
        "Engage or release a kill switch, with the same effect as the dashboard (SPEC 6, 8). "
        "engage commits before it returns: from then on every check of a covered run answers "
        "stop / killed."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("action", choices=["engage", "release"])
        parser.add_argument("--scope", required=True, choices=Scope.values)
        parser.add_argument("--team", default=None, help="team slug (team and agent scopes)")
        parser.add_argument("--agent", default="", help="agent name (agent scope)")
        parser.add_argument("--run", default=None, help="run id (run scope)")
        parser.add_argument("--reason", required=True, help="why; recorded in the audit log")

    def handle(self, *args: Any, action: str, scope: str, team: str | None, agent: str,
               run: str | None, reason: str, **options: Any) -> None:
        team_row, run_row = self._lookup(scope=scope, team=team, agent=agent, run=run)
        label = _operator_label()
        try:
            if action == "engage":
                self._engage(scope, team_row, agent, run_row, reason, label)
            else:
                self._release(scope, team_row, agent, run_row, reason, label)
        except KillSwitchError as exc:
            raise CommandError(str(exc)) from None

    def _lookup(self, *, scope: str, team: str | None, agent: str, run: str | None
                ) -> tuple[Team | None, Run | None]:
        """Options in the terms of the command line; resolve_target checks the rest."""
        if scope in (Scope.TEAM, Scope.AGENT) and not team:
            raise CommandError(f"--team SLUG is required with --scope {scope}")
        if scope == Scope.AGENT and not agent:
            raise CommandError("--agent NAME is required with --scope agent")
        if scope == Scope.RUN and not run:
            raise CommandError("--run UUID is required with --scope run")
        if scope == Scope.GLOBAL and (team or agent or run):
            raise CommandError("--scope global takes no --team, --agent or --run")
        if scope != Scope.RUN and run:
            raise CommandError(f"--run is only for --scope run, not {scope}")
        team_row = None
        if team:
            team_row = Team.objects.filter(slug=team).first()
            if team_row is None:
                raise CommandError(f"no team with slug {team!r}")
        run_row = None
        if run:
            try:
                run_id = uuid.UUID(run)
            except ValueError:
                raise CommandError(f"--run must be a run id (UUID), not {run!r}") from None
            run_row = Run.objects.select_related("team").filter(pk=run_id).first()
            if run_row is None:
                raise CommandError(f"no run with id {run}")
        return team_row, run_row

    def _engage(self, scope: str, team: Team | None, agent: str, run: Run | None, reason: str,
                label: str) -> None:
        target = resolve_target(scope=scope, team=team, agent=agent, run=run)
        covered = covered_running(target).count()
        switch = killswitch_engage(scope=scope, team=team, agent=agent, run=run, reason=reason,
                                   actor_label=label)
        what = cover.switch_scope_in_words(switch)
        if not switch.engaged_now:
            self.stdout.write(
                f"Already engaged: {what} (switch {switch.pk}), by {switch.engaged_by_label} "
                f"at {switch.engaged_at:%Y-%m-%d %H:%M:%S} UTC: {switch.reason}. Nothing changed."
            )
            return
        self.stdout.write(
            f"Engaged: {what} (switch {switch.pk}). Every check of a covered run now answers "
            f"stop / killed; {covered} running run(s) are being marked killed."
        )

    def _release(self, scope: str, team: Team | None, agent: str, run: Run | None, reason: str,
                 label: str) -> None:
        switch = killswitch_release(scope=scope, team=team, agent=agent, run=run, reason=reason,
                                    actor_label=label)
        what = cover.scope_in_words(scope, team=run.team if run else team, agent=agent,
                                    run_id=run.pk if run else None)
        if switch is None:
            self.stdout.write(f"Not engaged: {what}. Nothing to release.")
            return
        self.stdout.write(
            f"Released: {what} (switch {switch.pk}). New runs may start; killed runs stay killed."
        )
