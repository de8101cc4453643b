"""The policy document of SPEC section 3: validation (policies/document.py, pure) and applying it
(`policies.services.policy_apply` and `manage.py apply_policies`, on the database)."""

from __future__ import annotations

import copy
import io
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.core.management import CommandError, call_command

from policies.document import DocumentError, default_policy, parse_document, parse_policy
from policies.models import OperatorEvent, Policy, PolicyVersion, Team
from policies.services import policy_apply, team_ensure

ROOT = Path(__file__).resolve().parent.parent

STEP_LIMITS = {"max_steps": 18, "max_repeat_action": 3, "no_progress_window": 4}

# The SPEC 3 example, every default written out.
SPEC_DEFAULTS = {
    "name": "default",
    "mode": "enforce",
    "step_limits": {"max_steps": 18, "max_repeat_action": 3, "no_progress_window": 4},
    "budgets": {"max_seconds": 45, "max_usd": 1.0, "max_tool_calls": None,
                "max_idle_seconds": 3600},
    "tools": {"allow": None, "deny": []},
    "repeat_key": {"ignore_args": []},
    "on_repeated_error": {"threshold": 3, "action": "nudge"},
    "redact_args": ["password", "api_key", "token", "secret", "authorization"],
    "rate_limits": [],
    "approvals": {"tools": [], "timeout_s": 900},
    "warnings": {"repeat_action": 2, "no_progress": 3, "budget_fraction": 0.8},
}


def policy(name: str = "default", **fields: Any) -> dict[str, Any]:
    """The smallest valid policy, with ``fields`` merged one level deep."""
    out: dict[str, Any] = {"name": name, "step_limits": dict(STEP_LIMITS)}
    for key, value in fields.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def document(*teams: dict[str, Any]) -> dict[str, Any]:
    return {"teams": list(teams) or [{"slug": "support", "policies": [policy()]}]}


def one_policy(**fields: Any) -> dict[str, Any]:
    return document({"slug": "support", "policies": [policy(**fields)]})


def errors_of(data: Any) -> dict[str, str]:
    with pytest.raises(DocumentError) as caught:
        parse_document(data)
    return caught.value.errors


P = "teams[0].policies[0]"


# --- Defaults --------------------------------------------------------------------------------


def test_default_policy_is_the_spec_example() -> None:
    assert default_policy() == SPEC_DEFAULTS


def test_default_policy_takes_a_name() -> None:
    assert default_policy("strict") == {**SPEC_DEFAULTS, "name": "strict"}


def test_omitted_fields_take_their_defaults() -> None:
    (team,) = parse_document(document())

    # A team's name and webhook are not filled in: an existing team keeps its own.
    assert team == {"slug": "support", "policies": [SPEC_DEFAULTS]}


def test_omitted_keys_of_a_section_take_their_defaults() -> None:
    (team,) = parse_document(one_policy(budgets={"max_tool_calls": 50}, tools={"deny": ["x"]}))

    (parsed,) = team["policies"]
    assert parsed["budgets"] == {"max_seconds": 45, "max_usd": 1.0, "max_tool_calls": 50,
                                 "max_idle_seconds": 3600}
    assert parsed["tools"] == {"allow": None, "deny": ["x"]}


def test_null_budgets_mean_no_limit() -> None:
    budgets = {"max_seconds": None, "max_usd": None, "max_tool_calls": None,
               "max_idle_seconds": None}

    (team,) = parse_document(one_policy(budgets=budgets))

    assert team["policies"][0]["budgets"] == budgets


def test_a_full_document_is_kept_as_written() -> None:
    full = {
        "name": "strict",
        "mode": "shadow",
        "step_limits": {"max_steps": 10, "max_repeat_action": 2, "no_progress_window": 3},
        "budgets": {"max_seconds": 12.5, "max_usd": 0.25, "max_tool_calls": 8,
                    "max_idle_seconds": 600},
        "tools": {"allow": ["search.*", "crm.read"], "deny": ["crm.delete*"]},
        "repeat_key": {"ignore_args": ["request_id", "timestamp"]},
        "on_repeated_error": {"threshold": 2, "action": "stop"},
        "redact_args": ["password", "ssn"],
        "rate_limits": [{"match": "http.*", "per": "agent", "max": 10, "window_s": 60},
                        {"match": "mail.send", "per": "team", "max": 100, "window_s": 86400}],
        "approvals": {"tools": ["payments.*"], "timeout_s": 60},
        "warnings": {"repeat_action": 1, "no_progress": None, "budget_fraction": 0.5},
    }

    assert parse_policy(copy.deepcopy(full)) == full
    (team,) = parse_document(document({"slug": "support", "name": "Support",
                                       "webhook_url": "https://hooks.example.com/gov",
                                       "policies": [full]}))
    assert team == {"slug": "support", "name": "Support",
                    "webhook_url": "https://hooks.example.com/gov", "policies": [full]}


