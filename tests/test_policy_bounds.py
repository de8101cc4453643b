"""Issue 24, SPEC 10 "Bounded work per request": a policy document's parse and validation are
bounded before anything walks it. An alias bomb, deep nesting and a 5,000-digit number are
answered at once with a message (422 on the pages, exit 1 from the commands), never a 500, a
traceback or seconds of CPU, on every surface that reads a document: the import page, its
backtest (which viewers may use), the policy editor, `apply_policies` and `backtest --file`.

Each test that sends a hostile document runs under a deadline far above what the refusal takes
(milliseconds), so that a regression fails the test instead of hanging CI."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.conf import settings
from django.core.files.uploadedfile import SimpleUploadedFile
from django.core.management import CommandError, call_command
from django.test import Client
from django.urls import reverse

from backtests.models import Backtest
from policies.document import (
    MAX_DEPTH,
    MAX_DOCUMENT_BYTES,
    MAX_VALUES,
    DocumentError,
    load_yaml,
    parse_document,
    parse_policy,
)
from policies.models import Team

ROOT = Path(__file__).resolve().parent.parent
DEADLINE_S = 30


def alias_bomb(levels: int = 9) -> str:
    """A few hundred bytes: nine aliases of nine aliases ..., 9**levels values once expanded
    (the issue's document: each level multiplied the server's CPU time by nine)."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for level in range(1, levels):
        lines.append(f"l{level}: &l{level} [" + ", ".join([f"*l{level - 1}"] * 9) + "]")
    return "\n".join(lines) + f"\nteams: [{{slug: support, name: *l{levels - 1}}}]\n"


DEEP_FLOW = "teams: " + "[" * 5000 + "]" * 5000 + "\n"
DEEP_BLOCK = "teams:\n" + "".join("  " * i + "- k:\n" for i in range(1, 60))
HUGE_INT = ("teams:\n  - slug: support\n    policies:\n      - name: default\n"
            "        step_limits: {max_steps: " + "9" * 5000 + ", max_repeat_action: 3, "
            "no_progress_window: 4}\n")

# Each hostile document, and words of the message that refuses it.
HOSTILE = {
    "alias bomb": (alias_bomb(), f"at most {MAX_VALUES} values"),
    "deep flow nesting": (DEEP_FLOW, "nest"),
    "deep block nesting": (DEEP_BLOCK, f"at most {MAX_DEPTH} levels"),
    "5,000-digit integer": (HUGE_INT, "a number of more than 32 characters"),
}


@contextmanager
def deadline(seconds: float = DEADLINE_S) -> Iterator[None]:
    """Interrupt the test (in this, the main, thread) if what it runs takes longer."""
    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"not answered within {seconds} s: unbounded work")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def refusal(text: str | bytes) -> str:
    with deadline(), pytest.raises(DocumentError) as caught:
        load_yaml(text)
    return caught.value.errors["document"]


# --- Reading the text ------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_document_is_refused_before_it_is_built(name: str) -> None:
    text, words = HOSTILE[name]
    assert words in refusal(text)


def test_the_refusal_says_where() -> None:
    assert re.search(r": line 5, column \d+$", refusal(alias_bomb()))
    assert refusal("teams: []\nx: 1_000_000_000_000_000_000_000_000_000_000_000\n").endswith(
        "line 2, column 4")


@pytest.mark.parametrize("text", [
    "x: !!int '" + "1" * 5000 + "'",  # an explicit tag, quoted
    "x: 0x" + "f" * 5000,  # hexadecimal: no digit limit in Python, still unbounded work
    "x: 1." + "5" * 5000,
])
def test_every_spelling_of_a_long_number_is_refused(text: str) -> None:
    assert "a number of more than 32 characters" in refusal(text)


def test_an_alias_inside_its_own_anchor_is_refused() -> None:
    # PyYAML would build a list that contains itself: every walk of it would never end.
    assert "only after the whole value of its anchor &x" in refusal("a: &x [1, *x]\n")


def test_anchors_and_aliases_within_the_bounds_are_read() -> None:
    # PyYAML's own dump writes them for a value that appears twice.
    shared = {"max_steps": 5, "max_repeat_action": 2, "no_progress_window": 3}
    text = yaml.safe_dump({"teams": [{"slug": "support", "policies": [
        {"name": "a", "step_limits": shared}, {"name": "b", "step_limits": shared}]}]})
    assert "&id001" in text
    teams = parse_document(load_yaml(text))
    assert [p["step_limits"]["max_steps"] for p in teams[0]["policies"]] == [5, 5]


