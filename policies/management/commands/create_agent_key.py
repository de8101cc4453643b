from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from governance_client import rules
from policies.models import Team
from policies.services import agent_key_create


class Command(BaseCommand):
    help = "Create an agent key; the key is printed alone on the last line and never again."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--team", required=True)
        parser.add_argument("--name", required=True)
        parser.add_argument("--agent", default="", help="only runs of this agent name")

    def handle(self, *args: Any, team: str, name: str, agent: str, **options: Any) -> None:
        team_row = Team.objects.filter(slug=team).first()
        if team_row is None:
            raise CommandError(f"no team with slug {team!r}")
        if not name.strip() or len(name) > 100:
            raise CommandError("--name must be 1 to 100 characters")
        if agent and not rules.AGENT_NAME.fullmatch(agent):
            raise CommandError(f"--agent must match {rules.AGENT_NAME_PATTERN}")
        new = agent_key_create(team=team_row, name=name.strip(), agent=agent)
        scope = f" for agent {agent}" if agent else ""
        self.stdout.write(f"Created key {name!r} (prefix {new.key.prefix}) in team {team}{scope}.")
        self.stdout.write(new.token)
