"""`make demo`: the embedded-default demo, safe to run again on a used checkout.

The setup only creates what is missing: the example teams and policies, the demo users (with
their demo passwords) and their memberships, and one demo agent key. A policy an operator
edited, a password or role someone changed, the sessions of people signed in and every key
are left as they are, so running the demo again never undoes work done in the dashboard.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from django.conf import settings
from django.contrib.auth.models import User
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from governance_client import GovernanceClient
from policies.document import load_yaml, parse_document
from policies.models import AgentKey, Membership, Policy, Role, Team
from policies.services import (
    agent_key_claim,
    agent_key_create,
    membership_set,
    policy_save,
    team_ensure,
)
from runs.simulation import simulate

DEMO_USERS = [("admin", Role.ADMIN, True), ("operator", Role.OPERATOR, False),
              ("viewer", Role.VIEWER, False)]
DEMO_TEAM = "support"
DEMO_KEY_NAME = "demo key"


def demo_key_file() -> Path:
    """Where the demo key's token is kept between runs (git-ignored, readable by its owner
    only): the database keeps only the key's hash, and a second `make demo` must print a key
    that works without minting another one. ``DEMO_KEY_FILE`` moves it (tests do)."""
    return Path(os.environ.get("DEMO_KEY_FILE") or Path(settings.BASE_DIR) / ".demo-agent-key")


@dataclass
class DemoSetup:
    token: str
    created: list[str] = field(default_factory=list)  # what this run added
    kept_passwords: list[str] = field(default_factory=list)  # existing users left alone


def _live_demo_token(team: Team) -> str | None:
    """The saved demo token if it is still a valid, unrevoked key of the demo team."""
    path = demo_key_file()
    try:
        token = path.read_text().strip()
    except OSError:
        return None
    claim = agent_key_claim(token)
    if claim is None:
        return None
    ok = AgentKey.objects.filter(team=team, prefix=claim.prefix, key_hash=claim.digest,
                                 revoked_at__isnull=True).exists()
    return token if ok else None


def _save_token(token: str) -> None:
    path = demo_key_file()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(token + "\n")


@transaction.atomic
def demo_setup() -> DemoSetup:
    """Create what the demo needs and is missing; change nothing that exists."""
    document = load_yaml(
        (Path(settings.BASE_DIR) / "examples" / "policies.yaml").read_bytes())
    created: list[str] = []
    for doc in parse_document(document):
        team, new_team = team_ensure(slug=doc["slug"], name=doc["name"] or doc["slug"],
                                     with_default=False)
        if new_team:
            created.append(f"team {team.slug}")
        for policy in doc["policies"]:
            # An existing policy is the operator's now, whatever its version says.
            if not Policy.objects.filter(team=team, name=policy["name"]).exists():
                policy_save(team=team, document=policy, actor=None, source="demo")
                created.append(f"policy {team.slug}/{policy['name']}")
        team_ensure(slug=team.slug)  # the `default` policy, if the file named none
    team = Team.objects.get(slug=DEMO_TEAM)
    kept: list[str] = []
    for name, role, superuser in DEMO_USERS:
        user = User.objects.filter(username=name).first()
        if user is None:
            # A new password only for a new user: setting it again would sign everyone out.
            user = User.objects.create_user(name, password=f"demo-{name}",
                                            is_superuser=superuser, is_staff=superuser)
            created.append(f"user {name}")
        else:
            kept.append(name)
        if not Membership.objects.filter(team=team, user=user).exists():
            membership_set(team=team, user=user, role=role, actor=None)
    token = _live_demo_token(team)
    if token is None:
        token = agent_key_create(team=team, name=DEMO_KEY_NAME).token
        _save_token(token)
        created.append("agent key")
    return DemoSetup(token=token, created=created, kept_passwords=kept)


def port_from_env(default: int = 8000) -> int:
    raw = os.environ.get("PORT", "").strip()
    if not raw:
        return default
    if not (raw.isascii() and raw.isdigit()) or not 0 < int(raw) < 65536:
        raise CommandError(f"PORT={raw!r} is not a port number (1-65535).")
    return int(raw)


def port_problem(host: str, port: int) -> str | None:
    """Why the server could not listen there, or None. Checked before anything is printed
    or created, so a taken port is the first and only thing the demo says."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # The dev server sets SO_REUSEADDR too: a port left in TIME_WAIT by the last demo is free.
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        probe.bind((host, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            free = next((p for p in range(port + 1, min(port + 50, 65536))
                         if _bindable(host, p)), None)
            suggestion = f"PORT={free} make demo" if free else "another PORT=... make demo"
            return (f"Port {port} is already in use (another demo or server?). Stop it, or "
                    f"choose another port: {suggestion}")
        return f"Cannot listen on {host}:{port}: {exc.strerror}."
    finally:
        probe.close()
    return None


def _bindable(host: str, port: int) -> bool:
    """Whether a port is free now: the one the message suggests was taken too, once."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


class QuietAgentTraffic(logging.Filter):
    """The dev server logs every request; the simulated agents' successful API calls (and
    the dashboard's streams) would bury everything else. Pages and errors are still logged."""

    QUIET = (" /api/v1/", " /healthz", " /static/")

    def filter(self, record: logging.LogRecord) -> bool:
        status = getattr(record, "status_code", 0) or 0
        args = record.args if isinstance(record.args, tuple) else ()
        line = str(args[0]) if args else ""
        routine = any(q in line for q in self.QUIET) or "/stream" in line or "/live?" in line
        return status >= 400 or not routine


def demo_logins(base: str, password_login: str) -> list[str]:
    """The printout's sign-in lines, for ``OIDC_PASSWORD_LOGIN`` (``all`` without SSO)."""
    logins = [
        f"Dashboard: {base}/  sign in as admin / demo-admin (superuser),",
        "           operator / demo-operator, or viewer / demo-viewer.",
    ]
    if password_login == "off":
        # No password form at all: admin signs in with SSO too, as anyone the role map
        # covers (found by a review: the printout still offered admin / demo-admin).
        return [f"Dashboard: {base}/  SSO is on and password sign-in is off "
                "(OIDC_PASSWORD_LOGIN=off): the demo's",
                "           admin, operator and viewer (password accounts) cannot sign in: "
                "sign in with SSO as",
                "           someone whose groups OIDC_ROLE_MAP maps, or start again with "
                "OIDC_PASSWORD_LOGIN=all."]
    if password_login != "all":
        # With SSO on, the password form signs in superusers only (docs/sso.md): the other
        # two logins would be refused (found by a newcomer). Nor can they sign in with SSO:
        # they are password accounts, and SSO finds people by (issuer, sub), never by name;
        # "so operator and viewer sign in with SSO" sent a newcomer to the provider as
        # `operator`, who was refused for having no mapped group (found by a newcomer too).
        logins[1:] = [
            "           SSO is on: password sign-in is "
            f"{password_login} (OIDC_PASSWORD_LOGIN), so the demo's",
            "           operator and viewer (password accounts) cannot sign in: sign in with "
            "SSO as",
            "           someone whose groups OIDC_ROLE_MAP maps, or start again with "
            "OIDC_PASSWORD_LOGIN=all."]
    return logins


class Command(BaseCommand):
    help = ("The embedded-default demo: the database migrated, a team, policies, users and an "
            "agent key (only those missing), then the web server with simulated agents "
            "calling it, so the dashboard is live at once. The port is --port, else $PORT, "
            "else 8000.")

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--port", type=int, default=None)
        parser.add_argument("--agents", type=int, default=3)
        parser.add_argument("--no-agents", action="store_true")

    def handle(self, *args: Any, port: int | None, agents: int, no_agents: bool,
               **options: Any) -> None:
        port = port if port is not None else port_from_env()
        problem = port_problem("127.0.0.1", port)
        if problem:
            raise CommandError(problem)
        # Here rather than a separate `manage.py migrate`: a fresh clone's first command
        # starts Django once. Nothing to do on a migrated database.
        call_command("migrate", interactive=False, verbosity=0)
        setup = demo_setup()
        if setup.created:
            self.stdout.write("  created: " + ", ".join(setup.created))
        else:
            self.stdout.write("  everything was already there: nothing changed")
        base = f"http://127.0.0.1:{port}"
        token = setup.token
        run_id = "python3 -c 'import json,sys; print(json.load(sys.stdin)[\"run_id\"])'"
        check = '{"action": {"name": "search.docs", "args": {"query": "refund policy"}}}'
        logins = demo_logins(base, settings.OIDC_PASSWORD_LOGIN)
        if setup.kept_passwords:
            logins.append("           (" + ", ".join(setup.kept_passwords) + " already "
                          "existed: their passwords were left as they are.)")
        lines = [
            "",
            *logins,
            f"Agent key (team {DEMO_TEAM}): {token}",
            "",
            "Try the check API (the 4th identical call is stopped with loop_detected):",
            f"  KEY={token}",
            f'  RUN=$(curl -s -X POST {base}/api/v1/runs -H "Authorization: Bearer $KEY" \\',
            f"        -d '{{\"agent\": \"curl-demo\"}}' | {run_id})",
            f"  for i in 1 2 3 4; do curl -s -X POST {base}/api/v1/runs/$RUN/check \\",
            f"        -H \"Authorization: Bearer $KEY\" -d '{check}'; echo; done",
            "",
        ]
        if not settings.WEBHOOK_ALLOWED_HOSTS:
            # A newcomer's receiver on this machine was refused as not public, and only a
            # restart with the setting let it in: said before they try.
            lines[-1:] = [
                "Kill-switch webhooks go to public addresses only: to try one with a receiver",
                f"on this machine, start again with WEBHOOK_ALLOWED_HOSTS=127.0.0.1 PORT={port}"
                " make demo.", ""]
        self.stdout.write(self.style.SUCCESS("\n".join(lines)))
        logging.getLogger("django.server").addFilter(QuietAgentTraffic())
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
