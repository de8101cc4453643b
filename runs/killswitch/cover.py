"""The kill-switch cover rule, in one place: which runs an engaged switch stops (SPEC 4.5, 6),
as ORM filters and as SQL, and how a switch and its scope are put into words.

An active switch covers a run when its scope is

    global  any run of any team;
    team    a run of its team;
    agent   a run of its team by its agent;
    run     that run (so never a run that is only about to start).

and it covers the descendants of every run it covers (SPEC 20): the fan-out kills them too
(`runs_covered`), and a check of a child run reads the switches over its ancestors
(runs/check/tree.py) besides its own (`covers_sql`, which stays the rule for one run).

Whether a covered run is stopped (it must still be running) is the caller's business, and so
is ``active``: the check's SQL reads it with the statement's snapshot, the screens filter on
it. tests/test_killswitch_cover.py proves that every form here agrees with the table above
for every scope and state, on SQLite and on PostgreSQL.

Every read of the switches covering a run goes by the switches' target keys (`target_key`):
at most four exact keys in the partial unique index of the engaged switches, so what a check
or a start reads does not grow with the switches of other teams, nor with the history.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from string import Formatter
from typing import Any, Protocol

from django.db import connection
from django.db.models import Q

from governance_client import answers, rules
from policies.models import Team
from runs.models import KillSwitch, Run, Scope


class SwitchFields(Protocol):
    """What the wording needs of a switch: a KillSwitch, or the check's read of one."""

    scope: str
    agent: str
    reason: str
    engaged_by_label: str
    run_id: Any  # a run switch's run (None for the other scopes)


# --- The target key -------------------------------------------------------------------------

# A switch's target as one string (KillSwitch.target), one format per scope, written once:
# `target_key` fills it in Python (the engage, the ORM's reads) and `covers_sql` renders it as
# an SQL expression (the check's and the start's statements). The partial unique index
# `one_engaged_per_target` keeps one engaged switch per key, so the switches that cover a run
# are the engaged ones under its (at most) four keys. An agent name has no ':' (rules.AGENT_NAME),
# so no two targets share a key. tests/test_killswitch_cover.py proves both forms agree.
TARGET_FORMATS: dict[str, str] = {
    Scope.GLOBAL: "global",
    Scope.TEAM: "team:{team}",
    Scope.AGENT: "agent:{team}:{agent}",
    Scope.RUN: "run:{run}",
}
# The scopes that cover a run, and a run about to start (no run switch covers it yet).
_COVERING = (Scope.GLOBAL, Scope.TEAM, Scope.AGENT, Scope.RUN)


def target_key(scope: str, *, team_id: int | None = None, agent: str = "",
               run_id: Any = None) -> str:
    """The target key of a switch of this scope: a run id as its canonical text (hyphens,
    lower case), whatever form it was given in."""
    run = str(uuid.UUID(str(run_id))) if run_id is not None else None
    return TARGET_FORMATS[scope].format(team=team_id, agent=agent, run=run)


def covering_targets(*, team_id: int, agent: str, run_id: Any | None) -> list[str]:
    """The keys of every switch that covers a run, or a run about to start (``run_id``
    None): the global key, the team's, its agent's and the run's own."""
    return [target_key(scope, team_id=team_id, agent=agent, run_id=run_id)
            for scope in _COVERING if scope != Scope.RUN or run_id is not None]


def _uuid_text(expr: str, vendor: str) -> str:
    """A run id column or parameter as the text `target_key` writes for it: PostgreSQL's
    uuid text is that already; SQLite holds the 32 hex digits (Django's UUIDField there)."""
    if vendor == "postgresql":
        return f"CAST({expr} AS TEXT)"
    groups = ((1, 8), (9, 4), (13, 4), (17, 4), (21, 12))
    return " || '-' || ".join(f"substr(lower({expr}), {at}, {n})" for at, n in groups)