def test_a_team_without_policies_is_valid() -> None:
    (team,) = parse_document({"teams": [{"slug": "support"}]})

    assert team["policies"] == []


def test_a_document_without_teams_is_valid() -> None:
    assert parse_document({"teams": []}) == []


# --- Unknown keys ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "path"),
    [
        ({**document(), "version": 2}, "version"),
        (document({"slug": "support", "colour": "red"}), "teams[0].colour"),
        (one_policy(max_steps=18), f"{P}.max_steps"),
        (one_policy(step_limits={"max_step": 18}), f"{P}.step_limits.max_step"),
        (one_policy(budgets={"max_eur": 1}), f"{P}.budgets.max_eur"),
        (one_policy(tools={"block": ["x"]}), f"{P}.tools.block"),
        (one_policy(repeat_key={"ignore": ["x"]}), f"{P}.repeat_key.ignore"),
        (one_policy(on_repeated_error={"retries": 2}), f"{P}.on_repeated_error.retries"),
    ],
)
def test_an_unknown_key_is_an_error_naming_the_field(data: dict[str, Any], path: str) -> None:
    assert errors_of(data) == {path: "unknown field"}


# --- step_limits is required -----------------------------------------------------------------


def test_step_limits_is_required() -> None:
    data = document({"slug": "support", "policies": [{"name": "default"}]})

    assert errors_of(data) == {f"{P}.step_limits": "Field required"}


@pytest.mark.parametrize("missing", sorted(STEP_LIMITS))
def test_each_step_limit_is_required(missing: str) -> None:
    limits = {k: v for k, v in STEP_LIMITS.items() if k != missing}
    data = document({"slug": "support", "policies": [{"name": "x", "step_limits": limits}]})

    assert errors_of(data) == {f"{P}.step_limits.{missing}": "Field required"}


def test_a_policy_name_is_required() -> None:
    data = document({"slug": "support", "policies": [{"step_limits": STEP_LIMITS}]})

    assert list(errors_of(data)) == [f"{P}.name"]


def test_a_team_slug_is_required() -> None:
    assert list(errors_of({"teams": [{"name": "Support"}]})) == ["teams[0].slug"]


@pytest.mark.parametrize("data", [None, [], "teams: []", 3])
def test_a_document_must_be_a_mapping(data: Any) -> None:
    assert list(errors_of(data)) == ["document"]


def test_teams_is_required() -> None:
    assert errors_of({}) == {"teams": "Field required"}


@pytest.mark.parametrize("teams", [None, {"slug": "x"}, "support"])
def test_teams_must_be_a_list(teams: Any) -> None:
    assert list(errors_of({"teams": teams})) == ["teams"]


# --- Ranges ----------------------------------------------------------------------------------


def _set(section: str | None, key: str, value: Any) -> dict[str, Any]:
    if section is None:
        return one_policy(**{key: value})
    return one_policy(**{section: {key: value}})


RANGES = [
    # (section, key, valid values, invalid values)
    ("step_limits", "max_steps", [1, 18, 10000], [0, -1, 10001]),
    ("step_limits", "max_repeat_action", [1, 3, 1000], [0, -3, 1001]),
    ("step_limits", "no_progress_window", [1, 4, 1000], [0, -4, 1001]),
    ("on_repeated_error", "threshold", [1, 3, 1000], [0, -1, 1001]),
    ("budgets", "max_seconds", [0.001, 1, 45, 45.5, None], [0, -1, -0.5]),
    ("budgets", "max_usd", [0.000001, 0.5, 1, 1.123456, 999.99, None], [0, -1, -0.01]),
    ("budgets", "max_tool_calls", [1, 50, None], [0, -1]),
]


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [(s, k, v) for s, k, valid, _ in RANGES for v in valid],
)
def test_a_value_in_range_is_accepted(section: str, key: str, value: Any) -> None:
    (team,) = parse_document(_set(section, key, value))

    assert team["policies"][0][section][key] == value


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [(s, k, v) for s, k, _, invalid in RANGES for v in invalid],
)
def test_a_value_out_of_range_is_an_error_naming_the_field(
    section: str, key: str, value: Any
) -> None:
    errors = errors_of(_set(section, key, value))

    assert list(errors) == [f"{P}.{section}.{key}"]
    assert "greater than" in errors[f"{P}.{section}.{key}"] or "less than" in errors[
        f"{P}.{section}.{key}"
    ]


