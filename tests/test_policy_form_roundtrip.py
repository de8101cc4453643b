"""SPEC 3: a policy applied from YAML and then saved from the browser editor, untouched, is
the same policy. The editor shows each number as it is stored, so a save changes nothing it
was not asked to change."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from policies.forms import PolicyForm
from policies.models import Policy, Team
from policies.services import policy_apply

pytestmark = pytest.mark.django_db

PRECISE = {
    "name": "precise",
    "step_limits": {"max_steps": 5, "max_repeat_action": 3, "no_progress_window": 4},
    "budgets": {"max_usd": 12.345678, "max_seconds": 1234567.5, "max_idle_seconds": 86400.25},
    "warnings": {"repeat_action": 2, "no_progress": 3, "budget_fraction": 0.1234567},
}


@pytest.fixture
def admin(users: dict[str, Any]) -> Client:
    client = Client()
    client.force_login(users["admin"])
    return client


def form_post(document: dict[str, Any]) -> dict[str, str]:
    """What a browser sends back from the editor opened on this document, with a note."""
    initial = PolicyForm.initial_from(document)
    data = {k: v for k, v in initial.items() if not isinstance(v, bool)}
    data.update({k: "on" for k, v in initial.items() if v is True})
    data["note"] = "only a note"
    return data


def test_the_editor_shows_every_number_as_stored(team: Team, admin: Client) -> None:
    policy_apply(data={"teams": [{"slug": team.slug, "policies": [PRECISE]}]})
    page = admin.get(reverse("policy", kwargs={"slug": team.slug, "name": "precise"}))
    text = page.content.decode()
    for shown in ("12.345678", "1234567.5", "86400.25", "0.1234567"):
        assert f'value="{shown}"' in text


def test_saving_the_editor_untouched_makes_no_version(team: Team, admin: Client) -> None:
    policy_apply(data={"teams": [{"slug": team.slug, "policies": [PRECISE]}]})
    policy = Policy.objects.get(team=team, name="precise")
    before = policy.current.document
    response = admin.post(reverse("policy_save", kwargs={"slug": team.slug, "name": "precise"}),
                          form_post(before))
    assert response.status_code == 302
    policy.refresh_from_db()
    assert policy.current.version == 1
    assert policy.current.document == before


def test_apply_policies_says_it_made_the_default_policy(db: Any, tmp_path: Any) -> None:
    """SPEC 8: apply_policies prints what changed; a new team's `default`, made with the
    defaults because the file names none (SPEC 3), is one of the changes."""
    import io

    from django.core.management import call_command

    path = tmp_path / "one.yaml"
    path.write_text("teams:\n  - slug: fresh\n    policies:\n      - name: strict\n"
                    "        step_limits: {max_steps: 5, max_repeat_action: 2,"
                    " no_progress_window: 3}\n", encoding="utf-8")
    out = io.StringIO()
    call_command("apply_policies", str(path), stdout=out)
    lines = out.getvalue().splitlines()
    assert Policy.objects.filter(team__slug="fresh", name="default").exists()
    assert "team fresh: created" in lines and "policy fresh/strict: version 1" in lines
    assert any(line.startswith("policy fresh/default: version 1") for line in lines)


COMMAS = {
    "name": "commas",
    "step_limits": {"max_steps": 5, "max_repeat_action": 3, "no_progress_window": 4},
    "tools": {"allow": ["db.[a,b]*", "x.[!,]*", "odd,name"], "deny": ["db.[a,b]*"]},
    "approvals": {"tools": ["pay.[,;]*"], "timeout_s": 60},
}


def test_a_comma_in_a_globs_set_survives_a_save(team: Team, admin: Client) -> None:
    # A save of the editor untouched split `db.[a,b]*` into `db.[a` and `b]*`: a deny rule
    # that no longer matched what it did.
    policy_apply(data={"teams": [{"slug": team.slug, "policies": [COMMAS]}]})
    policy = Policy.objects.get(team=team, name="commas")
    before = policy.current.document
    response = admin.post(reverse("policy_save", kwargs={"slug": team.slug, "name": "commas"}),
                          form_post(before))
    assert response.status_code == 302
    policy.refresh_from_db()
    # A tool name with a comma of its own is shown as the set `[,]`: the same names match.
    assert policy.current.document["tools"]["deny"] == ["db.[a,b]*"]
    assert policy.current.document["tools"]["allow"] == ["db.[a,b]*", "x.[!,]*", "odd[,]name"]
    assert policy.current.document["approvals"]["tools"] == ["pay.[,;]*"]


def test_commas_outside_a_set_still_separate_patterns(team: Team, admin: Client) -> None:
    data = form_post(Policy.objects.get(team=team, name="default").current.document)
    data.update({"tools_deny": "shell.*, db.[a,b]*\nfs.delete,, [unclosed,x",
                 "note": "typed"})
    response = admin.post(reverse("policy_save", kwargs={"slug": team.slug, "name": "default"}),
                          data)
    assert response.status_code == 302
    document = Policy.objects.get(team=team, name="default").current.document
    assert document["tools"]["deny"] == ["shell.*", "db.[a,b]*", "fs.delete", "[unclosed", "x"]
