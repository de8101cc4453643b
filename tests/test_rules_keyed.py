"""The keyed memory (governance_client.rules `keyed_reads`, `keyed_changes`): the server keeps
a run's repeat counts, progress values, result signatures and error counts as rows and hands
the rules a state holding only the entries the check names. These properties prove that this
changes no answer: over random lives of a run (checks, kills, rate-limit waits, approvals and
their settlements, local decisions, finishes), every rule decides the same from the reduced
state as from the whole memory, and the reduced state's changes, written back, give exactly
the whole memory's new state."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from governance_client.keys import repeat_key
from governance_client.rules import (
    APPROVED,
    CANCELLED,
    COMPLETED,
    DENIED,
    ERROR,
    EXPIRED,
    PROGRESS,
    REPEAT,
    RUNNING,
    SIGNATURE,
    STOPPED,
    Check,
    Entry,
    LastResult,
    Policy,
    RateLimit,
    RateWindow,
    RunState,
    evaluate,
    finish,
    keyed_changes,
    keyed_reads,
    progress_token,
    record_outcome,
    settle,
    settle_reads,
    terminal_decision,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_rules_properties import checks, policies

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
LIVES = settings(max_examples=150, deadline=None)

RULE = RateLimit(match="search.*", per="run", max=2, window_s=60)


def reduced(full: RunState, wanted: tuple[Entry, ...]) -> RunState:
    """What the server builds: the run's columns and fixed memory, and only the entries
    `wanted` names (those the store has)."""
    state = replace(full, repeat_counts={}, progress_seen=set(), signatures_seen=set(),
                    error_counts={})
    entries = full.keyed()
    return state.load_keyed({e: entries[e] for e in wanted if e in entries})


def written_back(full: RunState, before: RunState, after: RunState) -> RunState:
    """The whole memory as the store holds it once it wrote the reduced state's changes."""
    merged = replace(after, repeat_counts=dict(full.repeat_counts),
                     progress_seen=set(full.progress_seen),
                     signatures_seen=set(full.signatures_seen),
                     error_counts=dict(full.error_counts))
    return merged.load_keyed(keyed_changes(before, after))


def same_from_both(full: RunState, wanted: tuple[Entry, ...], step: Any
                   ) -> tuple[Any, RunState]:
    """Apply ``step`` (state -> (decision, state)) to the whole memory and to the reduced
    state: the same decision, and the same new state once the changes are written back."""
    part = reduced(full, wanted)
    snapshot = part.copy()
    decision, new_full = step(full)
    part_decision, new_part = step(part)
    assert part_decision == decision
    assert part == snapshot  # the rules never mutate their input
    assert written_back(full, part, new_part) == new_full
    # Only the entries the check names can change.
    assert set(keyed_changes(part, new_part)) <= set(wanted)
    return decision, new_full


steps = st.lists(
    st.one_of(
        st.tuples(st.just("check"), checks, st.none() | st.just("the team kill switch"),
                  st.booleans()),
        st.tuples(st.just("settle"), st.sampled_from([APPROVED, DENIED, EXPIRED, CANCELLED])),
        st.tuples(st.just("local"), checks, st.booleans()),
        st.tuples(st.just("finish"), st.sampled_from([COMPLETED, STOPPED])),
    ),
    max_size=40,
)


@LIVES
@given(policy=policies, approvals=st.booleans(), life=steps)
def test_every_rule_answers_the_same_from_the_entries_the_check_names(
    policy: Policy, approvals: bool, life: list[tuple[Any, ...]]
) -> None:
    if approvals:
        policy = replace(policy, approval_tools=("edit_*",), approval_timeout_s=30)
    state = RunState(started_at=T0)
    for i, (kind, *params) in enumerate(life):
        now = T0 + timedelta(seconds=i)
        if kind == "check":
            check, kill, full_window = params
            check = replace(check, check_id=f"c{i}")
            key = repeat_key(check.name, check.args, policy.ignore_args)
            rate = [RateWindow(RULE, now - timedelta(seconds=1) if full_window else None, now)]
            _, state = same_from_both(
                state, keyed_reads(check, key),
                lambda s, check=check, kill=kill, rate=rate, now=now: evaluate(
                    policy, s, check, now=now, kill=kill, rate=rate, approval_id="a"))
            # A terminal run's answer and a check refused for its deadline read the same key.
            same_from_both(state, keyed_reads(check, key),
                           lambda s, key=key: (terminal_decision(s, key), s))
        elif kind == "settle":
            (status,) = params
            if state.pending is None or state.status != RUNNING:
                continue
            _, state = same_from_both(
                state, settle_reads(state.pending),
                lambda s, status=status, now=now: settle(
                    s, status, now=now, by="alice", note="n", kill="k", policy=policy))
        elif kind == "local":
            check, allowed = params
            key = repeat_key(check.name, check.args, policy.ignore_args)
            _, state = same_from_both(
                state, keyed_reads(check, key),
                lambda s, check=check, allowed=allowed, now=now: record_outcome(
                    policy, s, check, allowed=allowed,
                    reason="step_ok" if allowed else "max_steps", now=now))
        else:
            (status,) = params
            if state.status != RUNNING:
                continue
            key = state.pending.repeat_key if state.pending else "none"
            _, state = same_from_both(
                state, ((REPEAT, key),),
                lambda s, status=status, now=now: (
                    None, finish(s, status, already_finished=False, now=now)))


def test_a_check_names_its_key_progress_signature_and_error() -> None:
    check = Check(name="search.docs", args={"q": "x"}, progress=1.0,
                  last_result=LastResult(status="error", error="  Boom  now "))
    assert keyed_reads(check, "k") == (
        (REPEAT, "k"), (PROGRESS, progress_token(1)), (SIGNATURE, "error:Boom now"),
        (ERROR, "Boom now"))
    digest = LastResult(status="ok", digest="d1")
    assert keyed_reads(Check(name="a", last_result=digest), "k") == (
        (REPEAT, "k"), (SIGNATURE, "d1"))
    assert keyed_reads(Check(name="a"), "k") == ((REPEAT, "k"),)


def test_the_keyed_memory_round_trips_and_changes_are_only_what_moved() -> None:
    state = RunState(started_at=T0, repeat_counts={"a": 2}, progress_seen={'"p"'},
                     signatures_seen={"d"}, error_counts={"boom": 3})
    entries = state.keyed()
    assert entries == {(REPEAT, "a"): 2, (PROGRESS, '"p"'): 1, (SIGNATURE, "d"): 1,
                       (ERROR, "boom"): 3}
    assert RunState(started_at=T0).load_keyed(entries) == state
    assert state.memory() == {**state.fixed_memory(), "repeat_counts": {"a": 2},
                              "progress_seen": ['"p"'], "signatures_seen": ["d"],
                              "error_counts": {"boom": 3}}
    after = state.copy()
    after.repeat_counts["a"] = 3
    after.progress_seen.add('"q"')
    assert keyed_changes(state, after) == {(REPEAT, "a"): 3, (PROGRESS, '"q"'): 1}
    assert keyed_changes(state, state.copy()) == {}