@pytest.mark.parametrize("value", [1.1234567, 0.0000001, 0.30000000000000004, 1e-7])
def test_max_usd_has_at_most_6_decimals(value: float) -> None:
    assert errors_of(_set("budgets", "max_usd", value)) == {
        f"{P}.budgets.max_usd": "must have at most 6 decimals"
    }


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ("step_limits", "max_steps"),
        ("step_limits", "max_repeat_action"),
        ("step_limits", "no_progress_window"),
        ("on_repeated_error", "threshold"),
        ("budgets", "max_seconds"),
        ("budgets", "max_usd"),
        ("budgets", "max_tool_calls"),
    ],
)
@pytest.mark.parametrize("value", [True, False])
def test_booleans_are_not_numbers(section: str, key: str, value: bool) -> None:
    assert list(errors_of(_set(section, key, value))) == [f"{P}.{section}.{key}"]


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ("step_limits", "max_steps"),
        ("step_limits", "max_repeat_action"),
        ("step_limits", "no_progress_window"),
        ("on_repeated_error", "threshold"),
        ("budgets", "max_tool_calls"),
    ],
)
@pytest.mark.parametrize("value", [2.5, "18", [3]])
def test_counts_must_be_integers(section: str, key: str, value: Any) -> None:
    errors = errors_of(_set(section, key, value))

    assert list(errors) == [f"{P}.{section}.{key}"]
    assert "integer" in errors[f"{P}.{section}.{key}"]


@pytest.mark.parametrize("key", ["max_seconds", "max_usd"])
@pytest.mark.parametrize("value", ["1.00", "45", [1], {"usd": 1}])
def test_amounts_must_be_numbers_and_the_message_says_so(key: str, value: Any) -> None:
    errors = errors_of(_set("budgets", key, value))

    assert list(errors) == [f"{P}.budgets.{key}"]
    assert "number" in errors[f"{P}.budgets.{key}"]


@pytest.mark.parametrize("mode", ["enforce", "shadow"])
def test_mode_is_enforce_or_shadow(mode: str) -> None:
    (team,) = parse_document(one_policy(mode=mode))

    assert team["policies"][0]["mode"] == mode


@pytest.mark.parametrize("mode", ["Shadow", "audit", "", None, True])
def test_any_other_mode_is_an_error(mode: Any) -> None:
    assert list(errors_of(one_policy(mode=mode))) == [f"{P}.mode"]


@pytest.mark.parametrize("action", ["nudge", "stop"])
def test_on_repeated_error_action_is_nudge_or_stop(action: str) -> None:
    (team,) = parse_document(one_policy(on_repeated_error={"action": action}))

    assert team["policies"][0]["on_repeated_error"]["action"] == action


@pytest.mark.parametrize("action", ["kill", "Nudge", None])
def test_any_other_on_repeated_error_action_is_an_error(action: Any) -> None:
    assert list(errors_of(one_policy(on_repeated_error={"action": action}))) == [
        f"{P}.on_repeated_error.action"
    ]


@pytest.mark.parametrize(
    ("section", "value", "path"),
    [
        ("tools", {"allow": "search.*"}, "tools.allow"),
        ("tools", {"allow": [""]}, "tools.allow[0]"),
        ("tools", {"deny": ["ok", 3]}, "tools.deny[1]"),
        ("tools", {"deny": None}, "tools.deny"),
        ("repeat_key", {"ignore_args": "request_id"}, "repeat_key.ignore_args"),
        ("repeat_key", {"ignore_args": [1]}, "repeat_key.ignore_args[0]"),
    ],
)
def test_pattern_and_name_lists_are_lists_of_strings(
    section: str, value: dict[str, Any], path: str
) -> None:
    assert list(errors_of(one_policy(**{section: value}))) == [f"{P}.{path}"]


@pytest.mark.parametrize("value", ["password", None, [""], [3]])
def test_redact_args_is_a_list_of_names(value: Any) -> None:
    errors = errors_of(one_policy(redact_args=value))

    assert len(errors) == 1
    assert next(iter(errors)).startswith(f"{P}.redact_args")


def test_an_empty_allow_list_is_kept_apart_from_no_allow_list() -> None:
    (team,) = parse_document(one_policy(tools={"allow": []}))

    assert team["policies"][0]["tools"]["allow"] == []


# --- Names, slugs, URLs ----------------------------------------------------------------------


@pytest.mark.parametrize("slug", ["support", "a", "team-2", "0", "x" * 50, "-"])
def test_a_slug_matching_the_pattern_is_accepted(slug: str) -> None:
    (team,) = parse_document(document({"slug": slug}))

    assert team["slug"] == slug


@pytest.mark.parametrize(
    "slug", ["Support", "sup_port", "sup port", "", "x" * 51, "support\n", "équipe", 7, None]
)
def test_a_slug_not_matching_the_pattern_is_an_error(slug: Any) -> None:
    assert list(errors_of(document({"slug": slug}))) == ["teams[0].slug"]


@pytest.mark.parametrize("name", ["default", "a", "strict_v2", "read-only", "x" * 50, "_"])
def test_a_policy_name_matching_the_pattern_is_accepted(name: str) -> None:
    (team,) = parse_document(document({"slug": "s", "policies": [policy(name)]}))

    assert team["policies"][0]["name"] == name


