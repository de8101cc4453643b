"""A policy's patterns (SPEC 4.4 rule 3, 11, 12): matched as `fnmatch.fnmatchcase` matches,
compiled per policy rather than in fnmatch's process-wide cache, which one team's policy
versions could fill for every team (SPEC 10, found by an attacker)."""

from __future__ import annotations

import fnmatch
from datetime import UTC, datetime

from hypothesis import given
from hypothesis import strategies as st

from governance_client import rules

PATTERN = st.text(alphabet="ab.*?[]!-", max_size=12)
NAME = st.text(alphabet="ab.-*?[]!", max_size=10)


@given(PATTERN, NAME)
def test_a_pattern_matches_the_names_fnmatch_matches(pattern: str, name: str) -> None:
    expected = fnmatch.fnmatchcase(name, pattern)
    assert (rules.compile_glob(pattern).match(name) is not None) == expected
    policy = rules.Policy(deny=(pattern,), approval_tools=(pattern,),
                          rate_limits=(rules.RateLimit(pattern, "run", 1, 1),))
    assert (rules.tool_denied(policy, name) is not None) == expected
    assert (rules.approval_pattern(policy, name) == pattern) == expected
    assert policy.rate_limits[0].matches(name) == expected


def test_a_run_of_wildcards_is_compiled_as_its_questions_then_one_star() -> None:
    assert rules.compile_glob("*?*?x").pattern == fnmatch.translate("??*x")
    assert rules.compile_glob("a???b").pattern == fnmatch.translate("a???b")
    # A set may hold the wildcards as themselves: left as written.
    assert rules.compile_glob("[*?]*?").pattern == fnmatch.translate("[*?]*?")


def test_a_policys_patterns_stay_out_of_fnmatchs_process_wide_cache() -> None:
    fnmatch._compile_pattern.cache_clear()
    policy = rules.Policy(allow=("search.*", "files.*"), deny=("files.rm*",),
                          approval_tools=("pay.*",),
                          rate_limits=(rules.RateLimit("http.*", "agent", 5, 60),))
    now = datetime(2026, 12, 6, tzinfo=UTC)
    decision, _ = rules.evaluate(policy, rules.RunState(started_at=now),
                                 rules.Check(name="files.read"), now=now)
    assert decision.outcome == rules.ALLOW
    assert rules.tool_denied(policy, "shell.exec") is not None
    assert policy.rate_limits[0].matches("http.get")
    assert fnmatch._compile_pattern.cache_info().currsize == 0
    # Compiled once each, kept with the policy.
    assert set(policy._globs) == {"search.*", "files.*", "files.rm*", "pay.*"}