def test_a_key_written_twice_is_refused_where_it_is_written_again() -> None:
    # YAML's loaders keep the last one silently: this policy would be enforced while its
    # reader saw shadow (found by trying the Import page as an operator would).
    text = ("teams:\n  - slug: support\n    policies:\n      - name: default\n"
            "        mode: shadow\n        mode: enforce\n")
    words = refusal(text)
    assert "found the key 'mode' twice in one mapping" in words and "line 6, column 9" in words
    assert "twice" in refusal("- {x: 1, x: 2}\n")


def test_a_merge_may_still_be_overridden_by_the_mappings_own_keys() -> None:
    assert load_yaml("a: &x {b: 1}\nc:\n  <<: *x\n  b: 2\n") == {"a": {"b": 1}, "c": {"b": 2}}
    assert load_yaml("a: 1\nb: {a: 1}\n") == {"a": 1, "b": {"a": 1}}


def test_a_deep_alias_counts_as_the_levels_it_repeats() -> None:
    eight = "[" * 8 + "1" + "]" * 8
    assert f"at most {MAX_DEPTH} levels" in refusal(f"a: &a {eight}\nb: {eight.replace('1', '*a')}")


def test_the_size_is_bounded_before_reading() -> None:
    assert f"at most {MAX_DOCUMENT_BYTES // 1024} KiB" in refusal("#" * (MAX_DOCUMENT_BYTES + 1))
    assert "not UTF-8" in refusal(b"teams: [\xff]")


def test_a_value_yaml_reads_but_python_cannot_build_is_refused() -> None:
    assert "cannot be read: day is out of range" in refusal("teams: [{slug: 2024-02-30}]")


# --- Data that did not come from YAML text (JSON, forms) -------------------------------------

def test_data_from_elsewhere_has_the_same_bounds() -> None:
    deep: Any = "x"
    for _ in range(2000):  # deeper than Python's recursion limit
        deep = [deep]
    shared: Any = ["lol"] * 9
    for _ in range(9):
        shared = [shared] * 9
    limits = {"max_steps": 10**5000, "max_repeat_action": 3, "no_progress_window": 4}
    with deadline():
        for data, words in [({"teams": deep}, "nest"), ({"teams": shared}, "values"),
                            ({"teams": [{"slug": "x", "policies": [
                                {"name": "p", "step_limits": limits}]}]}, "digits")]:
            with pytest.raises(DocumentError) as caught:
                parse_document(data)
            assert words in caught.value.errors["document"]
        with pytest.raises(DocumentError) as caught:
            parse_policy({"name": "p", "step_limits": limits})
        assert "more than 32 digits" in caught.value.errors["policy"]


# --- The import page and its backtest --------------------------------------------------------

def client_of(user: Any) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.mark.django_db
@pytest.mark.parametrize("name", list(HOSTILE))
def test_the_import_page_answers_422_with_the_reason(team: Team, users: dict[str, Any],
                                                     name: str) -> None:
    text, words = HOSTILE[name]
    with deadline():
        response = client_of(users["admin"]).post(
            reverse("policies_import", kwargs={"slug": team.slug}), {"document": text})
    assert response.status_code == 422
    assert words in response.content.decode()
    assert team.policies.get(name="default").current.version == 1  # nothing applied


@pytest.mark.django_db
def test_an_upload_past_the_size_bound_is_refused_unread(team: Team, users: dict[str, Any]
                                                         ) -> None:
    upload = SimpleUploadedFile("big.yaml", b"#" * (MAX_DOCUMENT_BYTES * 4))
    response = client_of(users["admin"]).post(
        reverse("policies_import", kwargs={"slug": team.slug}), {"file": upload})
    assert response.status_code == 422
    assert f"at most {MAX_DOCUMENT_BYTES // 1024} KiB" in response.content.decode()


@pytest.mark.django_db
def test_a_paste_past_the_forms_limit_gets_a_page_that_says_what_to_do(
        team: Team, users: dict[str, Any]) -> None:
    # Django refuses a form body past DATA_UPLOAD_MAX_MEMORY_SIZE before the view runs; the
    # person saw a bare "Bad Request (400)".
    response = client_of(users["admin"]).post(
        reverse("policies_import", kwargs={"slug": team.slug}),
        {"document": "#" * (settings.DATA_UPLOAD_MAX_MEMORY_SIZE + 1)})
    assert response.status_code == 400
    page = response.content.decode()
    assert f"at most {MAX_DOCUMENT_BYTES // 1024} KiB: choose it as a file" in page
    assert 'href="/"' in page or "Back to the dashboard" in page
    assert team.policies.get(name="default").current.version == 1