@pytest.mark.parametrize(
    "name", ["Default", "a.b", "a b", "", "x" * 51, "default\n", "défaut", 1, None]
)
def test_a_policy_name_not_matching_the_pattern_is_an_error(name: Any) -> None:
    assert list(errors_of(document({"slug": "s", "policies": [policy(name)]}))) == [f"{P}.name"]


@pytest.mark.parametrize("name", ["Customer support", "S", "x" * 200])
def test_a_team_name_is_free_text(name: str) -> None:
    (team,) = parse_document(document({"slug": "s", "name": name}))

    assert team["name"] == name


@pytest.mark.parametrize("name", ["", "x" * 201, 3])
def test_a_team_name_must_be_1_to_200_characters(name: Any) -> None:
    assert list(errors_of(document({"slug": "s", "name": name}))) == ["teams[0].name"]


@pytest.mark.parametrize(
    "url",
    [
        None,
        "https://hooks.example.com/governance",
        "http://93.184.215.14:8080/hook?team=support",
        "https://[2606:4700::1111]/x",
    ],
)
def test_a_webhook_url_is_an_http_url_or_null(url: str | None) -> None:
    (team,) = parse_document(document({"slug": "s", "webhook_url": url}))

    assert team["webhook_url"] == url


@pytest.mark.parametrize(
    "url",
    [
        "ftp://files.example.com/hook",
        "hooks.example.com/hook",
        "javascript:alert(1)",
        "http://",
        "https://",
        "https:///path-only",
        "http://exa mple.com/hook",
        "",
        3,
        "https://" + "x" * 500 + ".com",
        "http://10.0.0.5:8080/hook?team=support",  # not public (tests/test_webhook_targets.py)
        "https://localhost/x",
    ],
)
def test_anything_else_as_webhook_url_is_an_error(url: Any) -> None:
    assert list(errors_of(document({"slug": "s", "webhook_url": url}))) == ["teams[0].webhook_url"]


def test_two_policies_with_one_name_in_a_team_are_an_error_naming_it() -> None:
    data = document({"slug": "s", "policies": [policy("strict"), policy("strict"), policy()]})

    errors = errors_of(data)

    assert list(errors) == ["teams[0].policies"]
    assert "strict" in errors["teams[0].policies"]


def test_two_teams_with_one_slug_are_an_error_naming_it() -> None:
    errors = errors_of(document({"slug": "support"}, {"slug": "billing"}, {"slug": "support"}))

    assert list(errors) == ["teams"]
    assert "support" in errors["teams"]


def test_one_policy_name_in_two_teams_is_fine() -> None:
    teams = parse_document(document({"slug": "a", "policies": [policy("strict")]},
                                    {"slug": "b", "policies": [policy("strict")]}))

    assert [t["policies"][0]["name"] for t in teams] == ["strict", "strict"]


# --- Whole-document refusal ------------------------------------------------------------------


def test_every_bad_field_of_the_document_is_reported() -> None:
    data = document(
        {"slug": "support", "policies": [policy(step_limits={"max_steps": 0})]},
        {"slug": "Billing", "policies": [policy(budgets={"max_usd": 0})]},
    )

    errors = errors_of(data)

    assert set(errors) == {
        "teams[0].policies[0].step_limits.max_steps",
        "teams[1].slug",
        "teams[1].policies[0].budgets.max_usd",
    }


def test_the_error_message_names_the_field_and_the_rule() -> None:
    with pytest.raises(DocumentError) as caught:
        parse_document(one_policy(step_limits={"max_steps": 10001}))

    message = str(caught.value)
    assert "teams[0].policies[0].step_limits.max_steps" in message
    assert "10000" in message


def test_parse_policy_names_fields_from_the_policy() -> None:
    with pytest.raises(DocumentError) as caught:
        parse_policy(policy(budgets={"max_tool_calls": 0}, extra=1))

    assert set(caught.value.errors) == {"budgets.max_tool_calls", "extra"}


@pytest.mark.parametrize("data", [None, [], "default"])
def test_parse_policy_wants_a_mapping(data: Any) -> None:
    with pytest.raises(DocumentError) as caught:
        parse_policy(data)

    assert list(caught.value.errors) == ["policy"]


def test_parsing_leaves_the_input_alone() -> None:
    data = one_policy(budgets={"max_usd": 0.5})
    before = copy.deepcopy(data)

    parse_document(data)

    assert data == before


# --- policy_apply ----------------------------------------------------------------------------


def counts() -> dict[str, int]:
    return {
        "teams": Team.objects.count(),
        "policies": Policy.objects.count(),
        "versions": PolicyVersion.objects.count(),
        "events": OperatorEvent.objects.count(),
    }


def current(slug: str, name: str = "default") -> PolicyVersion:
    row = Policy.objects.get(team__slug=slug, name=name)
    assert row.current is not None
    return row.current


