from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from governance.errors import AppError
from policies.models import Role, Team
from policies.tokens import operator_token_create, token_role, token_teams


class Command(BaseCommand):
    help = ("Create an operator token for automation (SPEC 17); the token is printed alone on "
            "the last line and never again.")

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--user", required=True, help="the token's owner (username)")
        parser.add_argument("--team", default=None, help="only this team (slug)")
        parser.add_argument("--role", required=True, choices=Role.values)
        parser.add_argument("--name", default=None, help="default: automation")
        parser.add_argument("--expires-days", type=int, default=None, dest="expires_days")

    def handle(self, *args: Any, user: str, team: str | None, role: str, name: str | None,
               expires_days: int | None, **options: Any) -> None:
        owner = get_user_model().objects.filter(username=user).first()
        if owner is None:
            raise CommandError(f"no user named {user!r}")
        team_row = None
        if team is not None:
            team_row = Team.objects.filter(slug=team).first()
            if team_row is None:
                raise CommandError(f"no team with slug {team!r}")
        try:
            new = operator_token_create(user=owner, name=name or "automation", role=role,
                                        team=team_row, expires_days=expires_days)
        except AppError as exc:
            raise CommandError(exc.message) from None
        if team:
            where = f"team {team}"
        elif getattr(new.token.user, "is_superuser", False):
            # A superuser is a member of no team: "every team of the owner" read as none.
            where = ("every team, as a superuser (the global kill switch too)" if role == "admin"
                     else f"every team, as {_a(role)} (a superuser's token acts as a superuser "
                          "only with the admin role)")
        else:
            where = "every team of the owner"
        expiry = (f", expires {new.token.expires_at:%Y-%m-%d %H:%M} UTC"
                  if new.token.expires_at else "")
        self.stdout.write(f"Created operator token {new.token.name!r} (prefix "
                          f"{new.token.prefix}) for {user}, role {role}, {where}{expiry}.")
        # The token acts with the lesser of the two roles: say so now, not at the first 403
        # of the automation it was made for (for every team of the owner too: found by a
        # newcomer, whose token for every team said nothing).
        if not owner.is_active:
            # A token that can never work, made without a word (found by a newcomer, whose
            # govctl then answered "A valid operator token is required").
            self.stderr.write(f"Note: {user}'s account is deactivated, so this token is "
                              "refused (401) until an administrator reactivates it.")
        elif team_row is not None:
            acts = token_role(new.token, team_row)
            if acts != role:
                self.stderr.write(
                    f"Note: {user} is {'not a member' if acts is None else _a(acts)} of "
                    f"team {team}, so this token acts there as "
                    f"{'nobody (404)' if acts is None else _a(acts)}, not as {_a(role)}.")
        elif not (teams := token_teams(new.token)):
            self.stderr.write(f"Note: {user} is a member of no team, so this token sees "
                              "nothing until they join one.")
        elif lesser := [(t.slug, acts) for t in teams
                        if (acts := token_role(new.token, t)) not in (None, role)]:
            roles = ", ".join(f"{_a(acts)} of team {slug}" for slug, acts in lesser)
            self.stderr.write(f"Note: {user} is {roles}, so this token acts there with that "
                              f"role, not as {_a(role)}.")
        self.stdout.write(new.secret)


def _a(role: str) -> str:
    return f"an {role}" if role[0] in "aeiou" else f"a {role}"
