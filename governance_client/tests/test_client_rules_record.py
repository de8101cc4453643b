"""rules.record_outcome counts a decision made elsewhere exactly as evaluate counts its own."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

from hypothesis import given
from hypothesis import strategies as st

from governance_client import rules

NOW = datetime(2026, 1, 1, tzinfo=UTC)
checks = st.builds(
    rules.Check,
    name=st.sampled_from(["search", "edit", "fetch"]),
    type=st.sampled_from(["tool", "llm"]),
    args=st.dictionaries(st.sampled_from(["q", "n"]), st.integers(0, 2), max_size=2),
    progress=st.none() | st.integers(0, 3),
    last_result=st.none() | st.builds(rules.LastResult, status=st.sampled_from(["ok", "error"]),
                                      digest=st.none() | st.sampled_from(["d1", "d2"]),
                                      error=st.none() | st.sampled_from(["boom", "bang"])),
    cost_usd=st.sampled_from([Decimal(0), Decimal("0.1")]),
)
POLICY = rules.Policy(max_steps=1000, max_repeat_action=1000, no_progress_window=1000,
                      max_seconds=None, max_usd=None)


@given(st.lists(checks, max_size=12))
def test_recorded_allows_count_as_evaluated_allows(sequence: list[rules.Check]) -> None:
    evaluated = recorded = rules.RunState(started_at=NOW - timedelta(seconds=1))
    for check in sequence:
        decision, evaluated = rules.evaluate(POLICY, evaluated, check, now=NOW)
        assert decision.outcome == rules.ALLOW
        mine, recorded = rules.record_outcome(POLICY, recorded, check, allowed=True,
                                              reason="step_ok", now=NOW)
        assert (mine.step, mine.repeat_key, mine.repeat_count) == (
            decision.step, decision.repeat_key, decision.repeat_count)
    assert recorded.memory() == evaluated.memory()
    assert (recorded.steps, recorded.tool_calls, recorded.cost_usd) == (
        evaluated.steps, evaluated.tool_calls, evaluated.cost_usd)


def test_a_recorded_stop_ends_the_run_with_its_reason() -> None:
    state = rules.RunState(started_at=NOW)
    decision, state = rules.record_outcome(POLICY, state, rules.Check(name="edit"),
                                           allowed=False, reason="loop_detected", now=NOW)
    assert (decision.outcome, state.status, state.stop_reason, state.steps) == (
        rules.STOP, rules.STOPPED, "loop_detected", 1)
    assert decision.next_action == rules.NEXT_ACTION["loop_detected"]
