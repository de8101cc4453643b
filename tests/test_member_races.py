"""Two admins demoting or removing each other at once (PostgreSQL's row locks, real threads):
found by an attacker, both passed the "last admin" count made before either wrote, and the
team was left with no admin, which only a superuser could repair. The count is made again
under the team's row lock now (`policies.services._keep_an_admin`): one change wins, the
other is refused, whatever the interleaving."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from threading import Barrier

import pytest
from django.contrib.auth import get_user_model
from django.db import connection

from policies.models import Membership, OperatorEvent, Role, Team
from policies.services import LastAdmin, membership_remove, membership_set

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

ROUNDS = 8


def each_changes_the_other(team: Team, change: str, memberships: list[Membership]
                           ) -> list[str]:
    """Two threads at once, each admin demoting or removing the other: their outcomes."""
    barrier = Barrier(2)

    def act(i: int) -> str:
        other, actor = memberships[1 - i], memberships[i].user
        try:
            barrier.wait()
            if change == "demote":
                membership_set(team=team, user=other.user, role=Role.VIEWER, actor=actor)
            else:
                membership_remove(membership=other, actor=actor)
            return "done"
        except LastAdmin:
            return "refused"
        finally:
            connection.close()

    with ThreadPoolExecutor(2) as pool:
        return sorted(pool.map(act, range(2)))


@pytest.mark.parametrize("change", ["demote", "remove"])
def test_two_admins_changing_each_other_at_once_leave_the_team_an_admin(
        team: Team, change: str) -> None:
    for n in range(ROUNDS):
        Membership.objects.filter(team=team, role=Role.ADMIN).delete()
        memberships = [membership_set(team=team, role=Role.ADMIN, actor=None,
                                      user=get_user_model().objects.create_user(
                                          f"admin-{change}-{n}-{i}", password="x"))
                       for i in range(2)]
        outcomes = each_changes_the_other(team, change, memberships)
        assert outcomes == ["done", "refused"], (n, outcomes)
        assert Membership.objects.filter(team=team, role=Role.ADMIN).count() == 1, n
        # The refused change wrote nothing, its audit event included.
        action = "member.role" if change == "demote" else "member.remove"
        assert OperatorEvent.objects.filter(
            team=team, action=action,
            target__in=[m.user.get_username() for m in memberships]).count() == 1


def test_the_last_admin_is_refused_with_its_reason(team: Team) -> None:
    Membership.objects.filter(team=team, role=Role.ADMIN).delete()
    user = get_user_model().objects.create_user("only-admin", password="x")
    only = membership_set(team=team, user=user, role=Role.ADMIN, actor=None)
    with pytest.raises(LastAdmin, match="last admin cannot be demoted"):
        membership_set(team=team, user=user, role=Role.OPERATOR, actor=None)
    with pytest.raises(LastAdmin, match="last admin cannot be removed"):
        membership_remove(membership=only, actor=None)
    assert Membership.objects.get(pk=only.pk).role == Role.ADMIN
