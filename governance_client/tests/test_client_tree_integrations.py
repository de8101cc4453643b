"""The integrations govern the frameworks' own sub-agents as child runs (SPEC 20), on
scripted models and the fake service (its tree rules are the service's)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from governance_client import rules
from governance_client.testing import FakeGovernance

pytest.importorskip("agents")


def _scripted(turns: list[list[Any]]) -> Any:
    from agents.items import ModelResponse
    from agents.models.interface import Model
    from agents.usage import Usage

    class Scripted(Model):
        def __init__(self) -> None:
            self.turns = iter(turns)

        async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
            return ModelResponse(output=next(self.turns), usage=Usage(), response_id=None)

        def stream_response(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError

    return Scripted()


def _call(name: str, args: dict[str, Any], i: int) -> Any:
    from openai.types.responses import ResponseFunctionToolCall
    return ResponseFunctionToolCall(id=f"fc_{name}_{i}", call_id=f"call_{name}_{i}",
                                    type="function_call", name=name, arguments=json.dumps(args))


def _text(text: str) -> Any:
    from openai.types.responses import ResponseOutputMessage, ResponseOutputText
    return ResponseOutputMessage(id="msg", type="message", role="assistant", status="completed",
                                 content=[ResponseOutputText(type="output_text", text=text,
                                                             annotations=[])])


def test_an_agents_sdk_handoff_loop_is_stopped_at_the_policys_step() -> None:
    from agents import Agent, RunConfig, Runner

    from governance_client.integrations.openai_agents import govern_agent

    fake = FakeGovernance(max_steps=6)
    triage = Agent(name="triage", model=_scripted(
        [[_call("transfer_to_billing", {}, i)] for i in range(20)]))
    billing = Agent(name="billing", model=_scripted(
        [[_call("transfer_to_triage", {}, i)] for i in range(20)]), handoffs=[triage])
    triage.handoffs = [billing]

    async def main() -> str:
        async with fake.async_client() as client, client.run("triage") as run:
            result = await Runner.run(govern_agent(triage, run), "help", max_turns=50,
                                      run_config=RunConfig(tracing_disabled=True))
            return str(result.final_output)

    output = asyncio.run(main())
    assert "max_steps" in output
    root = next(r for r in fake.runs.values() if not r.ancestors)
    children = [r for r in fake.runs.values() if r.ancestors == (root.id,)]
    assert root.steps == 7 and len(children) == 6  # 6 handoffs allowed, the 7th stopped
    assert all(c.status != rules.RUNNING for c in children)


def test_an_agents_sdk_handoff_stop_raised_tells_the_user_the_stop() -> None:
    # Found by a newcomer: with raise_on_stop the handoff's stop was a plain GovernanceError,
    # whose user_notice() said the service refused a request and to try again later.
    from agents import Agent, RunConfig, Runner

    from governance_client import GovernanceError, GovernanceStop
    from governance_client.integrations.openai_agents import govern_agent

    fake = FakeGovernance(max_steps=2)
    triage = Agent(name="triage", model=_scripted(
        [[_call("transfer_to_billing", {}, i)] for i in range(20)]))
    billing = Agent(name="billing", model=_scripted(
        [[_call("transfer_to_triage", {}, i)] for i in range(20)]), handoffs=[triage])
    triage.handoffs = [billing]

    async def main() -> None:
        async with fake.async_client() as client, client.run("triage") as run:
            await Runner.run(govern_agent(triage, run, raise_on_stop=True), "help",
                             max_turns=50, run_config=RunConfig(tracing_disabled=True))

    with pytest.raises(GovernanceError) as raised:
        asyncio.run(main())
    assert isinstance(raised.value, GovernanceStop)
    notice = raised.value.user_notice()
    assert notice.startswith("Stopped by governance (max_steps): "), notice
    assert "Try again later" not in notice
    assert raised.value.decision.reason == raised.value.reason == "max_steps"


def test_an_agent_as_tool_spends_the_roots_budget() -> None:
    from agents import Agent, RunConfig, Runner, function_tool

    from governance_client.integrations.openai_agents import govern_agent

    spent: list[int] = []

    @function_tool
    def research(query: str) -> str:
        """Research a query."""
        spent.append(1)
        return "found"

    fake = FakeGovernance(max_tool_calls=3)
    researcher = Agent(name="researcher", tools=[research], model=_scripted(
        [[_call("research", {"query": f"q{i}"}, i)] for i in range(10)] + [[_text("done")]]))
    planner = Agent(name="planner", tools=[researcher.as_tool("ask_researcher", "Research.")],
                    model=_scripted([[_call("ask_researcher", {"input": "refunds"}, 0)],
                                     [_text("all done")]]))

    async def main() -> None:
        async with fake.async_client() as client, client.run("planner") as run:
            await Runner.run(govern_agent(planner, run), "plan", max_turns=50,
                             run_config=RunConfig(tracing_disabled=True))

    asyncio.run(main())
    root = next(r for r in fake.runs.values() if not r.ancestors)
    (child,) = [r for r in fake.runs.values() if r.ancestors == (root.id,)]
    # The planner's call of its tool counts 1: the sub-agent may run 2 of its own.
    assert len(spent) == 2 and child.stop_reason == "max_tool_calls"
    assert root.tool_calls == 3


def test_a_claude_subagents_checks_appear_as_a_child_run() -> None:
    pytest.importorskip("claude_agent_sdk")
    from claude_agent_sdk import ClaudeAgentOptions

    from governance_client.integrations.claude_agent_sdk import governance_hooks

    fake = FakeGovernance(max_steps=4)
    base = {"session_id": "s", "transcript_path": "/dev/null", "cwd": "."}

    async def main() -> list[Any]:
        async with fake.async_client() as client, client.run("coder") as run:
            hooks = ClaudeAgentOptions(hooks=governance_hooks(run)).hooks or {}
            (pre,), (start,), (stop,) = (hooks[e][0].hooks for e in
                                         ("PreToolUse", "SubagentStart", "SubagentStop"))
            answers = [await pre({"hook_event_name": "PreToolUse", "tool_name": "Task",
                                  "tool_input": {"prompt": "explore"}, "tool_use_id": "t0",
                                  **base}, "t0", {"signal": None})]
            await start({"hook_event_name": "SubagentStart", "agent_id": "a1",
                         "agent_type": "Explore", **base}, None, {"signal": None})
            for i in range(1, 5):
                answers.append(await pre({
                    "hook_event_name": "PreToolUse", "tool_name": "Grep",
                    "tool_input": {"pattern": f"p{i}"}, "tool_use_id": f"t{i}",
                    "agent_id": "a1", "agent_type": "Explore", **base}, f"t{i}",
                    {"signal": None}))
            await stop({"hook_event_name": "SubagentStop", "agent_id": "a1",
                        "agent_type": "Explore", "agent_transcript_path": "/dev/null",
                        "stop_hook_active": False, **base}, None, {"signal": None})
            return answers

    answers = asyncio.run(main())
    root = next(r for r in fake.runs.values() if not r.ancestors)
    (child,) = [r for r in fake.runs.values() if r.ancestors == (root.id,)]
    assert child.agent == "Explore" and [c["action"]["name"] for c in child.checks] == \
        ["Grep"] * 4
    # The Task call and 3 of the subagent's calls fit the root's max_steps 4; the 4th is
    # denied without ending the main agent (a child's stop does not stop its parent). The
    # 3rd brings the root to step 4 of 4: the subagent is warned of its parent's budget.
    assert answers[:3] == [{}] * 3
    assert answers[3]["hookSpecificOutput"]["additionalContext"].startswith(
        f"Ancestor run {root.id}'s tree is at step 4 of max_steps=4")
    denied = answers[4]["hookSpecificOutput"]
    assert denied["permissionDecision"] == "deny" and "continue_" not in answers[4]
    assert root.steps == 5 and root.status == rules.COMPLETED  # finished by its block
    assert child.status == rules.STOPPED and child.finished


def test_a_langgraph_subgraph_runs_under_a_child_run(caplog: Any) -> None:
    pytest.importorskip("langgraph")
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_core.tools import tool
    from langgraph.graph import END, START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    from governance_client.integrations.langgraph import govern_graph

    ran: list[str] = []

    @tool
    def search(query: str) -> str:
        """Search the documents."""
        ran.append(query)
        return f"result {len(ran)}"

    class Scripted(GenericFakeChatModel):
        def bind_tools(self, tools: Any, **kwargs: Any) -> Scripted:
            return self

    turns = [AIMessage(content=f"turn {i}", tool_calls=[
        {"name": "search", "args": {"query": f"q{i}"}, "id": f"call_{i}"}]) for i in range(8)]
    model = Scripted(messages=iter([*turns, AIMessage(content="done")]))
    sub = StateGraph(MessagesState)
    sub.add_node("agent", lambda s: {"messages": [model.invoke(s["messages"])]})
    sub.add_node("tools", ToolNode([search], handle_tool_errors=True))
    sub.add_edge(START, "agent")
    sub.add_conditional_edges("agent", tools_condition)
    sub.add_edge("tools", "agent")
    main = StateGraph(MessagesState)
    main.add_node("research", sub.compile())
    main.add_edge(START, "research")
    main.add_edge("research", END)

    fake = FakeGovernance(max_steps=3)
    with fake.client().run("planner") as run:
        app = govern_graph(main, run).compile()
        state = app.invoke({"messages": [HumanMessage("research refunds")]},
                           {"recursion_limit": 100})
    root = next(r for r in fake.runs.values() if not r.ancestors)
    (child,) = [r for r in fake.runs.values() if r.ancestors == (root.id,)]
    assert child.agent == "research" and len(ran) == 3
    assert child.stop_reason == "max_steps" and root.steps == 4
    assert "max_steps" in str(state["messages"][-1].content)
    # Found by a newcomer: LangGraph warned four times that the compiled subgraph would not
    # see nodes added to it; what runs is compiled again under the child run.
    assert "already been compiled" not in caplog.text


def test_a_sub_agents_spend_stops_the_tree_at_the_roots_max_usd() -> None:
    from agents import Agent, RunConfig, Runner, function_tool

    from governance_client.integrations.openai_agents import govern_agent

    ran: list[str] = []

    @function_tool
    def search(query: str) -> str:
        """Search."""
        ran.append(query)
        return f"result {len(ran)}"

    fake = FakeGovernance(max_usd=0.35)
    researcher = Agent(name="researcher", tools=[search], model=_scripted(
        [[_call("search", {"query": f"q{i}"}, i)] for i in range(10)]))
    planner = Agent(name="planner", handoffs=[researcher],
                    model=_scripted([[_call("transfer_to_researcher", {}, 0)]]))

    async def main() -> str:
        async with fake.async_client() as client, client.run("planner") as run:
            result = await Runner.run(govern_agent(planner, run, llm_cost=lambda _r: 0.1),
                                      "research", max_turns=50,
                                      run_config=RunConfig(tracing_disabled=True))
            return str(result.final_output)

    output = asyncio.run(main())
    root = next(r for r in fake.runs.values() if not r.ancestors)
    (child,) = [r for r in fake.runs.values() if r.ancestors == (root.id,)]
    # 0.1 a model call: the handoff's check carries the planner's 0.1, each search the
    # researcher's; the third search brings the root to 0.40, past its max_usd 0.35.
    assert len(ran) == 2 and child.stop_reason == "max_usd"
    assert root.id in (child.decisions[-1].get("message") or "")
    assert root.cost_usd == pytest.approx(0.4) and "max_usd" in output


# Found by a newcomer: a sub-agent's stop that ended the whole agent showed the user
# "Stopped by governance (loop_detected): ..." while the root run was finished completed,
# with no stop and no output; only the child run said what happened.

def _looping_researcher() -> Any:
    from agents import Agent, function_tool

    @function_tool
    def search(query: str) -> str:
        """Search."""
        return "nothing new"

    return Agent(name="researcher", tools=[search], model=_scripted(
        [[_text("Looking."), _call("search", {"query": "refunds"}, i)] for i in range(10)]))


def test_a_handoffs_stop_that_ends_the_agent_ends_the_root_run_stopped() -> None:
    from agents import Agent, RunConfig, Runner

    from governance_client.integrations.openai_agents import govern_agent

    fake = FakeGovernance(max_repeat_action=3)
    triage = Agent(name="triage", handoffs=[_looping_researcher()],
                   model=_scripted([[_call("transfer_to_researcher", {}, 0)]]))

    async def main() -> tuple[str, Any]:
        async with fake.async_client() as client, client.run("triage") as run:
            result = await Runner.run(govern_agent(triage, run), "refunds?", max_turns=50,
                                      run_config=RunConfig(tracing_disabled=True))
            return str(result.final_output), run

    output, run = asyncio.run(main())
    assert "Stopped by governance (loop_detected): " in output
    root = fake.runs[run.id]
    (child,) = [r for r in fake.runs.values() if r.ancestors == (root.id,)]
    assert (child.status, child.stop_reason) == (rules.STOPPED, "loop_detected")
    # The child's stop does not stop the root on the service (SPEC 20); the agent ended
    # on it, so the root is finished stopped, with what the user read.
    assert (root.status, root.stop_reason, root.output) == (
        rules.STOPPED, "agent_stopped", output)
    assert run.subagent_stop is not None and run.subagent_stop.reason == "loop_detected"


def test_an_agents_sdk_run_stores_its_final_output() -> None:
    # The README's example never set run.output: a completed run was stored without it.
    from agents import Agent, RunConfig, Runner

    from governance_client.integrations.openai_agents import govern_agent

    fake = FakeGovernance()
    answer = Agent(name="answer", model=_scripted([[_text("Refunds take 5 days.")]]))
    triage = Agent(name="triage", handoffs=[answer],
                   model=_scripted([[_call("transfer_to_answer", {}, 0)]]))

    async def main() -> str:
        async with fake.async_client() as client, client.run("triage") as run:
            await Runner.run(govern_agent(triage, run), "refunds?",
                             run_config=RunConfig(tracing_disabled=True))
            return run.id

    root = fake.runs[asyncio.run(main())]
    (child,) = [r for r in fake.runs.values() if r.ancestors == (root.id,)]
    assert (root.status, root.output) == (rules.COMPLETED, "Refunds take 5 days.")
    assert (child.status, child.output) == (rules.COMPLETED, "Refunds take 5 days.")


def test_an_agent_as_tools_stop_does_not_stop_the_agent_that_goes_on() -> None:
    from agents import Agent, RunConfig, Runner

    from governance_client.integrations.openai_agents import govern_agent

    fake = FakeGovernance(max_repeat_action=3)
    planner = Agent(name="planner", tools=[_looping_researcher().as_tool("ask", "Research.")],
                    model=_scripted([[_call("ask", {"input": "refunds"}, 0)],
                                     [_text("I could not find it.")]]))

    async def main() -> str:
        async with fake.async_client() as client, client.run("planner") as run:
            await Runner.run(govern_agent(planner, run), "plan", max_turns=50,
                             run_config=RunConfig(tracing_disabled=True))
            return run.id

    root = fake.runs[asyncio.run(main())]
    (child,) = [r for r in fake.runs.values() if r.ancestors == (root.id,)]
    assert child.stop_reason == "loop_detected"
    assert (root.status, root.output) == (rules.COMPLETED, "I could not find it.")


def _langgraph_main(after: str | None) -> tuple[Any, Any]:
    """A graph whose subgraph loops, then ends (``after`` None) or goes on to ``after``;
    and the question to ask it."""
    pytest.importorskip("langgraph")
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_core.tools import tool
    from langgraph.graph import END, START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    @tool
    def search(query: str) -> str:
        """Search the documents."""
        return "nothing new"

    class Scripted(GenericFakeChatModel):
        def bind_tools(self, tools: Any, **kwargs: Any) -> Scripted:
            return self

    model = Scripted(messages=iter([AIMessage(content="Looking.", tool_calls=[
        {"name": "search", "args": {"query": "refunds"}, "id": f"call_{i}"}])
        for i in range(8)]))
    sub = StateGraph(MessagesState)
    sub.add_node("agent", lambda s: {"messages": [model.invoke(s["messages"])]})
    sub.add_node("tools", ToolNode([search]))
    sub.add_edge(START, "agent")
    sub.add_conditional_edges("agent", tools_condition)
    sub.add_edge("tools", "agent")
    main = StateGraph(MessagesState)
    main.add_node("research", sub.compile())
    main.add_edge(START, "research")
    if after is None:
        main.add_edge("research", END)
    else:
        main.add_node(after, lambda s: {"messages": [AIMessage(content="Summary: none.")]})
        main.add_edge("research", after)
        main.add_edge(after, END)
    return main, HumanMessage("research refunds")


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_subgraphs_stop_that_ends_the_graph_ends_the_root_run_stopped(kind: str) -> None:
    from governance_client.integrations.langgraph import govern_graph, stop_in

    main, question = _langgraph_main(after=None)
    fake = FakeGovernance(max_repeat_action=3)

    def scenario_sync() -> tuple[Any, Any, Any]:
        with fake.client().run("planner") as run:
            state = govern_graph(main, run).compile().invoke({"messages": [question]})
            return state, stop_in(state, run), run

    async def scenario_async() -> tuple[Any, Any, Any]:
        async with fake.async_client() as client, client.run("planner") as run:
            state = await govern_graph(main, run).compile().ainvoke({"messages": [question]})
            return state, stop_in(state, run), run

    state, stop, run = scenario_sync() if kind == "sync" else asyncio.run(scenario_async())
    last = str(state["messages"][-1].content)
    assert "Stopped by governance (loop_detected): " in last
    assert stop is not None and stop.reason == "loop_detected"
    root = fake.runs[run.id]
    (child,) = [r for r in fake.runs.values() if r.ancestors == (root.id,)]
    assert (child.status, child.stop_reason) == (rules.STOPPED, "loop_detected")
    assert (root.status, root.stop_reason, root.output) == (
        rules.STOPPED, "agent_stopped", last)


def test_a_subgraphs_stop_the_graph_goes_on_from_leaves_the_root_run_completed() -> None:
    from governance_client.integrations.langgraph import govern_graph

    main, question = _langgraph_main(after="summarize")
    fake = FakeGovernance(max_repeat_action=3)
    with fake.client().run("planner") as run:
        state = govern_graph(main, run).compile().invoke({"messages": [question]})
        run.output = str(state["messages"][-1].content)
    root = fake.runs[run.id]
    (child,) = [r for r in fake.runs.values() if r.ancestors == (root.id,)]
    assert child.stop_reason == "loop_detected"
    assert (root.status, root.output) == (rules.COMPLETED, "Summary: none.")
