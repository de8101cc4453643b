"""The policy document's `approvals` block (SPEC 3, 11): YAML validation with field errors,
the browser editor, export, and new versions as always."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from django.test import Client
from django.urls import reverse
from governance_client.rules import Policy as RulesPolicy

from policies.document import DocumentError, default_policy, parse_document, parse_policy
from policies.models import Policy, Team
from tests.test_dashboard_policies import form_data

STEP_LIMITS = {"max_steps": 18, "max_repeat_action": 3, "no_progress_window": 4}


def errors_of(approvals: Any) -> dict[str, str]:
    with pytest.raises(DocumentError) as caught:
        parse_document({"teams": [{"slug": "support", "policies": [
            {"name": "default", "step_limits": STEP_LIMITS, "approvals": approvals}]}]})
    return caught.value.errors


def test_a_new_policy_requires_no_approval_and_waits_900_seconds() -> None:
    assert default_policy()["approvals"] == {"tools": [], "timeout_s": 900}
    assert RulesPolicy.from_document(default_policy()).approval_tools == ()


def test_the_block_is_kept_as_written() -> None:
    doc = parse_policy({"name": "default", "step_limits": STEP_LIMITS,
                        "approvals": {"tools": ["payments.*", "crm.delete"], "timeout_s": 60}})
    assert doc["approvals"] == {"tools": ["payments.*", "crm.delete"], "timeout_s": 60}
    rules = RulesPolicy.from_document(doc)
    assert (rules.approval_tools, rules.approval_timeout_s) == (("payments.*", "crm.delete"), 60)


def test_an_omitted_timeout_takes_its_default() -> None:
    doc = parse_policy({"name": "default", "step_limits": STEP_LIMITS,
                        "approvals": {"tools": ["x"]}})
    assert doc["approvals"]["timeout_s"] == 900


@pytest.mark.parametrize("timeout", [0, 86401, -5, 1.5, "60", True])
def test_a_timeout_outside_1_to_86400_is_refused_naming_the_field(timeout: Any) -> None:
    assert "teams[0].policies[0].approvals.timeout_s" in errors_of(
        {"tools": [], "timeout_s": timeout})


@pytest.mark.parametrize("timeout", [1, 86400])
def test_the_timeout_bounds_are_inclusive(timeout: int) -> None:
    doc = parse_policy({"name": "d", "step_limits": STEP_LIMITS,
                        "approvals": {"timeout_s": timeout}})
    assert doc["approvals"]["timeout_s"] == timeout


def test_tools_must_be_a_list_of_patterns() -> None:
    assert "teams[0].policies[0].approvals.tools" in errors_of({"tools": "payments.*"})
    assert "teams[0].policies[0].approvals.tools[1]" in errors_of({"tools": ["a", ""]})


def test_unknown_keys_in_the_block_are_errors() -> None:
    errors = errors_of({"tools": [], "timout_s": 5})
    assert errors["teams[0].policies[0].approvals.timout_s"] == "unknown field"


def test_versions_saved_before_approvals_existed_require_none() -> None:
    old = {k: v for k, v in default_policy().items() if k != "approvals"}
    rules = RulesPolicy.from_document(old)
    assert (rules.approval_tools, rules.approval_timeout_s) == ((), 900)


# --- The browser editor and export --------------------------------------------------------

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin(users: dict[str, Any]) -> Client:
    client = Client()
    client.force_login(users["admin"])
    return client


def current(team: Team) -> dict[str, Any]:
    return Policy.objects.get(team=team, name="default").current.document


def test_the_editor_saves_the_block_as_a_new_version(team: Team, admin: Client) -> None:
    url = reverse("policy_save", kwargs={"slug": team.slug, "name": "default"})
    page = admin.get(reverse("policy", kwargs={"slug": team.slug, "name": "default"}))
    assert b'name="approval_tools"' in page.content
    assert b"approvals.timeout_s" in page.content

    response = admin.post(url, form_data(approval_tools="payments.*\ncrm.delete",
                                         approval_timeout_s="120"))

    assert response.status_code == 302
    policy = Policy.objects.get(team=team, name="default")
    assert policy.current.version == 2
    assert current(team)["approvals"] == {"tools": ["payments.*", "crm.delete"],
                                          "timeout_s": 120}
    edit = admin.get(reverse("policy", kwargs={"slug": team.slug, "name": "default"}))
    assert b"payments.*\ncrm.delete" in edit.content


def test_the_editor_shows_the_yaml_message_at_the_field(team: Team, admin: Client) -> None:
    url = reverse("policy_save", kwargs={"slug": team.slug, "name": "default"})
    response = admin.post(url, form_data(approval_timeout_s="0"))
    assert response.status_code == 422
    html = response.content.decode()
    assert 'id="err-approval_timeout_s"' in html
    assert "greater than or equal to 1" in html
    assert Policy.objects.get(team=team, name="default").current.version == 1


def test_the_save_address_opened_again_is_the_editor(team: Team, admin: Client) -> None:
    # A refused save's page is at .../save: entered again, the editor, not a 405.
    url = reverse("policy_save", kwargs={"slug": team.slug, "name": "default"})
    assert admin.post(url, form_data(approval_timeout_s="0")).status_code == 422
    response = admin.get(url)
    assert response.status_code == 302
    assert response["Location"] == reverse("policy", kwargs={"slug": team.slug,
                                                             "name": "default"})
    assert Policy.objects.get(team=team, name="default").current.version == 1


def test_an_empty_timeout_box_is_the_default(team: Team, admin: Client) -> None:
    url = reverse("policy_save", kwargs={"slug": team.slug, "name": "default"})
    admin.post(url, form_data(approval_tools="refund", approval_timeout_s=""))
    assert current(team)["approvals"] == {"tools": ["refund"], "timeout_s": 900}


def test_export_carries_the_block_and_imports_back_unchanged(team: Team, admin: Client) -> None:
    url = reverse("policy_save", kwargs={"slug": team.slug, "name": "default"})
    admin.post(url, form_data(approval_tools="payments.*", approval_timeout_s="30"))
    export = admin.get(reverse("policies_export", kwargs={"slug": team.slug}))
    data = yaml.safe_load(export.content)
    assert data["teams"][0]["policies"][0]["approvals"] == {"tools": ["payments.*"],
                                                            "timeout_s": 30}
    response = admin.post(reverse("policies_import", kwargs={"slug": team.slug}),
                          {"document": export.content.decode()})
    assert response.status_code == 302
    assert Policy.objects.get(team=team, name="default").current.version == 2
