"""The kill-switch cover rule, in one place: which runs an engaged switch stops (SPEC 4.5, 6),
as ORM filters and as SQL, and how a switch and its scope are put into words.

An active switch covers a run when its scope is

    global  any run of any team;
    team    a run of its team;
    agent   a run of its team by its agent;
    run     that run (so never a run that is only about to start).

Whether a covered run is stopped (it must still be running) is the caller's business, and so
is ``active``: the check's SQL reads it with the statement's snapshot, the screens filter on
it. tests/test_killswitch_cover.py proves that every form here agrees with the table above
for every scope and state, on SQLite and on PostgreSQL.
"""

from __future__ import annotations

from typing import Any, Protocol

from django.db.models import Q

from policies.models import Team
from runs.models import KillSwitch, Scope


class SwitchFields(Protocol):
    """What the wording needs of a switch: a KillSwitch, or the check's read of one."""

    scope: str
    agent: str
    reason: str
    engaged_by_label: str


# --- The rule -------------------------------------------------------------------------------

def switches_covering(*, team_id: int, agent: str, run_id: Any | None) -> Q:
    """A filter on KillSwitch: the switches that cover a run, or a run about to start
    (``run_id`` None)."""
    cover = (
        Q(scope=Scope.GLOBAL)
        | Q(scope=Scope.TEAM, team_id=team_id)
        | Q(scope=Scope.AGENT, team_id=team_id, agent=agent)
    )
    if run_id is not None:
        cover |= Q(scope=Scope.RUN, run_id=run_id)
    return cover


def covering_switch(*, team_id: int, agent: str, run_id: Any | None) -> KillSwitch | None:
    """The engaged switch that covers a run (or a run about to start), the oldest first.

    For a check it is read inside the transaction, after the run lock: a switch committed
    before this statement starts is always seen, which is the promise of SPEC 4.5. A start
    reads it only to name the switch that refused it."""
    return (KillSwitch.objects.filter(switches_covering(team_id=team_id, agent=agent,
                                                        run_id=run_id), active=True)
            .order_by("engaged_at").first())


def runs_covered(scope: str, *, team_id: int | None, agent: str, run_id: Any) -> Q:
    """A filter on Run: the runs a switch of this scope and target covers."""
    if scope == Scope.GLOBAL:
        return Q()
    if scope == Scope.TEAM:
        return Q(team_id=team_id)
    if scope == Scope.AGENT:
        return Q(team_id=team_id, agent=agent)
    return Q(pk=run_id)


def runs_covered_by(switch: KillSwitch) -> Q:
    return runs_covered(switch.scope, team_id=switch.team_id, agent=switch.agent,
                        run_id=switch.run_id)


def covers_sql(*, switch: str, team: str, agent: str, run: str | None) -> str:
    """The rule as an SQL condition on the switch row aliased ``switch``, for the run whose
    team id, agent name and id are the SQL expressions ``team``, ``agent`` and ``run`` (a
    column or a placeholder; ``run`` None for a run about to start). Placeholders come out in
    the order team, team, agent, run."""
    s = switch
    cond = (f"{s}.scope = '{Scope.GLOBAL.value}'"
            f" OR ({s}.scope = '{Scope.TEAM.value}' AND {s}.team_id = {team})"
            f" OR ({s}.scope = '{Scope.AGENT.value}' AND {s}.team_id = {team}"
            f" AND {s}.agent = {agent})")
    if run is not None:
        cond += f" OR ({s}.scope = '{Scope.RUN.value}' AND {s}.run_id = {run})"
    return cond


def team_switches(team_id: int) -> Q:
    """A filter on KillSwitch: the switches that cover every run the team may start (global,
    the team's own, one of its agents'), for the team's screens. Run switches are not in it:
    each covers one run, and the screens list it next to that run."""
    return Q(scope=Scope.GLOBAL) | Q(scope__in=[Scope.TEAM, Scope.AGENT], team_id=team_id)


# --- The wording ----------------------------------------------------------------------------

def scope_in_words(scope: str, *, team: Team | None, agent: str = "", run_id: Any = None
                   ) -> str:
    """A switch's target for operators: confirmations, banners, audit, command output."""
    if scope == Scope.GLOBAL:
        return "global (every run of every team)"
    team_name = f"team {team.slug}" if team is not None else "team ?"
    if scope == Scope.TEAM:
        return team_name
    if scope == Scope.AGENT:
        return f"agent {agent} of {team_name}"
    return f"run {str(run_id)[:8]} of {team_name}"


def switch_scope_in_words(switch: KillSwitch) -> str:
    return scope_in_words(switch.scope, team=switch.team, agent=switch.agent,
                          run_id=switch.run_id)


def covered_in_words(scope: str, *, team: Team | None, agent: str = "") -> str:
    """Which running runs will stop, after "N running runs" on the confirmation step."""
    slug = team.slug if team is not None else "?"
    if scope == Scope.GLOBAL:
        return "of every team"
    if scope == Scope.TEAM:
        return f"of team {slug}"
    if scope == Scope.AGENT:
        return f"of agent {agent} in team {slug}"
    return "(this run)"


def switch_in_words(switch: SwitchFields) -> str:
    """A switch for the agent it stops: the message of a refused start or a killed check."""
    what = {
        Scope.GLOBAL: "the global kill switch",
        Scope.TEAM: "the team kill switch",
        Scope.AGENT: f"the kill switch of agent {switch.agent}",
        Scope.RUN: "the kill switch of this run",
    }[Scope(switch.scope)]
    return f"{what}, engaged by {switch.engaged_by_label}: {switch.reason}"