def _key_sql(scope: str, fields: dict[str, str]) -> str:
    """The target key of ``scope`` as an SQL expression: its format's literal parts quoted,
    its fields replaced by the SQL expressions of ``fields``, joined with ``||``."""
    parts = []
    for literal, field, _, _ in Formatter().parse(TARGET_FORMATS[scope]):
        if literal:
            parts.append("'" + literal.replace("'", "''") + "'")
        if field is not None:
            parts.append(fields[field])
    return " || ".join(parts)


# --- The rule -------------------------------------------------------------------------------

def switches_covering(*, team_id: int, agent: str, run_id: Any | None) -> Q:
    """A filter on KillSwitch: the switches that cover a run, or a run about to start
    (``run_id`` None), by their target keys."""
    return Q(target__in=covering_targets(team_id=team_id, agent=agent, run_id=run_id))


def covering_switch(*, team_id: int, agent: str, run_id: Any | None) -> KillSwitch | None:
    """The engaged switch that covers a run (or a run about to start), the oldest first.

    For a check it is read inside the transaction, after the run lock: a switch committed
    before this statement starts is always seen, which is the promise of SPEC 4.5. A start
    reads it only to name the switch that refused it."""
    return (KillSwitch.objects.filter(switches_covering(team_id=team_id, agent=agent,
                                                        run_id=run_id), active=True)
            .order_by("engaged_at").first())


def switch_over_any(team_id: int, runs: Iterable[tuple[Any, str]]) -> KillSwitch | None:
    """The engaged switch, the oldest first, that covers any of a team's ``runs`` (their ids
    and agents): a run's ancestors, whose switches cover it too (SPEC 20)."""
    targets = [key for run_id, agent in runs
               for key in covering_targets(team_id=team_id, agent=agent, run_id=run_id)]
    if not targets:
        return None
    return (KillSwitch.objects.filter(target__in=targets, active=True)
            .order_by("engaged_at").first())


def covering_switch_of_tree(run: Any) -> KillSwitch | None:
    """The engaged switch that covers ``run`` or one of its ancestors (SPEC 20: a switch
    covering a run covers its descendants), the oldest first: what an approval of the run's
    action must look at (found by an attacker: a sub-agent's request approved after a switch
    over its parent was committed answered allow until the fan-out came)."""
    found = covering_switch(team_id=run.team_id, agent=run.agent, run_id=run.id)
    if found is not None or not run.ancestors:
        return found
    return switch_over_any(run.team_id, Run.objects.filter(
        pk__in=run.ancestors, team_id=run.team_id).values_list("pk", "agent"))


def tree_covering_targets(run: Any) -> list[str]:
    """The keys of every switch that covers ``run`` or one of its ancestors (SPEC 20), for a
    write that must not end a covered run as though no switch were engaged (a finish)."""
    targets = covering_targets(team_id=run.team_id, agent=run.agent, run_id=run.id)
    if run.ancestors:
        for pk, agent in Run.objects.filter(pk__in=run.ancestors, team_id=run.team_id
                                            ).values_list("pk", "agent"):
            targets += covering_targets(team_id=run.team_id, agent=agent, run_id=pk)
    return targets


def runs_covered(scope: str, *, team_id: int | None, agent: str, run_id: Any) -> Q:
    """A filter on Run: the runs a switch of this scope and target covers, their
    descendants included (SPEC 20: a switch covering a run covers its sub-agents' runs)."""
    if scope == Scope.GLOBAL:
        return Q()
    if scope == Scope.TEAM:
        return Q(team_id=team_id)  # a run's descendants are of its team
    if scope == Scope.AGENT:
        return with_descendants(Q(team_id=team_id, agent=agent))
    return with_descendants(Q(pk=run_id))


def with_descendants(covered: Q) -> Q:
    """``covered`` and the runs below them, level by level (a tree is at most
    rules.MAX_DEPTH deep below its root), by the index of child runs by parent."""
    level = Run.objects.filter(covered).values("pk")
    every = covered
    for _ in range(rules.MAX_DEPTH):
        every |= Q(parent_run_id__in=level)
        level = Run.objects.filter(parent_run_id__in=level).values("pk")
    return every


