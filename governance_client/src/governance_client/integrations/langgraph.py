"""LangGraph: govern a hand-built graph's prebuilt ``ToolNode`` (extra ``langgraph``).

One line, on the graph you already have::

    app = govern_graph(builder, run).compile()

``govern_graph`` finds the graph's ``ToolNode`` nodes, checks every tool call they run
before it runs (``run.check`` with the call's name, args and id) and reports each result
(``run.report``, per tool call id). A stopped call is not run: its ``ToolMessage`` is the stop
notice (``status="error"``, the decision in ``artifact["governance_stop"]``), and the graph
then ends through a ``governance_stop`` node whose ``AIMessage`` (``name="governance"``) is
the partial response with the stop's reason and next step. The repeated-error directive is
appended to the result of the call whose check carried it.

``GovernedToolNode(tools, run)`` is the drop-in ``ToolNode`` alone, for graphs that route out
of the tools node themselves: end the graph when ``stop_in(state, run)`` is not None (with
the run, it also says so on a new turn of a run that is over).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from langgraph.graph import END, START, StateGraph
from langgraph.prebuilt import ToolNode

from ._lc import (
    STOP_ARTIFACT,
    STOP_NAME,
    GovernedRun,
    PartialResponse,
    ToolCallGovernor,
    final_message,
    run_stop,
    stop_in,
)

__all__ = ["STOP_ARTIFACT", "STOP_NAME", "STOP_NODE", "GovernedToolNode", "govern_graph",
           "stop_in"]

STOP_NODE = "governance_stop"


class _Current:
    """The run a governed graph answers to now (``govern_graph`` again re-points it)."""

    def __init__(self, run: GovernedRun) -> None:
        self.run = run


_GOVERNED: weakref.WeakKeyDictionary[StateGraph[Any], _Current] = weakref.WeakKeyDictionary()


class GovernedToolNode(ToolNode):
    """``ToolNode`` whose every call is checked before it runs and reported after."""

    def __init__(self, tools: Sequence[Any], run: GovernedRun, **kwargs: Any) -> None:
        self.governor = ToolCallGovernor(run, nudge_in_result=True)
        super().__init__(tools, wrap_tool_call=self.governor.wrap,
                         awrap_tool_call=self.governor.awrap, **kwargs)


def govern_graph(
    builder: StateGraph[Any], run: GovernedRun, *, partial_response: PartialResponse | None = None
) -> StateGraph[Any]:
    """Govern every ``ToolNode`` of an uncompiled graph, in place; returns the builder.

    ``partial_response(state)`` gives the text the stop notice starts with (default: the
    model's last words). Each governed tools node must leave by plain edges
    (``add_edge("tools", "agent")``, as in LangGraph's prebuilt examples): they become a
    conditional edge that goes to ``governance_stop`` and END when governance stopped a call.
    Calling it again with the next run re-points the tool nodes at that run (compile after
    each call: a compiled graph shares the builder's tool nodes, so two runs at once need two
    builders, or ``GovernedToolNode``s of their own).
    """
    governed = []
    for name, spec in builder.nodes.items():
        node = spec.runnable
        if isinstance(node, ToolNode):
            if not isinstance(node, GovernedToolNode):
                governor = ToolCallGovernor(run, nudge_in_result=True)
                node._wrap_tool_call = governor.wrap
                node._awrap_tool_call = governor.awrap
            governed.append(name)
    if not governed:
        raise ValueError("the graph has no ToolNode to govern")

    current = _GOVERNED.get(builder)
    if current is not None:
        # Governed before (another run): the routes stand, only the run changes.
        current.run = run
        return builder
    current = _GOVERNED[builder] = _Current(run)

    def stop(state: Any) -> dict[str, Any]:
        decision = stop_in(state, current.run)
        assert decision is not None  # routed here only then
        return {"messages": [final_message(decision, state, partial_response)]}

    builder.add_node(STOP_NODE, stop)
    builder.add_edge(STOP_NODE, END)
    # A new turn on the thread of a run that is over ends at once, the model not called
    # again (the run's output stays its stop notice).
    starts = sorted(dst for src, dst in builder.edges if src == START)
    for target in starts:
        builder.edges.discard((START, target))
    if starts:
        def enter(state: Any, _targets: list[str] = starts) -> str | list[str]:
            if run_stop(current.run, state) is not None:
                return STOP_NODE
            return _targets if len(_targets) > 1 else _targets[0]

        builder.add_conditional_edges(START, enter, [*starts, STOP_NODE])
    for name in governed:
        targets = sorted(dst for src, dst in builder.edges if src == name)
        if not targets:
            raise ValueError(
                f"the tools node {name!r} has no plain edge out: route it yourself, ending "
                "the graph when governance_client.integrations.langgraph.stop_in(state) is set"
            )
        for target in targets:
            builder.edges.discard((name, target))

        def route(state: Any, _targets: list[str] = targets) -> str | list[str]:
            if stop_in(state) is not None:
                return STOP_NODE
            return _targets if len(_targets) > 1 else _targets[0]

        builder.add_conditional_edges(name, route, [*targets, STOP_NODE])
    return builder
