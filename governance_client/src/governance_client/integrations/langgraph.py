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

Subgraphs (SPEC 20): a node that is a compiled graph (``add_node("research",
sub_builder.compile())``) runs as a sub-agent under a child run of the graph's run: each time
the node runs, a child run starts (its agent: the node's name), the subgraph's ``ToolNode``s
are governed by it (its checks count on the graph's run too, whose limits bound it), and it
is finished when the subgraph returns. A child's stop ends the subgraph with its notice; the
parent graph goes on (a child's stop does not stop its parent on the service). When the
graph ends there (the subgraph's node has no plain edge to another node), the graph's run
ends with that stop: finished ``stopped``, the notice as its output
(``Run.subagent_stopped``). A compiled graph whose
builder governance cannot reach, or a subgraph invoked from inside a node's own function,
is not seen: the first is refused (``ValueError`` saying how to wrap it), the second is the
author's to wrap (``with run.child(agent=...) as child:`` and ``govern_graph(sub, child)``).

``GovernedToolNode(tools, run)`` is the drop-in ``ToolNode`` alone, for graphs that route out
of the tools node themselves: end the graph when ``stop_in(state, run)`` is not None (with
the run, it also says so on a new turn of a run that is over).
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import weakref
from collections.abc import Sequence
from typing import Any

from langchain_core.runnables import RunnableConfig, RunnableLambda
from langgraph.graph import END, START, StateGraph
from langgraph.prebuilt import ToolNode
from langgraph.pregel import Pregel

from .._core import FinishStatus
from ..aio import AsyncRun
from ._lc import (
    STOP_ARTIFACT,
    STOP_NAME,
    GovernedRun,
    PartialResponse,
    ToolCallGovernor,
    final_message,
    messages_of,
    recorded_stop,
    run_stop,
    stop_in,
    text_of,
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
    subgraphs = _subgraphs(builder)
    governed = []
    for name, spec in builder.nodes.items():
        node = spec.runnable
        if isinstance(node, ToolNode):
            if not isinstance(node, GovernedToolNode):
                governor = ToolCallGovernor(run, nudge_in_result=True)
                node._wrap_tool_call = governor.wrap
                node._awrap_tool_call = governor.awrap
            governed.append(name)
    if not governed and not subgraphs:
        raise ValueError("the graph has no ToolNode to govern")

    current = _GOVERNED.get(builder)
    if current is not None:
        # Governed before (another run): the routes stand, only the run changes.
        current.run = run
        return builder
    current = _GOVERNED[builder] = _Current(run)
    for name, sub in subgraphs.items():
        builder.nodes[name] = dataclasses.replace(
            builder.nodes[name], runnable=_subgraph_node(name, sub, current, partial_response,
                                                         ends=_ends_graph(builder, name)))

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


_AGENT_CHARS = re.compile(r"[^A-Za-z0-9._-]")  # what a run's agent name may hold (SPEC 5)


def _subgraphs(builder: StateGraph[Any]) -> dict[str, Pregel[Any, Any]]:
    """The graph's nodes that are compiled graphs (subgraphs), by node name; a compiled
    graph whose builder governance cannot reach is refused."""
    found = {}
    for name, spec in builder.nodes.items():
        node = spec.runnable
        if isinstance(node, Pregel):
            if not isinstance(getattr(node, "builder", None), StateGraph):
                raise ValueError(
                    f"the node {name!r} is a compiled graph governance cannot look into, so "
                    "its sub-agent would run ungoverned. Wrap it in a node of your own that "
                    "starts a child run (with run.child(agent=...) as child:) and invokes "
                    "govern_graph(sub_builder, child).compile() there.")
            if _governable(node.builder):  # type: ignore[attr-defined]
                found[name] = node
    return found


def _ends_graph(builder: StateGraph[Any], name: str) -> bool:
    """Whether the graph may end after the node ``name``: no plain edge out of it to
    another node (its plain edges go to END, or it has none, or it routes itself)."""
    return all(dst == END for src, dst in builder.edges if src == name)


def _governable(builder: StateGraph[Any]) -> bool:
    """Whether a subgraph runs tools, itself or in a subgraph of its own."""
    return any(isinstance(spec.runnable, ToolNode)
               or (isinstance(spec.runnable, Pregel)
                   and (not isinstance(getattr(spec.runnable, "builder", None), StateGraph)
                        or _governable(spec.runnable.builder)))  # type: ignore[attr-defined]
               for spec in builder.nodes.values())


def _subgraph_node(name: str, sub: Pregel[Any, Any], current: _Current,
                   partial_response: PartialResponse | None, *, ends: bool
                   ) -> RunnableLambda[Any, Any]:
    """The subgraph ``sub`` as a node: each time it runs, under a new child run of the
    graph's run (SPEC 20), finished when it returns. ``ends``: the graph may end after it;
    a stop of the subgraph then tells the graph's run that its agent may end with it."""
    sub_builder: StateGraph[Any] = sub.builder  # type: ignore[attr-defined]
    agent = _AGENT_CHARS.sub("-", name)[:100] or "subgraph"
    checkpointer = getattr(sub, "checkpointer", None)

    def compiled(child: GovernedRun) -> Pregel[Any, Any]:
        # The author compiled this subgraph; what runs is its builder compiled again here,
        # under each child run, so LangGraph's warning that the earlier compile misses the
        # governance's nodes (printed once per node and edge added) does not apply.
        sub_builder.compiled = False
        return govern_graph(sub_builder, child,
                            partial_response=partial_response).compile(checkpointer=checkpointer)

    def finish(child: GovernedRun) -> FinishStatus:
        return child.exit_status()

    def stopped(parent: GovernedRun, child: GovernedRun, result: Any) -> None:
        # The subgraph ended on its stop, and nothing of the graph follows it: the graph's
        # run ends with that stop (found by a newcomer: it was finished completed, output
        # empty, while the user read the stop). If the graph goes on after all (a route of
        # its own back to the model), the parent's next check or sub-agent forgets it.
        stop = child.stop_decision
        if not ends or stop is None:
            return
        messages = messages_of(result)
        notice = None
        if messages and recorded_stop(messages[-1]) is not None:
            notice = text_of(messages[-1].content)
        parent.subagent_stopped(stop, notice)

    def invoke(state: Any, config: RunnableConfig) -> Any:
        parent = current.run
        if isinstance(parent, AsyncRun):
            raise TypeError("a graph governed by an AsyncRun runs with ainvoke / astream")
        child = parent.start_subagent(agent)
        try:
            result = compiled(child).invoke(state, config)
            stopped(parent, child, result)
            return result
        finally:
            child.finish(finish(child))

    async def ainvoke(state: Any, config: RunnableConfig) -> Any:
        parent = current.run
        if isinstance(parent, AsyncRun):
            child: GovernedRun = await parent.start_subagent(agent)
        else:
            child = await asyncio.to_thread(parent.start_subagent, agent)
        try:
            result = await compiled(child).ainvoke(state, config)
            stopped(parent, child, result)
            return result
        finally:
            if isinstance(child, AsyncRun):
                await child.finish(finish(child))
            else:
                await asyncio.to_thread(child.finish, finish(child))

    return RunnableLambda(invoke, afunc=ainvoke, name=name)
