from __future__ import annotations

import threading
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from governance_client import GovernanceClient
from policies.models import Team
from policies.services import agent_key_create
from runs.simulation import simulate


class Command(BaseCommand):
    help = ("Drive realistic agents (normal runs, hard and soft loops, budget overruns, "
            "repeated errors) against the HTTP API, so the dashboard shows live activity.")

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--url", default="http://127.0.0.1:8000")
        parser.add_argument("--key", help="agent key; default: a new key of --team")
        parser.add_argument("--team", default="support")
        parser.add_argument("--agents", type=int, default=3, help="agents running at once")
        parser.add_argument("--runs", type=int, default=0, help="stop after N runs (0: never)")
        parser.add_argument("--pace", type=float, default=1.0, help="seconds between steps")
        parser.add_argument("--seed", type=int, default=1)
        parser.add_argument("--quiet", action="store_true")

    def handle(self, *args: Any, url: str, key: str | None, team: str, agents: int, runs: int,
               pace: float, seed: int, quiet: bool, **options: Any) -> None:
        if agents < 1 or runs < 0 or pace < 0:
            raise CommandError("--agents must be >= 1, --runs and --pace >= 0")
        if key is None:
            team_row = Team.objects.filter(slug=team).first()
            if team_row is None:
                raise CommandError(f"no team {team!r}: run apply_policies first, or pass --key")
            key = agent_key_create(team=team_row, name="simulated agents").token
        stop = threading.Event()

        def log(line: str) -> None:
            if not quiet:
                self.stdout.write(line)

        with GovernanceClient(url, key, timeout=10) as client:
            try:
                counts = simulate(client, agents=agents, runs=runs, pace_s=pace, seed=seed,
                                  stop=stop, log=log)
            except KeyboardInterrupt:
                stop.set()
                return
        self.stdout.write("finished runs: " + ", ".join(f"{k}={v}" for k, v in sorted(
            counts.items())))