@pytest.mark.django_db
@pytest.mark.parametrize("name", list(HOSTILE))
def test_the_import_pages_backtest_answers_422_to_a_viewer(team: Team, users: dict[str, Any],
                                                           name: str) -> None:
    text, words = HOSTILE[name]
    with deadline():
        response = client_of(users["viewer"]).post(
            reverse("backtest_import", kwargs={"slug": team.slug}), {"document": text})
    assert response.status_code == 422
    assert words in response.content.decode()
    assert not Backtest.objects.exists()


# --- The policy editor: a rate-limit line is free text ---------------------------------------

EDITOR = {"mode": "enforce", "max_steps": "18", "max_repeat_action": "3",
          "no_progress_window": "4", "max_seconds": "45", "max_usd": "1", "error_threshold": "3",
          "error_action": "nudge", "redact_args": "token", "note": "n"}


@pytest.mark.django_db
@pytest.mark.parametrize("url", ["policy_save", "policy_validate", "backtest_policy"])
def test_a_huge_number_in_a_rate_limit_line_is_a_form_error(team: Team, users: dict[str, Any],
                                                            url: str) -> None:
    who = "viewer" if url == "backtest_policy" else "admin"
    with deadline():
        response = client_of(users[who]).post(
            reverse(url, kwargs={"slug": team.slug, "name": "default"}),
            {**EDITOR, "rate_limits": "http.* agent " + "9" * 5000 + " 60"},
            HTTP_HX_REQUEST="true")
    assert response.status_code in (200, 422)  # the inline validation answers 200
    html = response.content.decode()
    if url == "backtest_policy":
        assert "The form has errors" in html
    else:
        assert "line 1: a number may have at most 32 characters" in html
    assert team.policies.get(name="default").current.version == 1


# --- The commands ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(HOSTILE))
def test_apply_policies_exits_1_with_the_reason(tmp_path: Path, name: str) -> None:
    text, words = HOSTILE[name]
    path = tmp_path / "policies.yaml"
    path.write_text(text, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "manage.py", "apply_policies", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=DEADLINE_S * 2, check=False,
    )
    assert done.returncode == 1
    assert words in done.stderr and str(path) in done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout == ""


def test_apply_policies_refuses_a_file_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("teams: [{slug: caf\u00e9}]".encode("latin-1"))
    with pytest.raises(CommandError, match="is not UTF-8 text"):
        call_command("apply_policies", str(path))


@pytest.mark.django_db
@pytest.mark.parametrize("name", list(HOSTILE))
def test_the_backtest_command_refuses_a_hostile_draft(team: Team, tmp_path: Path,
                                                      name: str) -> None:
    text, words = HOSTILE[name]
    path = tmp_path / "draft.yaml"
    path.write_text(text, encoding="utf-8")
    with deadline(), pytest.raises(CommandError) as caught:
        call_command("backtest", "--team", team.slug, "--policy", "default", "--file",
                     str(path), stdout=StringIO())
    assert words in str(caught.value)


# --- Lists a check walks, and a team's policies (SPEC 10: a check's work is bounded) --------

def test_a_pattern_list_is_capped(team):
    from policies.document import MAX_PATTERNS, parse_policy
    from policies.document import default_policy as default

    document = default("big")
    for path in (("tools", "deny"), ("tools", "allow"), ("approvals", "tools"),
                 ("repeat_key", "ignore_args")):
        many = [f"tool{i}.*" for i in range(MAX_PATTERNS + 1)]
        too_many = {**document, path[0]: {**document[path[0]], path[1]: many}}
        with pytest.raises(DocumentError) as refused:
            parse_policy(too_many)
        assert ".".join(path) in str(refused.value)
    with pytest.raises(DocumentError):
        parse_policy({**document, "redact_args": [f"k{i}" for i in range(MAX_PATTERNS + 1)]})
    parse_policy({**document, "tools": {"allow": None,
                                        "deny": [f"t{i}" for i in range(MAX_PATTERNS)]}})


