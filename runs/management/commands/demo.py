from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml
from django.conf import settings
from django.contrib.auth.models import User
from django.core.management import call_command
from django.core.management.base import BaseCommand

from governance_client import GovernanceClient
from policies.models import Role, Team
from policies.services import agent_key_create, membership_set, policy_apply
from runs.simulation import simulate

DEMO_USERS = [("admin", Role.ADMIN, True), ("operator", Role.OPERATOR, False),
              ("viewer", Role.VIEWER, False)]


class Command(BaseCommand):
    help = ("The embedded-default demo: a team, policies, users and an agent key, then the web "
            "server with simulated agents calling it, so the dashboard is live at once.")

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--agents", type=int, default=3)
        parser.add_argument("--no-agents", action="store_true")

    def handle(self, *args: Any, port: int, agents: int, no_agents: bool, **options: Any) -> None:
        document = yaml.safe_load(
            (Path(settings.BASE_DIR) / "examples" / "policies.yaml").read_text())
        for line in policy_apply(data=document, source="demo"):
            self.stdout.write(f"  {line}")
        team = Team.objects.get(slug="support")
        for name, role, superuser in DEMO_USERS:
            user = User.objects.filter(username=name).first() or User.objects.create_user(name)
            user.set_password(f"demo-{name}")
            user.is_superuser = user.is_staff = superuser
            user.save()
            membership_set(team=team, user=user, role=role, actor=None)
        token = agent_key_create(team=team, name="demo key").token
        base = f"http://127.0.0.1:{port}"
        run_id = "python3 -c 'import json,sys; print(json.load(sys.stdin)[\"run_id\"])'"
        check = '{"action": {"name": "search.docs", "args": {"query": "refund policy"}}}'
        lines = [
            "",
            f"Dashboard: {base}/  sign in as admin / demo-admin (superuser),",
            "           operator / demo-operator, or viewer / demo-viewer.",
            f"Agent key (team support): {token}",
            "",
            "Try the check API (the 4th identical call is stopped with loop_detected):",
            f"  KEY={token}",
            f'  RUN=$(curl -s -X POST {base}/api/v1/runs -H "Authorization: Bearer $KEY" \\',
            f"        -d '{{\"agent\": \"curl-demo\"}}' | {run_id})",
            f"  for i in 1 2 3 4; do curl -s -X POST {base}/api/v1/runs/$RUN/check \\",
            f"        -H \"Authorization: Bearer $KEY\" -d '{check}'; echo; done",
            "",
        ]
        self.stdout.write(self.style.SUCCESS("\n".join(lines)))
        if not no_agents:
            threading.Thread(target=self._agents, args=(base, token, agents), daemon=True).start()
        # The static files (htmx, the CSS) are the application's own (WhiteNoise), as under
        # any other server: runserver's own static handler stays off.
        call_command("runserver", f"127.0.0.1:{port}", use_reloader=False)

    def _agents(self, base: str, token: str, agents: int) -> None:
        for _ in range(100):  # wait for the server this process is starting
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        with GovernanceClient(base, token, timeout=10) as client:
            simulate(client, agents=agents, runs=0, pace_s=1.2, seed=int(time.time()),
                     stop=threading.Event(), log=lambda line: None)
