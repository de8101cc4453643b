"""What the client puts in an agent's state survives LangGraph's checkpoint serializer."""

from __future__ import annotations

import logging
from typing import Any, TypedDict

import pytest

pytest.importorskip("langgraph")

from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.graph import END, START, StateGraph

from governance_client import Decision

STOP = Decision(decision="stop", reason="loop_detected", message="edit_file 3 times",
                next_action="Return the partial response.", step=4, usage={"steps": 4},
                limits={"max_steps": 18}, check_id="abc", call_id="call_4", local=True)


def round_trip(value: Any, saver: InMemorySaver) -> Any:
    class State(TypedDict):
        stop: Any

    graph = StateGraph(State)
    graph.add_node("n", lambda _state: {"stop": value})
    graph.add_edge(START, "n")
    graph.add_edge("n", END)
    app = graph.compile(checkpointer=saver)
    config = {"configurable": {"thread_id": "t"}}
    app.invoke({"stop": None}, config)
    return app.get_state(config).values["stop"]


def test_a_decision_kept_as_its_state_form_round_trips_without_warnings(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        back = round_trip(STOP.to_state(), InMemorySaver())

    assert Decision.from_state(back) == STOP
    assert Decision.from_state(back).user_notice("partial").startswith("partial")
    assert not [r for r in caplog.records if r.name.startswith("langgraph")]


def test_a_decision_object_is_rebuilt_as_a_decision() -> None:
    back = round_trip(STOP, InMemorySaver())
    assert isinstance(back, Decision) and back == STOP
    assert not back.allowed


def test_an_allowlisted_decision_round_trips_without_warnings(
    caplog: pytest.LogCaptureFixture,
) -> None:
    serde = JsonPlusSerializer(allowed_msgpack_modules=[("governance_client.decision",
                                                        "Decision")])
    with caplog.at_level(logging.WARNING):
        back = round_trip(STOP, InMemorySaver(serde=serde))
    assert back == STOP
    assert not [r for r in caplog.records if r.name.startswith("langgraph")]
