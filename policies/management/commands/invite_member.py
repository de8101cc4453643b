"""`manage.py invite_member --team SLUG --username NAME [--role viewer|operator|admin]
[--base-url URL]`: invite a person to a team; prints their one-time link to join (alone on
the last line), as the Members page's invitation does, and says the same whether the
username has an account or not (policies.services.member_invite)."""

from __future__ import annotations

import os
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from policies.models import Role, Team
from policies.services import member_invite


class Command(BaseCommand):
    help = "Invite someone to a team: prints a one-time link to join."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--team", required=True)
        parser.add_argument("--username", required=True)
        parser.add_argument("--role", default=Role.VIEWER, choices=[r.value for r in Role])
        parser.add_argument("--base-url",
                            default=f"http://127.0.0.1:{os.environ.get('PORT', '8000')}",
                            help="the dashboard's address, for the printed link (default: "
                                 "this machine on $PORT, else 8000, as `make demo` serves)")

    def handle(self, *args: Any, team: str, username: str, role: str, base_url: str,
               **options: Any) -> None:
        found = Team.objects.filter(slug=team).first()
        if found is None:
            raise CommandError(f"No team {team!r}.")
        try:
            invitation = member_invite(team=found, username=username, role=role, actor=None)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"Invited {username} to {found.slug} as {role}. Send them this "
                          "link (valid once, for 3 days) to join, choosing a password or "
                          "signing in to the account they have:")
        self.stdout.write(base_url.rstrip("/") + invitation.path)
