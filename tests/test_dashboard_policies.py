"""The policy editor: inline validation with the YAML's messages, versions, diffs, export and
import, and what the page says about running runs on older versions."""

from __future__ import annotations

import html
import re
from typing import Any

import pytest
import yaml
from django.test import Client
from django.urls import reverse

from policies.document import DocumentError, parse_document
from policies.models import OperatorEvent, Policy, Team
from policies.services import agent_key_create
from runs.check.policy_cache import rules_for_version

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fast(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    rules_for_version.cache_clear()


@pytest.fixture
def admin(users: dict[str, Any]) -> Client:
    client = Client()
    client.force_login(users["admin"])
    return client


def form_data(**changes: str) -> dict[str, str]:
    data = {"mode": "enforce", "max_steps": "18", "max_repeat_action": "3",
            "no_progress_window": "4", "max_seconds": "45", "max_usd": "1", "max_tool_calls": "",
            "tools_deny": "", "ignore_args": "", "error_threshold": "3", "error_action": "nudge",
            "redact_args": "password\napi_key\ntoken\nsecret\nauthorization",
            "max_idle_seconds": "3600", "rate_limits": "", "note": "a test edit",
            "warn_repeat_action": "2", "warn_no_progress": "3", "warn_budget_fraction": "0.8"}
    return {**data, **changes}


def yaml_error(team: Team, policy_changes: dict[str, Any]) -> dict[str, str]:
    """What `apply_policies` says about the same mistake."""
    policy = {"name": "default",
              "step_limits": {"max_steps": 18, "max_repeat_action": 3, "no_progress_window": 4}}
    for path, value in policy_changes.items():
        section, _, key = path.rpartition(".")
        (policy.setdefault(section, {}) if section else policy)[key] = value
    with pytest.raises(DocumentError) as caught:
        parse_document({"teams": [{"slug": team.slug, "policies": [policy]}]})
    return {k.split(".", 2)[-1].split("].", 1)[-1]: v for k, v in caught.value.errors.items()}


def current(team: Team) -> dict[str, Any]:
    return Policy.objects.get(team=team, name="default").current.document


def test_saving_the_form_creates_a_new_version_audited_with_source_dashboard(team, admin):
    url = reverse("policy_save", kwargs={"slug": team.slug, "name": "default"})
    response = admin.post(url, form_data(max_steps="7", mode="shadow", max_tool_calls="5",
                                         restrict_tools="on", tools_allow="search.*\ncrm.*"))
    assert response.status_code == 302
    policy = Policy.objects.get(team=team, name="default")
    assert policy.current.version == 2 and policy.current.source == "dashboard"
    doc = policy.current.document
    assert doc["step_limits"]["max_steps"] == 7 and doc["mode"] == "shadow"
    assert doc["budgets"]["max_tool_calls"] == 5 and doc["tools"]["allow"] == ["search.*", "crm.*"]
    event = OperatorEvent.objects.get(action="policy.version", detail__version=2)
    assert event.actor_label == "admin" and event.detail["source"] == "dashboard"


def test_saving_unchanged_values_creates_no_version(team, admin):
    admin.post(reverse("policy_save", kwargs={"slug": team.slug, "name": "default"}),
               form_data())
    assert Policy.objects.get(team=team, name="default").current.version == 1


def test_an_empty_budget_means_no_limit_and_an_unchecked_allow_list_means_all_tools(team, admin):
    admin.post(reverse("policy_save", kwargs={"slug": team.slug, "name": "default"}),
               form_data(max_usd="", tools_allow="ignored.*"))
    doc = current(team)
    assert doc["budgets"]["max_usd"] is None and doc["tools"]["allow"] is None


@pytest.mark.parametrize(("field", "value", "path", "yaml_value"), [
    ("max_steps", "0", "step_limits.max_steps", 0),
    ("max_steps", "abc", "step_limits.max_steps", "abc"),
    ("max_steps", "2.5", "step_limits.max_steps", 2.5),
    # An Arabic-Indic 3: a string in a file, and so in the form (it was saved as 3).
    ("max_steps", "\u0663", "step_limits.max_steps", "\u0663"),
    ("max_usd", "0.1234567", "budgets.max_usd", 0.1234567),
    ("max_seconds", "-1", "budgets.max_seconds", -1),
    ("mode", "sideways", "mode", "sideways"),
])
def test_errors_match_the_yaml_ones_and_change_nothing(team, admin, field, value, path,
                                                        yaml_value):
    response = admin.post(reverse("policy_save", kwargs={"slug": team.slug, "name": "default"}),
                          form_data(**{field: value}))
    expected = yaml_error(team, {path: yaml_value})[path]
    if field == "mode":  # a select: Django refuses a value that is not an option first
        assert response.status_code == 422
    else:
        assert response.status_code == 422
        assert expected in response.content.decode()
    assert Policy.objects.get(team=team, name="default").current.version == 1


def test_inline_validation_returns_out_of_band_field_errors(team, admin):
    url = reverse("policy_validate", kwargs={"slug": team.slug, "name": "default"})
    response = admin.post(url, form_data(max_steps="0", max_usd="-2"), HTTP_HX_REQUEST="true")
    html = response.content.decode()
    assert response.status_code == 200
    assert 'id="err-max_steps"' in html and 'hx-swap-oob="true"' in html
    assert yaml_error(team, {"step_limits.max_steps": 0})["step_limits.max_steps"] in html
    assert "2 fields to fix" in html
    ok = admin.post(url, form_data(), HTTP_HX_REQUEST="true").content.decode()
    assert "Valid." in ok and "note" not in ok.split("</p>")[0]
    # Valid but not yet savable: the save asks for a note, and the validation says so first.
    no_note = admin.post(url, form_data(note=""), HTTP_HX_REQUEST="true").content.decode()
    assert "Valid. Add a note saying what changed to save it." in no_note
    new = reverse("policy_new_validate", kwargs={"slug": team.slug})
    created = admin.post(new, form_data(name="fresh", note=""), HTTP_HX_REQUEST="true")
    assert "Add a note" not in created.content.decode()  # a new policy's note is optional
    # The slots swapped are the editor's own: an existing policy's has no name field, and
    # the note's slot is always sent, so a refused save's note error does not stay.
    assert 'id="err-name"' not in no_note and 'id="err-note"' in no_note
    assert 'id="err-name"' in created.content.decode()


def test_a_policy_named_dash_is_validated_as_itself(team, admin):
    # "-" is a valid policy name ([a-z0-9_-]{1,50}), and it stood for the editor of a policy
    # not saved yet: the inline validation of a policy named "-" asked for its name (found
    # by an attacker). The new policy's editor validates at an address of its own.
    admin.post(reverse("policy_new", kwargs={"slug": team.slug}), form_data(name="-"))
    assert Policy.objects.filter(team=team, name="-").exists()
    editor = admin.get(reverse("policy", kwargs={"slug": team.slug, "name": "-"}))
    url = reverse("policy_validate", kwargs={"slug": team.slug, "name": "-"})
    assert f'hx-post="{url}"' in editor.content.decode()
    ok = admin.post(url, form_data(), HTTP_HX_REQUEST="true").content.decode()
    assert "Valid." in ok and 'id="err-name"' not in ok
    new_editor = admin.get(reverse("policy_new", kwargs={"slug": team.slug})).content.decode()
    assert f'hx-post="{reverse("policy_new_validate", kwargs={"slug": team.slug})}"' \
        in new_editor


def test_inline_validation_shows_a_warning_at_its_limit_in_its_slot(team, admin):
    url = reverse("policy_validate", kwargs={"slug": team.slug, "name": "default"})
    html = admin.post(url, form_data(warn_repeat_action="3"),
                      HTTP_HX_REQUEST="true").content.decode()
    slot = html.split('id="err-warn_repeat_action"')[1].split("</div>")[0]
    assert "must be below step_limits.max_repeat_action (3)" in slot
    # Three empty boxes: no warnings at all (a null block, as an older version has).
    admin.post(reverse("policy_save", kwargs={"slug": team.slug, "name": "default"}),
               form_data(warn_repeat_action="", warn_no_progress="", warn_budget_fraction=""))
    assert current(team)["warnings"] is None


def test_a_save_refused_for_its_note_shows_the_error_where_validation_clears_it(team, admin):
    save = reverse("policy_save", kwargs={"slug": team.slug, "name": "default"})
    refused = admin.post(save, form_data(max_steps="20", note=""))
    assert refused.status_code == 422
    html = refused.content.decode()
    slot = html[html.index('id="err-note"'):]
    assert slot.index("Say what changed and why") < slot.index("</div>")
    assert Policy.objects.get(team=team, name="default").current.version == 1


def test_a_new_policy_can_be_created_and_names_are_validated(team, admin):
    url = reverse("policy_new", kwargs={"slug": team.slug})
    assert admin.get(url).status_code == 200
    bad = admin.post(url, form_data(name="Bad Name"))
    assert bad.status_code == 422 and "pattern" in bad.content.decode()
    assert admin.post(url, form_data(name="strict", max_steps="5")).status_code == 302
    assert Policy.objects.get(team=team, name="strict").current.document["step_limits"][
        "max_steps"] == 5
    again = admin.post(url, form_data(name="strict"))
    assert again.status_code == 422 and "already exists" in again.content.decode()


def test_the_page_counts_running_runs_on_older_versions(team, admin):
    token = agent_key_create(team=team, name="k").token
    started = Client().post("/api/v1/runs", {"agent": "a"}, content_type="application/json",
                            HTTP_AUTHORIZATION=f"Bearer {token}")
    assert started.status_code == 201
    admin.post(reverse("policy_save", kwargs={"slug": team.slug, "name": "default"}),
               form_data(max_steps="9"))
    html = admin.get(reverse("policy", kwargs={"slug": team.slug, "name": "default"})
                     ).content.decode()
    assert 'data-old-running="1"' in html and "running runs keep the version" in html
    listing = admin.get(reverse("policies", kwargs={"slug": team.slug})).content.decode()
    assert "1 running run" in listing
    # Money in cents, as on every page; the saved version names who saved it (found by a
    # newcomer: "1.0", and "by demo" for a version the demo made, which History says is its
    # source).
    assert '<td class="num">$1.00</td>' in listing and "by admin" in listing


def test_history_shows_a_diff_between_any_two_versions(team, admin):
    save = reverse("policy_save", kwargs={"slug": team.slug, "name": "default"})
    admin.post(save, form_data(max_steps="10"))
    admin.post(save, form_data(max_steps="12", mode="shadow"))
    url = reverse("policy_history", kwargs={"slug": team.slug, "name": "default"})
    latest = admin.get(url).content.decode()
    assert "v2 → v3" in latest
    assert "-  max_steps: 10" in latest and "+  max_steps: 12" in latest
    chosen = admin.get(url, {"a": 1, "b": 3}).content.decode()
    assert "-  max_steps: 18" in chosen and "+mode: shadow" in chosen


def test_export_is_the_apply_policies_format_and_imports_back_unchanged(team, admin):
    export = admin.get(reverse("policies_export", kwargs={"slug": team.slug}))
    assert export["Content-Type"].startswith("application/yaml")
    data = yaml.safe_load(export.content)
    assert data["teams"][0]["slug"] == team.slug
    parse_document(data)  # valid for apply_policies
    response = admin.post(reverse("policies_import", kwargs={"slug": team.slug}),
                          {"document": export.content.decode()})
    assert response.status_code == 302
    assert Policy.objects.get(team=team, name="default").current.version == 1


def test_import_applies_the_document_for_this_team(team, admin):
    document = f"""
teams:
  - slug: {team.slug}
    name: Support team
    policies:
      - name: default
        step_limits: {{max_steps: 5, max_repeat_action: 2, no_progress_window: 3}}
      - name: batch
        mode: shadow
        step_limits: {{max_steps: 50, max_repeat_action: 5, no_progress_window: 8}}
"""
    response = admin.post(reverse("policies_import", kwargs={"slug": team.slug}),
                          {"document": document})
    assert response.status_code == 302
    assert current(team)["step_limits"]["max_steps"] == 5
    assert Policy.objects.get(team=team, name="batch").current.source == "import"
    team.refresh_from_db()
    assert team.name == "Support team"


def test_import_refuses_a_document_naming_another_team(team, other_team, admin):
    document = f"""
teams:
  - slug: {team.slug}
    policies:
      - name: default
        step_limits: {{max_steps: 5, max_repeat_action: 2, no_progress_window: 3}}
  - slug: {other_team.slug}
    name: Taken over
"""
    response = admin.post(reverse("policies_import", kwargs={"slug": team.slug}),
                          {"document": document})
    html = response.content.decode()
    assert response.status_code == 422
    assert "teams[1].slug" in html and "only" in html
    assert current(team)["step_limits"]["max_steps"] == 18  # nothing half applied
    other_team.refresh_from_db()
    assert other_team.name == "Billing"


def test_import_shows_each_invalid_field_and_applies_nothing(team, admin):
    document = f"""
teams:
  - slug: {team.slug}
    policies:
      - name: default
        step_limits: {{max_steps: 0, max_repeat_action: 2, no_progress_window: 3}}
        colour: blue
"""
    html = admin.post(reverse("policies_import", kwargs={"slug": team.slug}),
                      {"document": document}).content.decode()
    assert "teams[0].policies[0].step_limits.max_steps" in html
    assert "teams[0].policies[0].colour" in html and "unknown field" in html
    assert current(team)["step_limits"]["max_steps"] == 18


def test_import_of_text_that_is_not_yaml_says_so(team, admin):
    html = admin.post(reverse("policies_import", kwargs={"slug": team.slug}),
                      {"document": "teams: [unclosed"}).content.decode()
    assert "not valid YAML" in html


def test_a_viewer_sees_the_policy_read_only(team, users):
    client = Client()
    client.force_login(users["viewer"])
    html = client.get(reverse("policy", kwargs={"slug": team.slug, "name": "default"})
                      ).content.decode()
    assert "<fieldset disabled>" in html.replace(" >", ">")
    # No inline validation or save (the backtest panel, which viewers may use, posts too).
    validate = reverse("policy_validate", kwargs={"slug": team.slug, "name": "default"})
    assert f'hx-post="{validate}"' not in html and "Save as version" not in html
    assert "Read only" in html


# --- SPEC 12 rate limits and SPEC 14 max_idle_seconds in the editor ---------------------------

def test_rate_limits_are_edited_one_rule_per_line(team, admin):
    url = reverse("policy_save", kwargs={"slug": team.slug, "name": "default"})
    admin.post(url, form_data(rate_limits="http.* agent 10 60\nmail send * team 5 3600",
                              max_idle_seconds="600"))
    assert current(team)["rate_limits"] == [
        {"match": "http.*", "per": "agent", "max": 10, "window_s": 60},
        {"match": "mail send *", "per": "team", "max": 5, "window_s": 3600},
    ]
    assert current(team)["budgets"]["max_idle_seconds"] == 600
    page = admin.get(reverse("policy", kwargs={"slug": team.slug, "name": "default"}))
    assert "http.* agent 10 60" in page.content.decode()
    assert 'value="600"' in page.content.decode()


@pytest.mark.parametrize(("lines", "words"), [
    ("http.* agent", "line 1: max and window_s missing: write a rule as match per max window_s"),
    ("http.* agnt 10", "line 1: window_s missing; per is run, agent or team, not 'agnt'"),
    ("http.* user 10 60", "line 1: per: Input should be 'run', 'agent' or 'team'"),
    ("a run 1 1\nhttp.* agent 0 60", "line 2: max: Input should be greater than or equal to 1"),
    ("http.* agent 10 86401", "line 1: window_s: Input should be less than or equal to 86400"),
])
def test_a_bad_rate_limit_line_is_refused_naming_the_line(team, admin, lines, words):
    url = reverse("policy_save", kwargs={"slug": team.slug, "name": "default"})
    response = admin.post(url, form_data(rate_limits=lines))
    assert words in html.unescape(response.content.decode())
    assert current(team)["rate_limits"] == []


def test_the_diff_shows_a_new_rate_limit(team, admin):
    url = reverse("policy_save", kwargs={"slug": team.slug, "name": "default"})
    admin.post(url, form_data(rate_limits="http.* agent 10 60"))
    page = admin.get(reverse("policy_history", kwargs={"slug": team.slug, "name": "default"}))
    text = page.content.decode()
    assert "+rate_limits:" in text
    # The key order of a stored document is the database's (jsonb sorts keys by length).
    assert re.search(r'class="diff-add">\+[ -]*match: http\.\*<', text), text


def test_a_rate_limit_line_may_have_commas_between_its_parts(team, admin):
    """Found by a newcomer: "http.*, agent, 10, 60", written as the list boxes take their
    items, was refused ("per: Input should be 'run', 'agent' or 'team'", "max: Input should
    be a valid integer"). A comma inside a glob's set stays the pattern's."""
    url = reverse("policy_save", kwargs={"slug": team.slug, "name": "default"})
    response = admin.post(url, form_data(rate_limits="http.*, agent, 10, 60,\n"
                                                     "db.[a,b]* run 5 30"))
    assert response.status_code == 302, html.unescape(response.content.decode())[:2000]
    assert current(team)["rate_limits"] == [
        {"match": "http.*", "per": "agent", "max": 10, "window_s": 60},
        {"match": "db.[a,b]*", "per": "run", "max": 5, "window_s": 30},
    ]