def versions(slug: str, name: str = "default") -> list[int]:
    return sorted(
        PolicyVersion.objects.filter(policy__team__slug=slug, policy__name=name)
        .values_list("version", flat=True)
    )


TWO_TEAMS = {
    "teams": [
        {
            "slug": "support",
            "name": "Customer support",
            "webhook_url": "https://hooks.example.com/support",
            "policies": [
                policy(),
                policy("strict", mode="shadow", step_limits={"max_steps": 5},
                       budgets={"max_usd": 0.25}),
            ],
        },
        {"slug": "billing", "policies": [policy("batch", budgets={"max_seconds": None})]},
    ]
}


def test_applying_a_document_creates_its_teams_and_policies(db: Any) -> None:
    changes = policy_apply(data=copy.deepcopy(TWO_TEAMS))

    support = Team.objects.get(slug="support")
    assert (support.name, support.webhook_url) == (
        "Customer support",
        "https://hooks.example.com/support",
    )
    assert current("support").document == SPEC_DEFAULTS
    strict = current("support", "strict")
    assert strict.version == 1
    assert strict.source == "yaml"
    assert strict.document["mode"] == "shadow"
    assert strict.document["step_limits"]["max_steps"] == 5
    assert strict.document["budgets"] == {"max_seconds": 45, "max_usd": 0.25,
                                          "max_tool_calls": None, "max_idle_seconds": 3600}
    assert current("billing", "batch").document["budgets"]["max_seconds"] is None
    assert "team support: created" in changes
    assert "team billing: created" in changes
    assert "policy support/strict: version 1" in changes


def test_a_policy_named_in_the_file_is_its_first_version(db: Any) -> None:
    doc = document({"slug": "support", "policies": [policy(step_limits={"max_steps": 30})]})

    policy_apply(data=doc)

    assert versions("support") == [1]
    assert current("support").document["step_limits"]["max_steps"] == 30


def test_a_team_always_has_a_default_policy(db: Any) -> None:
    policy_apply(data=document({"slug": "support", "policies": [policy("strict")]},
                               {"slug": "billing"}))

    for slug in ("support", "billing"):
        assert current(slug).document == SPEC_DEFAULTS
    assert set(Policy.objects.filter(team__slug="support").values_list("name", flat=True)) == {
        "default",
        "strict",
    }


def test_a_team_name_defaults_to_its_slug(db: Any) -> None:
    policy_apply(data=document({"slug": "billing"}))

    assert Team.objects.get(slug="billing").name == "billing"


def test_reapplying_the_same_document_creates_no_version(db: Any) -> None:
    policy_apply(data=copy.deepcopy(TWO_TEAMS))
    before = counts()

    changes = policy_apply(data=copy.deepcopy(TWO_TEAMS))

    assert changes == []
    assert counts() == before


def test_reapplying_an_equivalent_document_creates_no_version(db: Any) -> None:
    policy_apply(data=document({"slug": "support", "policies": [policy()]}))
    before = counts()

    spelled_out = {**SPEC_DEFAULTS, "budgets": {"max_seconds": 45.0, "max_usd": 1,
                                                "max_tool_calls": None}}
    changes = policy_apply(data=document({"slug": "support", "name": "support",
                                          "policies": [spelled_out]}))

    assert changes == []
    assert counts()["versions"] == before["versions"]


def test_a_changed_policy_gets_exactly_one_new_version(db: Any) -> None:
    policy_apply(data=copy.deepcopy(TWO_TEAMS))
    before = counts()
    changed = copy.deepcopy(TWO_TEAMS)
    changed["teams"][0]["policies"][1]["step_limits"]["max_steps"] = 6

    changes = policy_apply(data=changed)

    assert changes == ["policy support/strict: version 2"]
    assert counts()["versions"] == before["versions"] + 1
    assert versions("support", "strict") == [1, 2]
    assert current("support", "strict").document["step_limits"]["max_steps"] == 6
    assert versions("support") == [1]
    assert versions("billing", "batch") == [1]


def test_an_old_version_is_never_edited(db: Any) -> None:
    policy_apply(data=copy.deepcopy(TWO_TEAMS))
    first = current("support", "strict")
    changed = copy.deepcopy(TWO_TEAMS)
    changed["teams"][0]["policies"][1]["mode"] = "enforce"

    policy_apply(data=changed)

    first.refresh_from_db()
    assert first.document["mode"] == "shadow"
    assert current("support", "strict").document["mode"] == "enforce"


def test_an_omitted_field_goes_back_to_its_default(db: Any) -> None:
    policy_apply(data=one_policy(budgets={"max_usd": 5}))
    before = versions("support")

    changes = policy_apply(data=one_policy())

    assert current("support").document["budgets"]["max_usd"] == 1.0
    assert versions("support") == [*before, before[-1] + 1]
    assert changes == [f"policy support/default: version {before[-1] + 1}"]


