"""Reads of the kill switch for people (SPEC 6, 7): what the banner, the kill switch pages
and the ``killswitch`` command show. The writes, and the reads the fan-out and its sweep make
for themselves, are in services.py; which switch covers which run is cover.py's rule, used
here, never repeated."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ValidationError
from django.db.models import Q, QuerySet

from policies.access import can
from policies.models import OperatorRelease, Role, Team
from runs.killswitch import cover
from runs.models import KillSwitch, Run, RunStatus, Scope

if TYPE_CHECKING:  # services imports this module: the type only, no cycle at run time
    from runs.killswitch.services import Target


def may_release(switch: KillSwitch, *, team: Team, user: Any, role: Role | None) -> bool:
    """Whether this person may release this switch (SPEC 7 and the team's setting): the
    global switch is the superusers'; a team, agent or run switch is its team's admins', and
    its operators' too as the team's `operator_release` says (by default none, as SPEC 7
    says; a team may let the on-call undo their own kill without waking an admin)."""
    if switch.scope == Scope.GLOBAL:
        return bool(getattr(user, "is_superuser", False))
    if can(role, Role.ADMIN):
        return True
    if not can(role, Role.OPERATOR):
        return False
    if team.operator_release == OperatorRelease.ANY:
        return True
    return (team.operator_release == OperatorRelease.OWN and switch.engaged_by_id is not None
            and switch.engaged_by_id == getattr(user, "pk", None))


def release_check(*, team: Team, user: Any, role: Role | None
                  ) -> Callable[[KillSwitch], str | None]:
    """`killswitch_release`'s ``may`` for this person: why they may not release a switch
    (`release_refusal`), or None when they may (`may_release`)."""
    def refusal(switch: KillSwitch) -> str | None:
        if may_release(switch, team=team, user=user, role=role):
            return None
        if switch.scope == Scope.GLOBAL:
            return "Only a superuser may release the global kill switch."
        return release_refusal(switch, team=team)
    return refusal


def release_refusal(switch: KillSwitch, *, team: Team) -> str:
    """Why this operator may not release this switch, and whom to ask: the refusal of the
    dashboard and of the operator API (an operator cannot read the team's settings page)."""
    if team.operator_release == OperatorRelease.OWN:
        return (f"Operators of this team may release only the switches they engaged "
                f"themselves, and this one was engaged by {switch.engaged_by_label}: ask an "
                "admin of the team to release it.")
    return ("Only the team's admins may release this switch (operators of this team release "
            "none, as the team's settings say): ask an admin of the team to release it.")


def covered_running(target: Target) -> QuerySet[Run]:
    """The running runs a switch on this target would stop (for the confirmation step)."""
    return Run.objects.filter(target.cover(), status=RunStatus.RUNNING)


@dataclass(frozen=True)
class Covered:
    """What the engage confirmation lists: the newest covered running runs, how many."""

    first: list[Run]
    count: int

    @property
    def more(self) -> int:
        return self.count - len(self.first)


def covered_preview(target: Target, *, limit: int) -> Covered:
    covered = covered_running(target)
    first = list(covered.select_related("team").order_by("-started_at", "pk")[:limit])
    # Counted only when the list is full: a short list is the whole answer.
    return Covered(first, len(first) if len(first) < limit else covered.count())


def engaged_switch(target: Target) -> KillSwitch | None:
    """The engaged switch of exactly this target (not of a wider one that covers it too)."""
    return KillSwitch.objects.filter(target=target.key, active=True).first()


def engaged_for_team(team: Team) -> list[KillSwitch]:
    """Engaged switches covering the team, for its banner and kill switch page. A run switch
    is listed only while its run is running: once the run is killed (and a killed run stays
    killed) it has nothing left to guard."""
    return list(_banner_switches(team.pk).select_related("team", "run")
                .order_by("engaged_at", "pk"))


def _banner_switches(team_id: int) -> QuerySet[KillSwitch]:
    return (KillSwitch.objects.filter(cover.engaged_over_team(team_id))
            .filter(cover.team_switches(team_id)
                    | Q(scope=Scope.RUN, team_id=team_id, run__status=RunStatus.RUNNING)))


def engaged_ids_for_team(team_id: int) -> frozenset[int]:
    """The ids of `engaged_for_team`'s switches: what the team's banner shows, in one small
    read, so that a live page can tell whether its banner is still the one it sent."""
    return frozenset(_banner_switches(team_id).order_by().values_list("pk", flat=True))


NEWEST_FIRST = ("-engaged_at", "-pk")


def _global_history(limit: int) -> list[KillSwitch]:
    """The global switches, newest first: a range of `killswitch_global_history`."""
    return list(KillSwitch.objects.filter(scope=Scope.GLOBAL).order_by(*NEWEST_FIRST)[:limit])


def history_for_team(team: Team, *, limit: int = 50) -> list[KillSwitch]:
    """The switches of the team's history page, newest first: the global ones and the
    team's. Two ranges of an index each, merged here: one read of either kind (an OR) would
    sort the whole history to find the newest."""
    own = list(KillSwitch.objects.filter(team=team).select_related("team", "run")
               .order_by(*NEWEST_FIRST)[:limit])
    merged = sorted([*own, *_global_history(limit)], key=lambda s: (s.engaged_at, s.pk),
                    reverse=True)
    return merged[:limit]


def global_page(*, limit: int = 50) -> dict[str, Any]:
    """The superuser's page: the global switch, every engaged switch of every team (a run
    switch while its run runs, as on the team pages), the global history, running runs."""
    engaged = list(KillSwitch.objects.filter(active=True).select_related("team", "run")
                   .order_by("engaged_at", "pk"))
    return {
        "global_switch": next((s for s in engaged if s.scope == Scope.GLOBAL), None),
        "engaged": [s for s in engaged if s.scope != Scope.RUN
                    or (s.run is not None and s.run.status == RunStatus.RUNNING)],
        "history": _global_history(limit),
        "running": Run.objects.filter(status=RunStatus.RUNNING).count(),
    }


def team_run(team: Team, run_id: Any) -> Run | None:
    """The team's run, or None: another team's run is as absent as a missing one, and so is
    a run id that is not a UUID."""
    try:
        return Run.objects.select_related("team").filter(team=team, pk=run_id).first()
    except (ValueError, ValidationError):
        return None

