"""The integrations on the in-process fake: async paths, parallel calls, approvals, the
raising and non-stopping variants. (Against the real server: tests/test_integrations.py.)"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from governance_client.testing import FakeGovernance

pytest.importorskip("langchain")

from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import tool


class ScriptedChatModel(GenericFakeChatModel):
    def bind_tools(self, tools: Any, **kwargs: Any) -> ScriptedChatModel:
        return self


@tool
def fetch(url: str) -> str:
    """Fetch a URL."""
    raise ConnectionError(f"refused: {url}")


@tool
def refund(order: int) -> str:
    """Refund an order."""
    return f"order {order} refunded"


def model(*turns: list[tuple[str, dict[str, Any]]]) -> ScriptedChatModel:
    messages = [AIMessage(content=f"turn {i}", tool_calls=[
        {"name": name, "args": args, "id": f"c{i}_{j}"} for j, (name, args) in enumerate(calls)])
        for i, calls in enumerate(turns)]
    return ScriptedChatModel(messages=iter([*messages, AIMessage(content="done")]))


def check_bodies(fake: FakeGovernance) -> list[dict[str, Any]]:
    return [json.loads(r.content) for r in fake.requests if r.url.path.endswith("/check")]


def test_the_langchain_middleware_governs_an_async_agent_with_the_async_client() -> None:
    from langchain.agents import create_agent

    from governance_client.integrations.langchain import GovernanceMiddleware

    fake = FakeGovernance(max_repeat_action=2)
    same = [("fetch", {"url": "x"})]

    async def main() -> str:
        async with fake.async_client() as client, client.run("bot") as run:
            agent = create_agent(model(same, same, same, same), [fetch],
                                 middleware=[GovernanceMiddleware(run)])
            state = await agent.ainvoke({"messages": [HumanMessage("go")]})
            return str(state["messages"][-1].content)

    answer = asyncio.run(main())
    (stored,) = fake.runs.values()
    assert stored.stop_reason == "loop_detected" and stored.steps == 3
    assert answer.startswith("turn 2") and "Stopped by governance (loop_detected)" in answer
    assert stored.output == answer


def test_parallel_tool_calls_report_every_result_by_call_id() -> None:
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    from governance_client.integrations.langgraph import govern_graph

    fake = FakeGovernance()
    chat = model([("fetch", {"url": "a"}), ("fetch", {"url": "b"})], [("refund", {"order": 1})])
    with fake.client() as client, client.run("bot") as run:
        builder = StateGraph(MessagesState)
        builder.add_node("agent", lambda s: {"messages": [chat.invoke(s["messages"])]})
        builder.add_node("tools", ToolNode([fetch, refund], handle_tool_errors=True))
        builder.add_edge(START, "agent")
        builder.add_conditional_edges("agent", tools_condition)
        builder.add_edge("tools", "agent")
        govern_graph(builder, run).compile().invoke({"messages": [HumanMessage("go")]})
        leftover = run.pending_results

    bodies = check_bodies(fake)
    assert [b["action"]["name"] for b in bodies] == ["fetch", "fetch", "refund"]
    # The calls ran in parallel (in any order, a check possibly after the other call's
    # report): whatever the order, each result is sent once with a later check or still
    # waiting its turn, none is lost or replaced by another call's.
    sent = [b["last_result"] for b in bodies if "last_result" in b]
    results = sent + list(leftover.values())
    assert sorted(r["status"] for r in results) == ["error", "error", "ok"]
    errors = [r["error"] for r in results if r["status"] == "error"]
    assert any("refused: a" in e for e in errors) and any("refused: b" in e for e in errors)


def test_an_approval_is_waited_for_inside_the_middleware() -> None:
    from langchain.agents import create_agent

    from governance_client.integrations.langchain import GovernanceMiddleware

    fake = FakeGovernance(approvals=["refund"], operator=lambda approval: "approve")
    with fake.client() as client, client.run("bot") as run:
        agent = create_agent(model([("refund", {"order": 7})]), [refund],
                             middleware=[GovernanceMiddleware(run)])
        state = agent.invoke({"messages": [HumanMessage("go")]})

    assert "order 7 refunded" in [m.content for m in state["messages"]]
    (stored,) = fake.runs.values()
    assert (stored.status, stored.tool_calls) == ("completed", 1)


def test_the_agents_sdk_integration_can_raise_instead() -> None:
    pytest.importorskip("agents")
    from agents import Agent, RunConfig, Runner, ToolInputGuardrailTripwireTriggered
    from agents import function_tool as sdk_tool
    from agents.items import ModelResponse
    from agents.models.interface import Model
    from agents.usage import Usage
    from openai.types.responses import ResponseFunctionToolCall

    from governance_client import Decision
    from governance_client.integrations.openai_agents import govern_agent

    class Loop(Model):
        async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
            call = ResponseFunctionToolCall(id="fc", call_id="c", type="function_call",
                                            name="shell", arguments='{"cmd": "ls"}')
            return ModelResponse(output=[call], usage=Usage(), response_id=None)

        def stream_response(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError

    @sdk_tool
    def shell(cmd: str) -> str:
        """Run a command."""
        return "ok"

    fake = FakeGovernance(deny=["shell"])
    agent = Agent(name="bot", model=Loop(), tools=[shell])

    async def main() -> None:
        async with fake.async_client() as client, client.run("bot") as run:
            await Runner.run(govern_agent(agent, run, raise_on_stop=True), "go",
                             run_config=RunConfig(tracing_disabled=True))

    with pytest.raises(ToolInputGuardrailTripwireTriggered) as raised:
        asyncio.run(main())
    decision = raised.value.output.output_info
    assert isinstance(decision, Decision) and decision.reason == "tool_denied"
    assert agent.tools[0].tool_input_guardrails in (None, [])  # the original is untouched


def test_the_claude_hooks_can_deny_without_stopping_the_agent() -> None:
    pytest.importorskip("claude_agent_sdk")
    from claude_agent_sdk.types import PreToolUseHookInput

    from governance_client.integrations.claude_agent_sdk import governance_hooks

    fake = FakeGovernance(deny=["Bash"])
    with fake.client() as client, client.run("bot") as run:
        (pre,) = governance_hooks(run, stop_agent=False)["PreToolUse"][0].hooks
        hook_input = PreToolUseHookInput(
            hook_event_name="PreToolUse", tool_name="Bash", tool_input={"command": "ls"},
            tool_use_id="toolu_1", session_id="s", transcript_path="/dev/null", cwd=".")
        out = asyncio.run(pre(hook_input, "toolu_1", {"signal": None}))

    assert out["hookSpecificOutput"]["permissionDecision"] == "deny"
    assert "tool_denied" in out["hookSpecificOutput"]["permissionDecisionReason"]
    assert "continue_" not in out


def test_a_call_stopped_after_another_shows_the_first_stop_not_the_echo() -> None:
    """Parallel calls: the first stop explains (here: a denied tool); the calls checked after
    it are answered "the run is already stopped". Every stopped call, and so the notice,
    shows the first."""
    from langchain_core.messages import ToolMessage

    from governance_client.integrations._lc import ToolCallGovernor, stop_in

    fake = FakeGovernance(deny=["shell"])
    with fake.client() as client, client.run("bot") as run:
        governor = ToolCallGovernor(run, nudge_in_result=True)
        calls = [{"name": "shell", "args": {"cmd": "rm"}, "id": "a"},
                 {"name": "search", "args": {"q": 1}, "id": "b"}]
        answers = [governor.wrap(type("Request", (), {"tool_call": call})(),
                                 lambda _r: ToolMessage("ran", tool_call_id="x"))
                   for call in calls]
        echo = run.last_decision
    assert echo is not None and "already stopped" in (echo.message or "")
    state = {"messages": [AIMessage(content="", tool_calls=calls), *answers]}
    shown = stop_in(state)
    assert shown is not None and shown.reason == "tool_denied"
    assert "already" not in (shown.message or "")
    assert all("already" not in str(m.content) for m in answers)


def test_a_finished_state_and_a_new_turn_of_a_stopped_run_keep_the_stop() -> None:
    """stop_in reads the stop in the final state (and so in a checkpoint); a follow-up turn
    on the thread of the stopped run ends at once: the model is not called again and the
    run's output stays the notice."""
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    from governance_client.integrations.langgraph import govern_graph, stop_in

    fake = FakeGovernance(max_repeat_action=1)
    same = [("refund", {"order": 1})]
    chat = model(same, same, same)
    with fake.client() as client, client.run("bot") as run:
        builder = StateGraph(MessagesState)
        builder.add_node("agent", lambda s: {"messages": [chat.invoke(s["messages"])]})
        builder.add_node("tools", ToolNode([refund]))
        builder.add_edge(START, "agent")
        builder.add_conditional_edges("agent", tools_condition)
        builder.add_edge("tools", "agent")
        app = govern_graph(builder, run).compile(checkpointer=InMemorySaver())
        thread = {"configurable": {"thread_id": "t"}}
        first = app.invoke({"messages": [HumanMessage("go")]}, thread)
        notice = str(first["messages"][-1].content)
        run.output = notice
        stopped = stop_in(first)
        saved = stop_in(app.get_state(thread).values)
        again = app.invoke({"messages": [HumanMessage("and now?")]}, thread)
        run.output = str(again["messages"][-1].content)

    assert stopped is not None and stopped.reason == "loop_detected"
    assert saved is not None and saved.reason == "loop_detected"
    assert str(again["messages"][-1].content) == notice
    assert next(chat.messages).content == "turn 2"  # the model was called twice, not thrice
    assert fake.runs[run.id].output == notice


def test_a_new_turn_of_a_stopped_run_does_not_call_the_model_in_the_middleware() -> None:
    from langchain.agents import create_agent
    from langgraph.checkpoint.memory import InMemorySaver

    from governance_client.integrations.langchain import GovernanceMiddleware, stop_in

    fake = FakeGovernance(max_repeat_action=1)
    same = [("refund", {"order": 1})]
    chat = model(same, same, same)
    with fake.client() as client, client.run("bot") as run:
        agent = create_agent(chat, [refund], middleware=[GovernanceMiddleware(run)],
                             checkpointer=InMemorySaver())
        thread = {"configurable": {"thread_id": "t"}}
        first = agent.invoke({"messages": [HumanMessage("go")]}, thread)
        again = agent.invoke({"messages": [HumanMessage("and now?")]}, thread)

    notice = str(first["messages"][-1].content)
    assert "Stopped by governance (loop_detected)" in notice
    assert stop_in(first) is not None
    assert str(again["messages"][-1].content) == notice
    assert next(chat.messages).content == "turn 2"
    assert fake.runs[run.id].output == notice
