"""The kill-switch cover rule (runs/killswitch/cover.py) in all its forms agrees with one table,
for every scope, every relation between a switch and a run, engaged or released, and a run
running or over: the ORM filters, the SQL condition, the start's INSERT, the check's locking
read on each backend, and the screens' lists."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.db import connection, transaction
from django.utils import timezone

from policies.models import Team
from policies.services import agent_key_create
from runs.check import check_store
from runs.check.lifecycle import _insert_unless_switched
from runs.killswitch import cover
from runs.killswitch.selectors import engaged_for_team
from runs.models import KillSwitch, Run, Scope

pytestmark = pytest.mark.django_db


def make_run(team: Team, agent: str, status: str = "running") -> Run:
    policy = team.policies.get(name="default")
    return Run.objects.create(team=team, agent=agent, policy_version=policy.current,
                              started_at=timezone.now(), status=status)


def expected(switch: KillSwitch, *, team_id: int, agent: str, run_id: Any) -> bool:
    """The rule as the SPEC says it (SPEC 6), independent of the code under test."""
    return {
        Scope.GLOBAL: True,
        Scope.TEAM: switch.team_id == team_id,
        Scope.AGENT: switch.team_id == team_id and switch.agent == agent,
        Scope.RUN: run_id is not None and switch.run_id == run_id,
    }[Scope(switch.scope)]


def targets(team: Team, other: Team, runs: list[Run]) -> list[dict[str, Any]]:
    return [
        {"scope": Scope.GLOBAL},
        {"scope": Scope.TEAM, "team": team},
        {"scope": Scope.TEAM, "team": other},
        {"scope": Scope.AGENT, "team": team, "agent": "bot"},
        {"scope": Scope.AGENT, "team": team, "agent": "helper"},
        {"scope": Scope.AGENT, "team": other, "agent": "bot"},
        *({"scope": Scope.RUN, "team": run.team, "run": run} for run in runs),
    ]


def lock_sql_switch(run: Run) -> str | None:
    """The check's own locking statement on PostgreSQL, run inside the test's transaction:
    the scope of the switch it reads for this run, or None."""
    key = agent_key_create(team=run.team, name=f"k-{uuid.uuid4().hex[:6]}").key
    with connection.cursor() as cursor:
        # The run, the check_id, the key's prefix.
        cursor.execute(f"PREPARE cover_test_lock(uuid, text, text) AS {check_store.LOCK_SQL}")
        try:
            cursor.execute("EXECUTE cover_test_lock(%s, %s, %s)", [run.pk, None, key.prefix])
            row = cursor.fetchone()
        finally:
            cursor.execute("DEALLOCATE cover_test_lock")
    assert row is not None and row[check_store.LOCK_AT["run_id"]] == run.pk
    return row[check_store.LOCK_AT["switch_scope"]]


def orm_lock_switch(run: Run) -> KillSwitch | None:
    key = agent_key_create(team=run.team, name=f"k-{uuid.uuid4().hex[:6]}").key
    with transaction.atomic():
        locked = check_store.OrmCheck().lock(prefix=key.prefix, run_id=run.pk, check_id=None)
    assert locked is not None and locked.run is not None
    return locked.switch


def test_the_lock_statement_uses_the_rules_sql() -> None:
    # The run by the statement's parameter, as every lateral read of the lock statement.
    assert cover.covers_sql(switch="ks", team="r.team_id", agent="r.agent", run="$1") in (
        check_store.LOCK_SQL)


@pytest.mark.parametrize("active", [True, False], ids=["engaged", "released"])
def test_every_form_of_the_cover_rule_agrees(team: Team, other_team: Team, active: bool
                                             ) -> None:
    runs = [make_run(team, "bot"), make_run(team, "helper"), make_run(other_team, "bot"),
            make_run(team, "bot", status="killed")]
    covers_sql = cover.covers_sql(switch="ks", team="r.team_id", agent="r.agent", run="r.id")
    for spec in targets(team, other_team, runs):
        # The target as the engage writes it (services.Target.key): the reads go by it.
        key = cover.target_key(spec["scope"], team_id=spec["team"].pk if "team" in spec else None,
                               agent=spec.get("agent", ""),
                               run_id=spec["run"].pk if "run" in spec else None)
        switch = KillSwitch.objects.create(
            scope=spec["scope"], team=spec.get("team"), agent=spec.get("agent", ""),
            run=spec.get("run"), target=key, reason="r",
            engaged_by_label="test", engaged_at=timezone.now(), active=active)
        covered_runs = set(Run.objects.filter(cover.runs_covered_by(switch))
                           .values_list("pk", flat=True))
        for run in runs:
            where = (switch.scope, spec.get("agent"), run.agent, run.team.slug, run.status)
            rule = expected(switch, team_id=run.team_id, agent=run.agent, run_id=run.pk)
            stops = rule and active
            # Which runs a switch covers (fan-out, confirmation counts), engaged or not.
            assert (run.pk in covered_runs) == rule, where
            # Which switches cover a run (a check on SQLite, a start's refusal message).
            found = KillSwitch.objects.filter(
                cover.switches_covering(team_id=run.team_id, agent=run.agent, run_id=run.pk),
                active=True)
            assert found.filter(pk=switch.pk).exists() == stops, where
            assert (cover.covering_switch(team_id=run.team_id, agent=run.agent,
                                          run_id=run.pk) is not None) == stops, where
            # The SQL condition, on this backend.
            with connection.cursor() as cursor:
                cursor.execute(
                    f"SELECT 1 FROM runs_killswitch ks, runs_run r "
                    f"WHERE ks.id = %s AND r.id = %s AND ks.active = %s AND ({covers_sql})",
                    [switch.pk, Run._meta.pk.get_db_prep_value(run.pk, connection), True])
                assert (cursor.fetchone() is not None) == stops, where
            # The check's locking read: only a running run is stopped by its switch.
            seen = orm_lock_switch(run)
            assert (seen is not None) == (stops and run.status == "running"), where
            if connection.vendor == "postgresql":
                scope = lock_sql_switch(run)
                assert (scope is not None) == (stops and run.status == "running"), where
                assert scope in (None, switch.scope)
        # A start: a run that does not exist yet, refused by the start's own INSERT.
        for team_row, agent in ((team, "bot"), (team, "helper"), (other_team, "bot")):
            rule = expected(switch, team_id=team_row.pk, agent=agent, run_id=None)
            new = Run(team=team_row, agent=agent, started_at=timezone.now(),
                      policy_version=team_row.policies.get(name="default").current)
            inserted = _insert_unless_switched(new)
            assert inserted == (not (rule and active)), (switch.scope, agent, team_row.slug)
            if inserted:
                new.delete()
            assert (cover.covering_switch(team_id=team_row.pk, agent=agent, run_id=None)
                    is not None) == (rule and active)
        # The team's screens: the switches that stop what the team runs or may start.
        for team_row in (team, other_team):
            listed = KillSwitch.objects.filter(cover.team_switches(team_row.pk), pk=switch.pk)
            may_start = switch.scope != Scope.RUN and expected(
                switch, team_id=team_row.pk, agent=switch.agent or "bot", run_id=None)
            assert listed.exists() == may_start, (switch.scope, team_row.slug)
            banner = {s.pk for s in engaged_for_team(team_row)}
            guards = active and (may_start or (switch.scope == Scope.RUN
                                              and switch.team_id == team_row.pk
                                              and switch.run.status == "running"))
            assert (switch.pk in banner) == guards, (switch.scope, team_row.slug)
        switch.delete()


def test_each_scope_has_its_words(team: Team) -> None:
    run = make_run(team, "bot")
    words = {
        scope: (cover.scope_in_words(scope, team=team, agent="bot", run_id=run.pk),
                cover.covered_in_words(scope, team=team, agent="bot"),
                cover.switch_in_words(KillSwitch(scope=scope, agent="bot", reason="why",
                                                 engaged_by_label="ops",
                                                 run=run if scope == Scope.RUN else None)))
        for scope in Scope.values
    }
    assert words[Scope.GLOBAL] == ("global (every run of every team)", "of every team",
                                   "the global kill switch, engaged by ops: why")
    assert words[Scope.TEAM] == ("team support", "of team support",
                                 "the team kill switch, engaged by ops: why")
    assert words[Scope.AGENT] == ("agent bot of team support", "of agent bot in team support",
                                  "the kill switch of agent bot, engaged by ops: why")
    assert words[Scope.RUN] == (f"run {str(run.pk)[:8]} of team support", "(this run)",
                                f"the kill switch of run {run.pk}, engaged by ops: why")