def test_teams_and_policies_absent_from_the_file_are_left_alone(db: Any) -> None:
    policy_apply(data=copy.deepcopy(TWO_TEAMS))
    before = counts()
    strict = current("support", "strict")

    policy_apply(data=document({"slug": "support", "name": "Customer support",
                                "webhook_url": "https://hooks.example.com/support",
                                "policies": [policy()]}))

    assert counts() == before
    assert current("support", "strict") == strict
    assert Team.objects.filter(slug="billing").exists()


def test_an_invalid_document_changes_nothing_at_all(db: Any) -> None:
    policy_apply(data=copy.deepcopy(TWO_TEAMS))
    before = counts()
    bad = copy.deepcopy(TWO_TEAMS)
    bad["teams"][0]["name"] = "Renamed"
    bad["teams"][0]["policies"][1]["step_limits"]["max_steps"] = 99
    bad["teams"].append({"slug": "newteam", "policies": [policy()]})
    bad["teams"].append({"slug": "broken", "policies": [policy(budgets={"max_usd": 0})]})

    with pytest.raises(DocumentError) as caught:
        policy_apply(data=bad)

    assert list(caught.value.errors) == ["teams[3].policies[0].budgets.max_usd"]
    assert counts() == before
    assert Team.objects.get(slug="support").name == "Customer support"
    assert current("support", "strict").document["step_limits"]["max_steps"] == 5
    assert not Team.objects.filter(slug__in=["newteam", "broken"]).exists()


def test_an_invalid_document_on_an_empty_database_creates_nothing(db: Any) -> None:
    bad = document({"slug": "support", "policies": [policy()]}, {"slug": "Bad Slug"})

    with pytest.raises(DocumentError):
        policy_apply(data=bad)

    assert counts() == {"teams": 0, "policies": 0, "versions": 0, "events": 0}


def test_applying_updates_a_team_made_elsewhere(db: Any, team: Team) -> None:
    policy_apply(data=document({"slug": team.slug, "name": "Support desk",
                                "webhook_url": "https://hooks.example.com/x"}))

    team.refresh_from_db()
    assert (team.name, team.webhook_url) == ("Support desk", "https://hooks.example.com/x")
    assert versions(team.slug) == [1]


def test_a_team_keeps_the_name_and_webhook_the_file_leaves_out(db: Any, team: Team) -> None:
    """Found by a newcomer: applying the README's example, which names no webhook, cleared
    the one set in Settings, saying only "name/webhook updated". What the file leaves out
    is kept; what it names, null included, is applied and said."""
    policy_apply(data=document({"slug": team.slug, "name": "Support desk",
                                "webhook_url": "https://hooks.example.com/x"}))
    assert policy_apply(data=document({"slug": team.slug})) == []
    team.refresh_from_db()
    assert (team.name, team.webhook_url) == ("Support desk", "https://hooks.example.com/x")

    changes = policy_apply(data=document({"slug": team.slug, "webhook_url": None}))
    team.refresh_from_db()
    assert team.webhook_url is None
    assert changes == [f"team {team.slug}: webhook cleared"]
    changes = policy_apply(data=document({"slug": team.slug, "name": "Desk",
                                          "webhook_url": "https://hooks.example.com/y"}))
    assert changes == [f"team {team.slug}: name 'Support desk' -> 'Desk', "
                       "webhook set to https://hooks.example.com/y"]


def test_every_new_version_is_an_operator_audit_event(db: Any) -> None:
    policy_apply(data=copy.deepcopy(TWO_TEAMS))
    changed = copy.deepcopy(TWO_TEAMS)
    changed["teams"][1]["policies"][0]["mode"] = "shadow"

    policy_apply(data=changed)

    event = OperatorEvent.objects.filter(action="policy.version").first()
    assert event is not None
    assert event.target == "batch"
    assert event.detail["version"] == 2
    assert event.detail["before"]["mode"] == "enforce"
    assert event.detail["after"]["mode"] == "shadow"


def test_team_ensure_gives_an_existing_team_a_default_policy(db: Any) -> None:
    bare = Team.objects.create(slug="bare", name="Bare")

    team_ensure(slug="bare")

    assert Policy.objects.filter(team=bare, name="default").exists()
    assert current("bare").document == SPEC_DEFAULTS


# --- manage.py apply_policies ----------------------------------------------------------------


