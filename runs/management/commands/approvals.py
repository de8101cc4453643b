from __future__ import annotations

import getpass
import uuid
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from policies.access import can, role_in
from policies.models import Role, Team
from runs import due
from runs.approvals.selectors import approvals_for_team, iso
from runs.approvals.services import ApprovalError, approval_decide, settle_due_for_team


def _shell_label() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # no login name in some containers
        user = "unknown"
    return f"manage.py approvals ({user})"


class Command(BaseCommand):
    help = (
        "List a team's approval requests, or approve / deny one (SPEC 11), with the same "
        "effect as the dashboard: the waiting agent gets the final answer at once."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        listing = sub.add_parser("list", help="pending first, then the latest decided")
        listing.add_argument("--team", required=True, help="team slug")
        listing.add_argument("--all", action="store_true", help="decided ones too")
        decide = sub.add_parser("decide", help="approve or deny a pending request")
        decide.add_argument("id", help="the approval id")
        decide.add_argument("decision", choices=["approve", "deny"])
        decide.add_argument("--note", default="", help="why; required to deny")
        decide.add_argument("--user", default=None,
                            help="the dashboard user deciding (recorded as the approver)")

    def handle(self, *args: Any, action: str, **options: Any) -> None:
        if action == "list":
            self._list(options["team"], show_all=options["all"])
        else:
            self._decide(options["id"], options["decision"], options["note"], options["user"])

    def _list(self, slug: str, *, show_all: bool) -> None:
        team = Team.objects.filter(slug=slug).first()
        if team is None:
            raise CommandError(f"No team {slug!r}.")
        now = timezone.now()
        settle_due_for_team(team, now=now)
        # Past the settle's batch, what is past its expiry shows expired, never pending.
        rows = [a for a in due.approvals_as_they_will_be(approvals_for_team(team), now=now)
                if show_all or a.status == "pending"]
        if not rows:
            self.stdout.write("No pending approval." if not show_all else "No approval.")
            return
        for a in rows:
            if a.status == "pending":
                left = max(0, int((a.expires_at - now).total_seconds()))
                when = f"expires in {left} s"
            else:
                when = f"{a.status} {iso(a.decided_at)}" + (
                    f" by {a.decided_by_label}" if a.decided_by_label else "")
            self.stdout.write(f"{a.pk}  {a.status:<9} {a.action_name}  run {str(a.run_id)[:8]} "
                              f"({a.run.agent}) step {a.step}  {when}")

    def _decide(self, approval_id: str, decision: str, note: str, username: str | None) -> None:
        try:
            wanted = uuid.UUID(approval_id)
        except ValueError:
            raise CommandError(f"Not an approval id: {approval_id!r}.") from None
        user = None
        label = _shell_label()
        if username is not None:
            user = get_user_model().objects.filter(username=username).first()
            if user is None:
                raise CommandError(f"No user {username!r}.")
            # SPEC 11: operators and above decide. The user is the recorded approver, so a
            # viewer's name on a decision would say a viewer decided it.
            team = Team.objects.filter(approvals__pk=wanted).first()
            if team is not None and not can(role_in(user, team), Role.OPERATOR):
                raise CommandError(f"{username!r} may not decide approvals of team "
                                   f"{team.slug}: only its operators and admins decide.")
            label = user.get_username()
        try:
            approval = approval_decide(team=None, approval_id=wanted, decision=decision,
                                       note=note, actor=user, actor_label=label)
        except ApprovalError as exc:
            raise CommandError(f"{exc.code}: {exc.message}") from None
        self.stdout.write(f"{approval.status}: {approval.action_name} of run "
                          f"{approval.run_id} (step {approval.step}).")
