"""The words the server and the client share are written once: a run's statuses and an
agent's name mean the same to the rules, the models, the API schema, the forms and the
commands."""

from __future__ import annotations

from typing import Any, get_args

import pytest
from django.core.management import CommandError, call_command
from pydantic import ValidationError

from governance_client import rules
from policies.forms import KeyForm
from policies.models import Team
from runs.check import schemas
from runs.killswitch.services import KillSwitchError, resolve_target
from runs.models import RunStatus

NAMES = ["bot", "a.b-c_d", "A9", "x" * 100, "", "x" * 101, "bad name", "bot/1", "bøt", "b\x00t"]


def test_a_runs_statuses_are_the_rules_names() -> None:
    names = {rules.RUNNING, rules.STOPPED, rules.KILLED, rules.COMPLETED, rules.FAILED}
    assert set(RunStatus.values) == names
    assert set(get_args(schemas.RunStatusName)) == names
    assert names - {rules.RUNNING} == rules.TERMINAL


def api_accepts(name: str) -> bool:
    try:
        schemas.RunStartIn(agent=name)
    except ValidationError:
        return False
    return True


def form_accepts(name: str) -> bool:
    return KeyForm(data={"name": "k", "agent": name}).is_valid()


def killswitch_accepts(name: str, team: Team) -> bool:
    try:
        resolve_target(scope="agent", team=team, agent=name)
    except KillSwitchError:
        return False
    return True


def command_accepts(name: str, team: Team) -> bool:
    try:
        call_command("create_agent_key", team=team.slug, name="k", agent=name, stdout=_Null())
    except CommandError:
        return False
    return True


class _Null:
    def write(self, *args: Any) -> None:
        pass


@pytest.mark.django_db
@pytest.mark.parametrize("name", NAMES)
def test_an_agent_name_is_judged_alike_everywhere(name: str, team: Team) -> None:
    valid = rules.AGENT_NAME.fullmatch(name) is not None
    assert api_accepts(name) == valid
    assert killswitch_accepts(name, team) == valid
    if name:  # an empty agent means "any agent" to a key, not a bad name
        assert form_accepts(name) == valid
        assert command_accepts(name, team) == valid