def write(tmp_path: Path, data: Any, name: str = "policies.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


SPEC_YAML = """\
teams:
  - slug: support                # [a-z0-9-]{1,50}
    name: Customer support
    webhook_url: null            # optional: kill-switch notifications are POSTed here
    policies:
      - name: default            # [a-z0-9-_]{1,50}
        mode: enforce            # enforce | shadow
        step_limits:
          max_steps: 18          # 1..10000, required
          max_repeat_action: 3   # 1..1000, required
          no_progress_window: 4  # 1..1000, required
        budgets:                 # each optional; null = no limit
          max_seconds: 45        # > 0
          max_usd: 1.00          # > 0, up to 6 decimals
          max_tool_calls: null   # >= 1
        tools:
          allow: null            # null = all; else a list of glob patterns (fnmatch)
          deny: []               # glob patterns; deny wins over allow
        repeat_key:
          ignore_args: []        # arg names dropped before keying (e.g. request_id, timestamp)
        on_repeated_error:
          threshold: 3           # 1..1000
          action: nudge          # nudge | stop
        redact_args: [password, api_key, token, secret, authorization]
"""


def test_the_spec_example_applies_as_the_defaults(db: Any, tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC_YAML, encoding="utf-8")

    out = io.StringIO()

    call_command("apply_policies", str(path), stdout=out)

    assert current("support").document == SPEC_DEFAULTS
    assert versions("support") == [1]
    assert "team support: created" in out.getvalue()


def test_apply_policies_prints_what_changed(db: Any, tmp_path: Path) -> None:
    path = write(tmp_path, TWO_TEAMS)

    first, second = io.StringIO(), io.StringIO()

    call_command("apply_policies", str(path), stdout=first)
    call_command("apply_policies", str(path), stdout=second)

    assert "team support: created" in first.getvalue()
    assert "policy support/strict: version 1" in first.getvalue()
    assert second.getvalue().strip() == "no changes"


def test_apply_policies_refuses_an_invalid_file_naming_the_field(
    db: Any, tmp_path: Path
) -> None:
    call_command("apply_policies", str(write(tmp_path, TWO_TEAMS)), stdout=io.StringIO())
    before = counts()
    bad = copy.deepcopy(TWO_TEAMS)
    bad["teams"][0]["policies"][0]["step_limits"]["max_steps"] = 0
    bad["teams"][1]["policies"][0]["colour"] = "red"

    with pytest.raises(CommandError) as caught:
        call_command("apply_policies", str(write(tmp_path, bad, "bad.yaml")), stdout=io.StringIO())

    message = str(caught.value)
    assert "nothing was applied" in message
    assert "teams[0].policies[0].step_limits.max_steps" in message
    assert "teams[1].policies[0].colour: unknown field" in message
    assert counts() == before


def test_apply_policies_refuses_a_file_that_is_not_yaml(db: Any, tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("teams: [\n  - slug: x\n", encoding="utf-8")

    with pytest.raises(CommandError, match="not valid YAML"):
        call_command("apply_policies", str(path))

    assert counts()["teams"] == 0


def test_apply_policies_refuses_a_missing_file(db: Any, tmp_path: Path) -> None:
    with pytest.raises(CommandError, match="cannot read"):
        call_command("apply_policies", str(tmp_path / "nope.yaml"))


def test_apply_policies_refuses_an_empty_file(db: Any, tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("", encoding="utf-8")

    with pytest.raises(CommandError, match="document"):
        call_command("apply_policies", str(path))


def test_apply_policies_exits_1_naming_the_bad_field(tmp_path: Path) -> None:
    bad = document({"slug": "support", "policies": [policy(budgets={"max_usd": 0.1234567})]})

    done = subprocess.run(
        [sys.executable, "manage.py", "apply_policies", str(write(tmp_path, bad))],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )

    assert done.returncode == 1
    assert "teams[0].policies[0].budgets.max_usd: must have at most 6 decimals" in done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout == ""


# --- SPEC 12 rate limits and SPEC 14 max_idle_seconds -----------------------------------------

RULE = {"match": "http.*", "per": "agent", "max": 10, "window_s": 60}


@pytest.mark.parametrize(("rule", "path", "words"), [
    ({**RULE, "per": "user"}, "rate_limits[0].per", "'run', 'agent' or 'team'"),
    ({**RULE, "max": 0}, "rate_limits[0].max", "greater than or equal to 1"),
    ({**RULE, "max": 100_001}, "rate_limits[0].max", "less than or equal to 100000"),
    ({**RULE, "max": 2.5}, "rate_limits[0].max", "integer"),
    ({**RULE, "window_s": 0}, "rate_limits[0].window_s", "greater than or equal to 1"),
    ({**RULE, "window_s": 86_401}, "rate_limits[0].window_s", "less than or equal to 86400"),
    ({**RULE, "match": ""}, "rate_limits[0].match", "at least 1 character"),
    ({k: v for k, v in RULE.items() if k != "max"}, "rate_limits[0].max", "Field required"),
    ({**RULE, "burst": 3}, "rate_limits[0].burst", "unknown field"),
])
def test_a_bad_rate_limit_is_refused_naming_its_field(rule: dict, path: str, words: str) -> None:
    with pytest.raises(DocumentError) as caught:
        parse_policy(policy(rate_limits=[rule]))
    assert path in caught.value.errors, caught.value.errors
    assert words in caught.value.errors[path]


def test_rate_limits_default_to_none_and_keep_their_order() -> None:
    assert parse_policy(policy())["rate_limits"] == []
    rules = [RULE, {**RULE, "match": "http.get", "per": "run", "max": 1, "window_s": 1}]
    assert parse_policy(policy(rate_limits=rules))["rate_limits"] == rules


@pytest.mark.parametrize("bad", [0, -1, "60", True])
def test_max_idle_seconds_must_be_a_positive_number_or_null(bad: Any) -> None:
    with pytest.raises(DocumentError) as caught:
        parse_policy(policy(budgets={"max_idle_seconds": bad}))
    assert "budgets.max_idle_seconds" in caught.value.errors


def test_max_idle_seconds_defaults_to_an_hour_and_null_means_never() -> None:
    assert parse_policy(policy())["budgets"]["max_idle_seconds"] == 3600
    assert parse_policy(policy(budgets={"max_idle_seconds": None}))["budgets"][
        "max_idle_seconds"] is None


# --- SPEC 16: the warnings block ---------------------------------------------------------------

def test_a_new_policy_gets_the_spec_warnings() -> None:
    (team,) = parse_document(one_policy())
    assert team["policies"][0]["warnings"] == {"repeat_action": 2, "no_progress": 3,
                                               "budget_fraction": 0.8}


@pytest.mark.parametrize(("warnings", "field"), [
    ({"repeat_action": 3}, "warnings.repeat_action"),
    ({"repeat_action": 7}, "warnings.repeat_action"),
    ({"no_progress": 4}, "warnings.no_progress"),
    ({"budget_fraction": 1}, "warnings.budget_fraction"),
    ({"budget_fraction": 0}, "warnings.budget_fraction"),
    ({"repeat_action": 0}, "warnings.repeat_action"),
    ({"later": 1}, "warnings.later"),
])
def test_a_warning_at_or_past_its_limit_is_refused_naming_the_field(
        warnings: dict[str, Any], field: str) -> None:
    with pytest.raises(DocumentError) as caught:
        parse_document(one_policy(warnings=warnings))
    assert list(caught.value.errors) == [f"teams[0].policies[0].{field}"]


def test_one_refusal_names_every_bad_warning_with_the_other_fields_errors() -> None:
    """Found by a tester: a bad budget_fraction hid the count warnings past their limits,
    named only once it was fixed (SPEC 17: 422 naming each bad field)."""
    bad = {"repeat_action": 3, "no_progress": 4, "budget_fraction": 1.0}
    with pytest.raises(DocumentError) as caught:
        parse_document(one_policy(warnings=bad))
    assert sorted(caught.value.errors) == [
        f"teams[0].policies[0].warnings.{field}"
        for field in ("budget_fraction", "no_progress", "repeat_action")]
    with pytest.raises(DocumentError) as caught:
        parse_policy(policy(warnings=bad, mode="sometimes"))
    assert sorted(caught.value.errors) == ["mode", "warnings.budget_fraction",
                                           "warnings.no_progress", "warnings.repeat_action"]
    assert "below step_limits.max_repeat_action (3)" in caught.value.errors[
        "warnings.repeat_action"]
    # A limit that is itself refused is not compared with.
    with pytest.raises(DocumentError) as caught:
        parse_policy(policy(warnings={"repeat_action": 3},
                            step_limits={"max_steps": 5, "max_repeat_action": "3",
                                         "no_progress_window": 4}))
    assert list(caught.value.errors) == ["step_limits.max_repeat_action"]


def test_null_warnings_are_off_and_omitted_ones_fit_small_limits() -> None:
    (team,) = parse_document(one_policy(warnings=None))
    assert team["policies"][0]["warnings"] is None
    small = {"max_steps": 5, "max_repeat_action": 2, "no_progress_window": 1}
    (team,) = parse_document(one_policy(step_limits=small))
    assert team["policies"][0]["warnings"] == {"repeat_action": 1, "no_progress": None,
                                               "budget_fraction": 0.8}


def test_the_dashboards_yaml_is_what_the_pure_python_emitter_writes() -> None:
    """The pages dump documents with libyaml's emitter (fast): the text an operator reviews
    and exports is PyYAML's own for a policy as written, and reads back as the document
    whatever it holds (a long quoted line with a control character folds elsewhere)."""
    from policies.selectors import policy_yaml

    document = {**default_policy("pay"), "description": "ré " * 80}
    document["tools"] = {"allow": [f"tool.{i}.é*" for i in range(50)], "deny": ["x: y", "- z"]}
    assert policy_yaml(document) == yaml.safe_dump(document, sort_keys=False,
                                                   default_flow_style=False, allow_unicode=True)
    odd = {**document, "description": "ré " * 80 + "\u2028 end", "n": None, "t": "yes"}
    assert yaml.safe_load(policy_yaml(odd)) == odd