def runs_covered_by(switch: KillSwitch) -> Q:
    return runs_covered(switch.scope, team_id=switch.team_id, agent=switch.agent,
                        run_id=switch.run_id)


def covering_targets_sql(*, team: str, agent: str, run: str | None,
                         vendor: str | None = None) -> list[str]:
    """`covering_targets` as SQL expressions, for the run whose team id, agent name and id
    are the SQL expressions ``team``, ``agent`` and ``run`` (a column or a placeholder;
    ``run`` None for a run about to start). Placeholders come out in the order team, team,
    agent, run. ``vendor``: the database's, by default the connection's (it holds a run id
    differently)."""
    fields = {"team": f"CAST({team} AS TEXT)", "agent": agent}
    if run is not None:
        fields["run"] = _uuid_text(run, vendor or connection.vendor)
    return [_key_sql(scope, fields) for scope in _COVERING
            if scope != Scope.RUN or run is not None]


def covers_sql(*, switch: str, team: str, agent: str, run: str | None) -> str:
    """The rule as an SQL condition on the switch row aliased ``switch``: its target is one
    of the run's keys (`covering_targets_sql`, same arguments). With ``active`` beside it,
    both databases read it as at most four probes of `one_engaged_per_target`."""
    keys = covering_targets_sql(team=team, agent=agent, run=run)
    return f"{switch}.target IN ({', '.join(keys)})"


def team_switches(team_id: int) -> Q:
    """A filter on KillSwitch: the switches that cover every run the team may start (global,
    the team's own, one of its agents'), for the team's screens. Run switches are not in it:
    each covers one run, and the screens list it next to that run. The global one by its
    key; with `engaged_over_team` beside it, the reads stay within the engaged switches."""
    return (Q(target=target_key(Scope.GLOBAL))
            | Q(scope__in=[Scope.TEAM, Scope.AGENT], team_id=team_id))


def engaged_over_team(team_id: int) -> Q:
    """A filter on KillSwitch: the engaged switches that cover any run of the team (global,
    the team's, its agents', its runs'): the global one by its key, the team's by the
    partial index of engaged switches by team (`killswitch_team_engaged`), so the read
    grows with neither another team's switches nor the history of released ones."""
    return Q(active=True) & (Q(target=target_key(Scope.GLOBAL)) | Q(team_id=team_id))


def engaged_over_team_ids(team_id: int) -> list[int]:
    """The engaged switches over any run of the team (`engaged_over_team`), read whole: they
    are few. Not `exists()`: under its `LIMIT 1` PostgreSQL priced a sequential scan as
    stopping at the first match (its estimate of the team's engaged switches counts the
    team's released ones), and read the whole table when none was engaged."""
    return list(KillSwitch.objects.filter(engaged_over_team(team_id)).order_by()
                .values_list("pk", flat=True))


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


def switch_rule(switch: SwitchFields, *, team: str | None) -> dict[str, Any]:
    """The switch as a killed stop's `rule` names it (SPEC 16, `answers.kill_rule`): ``team``
    the covered run's team slug; a run switch names its run (the stopped run's, or an
    ancestor's: SPEC 20)."""
    run = switch.run_id
    return answers.kill_rule(Scope(switch.scope).value, team=team, agent=switch.agent or None,
                             by=switch.engaged_by_label, reason=switch.reason,
                             run=str(run) if run is not None else None)


def switch_in_words(switch: SwitchFields) -> str:
    """A switch for the agent it stops: the message of a refused start or a killed check
    (the words are `answers.switch_in_words`, which the client's fake says too)."""
    return answers.switch_in_words(Scope(switch.scope).value, agent=switch.agent,
                                   by=switch.engaged_by_label, reason=switch.reason,
                                   run=switch.run_id)