def test_a_policys_patterns_are_bounded_in_characters_across_its_lists(team):
    # Found by an attacker: 768 patterns of 200 characters a version, in versions enough to
    # push them out of every cache, made each check compile them (1.3 s) again.
    from policies.document import MAX_PATTERN_CHARS, parse_policy
    from policies.document import default_policy as default

    document = default("big")
    long = [f"{'x' * 190}{i:04d}*" for i in range(MAX_PATTERN_CHARS // 195 + 1)]
    third = len(long) // 3
    spread = {**document, "tools": {"allow": long[:third], "deny": long[third:2 * third]},
              "approvals": {**document["approvals"], "tools": long[2 * third:]}}
    with pytest.raises(DocumentError) as refused:
        parse_policy(spread)
    assert "tools:" in str(refused.value) and f"at most {MAX_PATTERN_CHARS:,}" in str(
        refused.value)
    rules = [{"match": "y" * 200, "per": "run", "max": 1, "window_s": 1}] * 40
    with pytest.raises(DocumentError):
        parse_policy({**document, "tools": {"allow": None, "deny": long[:45]},
                      "rate_limits": rules})
    parse_policy({**document, "tools": {"allow": None, "deny": long[:third]},
                  "rate_limits": rules[:20]})


def test_a_team_has_a_bounded_number_of_policies(team, users, settings, monkeypatch):
    from policies import services
    from policies.document import default_policy as default

    monkeypatch.setattr(services, "MAX_POLICIES_PER_TEAM", 3)
    services.policy_save(team=team, document=default("second"), actor=None, source="test")
    services.policy_save(team=team, document=default("third"), actor=None, source="test")
    with pytest.raises(DocumentError):
        services.policy_save(team=team, document=default("fourth"), actor=None, source="test")
    # A new version of an existing policy is not a new policy.
    services.policy_save(team=team, document={**default("third"), "mode": "shadow"},
                         actor=None, source="test")
    from policies.forms import PolicyForm

    admin = Client()
    admin.force_login(users["admin"])
    data = {**PolicyForm.initial_from(default("fifth")), "name": "fifth", "note": "n"}
    data = {k: v for k, v in data.items() if v is not None}
    response = admin.post(f"/teams/{team.slug}/policies-new", data)
    assert response.status_code == 422
    assert b"at most 3 policies" in response.content


def test_a_teams_policies_have_a_bounded_number_of_rate_limit_rules(team, users, monkeypatch):
    # Found by an attacker: 40 policies of 50 rules each (2,000 rules, each matched and
    # counted by every action of the team) made the team's checks take seconds and another
    # team's p99 rise 15x.
    from policies import services
    from policies.document import default_policy as default
    from policies.forms import PolicyForm

    monkeypatch.setattr(services, "MAX_RATE_RULES_PER_TEAM", 4)

    def with_rules(name: str, maxes: list[int]) -> dict[str, Any]:
        return parse_policy({**default(name), "rate_limits": [
            {"match": "http.*", "per": "team", "max": m, "window_s": 60} for m in maxes]})

    services.policy_save(team=team, document=with_rules("a", [1, 2]), actor=None,
                         source="test")
    services.policy_save(team=team, document=with_rules("b", [2, 3, 4]), actor=None,
                         source="test")  # 4 distinct rules in all: the cap
    with pytest.raises(DocumentError) as refused:
        services.policy_save(team=team, document=with_rules("c", [5]), actor=None,
                             source="test")
    assert "at most 4 distinct rate-limit rules" in str(refused.value)
    with pytest.raises(DocumentError):
        services.policy_would_save(team=team, document=with_rules("c", [5]))
    # Reusing rules, or replacing a policy's own, fits.
    services.policy_save(team=team, document=with_rules("c", [1, 4]), actor=None,
                         source="test")
    services.policy_save(team=team, document=with_rules("a", [1, 3]), actor=None,
                         source="test")
    # The editor says so on its field.
    admin = Client()
    admin.force_login(users["admin"])
    data = {**PolicyForm.initial_from(with_rules("d", [9])), "name": "d", "note": "n"}
    data = {k: v for k, v in data.items() if v is not None}
    response = admin.post(f"/teams/{team.slug}/policies-new", data)
    assert response.status_code == 422
    assert b"distinct rate-limit rules" in response.content


def test_a_policys_set_ranges_are_bounded_in_the_code_points_they_span():
    # Found by an attacker: 81 deny patterns of 66 distinct ranges up to U+FFFF (16,200
    # characters, under the character bound) took 15 to 20 s to compile at a version's first
    # check in each process, past the database's idle-transaction timeout, and another
    # team's p99 rose 8 to 10 times.
    from policies.document import MAX_SET_SPAN
    from policies.document import default_policy as default

    def wide(seed: int) -> str:
        return "[" + "".join(chr(0x100 + seed * 66 + k) + "-\uffff" for k in range(66)) + "]"

    document = default("wide")
    for field in ({"tools": {"allow": None, "deny": [wide(0)]}},
                  {"approvals": {**document["approvals"], "tools": [wide(1)]}},
                  {"rate_limits": [{"match": wide(2), "per": "run", "max": 1,
                                    "window_s": 1}]}):
        with pytest.raises(DocumentError) as refused:
            parse_policy({**document, **field})
        assert "tools:" in str(refused.value) and f"at most {MAX_SET_SPAN:,}" in str(
            refused.value)
    # What names are made of, many times over, and one whole plane, are fine.
    parse_policy({**document, "tools": {"allow": None,
                                        "deny": ["[a-z][0-9A-Z]*" for _ in range(256)]}})
    parse_policy({**document, "tools": {"allow": None, "deny": ["[\u0001-\uffff]x"]}})
