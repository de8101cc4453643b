"""Property-based tests of the pure rules: repeat-key canonicalization (SPEC 4.2) and the
invariants of SPEC 4.4 over random check sequences.

The repeat-key properties compare the implementation with an independent model of the SPEC
sentence: numbers by exact value (fractions), strings trimmed and collapsed, keys sorted,
booleans and null kept apart from numbers. Two args give the same key exactly when the model
says they are equivalent.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from fractions import Fraction
from typing import Any

import pytest
from governance_client.keys import repeat_key
from governance_client.rules import (
    ALLOW,
    RUNNING,
    STOP,
    TERMINAL,
    WOULD_STOP,
    Check,
    Decision,
    LastResult,
    Policy,
    RunState,
    abandon,
    evaluate,
    finish,
    kill,
    record_outcome,
    settle,
)
from hypothesis import assume, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.stack_independent

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
FAST = settings(max_examples=75, deadline=None)
SEQUENCES = settings(max_examples=100, deadline=None)

# --- JSON values and the model of SPEC 4.2 ---------------------------------------------------

WHITESPACE = " \t\n\r"

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**60), max_value=2**60)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
keys = st.text(max_size=8)
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(keys, children, max_size=4),
    max_leaves=12,
)
args_objects = st.dictionaries(keys, json_values, max_size=4)
names = st.text(min_size=1, max_size=30).filter(lambda s: ":" not in s)


def model(value: Any) -> Any:
    """SPEC 4.2 written independently: what must be equal for two args to share a key."""
    if value is None or isinstance(value, bool):
        return ["lit", value]
    if isinstance(value, int | float):
        return ["num", str(Fraction(value))]
    if isinstance(value, str):
        return ["str", " ".join(value.split())]
    if isinstance(value, list):
        return ["list", [model(v) for v in value]]
    return ["obj", sorted([k, model(v)] for k, v in value.items())]


def model_key(args: dict[str, Any], ignore: Sequence[str] = ()) -> str:
    return json.dumps(model({k: v for k, v in args.items() if k not in ignore}))


def reordered(value: Any, rnd: random.Random) -> Any:
    """The same value with the keys of every object in another order."""
    if isinstance(value, dict):
        items = list(value.items())
        rnd.shuffle(items)
        return {k: reordered(v, rnd) for k, v in items}
    if isinstance(value, list):
        return [reordered(v, rnd) for v in value]
    return value


def respaced(value: Any, rnd: random.Random) -> Any:
    """The same value with whitespace added around and inside every string value."""
    if isinstance(value, dict):
        return {k: respaced(v, rnd) for k, v in value.items()}
    if isinstance(value, list):
        return [respaced(v, rnd) for v in value]
    if isinstance(value, str):

        def gap(min_size: int) -> str:
            return "".join(rnd.choice(WHITESPACE) for _ in range(rnd.randint(min_size, 3)))

        return gap(0) + gap(1).join(value.split()) + gap(0)
    return value


def renumbered(value: Any) -> Any:
    """The same value with every integral number written the other way (1 <-> 1.0)."""
    if isinstance(value, dict):
        return {k: renumbered(v) for k, v in value.items()}
    if isinstance(value, list):
        return [renumbered(v) for v in value]
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and abs(value) <= 2**53:
        return float(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# --- Repeat-key canonicalization -------------------------------------------------------------


@FAST
@given(name=names, args=args_objects, seed=st.integers())
def test_reordering_keys_at_any_level_keeps_the_key(
    name: str, args: dict[str, Any], seed: int
) -> None:
    assert repeat_key(name, reordered(args, random.Random(seed))) == repeat_key(name, args)


@FAST
@given(name=names, args=args_objects, seed=st.integers())
def test_trimming_and_collapsing_whitespace_in_string_values_keeps_the_key(
    name: str, args: dict[str, Any], seed: int
) -> None:
    assert repeat_key(name, respaced(args, random.Random(seed))) == repeat_key(name, args)


@FAST
@given(name=names, args=args_objects)
def test_numbers_are_keyed_by_value(name: str, args: dict[str, Any]) -> None:
    assert repeat_key(name, renumbered(args)) == repeat_key(name, args)


@FAST
@given(name=names, arg=keys, path=st.lists(keys, max_size=3))
def test_true_is_not_1_and_false_is_not_0_nor_null(name: str, arg: str, path: list[str]) -> None:
    def nest(value: Any) -> dict[str, Any]:
        for key in reversed(path):
            value = {key: value}
        return {arg: value}

    spelled = [True, 1, 1.0, False, 0, 0.0, None, "true", "1"]
    distinct = {repeat_key(name, nest(v)) for v in spelled}

    assert repeat_key(name, nest(1)) == repeat_key(name, nest(1.0))
    assert repeat_key(name, nest(0)) == repeat_key(name, nest(0.0))
    assert len(distinct) == len(spelled) - 2


@FAST
@given(name=names, args=args_objects, ignored=st.lists(keys, min_size=1, max_size=3),
       extra=json_values)
def test_ignored_args_are_dropped_at_the_top_level(
    name: str, args: dict[str, Any], ignored: list[str], extra: Any
) -> None:
    with_extra = {**args, ignored[0]: extra}
    without = {k: v for k, v in args.items() if k not in ignored}

    assert repeat_key(name, with_extra, ignored) == repeat_key(name, without)
    assert repeat_key(name, with_extra, ignored) == repeat_key(name, without, ignored)


@FAST
@given(name=names, outer=keys, ignored=keys, a=json_values, b=json_values)
def test_ignored_args_are_kept_below_the_top_level(
    name: str, outer: str, ignored: str, a: Any, b: Any
) -> None:
    assume(outer != ignored)
    assume(model(a) != model(b))

    key_a = repeat_key(name, {outer: {ignored: a}}, [ignored])
    key_b = repeat_key(name, {outer: {ignored: b}}, [ignored])

    assert key_a != key_b


@FAST
@given(pair=st.lists(names, min_size=2, max_size=2, unique=True), args=args_objects)
def test_a_different_tool_name_gives_a_different_key(
    pair: list[str], args: dict[str, Any]
) -> None:
    a, b = pair

    assert repeat_key(a, args) != repeat_key(b, args)


@FAST
@given(name=names, a=args_objects, b=args_objects, ignored=st.lists(keys, max_size=2))
def test_args_share_a_key_exactly_when_they_are_equivalent(
    name: str, a: dict[str, Any], b: dict[str, Any], ignored: list[str]
) -> None:
    same_model = model_key(a, ignored) == model_key(b, ignored)

    assert (repeat_key(name, a, ignored) == repeat_key(name, b, ignored)) is same_model


@FAST
@given(name=names, args=args_objects, seed=st.integers())
def test_equivalent_spellings_combined_share_a_key(
    name: str, args: dict[str, Any], seed: int
) -> None:
    rnd = random.Random(seed)
    other = renumbered(respaced(reordered(args, rnd), rnd))

    assert model_key(other) == model_key(args)
    assert repeat_key(name, other) == repeat_key(name, args)


def test_missing_and_null_args_are_the_empty_object() -> None:
    assert repeat_key("search.docs", None) == repeat_key("search.docs", {})


@FAST
@given(name=names, args=args_objects)
def test_the_key_is_the_name_and_a_hex_digest_of_at_least_16_characters(
    name: str, args: dict[str, Any]
) -> None:
    key = repeat_key(name, args)
    prefix, _, digest = key.rpartition(":")

    assert prefix == name
    assert len(digest) >= 16
    assert int(digest, 16) >= 0


@FAST
@given(
    name=names,
    args=args_objects,
    a=st.sampled_from(["tool", "llm", "other"]),
    b=st.sampled_from(["tool", "llm", "other"]),
)
def test_the_action_type_is_not_part_of_the_key(
    name: str, args: dict[str, Any], a: str, b: str
) -> None:
    state = RunState(started_at=T0)
    first, _ = evaluate(Policy(), state, Check(name=name, type=a, args=args), now=T0)
    second, _ = evaluate(Policy(), state, Check(name=name, type=b, args=args), now=T0)

    assert first.repeat_key == second.repeat_key == repeat_key(name, args)


# --- Random check sequences ------------------------------------------------------------------

results = st.none() | st.builds(
    LastResult,
    status=st.sampled_from(["ok", "error"]),
    digest=st.none() | st.sampled_from(["d1", "d2", "d3"]),
    error=st.none() | st.sampled_from(["boom", " boom ", "bang"]),
)
checks = st.builds(
    Check,
    name=st.sampled_from(["search.docs", "edit_file", "llm.answer", "shell.exec"]),
    type=st.sampled_from(["tool", "llm", "other"]),
    args=st.fixed_dictionaries(
        {"q": st.sampled_from(["a", "b", " a "]), "request_id": st.integers(0, 3)}
    ),
    progress=st.none() | st.sampled_from(["p1", "p2", 1, 1.0, "1"]),
    last_result=results,
    cost_usd=st.decimals(min_value=0, max_value=Decimal("0.4"), places=6),
)
sequences = st.lists(checks, max_size=40)
usd = st.decimals(min_value=Decimal("0.000001"), max_value=Decimal("3"), places=6)
policies = st.builds(
    Policy,
    mode=st.sampled_from(["enforce", "shadow"]),
    max_steps=st.integers(1, 25),
    max_repeat_action=st.integers(1, 5),
    no_progress_window=st.integers(1, 5),
    max_seconds=st.none() | st.sampled_from([1, 5.5, 30]),
    max_usd=st.none() | usd,
    max_tool_calls=st.none() | st.integers(1, 10),
    allow=st.none() | st.just(("search.*", "llm.*", "edit_*")),
    deny=st.sampled_from([(), ("shell.*",)]),
    ignore_args=st.sampled_from([(), ("request_id",)]),
    error_threshold=st.integers(1, 4),
    error_action=st.sampled_from(["nudge", "stop"]),
)
# Every limit out of the way, so that a property switches on only the limit it is about.
LOOSE = {
    "max_steps": 10000,
    "max_repeat_action": 1000,
    "no_progress_window": 1000,
    "max_seconds": None,
    "max_usd": None,
    "max_tool_calls": None,
}


def run(
    policy: Policy,
    sequence: Sequence[Check],
    *,
    kill_at: int | None = None,
    seconds_per_check: float = 0,
) -> tuple[list[tuple[RunState, Decision, RunState]], RunState]:
    """Evaluate a sequence, checking on the way that no input state is ever mutated."""
    state = RunState(started_at=T0)
    trace = []
    for i, check in enumerate(sequence):
        now = T0 + timedelta(seconds=i * seconds_per_check)
        kill = "the global kill switch" if kill_at is not None and i >= kill_at else None
        snapshot = state.copy()
        decision, new = evaluate(policy, state, check, now=now, kill=kill)
        assert state == snapshot
        trace.append((state, decision, new))
        state = new
    return trace, state


@SEQUENCES
@given(limit=st.integers(1, 30), sequence=sequences)
def test_max_steps_n_allows_at_most_n_steps(limit: int, sequence: list[Check]) -> None:
    trace, state = run(Policy(**{**LOOSE, "max_steps": limit}), sequence)
    allowed = [d for _, d, _ in trace if d.answer == ALLOW]

    assert len(allowed) == min(limit, len(sequence))
    if len(sequence) > limit:
        assert (state.stop_reason, state.steps) == ("max_steps", limit + 1)


@SEQUENCES
@given(limit=st.integers(1, 5), sequence=sequences, ignore=st.sampled_from([(), ("request_id",)]))
def test_max_repeat_action_n_allows_each_call_at_most_n_times(
    limit: int, sequence: list[Check], ignore: tuple[str, ...]
) -> None:
    trace, state = run(Policy(**{**LOOSE, "max_repeat_action": limit}, ignore_args=ignore),
                       sequence)
    allowed: dict[str, int] = {}
    for _, decision, _ in trace:
        if decision.answer == ALLOW:
            allowed[decision.repeat_key] = allowed.get(decision.repeat_key, 0) + 1

    assert all(count <= limit for count in allowed.values())
    assert allowed == {k: v for k, v in state.repeat_counts.items() if v}
    if state.stop_reason == "loop_detected":
        stop = next(d for _, d, _ in trace if d.answer == STOP)
        assert allowed[stop.repeat_key] == limit == stop.repeat_count


@SEQUENCES
@given(limit=st.integers(1, 10), sequence=sequences)
def test_max_tool_calls_n_allows_at_most_n_tool_calls(limit: int, sequence: list[Check]) -> None:
    trace, state = run(Policy(**{**LOOSE, "max_tool_calls": limit}), sequence)
    allowed_tools = sum(
        1 for (_, d, _), c in zip(trace, sequence, strict=True)
        if d.answer == ALLOW and c.type == "tool"
    )

    assert allowed_tools <= limit
    assert state.tool_calls == allowed_tools
    if state.stop_reason is not None:
        assert state.stop_reason == "max_tool_calls"
        assert state.tool_calls == limit


@SEQUENCES
@given(limit=usd, sequence=sequences)
def test_max_usd_allows_no_check_once_the_spend_reaches_it(
    limit: Decimal, sequence: list[Check]
) -> None:
    trace, state = run(Policy(**{**LOOSE, "max_usd": limit}), sequence)

    for _, decision, after in trace:
        if decision.answer == ALLOW:
            assert after.cost_usd < limit
    if state.stop_reason is not None:
        assert state.stop_reason == "max_usd"
        assert state.cost_usd >= limit
    else:
        assert sum((c.cost_usd for c in sequence), Decimal(0)) < limit


@SEQUENCES
@given(policy=policies, sequence=sequences, kill_at=st.none() | st.integers(0, 40),
       pace=st.sampled_from([0, 0.5, 2]))
def test_the_step_counter_moves_on_every_check_of_a_running_run_only(
    policy: Policy, sequence: list[Check], kill_at: int | None, pace: float
) -> None:
    trace, _ = run(policy, sequence, kill_at=kill_at, seconds_per_check=pace)

    for before, decision, after in trace:
        if before.status == RUNNING:
            assert after.steps == before.steps + 1 == decision.step
        else:
            assert after == before
            assert decision.step == before.steps


@SEQUENCES
@given(policy=policies, sequence=sequences, kill_at=st.none() | st.integers(0, 40),
       pace=st.sampled_from([0, 0.5, 2]))
def test_shadow_mode_never_answers_stop_except_for_killed(
    policy: Policy, sequence: list[Check], kill_at: int | None, pace: float
) -> None:
    shadow = replace(policy, mode="shadow")

    trace, state = run(shadow, sequence, kill_at=kill_at, seconds_per_check=pace)

    for i, (_, decision, _) in enumerate(trace):
        if kill_at is None or i < kill_at:
            assert decision.answer == ALLOW
            assert decision.outcome in (ALLOW, WOULD_STOP)
            assert (decision.outcome == WOULD_STOP) is (decision.shadow is not None)
        else:
            assert (decision.answer, decision.reason) == (STOP, "killed")
    assert state.status in (RUNNING, "killed")


@SEQUENCES
@given(policy=policies, sequence=sequences, kill_at=st.none() | st.integers(0, 40),
       pace=st.sampled_from([0, 0.5, 2]))
def test_every_check_gets_exactly_one_answer_and_stops_are_final(
    policy: Policy, sequence: list[Check], kill_at: int | None, pace: float
) -> None:
    trace, state = run(policy, sequence, kill_at=kill_at, seconds_per_check=pace)
    answered = [d.answer for _, d, _ in trace]

    assert answered.count(ALLOW) + answered.count(STOP) == len(sequence)
    if STOP in answered:
        first = answered.index(STOP)
        assert answered[first:] == [STOP] * (len(sequence) - first)
        assert {d.reason for _, d, _ in trace[first:]} == {state.stop_reason}
        assert state.status in TERMINAL
    else:
        assert state.status == RUNNING


@SEQUENCES
@given(policy=policies, sequence=sequences, pace=st.sampled_from([0, 0.5, 2]))
def test_allows_carry_no_message_and_stops_carry_one(
    policy: Policy, sequence: list[Check], pace: float
) -> None:
    trace, _ = run(policy, sequence, seconds_per_check=pace)

    for _, decision, _ in trace:
        if decision.answer == ALLOW:
            assert decision.reason == "step_ok"
            assert decision.message is None and decision.next_action is None
        else:
            assert decision.message and decision.next_action


@SEQUENCES
@given(policy=policies, sequence=sequences, pace=st.sampled_from([0, 0.5, 2]))
def test_allowed_calls_are_what_the_counters_count(
    policy: Policy, sequence: list[Check], pace: float
) -> None:
    trace, state = run(policy, sequence, seconds_per_check=pace)
    allowed = [(d, c) for (_, d, _), c in zip(trace, sequence, strict=True) if d.answer == ALLOW]

    assert sum(state.repeat_counts.values()) == len(allowed)
    assert state.tool_calls == sum(1 for _, c in allowed if c.type == "tool")
    for _, decision, after in trace:
        if decision.answer == ALLOW:
            assert decision.repeat_count == after.repeat_counts[decision.repeat_key]


# --- A run that ends ends its wait (SPEC 10, "No impossible states") ------------------------

ENDINGS = ["local stop", "abandoned", "killed", "finished", "expired", "denied",
           "cancelled by a kill"]


@SEQUENCES
@given(policy=policies, sequence=st.lists(checks, max_size=10),
       ending=st.sampled_from(ENDINGS), waited=st.integers(0, 900))
def test_no_rule_leaves_an_ended_run_waiting_for_an_approval(
    policy: Policy, sequence: list[Check], ending: str, waited: int
) -> None:
    """Whatever ends a waiting run ends its wait: the state names no pending request, and
    the wait's seconds are paused time (until the expiry, for an expiry)."""
    policy = replace(policy, mode="enforce", allow=None, approval_tools=("payments.*",),
                     approval_timeout_s=600)
    _, state = run(policy, sequence)
    assume(state.status == RUNNING)
    asked = T0 + timedelta(seconds=1)
    _, waiting = evaluate(policy, state, Check(name="payments.refund", check_id="pay-1"),
                          now=asked, approval_id="a-1")
    assume(waiting.pending is not None)
    now = asked + timedelta(seconds=waited)
    if ending == "local stop":
        _, ended = record_outcome(policy, waiting, Check(name="search.docs"), allowed=False,
                                  reason="loop_detected", now=now)
    elif ending == "abandoned":
        # A waiting run has no idle deadline; one recorded by an older version could.
        ended = abandon(replace(waiting, idle_deadline=now), now=now)
    elif ending == "killed":
        ended = kill(waiting, now=now)
    elif ending == "finished":
        ended = finish(waiting, "completed", already_finished=False, now=now)
    else:
        status = {"expired": "expired", "denied": "denied"}.get(ending, "cancelled")
        _, ended = settle(waiting, status, now=now, note="no",
                          kill="the team kill switch" if status == "cancelled" else None)

    assert ended is not None and ended.status in TERMINAL
    assert ended.pending is None
    end = asked + timedelta(seconds=600) if ending == "expired" else now
    assert ended.paused_s == state.paused_s + (end - asked).total_seconds()
