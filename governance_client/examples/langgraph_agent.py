"""A LangGraph agent governed by the check API: every tool call passes through a ``govern`` node.

    agent ──tool calls──▶ govern ──allowed──▶ tools ──▶ agent
      │                     │
      └──no tool call──▶ END ◀──stop (reason, message, next action)

The model is scripted (no network, no API key): it replays the seed article's rename loop.
The run is stopped with ``loop_detected`` at the 4th identical ``edit_file`` call, and the agent
answers with its partial response and the stop's reason and next action.

Run it: ``python governance_client/examples/langgraph_agent.py`` (against a real service with
GOVERNANCE_URL and GOVERNANCE_API_KEY (or GOVERNANCE_KEY) set, else against an
in-process fake).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import BaseTool, tool
from langgraph.graph import END, START, MessagesState, StateGraph

from governance_client import Decision, GovernanceClient, Run
from rename_loop import (
    AGENT,
    EDIT_ARGS,
    ITERATIONS,
    SYSTEM_PROMPT,
    TASK,
    Workspace,
    governance_client,
    narration,
)


class AgentState(MessagesState):
    stop: Decision | None


@dataclass
class Outcome:
    run_id: str
    stop: Decision | None
    answer: str
    workspace: Workspace


def scripted_model() -> GenericFakeChatModel:
    """The runaway model: the same edit_file call every turn, differently narrated."""
    turns = [
        AIMessage(
            content=narration(i),
            tool_calls=[{"name": "edit_file", "args": dict(EDIT_ARGS), "id": f"call_{i}"}],
        )
        for i in range(ITERATIONS)
    ]
    turns.append(AIMessage(content="Renamed user_id to account_id in auth.py."))
    return GenericFakeChatModel(messages=iter(turns))


def make_tools(workspace: Workspace) -> dict[str, BaseTool]:
    @tool
    def edit_file(path: str, old: str, new: str) -> str:
        """Replace every occurrence of `old` with `new` in the file at `path`."""
        return workspace.edit_file(path, old, new)

    return {"edit_file": edit_file}


def build_graph(model: GenericFakeChatModel, tools: dict[str, BaseTool], run: Run) -> Any:
    def agent(state: AgentState) -> dict[str, Any]:
        return {"messages": [model.invoke(state["messages"])]}

    def govern(state: AgentState) -> dict[str, Any]:
        # Checked after the model chose its actions and before any of them runs.
        last = state["messages"][-1]
        assert isinstance(last, AIMessage)
        for call in last.tool_calls:
            decision = run.check(call["name"], call["args"])
            if not decision.allowed:
                return {"stop": decision}
        return {"stop": None}

    def execute(state: AgentState) -> dict[str, Any]:
        last = state["messages"][-1]
        assert isinstance(last, AIMessage)
        results: list[ToolMessage] = []
        for call in last.tool_calls:
            try:
                output = tools[call["name"]].invoke(call["args"])
            except Exception as exc:
                # Reported, the next check carries it: the service counts repeated errors.
                run.report(error=exc)
                results.append(
                    ToolMessage(content=f"error: {exc}", tool_call_id=call["id"], status="error")
                )
            else:
                run.report(output)
                results.append(ToolMessage(content=str(output), tool_call_id=call["id"]))
        return {"messages": results}

    def after_agent(state: AgentState) -> str:
        last = state["messages"][-1]
        return "govern" if isinstance(last, AIMessage) and last.tool_calls else END

    def after_govern(state: AgentState) -> str:
        return END if state.get("stop") else "tools"

    graph = StateGraph(AgentState)
    graph.add_node("agent", agent)
    graph.add_node("govern", govern)
    graph.add_node("tools", execute)
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", after_agent, ["govern", END])
    graph.add_conditional_edges("govern", after_govern, ["tools", END])
    graph.add_edge("tools", "agent")
    return graph.compile()


def run_agent(client: GovernanceClient) -> Outcome:
    workspace = Workspace()
    with client.run(AGENT, task=TASK) as run:
        app = build_graph(scripted_model(), make_tools(workspace), run)
        state = app.invoke(
            {"messages": [SystemMessage(SYSTEM_PROMPT), HumanMessage(TASK)], "stop": None},
            # Far above the loop, so that governance, not LangGraph's recursion limit, stops it.
            {"recursion_limit": 4 * ITERATIONS + 10},
        )
        stop: Decision | None = state.get("stop")
        if stop is None:
            run.output = str(state["messages"][-1].content)
        else:
            run.output = stop.user_notice(workspace.partial_response())
    return Outcome(run.id, stop, run.output, workspace)


def main() -> int:
    with governance_client() as client:
        outcome = run_agent(client)
    print(outcome.answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
