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


def _parsed_span(pattern: str) -> int:
    """The code points below U+10000 that `re` visits compiling ``pattern``'s ranges, read
    from its own parse of fnmatch's translation (which merges a set's repeated ranges)."""
    from re import _parser  # type: ignore[attr-defined]

    def walk(items) -> int:  # type: ignore[no-untyped-def]
        total = 0
        for op, av in items:
            if op == _parser.IN:
                total += sum(max(0, min(hi, 0xFFFF) - lo + 1)
                             for kind, value in av if kind == _parser.RANGE
                             for lo, hi in [value])
            elif op == _parser.SUBPATTERN:
                total += walk(av[-1])
            elif op in (_parser.ATOMIC_GROUP,):
                total += walk(av)
        return total

    return walk(_parser.parse(fnmatch.translate(pattern)))


@given(st.text(alphabet="az!-[]*\u0100\uffff\U0001f600", max_size=16))
def test_a_patterns_set_span_is_at_least_what_re_visits_compiling_it(pattern: str) -> None:
    assert rules.glob_set_span(pattern) >= _parsed_span(pattern)


def test_a_patterns_set_span_counts_its_ranges_code_points() -> None:
    assert rules.glob_set_span("tool.[a-z]*") == 26
    assert rules.glob_set_span("[!a-c]x[0-9]") == 13
    assert rules.glob_set_span("[z-a]") == 0  # descending: dropped, as fnmatch drops it
    assert rules.glob_set_span("[a-z") == 0  # no closing bracket: a literal "["
    assert rules.glob_set_span("a-z*") == 0
    # A range past U+FFFF is visited up to it only (re keeps the rest apart).
    assert rules.glob_set_span("[\u0100-\U0010ffff]") == 0x10000 - 0x100
    # Found by an attacker: 200 characters of distinct wide ranges, 260 ms to compile.
    wide = "[" + "".join(chr(0x100 + k) + "-\uffff" for k in range(66)) + "]"
    assert rules.glob_set_span(wide) == _parsed_span(wide) > 4_000_000


def test_a_set_past_latin1_counts_at_least_its_table() -> None:
    # Found by an attacker: 3,240 sets of 3 characters past U+00FF, each a table re builds
    # (0.1 to 0.2 ms), 0.35 s a version within the character bound.
    assert rules.glob_set_span("[ĀĂĄ]") == rules.SET_PAST_LATIN1
    assert rules.glob_set_span("[éà]x[ĀĂ]") == rules.SET_PAST_LATIN1
    assert rules.glob_set_span("[\u0100-\uffff]") == 0xFFFF - 0x100 + 1
    assert rules.glob_set_span("Ā*") == 0  # a character outside a set is no table


def test_the_compiled_patterns_a_process_keeps_are_bounded_in_characters() -> None:
    # Found by a review: each policy version kept its compiled patterns for as long as the
    # store kept the version, 4,096 of them, about 2 GB at the document's pattern bounds.
    kept = rules._KeptGlobs(budget=30)
    first, second, third = (rules.Policy(deny=(n * 10 + "*",)) for n in "abc")  # 11 each
    for policy in (first, second):
        assert kept.compiled(policy, policy.deny[0]).match(policy.deny[0][0] * 12)
    assert len(first._globs) == len(second._globs) == 1 and kept._total == 22
    kept.compiled(third, third.deny[0])  # 33: the first compiled loses its own
    assert (first._globs, len(second._globs), len(third._globs)) == ({}, 1, 1)
    assert kept._total == 22
    # Compiled again at its next use, matching as before; the oldest then goes.
    assert kept.compiled(first, first.deny[0]).match("a" * 10) is not None
    assert (len(first._globs), second._globs, len(third._globs)) == (1, {}, 1)
    assert kept._total == 22


def test_threads_compiling_at_once_match_right_and_stay_near_the_bound() -> None:
    # No lock (the rules take none): threads compiling at once may miscount a pattern;
    # every match is still made with a compiled pattern, and the total is counted again
    # from what is held every RECOUNT compiles.
    import threading

    kept = rules._KeptGlobs(budget=2_000)
    kept.RECOUNT = 50
    policies = [rules.Policy(deny=tuple(f"p{n}.t{k}.*" for k in range(8))) for n in range(60)]
    failures: list[str] = []

    def work(offset: int) -> None:
        for round_ in range(30):
            policy = policies[(offset * 7 + round_) % len(policies)]
            for pattern in policy.deny:
                if kept.compiled(policy, pattern).match(pattern[:-1] + "x") is None:
                    failures.append(pattern)
                if kept.compiled(policy, pattern).match("other") is not None:
                    failures.append("other " + pattern)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    held = sum(its for _, its in kept._held.values())
    assert held <= 2_000 + 8 * 8 * 12  # the bound, give or take one policy a thread
