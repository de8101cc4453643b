"""The shipped integrations, each on a real agent of its framework with its scripted model,
against the real server: loop, soft loop, budget, tool denied, kill switch mid-run, nudge.

The Claude Agent SDK needs the Claude Code CLI and a model to run a whole agent, which a test
machine cannot have: its hooks are driven here with the SDK's own hook input types, in the
order the SDK calls them, with the tools run in between.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from governance_client import GovernanceClient
from policies.models import Team
from runs.killswitch.services import killswitch_engage, killswitch_release
from tests.conftest import Agent, Server, set_policy

pytest.importorskip("langchain")
pytest.importorskip("agents")
pytest.importorskip("claude_agent_sdk")

TASK = "Rename user_id to account_id in auth.py."
KILL_REASON = "runaway refunds, INC-7"


@dataclass
class Tools:
    """The tools every framework's agent gets; they record what really ran."""

    on_step: Callable[[int], None] = lambda _n: None
    ran: list[str] = field(default_factory=list)
    edits: int = 0

    def edit_file(self, path: str, old: str, new: str) -> str:
        """Replace old with new in the file at path."""
        self.ran.append("edit_file")
        self.edits += 1
        if self.edits > 1:
            raise ValueError("no matches found")
        return "3 matches replaced"

    def search(self, query: str) -> str:
        """Search the documents."""
        self.ran.append("search")
        return "No document mentions refunds."  # the same result whatever the query

    def run_shell(self, cmd: str) -> str:
        """Run a shell command."""
        self.ran.append("run_shell")
        return "done"

    def fetch(self, url: str) -> str:
        """Fetch a URL."""
        self.ran.append("fetch")
        raise ConnectionError("connection refused")

    def step(self, n: int) -> str:
        """Do step n of the task."""
        self.ran.append("step")
        self.on_step(n)
        return f"step {n} done"


@dataclass
class Scenario:
    name: str
    policy: dict[str, Any]
    calls: list[tuple[str, dict[str, Any]]]
    reason: str | None  # the expected stop reason (None: the run completes)
    step: int | None = None  # the step of the stop
    # A run that completes: what the model must have been told, and before which of its
    # turns (the directive of SPEC 16 put in front of it by the integration).
    told: str = "occurred 3 times. Change approach radically or abandon this subtask."
    told_by_turn: int | None = None


EDIT = {"path": "auth.py", "old": "user_id", "new": "account_id"}
SCENARIOS = [
    Scenario("loop", {}, [("edit_file", EDIT)] * 8, "loop_detected", 4),
    # Different queries, the same answer every time: four checks in a row bring nothing new.
    Scenario("soft_loop", {}, [("search", {"query": f"refunds {i}"}) for i in range(10)],
             "no_progress", 6),
    Scenario("budget", {"budgets": {"max_tool_calls": 3}},
             [("search", {"query": f"q{i}"}) for i in range(6)], "max_tool_calls", 4),
    Scenario("tool_denied", {"tools": {"allow": None, "deny": ["run_shell"]}},
             [("search", {"query": "a"}), ("run_shell", {"cmd": "rm -rf /"})],
             "tool_denied", 2),
    Scenario("kill_switch", {}, [("step", {"n": n}) for n in range(1, 8)], "killed", 3),
    Scenario("nudge", {}, [("fetch", {"url": f"https://x/{i}"}) for i in range(4)], None),
    # SPEC 16: the model loops, is warned at the 2nd identical call (the policy's
    # warnings.repeat_action: 2 of max_repeat_action 3), changes action, and the run
    # completes instead of stopping at the 4th identical call.
    Scenario("warned_then_changed", {}, [("step", {"n": 1}), ("step", {"n": 1}),
                                         ("search", {"query": "another way"})], None,
             told="step was called 2 times with the same arguments; max_repeat_action is 3",
             told_by_turn=2),
]
SCENARIO_IDS = [s.name for s in SCENARIOS]


@dataclass
class Outcome:
    run_id: str
    answer: str
    #: What the model was given before each of its turns, as text.
    model_inputs: list[str] = field(default_factory=list)


# -- One agent per framework ------------------------------------------------------------------

def langchain_tools(tools: Tools) -> list[Any]:
    from langchain_core.tools import tool

    return [tool(tools.edit_file), tool(tools.search), tool(tools.run_shell), tool(tools.fetch),
            tool(tools.step)]


def scripted_chat_model(calls: list[tuple[str, dict[str, Any]]], seen: list[str]) -> Any:
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage

    class ScriptedChatModel(GenericFakeChatModel):
        def bind_tools(self, tools: Any, **kwargs: Any) -> ScriptedChatModel:
            return self

        def _generate(self, messages: Any, *args: Any, **kwargs: Any) -> Any:
            seen.append("\n".join(str(m.content) for m in messages))
            return super()._generate(messages, *args, **kwargs)

    turns = [AIMessage(content=f"I'll now call {name} (turn {i}).",
                       tool_calls=[{"name": name, "args": args, "id": f"call_{i}"}])
             for i, (name, args) in enumerate(calls)]
    turns.append(AIMessage(content="All done."))
    return ScriptedChatModel(messages=iter(turns))


def run_langchain(client: GovernanceClient, scenario: Scenario, tools: Tools) -> Outcome:
    from governance_client.integrations.langchain import GovernanceMiddleware
    from langchain.agents import create_agent
    from langchain_core.messages import HumanMessage

    seen: list[str] = []
    with client.run("support-bot", task=TASK) as run:
        agent = create_agent(scripted_chat_model(scenario.calls, seen), langchain_tools(tools),
                             middleware=[GovernanceMiddleware(run)])
        state = agent.invoke({"messages": [HumanMessage(TASK)]}, {"recursion_limit": 100})
    return Outcome(run.id, str(state["messages"][-1].content), seen)


def run_langgraph(client: GovernanceClient, scenario: Scenario, tools: Tools) -> Outcome:
    from governance_client.integrations.langgraph import govern_graph
    from langchain_core.messages import HumanMessage
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    seen: list[str] = []
    model = scripted_chat_model(scenario.calls, seen)
    with client.run("support-bot", task=TASK) as run:
        builder = StateGraph(MessagesState)
        builder.add_node("agent", lambda s: {"messages": [model.invoke(s["messages"])]})
        builder.add_node("tools", ToolNode(langchain_tools(tools), handle_tool_errors=True))
        builder.add_edge(START, "agent")
        builder.add_conditional_edges("agent", tools_condition)
        builder.add_edge("tools", "agent")
        app = govern_graph(builder, run).compile()
        state = app.invoke({"messages": [HumanMessage(TASK)]}, {"recursion_limit": 100})
        run.output = str(state["messages"][-1].content)
    return Outcome(run.id, run.output, seen)


def run_openai_agents(client: GovernanceClient, scenario: Scenario, tools: Tools) -> Outcome:
    from agents import Agent, RunConfig, Runner, function_tool
    from agents.items import ModelResponse
    from agents.models.interface import Model
    from agents.usage import Usage
    from governance_client.integrations.openai_agents import govern_agent
    from openai.types.responses import (
        ResponseFunctionToolCall,
        ResponseOutputMessage,
        ResponseOutputText,
    )

    def message(text: str, i: int) -> ResponseOutputMessage:
        return ResponseOutputMessage(
            id=f"msg_{i}", type="message", role="assistant", status="completed",
            content=[ResponseOutputText(type="output_text", text=text, annotations=[])])

    turns = [[message(f"I'll now call {name} (turn {i}).", i),
              ResponseFunctionToolCall(id=f"fc_{i}", call_id=f"call_{i}", type="function_call",
                                       name=name, arguments=json.dumps(args))]
             for i, (name, args) in enumerate(scenario.calls)]
    turns.append([message("All done.", 999)])
    seen: list[str] = []

    class ScriptedModel(Model):
        def __init__(self) -> None:
            self.turns = iter(turns)

        async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
            given = kwargs.get("input", args[1] if len(args) > 1 else "")
            seen.append(json.dumps(given, default=str))
            return ModelResponse(output=next(self.turns), usage=Usage(), response_id=None)

        def stream_response(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError

    agent = Agent(name="support-bot", instructions="Rename things.", model=ScriptedModel(),
                  tools=[function_tool(tools.edit_file), function_tool(tools.search),
                         function_tool(tools.run_shell), function_tool(tools.fetch),
                         function_tool(tools.step)])

    async def main() -> Outcome:
        with client.run("support-bot", task=TASK) as run:
            result = await Runner.run(govern_agent(agent, run), TASK, max_turns=100,
                                      run_config=RunConfig(tracing_disabled=True))
            run.output = str(result.final_output)
        return Outcome(run.id, run.output, seen)

    return asyncio.run(main())


def run_claude_agent_sdk(client: GovernanceClient, scenario: Scenario, tools: Tools) -> Outcome:
    from claude_agent_sdk import ClaudeAgentOptions
    from claude_agent_sdk.types import (
        PostToolUseFailureHookInput,
        PostToolUseHookInput,
        PreToolUseHookInput,
    )
    from governance_client.integrations.claude_agent_sdk import governance_hooks

    seen: list[str] = []

    async def main() -> Outcome:
        with client.run("support-bot", task=TASK) as run:
            options = ClaudeAgentOptions(hooks=governance_hooks(run))
            hooks = options.hooks or {}
            (pre,), (post,), (failure,) = (hooks[e][0].hooks for e in
                                           ("PreToolUse", "PostToolUse", "PostToolUseFailure"))
            base = {"session_id": "s", "transcript_path": "/dev/null", "cwd": "."}
            context: list[str] = []
            answer = "All done."
            for i, (name, args) in enumerate(scenario.calls):
                seen.append("\n".join(context))
                call_id = f"toolu_{i}"
                pre_input = PreToolUseHookInput(hook_event_name="PreToolUse", tool_name=name,
                                                tool_input=args, tool_use_id=call_id, **base)
                out = await pre(pre_input, call_id, {"signal": None})
                specific = out.get("hookSpecificOutput", {})
                if specific.get("additionalContext"):
                    context.append(specific["additionalContext"])
                if specific.get("permissionDecision") == "deny":
                    assert out.get("continue_") is False
                    answer = f"I'll now call {name} (turn {i}).\n\n{out['stopReason']}"
                    break
                try:
                    # The CLI runs the tools, away from the hooks' event loop.
                    response = await asyncio.to_thread(getattr(tools, name), **args)
                except Exception as exc:
                    failure_input = PostToolUseFailureHookInput(
                        hook_event_name="PostToolUseFailure", tool_name=name, tool_input=args,
                        tool_use_id=call_id, error=str(exc), **base)
                    await failure(failure_input, call_id, {"signal": None})
                else:
                    post_input = PostToolUseHookInput(
                        hook_event_name="PostToolUse", tool_name=name, tool_input=args,
                        tool_response=response, tool_use_id=call_id, **base)
                    await post(post_input, call_id, {"signal": None})
            seen.append("\n".join(context))
            run.output = answer
        return Outcome(run.id, answer, seen)

    return asyncio.run(main())


FRAMEWORKS = {
    "langchain": run_langchain,
    "langgraph": run_langgraph,
    "openai_agents": run_openai_agents,
    "claude_agent_sdk": run_claude_agent_sdk,
}


# -- The scenarios ----------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("framework", list(FRAMEWORKS))
@pytest.mark.parametrize("scenario", SCENARIOS, ids=SCENARIO_IDS)
def test_the_integration_governs_a_real_agent(
    framework: str, scenario: Scenario, agent: Agent, server: Server, team: Team
) -> None:
    if scenario.policy:
        set_policy(team, **scenario.policy)
    tools = Tools()
    engaged: list[bool] = []
    if scenario.name == "kill_switch":
        def on_step(n: int) -> None:
            if n == 2 and not engaged:
                killswitch_engage(scope="team", team=team, reason=KILL_REASON)
                engaged.append(True)
        tools.on_step = on_step
    try:
        with GovernanceClient(server.url, agent.token, deadline=10) as client:
            outcome = FRAMEWORKS[framework](client, scenario, tools)
    finally:
        if engaged:
            killswitch_release(scope="team", team=team, reason="test over")

    stored = agent.http.get(f"/api/v1/runs/{outcome.run_id}").json()
    audited = agent.http.get(f"/api/v1/runs/{outcome.run_id}/decisions").json()["decisions"]
    if scenario.reason is None:
        assert stored["status"] == "completed", outcome.answer
        assert [d["outcome"] for d in audited] == ["allow"] * len(scenario.calls)
        # The directive reached the model: the repeated-error nudge (the 3rd error, on the
        # 4th check; each framework words the error its own way, the count and the advice
        # are the service's), or the repeat warning before the turn that changed action.
        assert any(scenario.told in given for given in outcome.model_inputs), \
            outcome.model_inputs
        if scenario.told_by_turn is not None:
            n = scenario.told_by_turn
            assert scenario.told in outcome.model_inputs[n], outcome.model_inputs
            assert not any(scenario.told in given for given in outcome.model_inputs[:n])
            warned = [d for d in audited if d["step"] == 2]
            assert warned and warned[0]["outcome"] == "allow"
            rule = agent.http.get(f"/api/v1/decisions/{warned[0]['id']}").json()["rule"]
            assert rule["name"] == "repeat_action"
        return
    assert stored["stop_reason"] == scenario.reason, outcome.answer
    stop = audited[-1]
    assert (stop["outcome"], stop["reason"]) == ("stop", scenario.reason)
    if scenario.reason == "killed":
        # Killed by the fan-out before the 3rd check (Celery eager), or by that check itself.
        assert stop["step"] in (2, 3)
    else:
        assert stop["step"] == scenario.step
    # The stopped call did not run; the user gets the partial response and the notice.
    assert len(tools.ran) == scenario.step - 1
    assert f"Stopped by governance ({scenario.reason})" in outcome.answer
    assert "Next:" in outcome.answer
    assert outcome.answer.startswith("I'll now call")
    assert stored["output"] == outcome.answer
    if scenario.reason == "killed":
        assert KILL_REASON in outcome.answer


# -- Parallel calls, finished states, new turns ------------------------------------------------

def parallel_chat_model(turns: list[list[tuple[str, dict[str, Any]]]]) -> Any:
    """A scripted model asking for several tools at once in each turn."""
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage

    class ScriptedChatModel(GenericFakeChatModel):
        def bind_tools(self, tools: Any, **kwargs: Any) -> ScriptedChatModel:
            return self

    messages = [AIMessage(content=f"I'll now call {len(calls)} tools (turn {i}).",
                          tool_calls=[{"name": name, "args": args, "id": f"call_{i}_{j}"}
                                      for j, (name, args) in enumerate(calls)])
                for i, calls in enumerate(turns)]
    return ScriptedChatModel(messages=iter([*messages, AIMessage(content="All done.")]))


def governed_app(framework: str, run: Any, chat: Any, tools: Tools) -> Any:
    from langgraph.checkpoint.memory import InMemorySaver

    if framework == "langchain":
        from governance_client.integrations.langchain import GovernanceMiddleware
        from langchain.agents import create_agent

        return create_agent(chat, langchain_tools(tools), middleware=[GovernanceMiddleware(run)],
                            checkpointer=InMemorySaver())
    from governance_client.integrations.langgraph import govern_graph
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    builder = StateGraph(MessagesState)
    builder.add_node("agent", lambda s: {"messages": [chat.invoke(s["messages"])]})
    builder.add_node("tools", ToolNode(langchain_tools(tools), handle_tool_errors=True))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    return govern_graph(builder, run).compile(checkpointer=InMemorySaver())


@pytest.mark.parametrize("framework", ["langchain", "langgraph"])
def test_parallel_calls_show_the_stop_that_explains_and_a_new_turn_keeps_it(
    framework: str, agent: Agent, server: Server, team: Team
) -> None:
    """A denied tool among parallel calls: the calls checked after it are answered "the run
    is already stopped", but the notice is the denial's. The stopped state says so (stop_in),
    and a new turn on the same thread does not call the model again nor change the output."""
    from governance_client.integrations.langgraph import stop_in
    from langchain_core.messages import HumanMessage

    set_policy(team, tools={"allow": None, "deny": ["run_shell"]})
    tools = Tools()
    chat = parallel_chat_model([[("search", {"query": "a"})],
                                [("run_shell", {"cmd": "ls"}), ("search", {"query": "b"}),
                                 ("search", {"query": "c"})],
                                [("search", {"query": "d"})]])
    thread = {"configurable": {"thread_id": "t"}, "recursion_limit": 50}
    with GovernanceClient(server.url, agent.token, deadline=10) as client, \
            client.run("support-bot", task=TASK) as run:
        app = governed_app(framework, run, chat, tools)
        first = app.invoke({"messages": [HumanMessage(TASK)]}, thread)
        run.output = str(first["messages"][-1].content)
        again = app.invoke({"messages": [HumanMessage("Anything else?")]}, thread)
        run.output = str(again["messages"][-1].content)

    notice = str(first["messages"][-1].content)
    assert "Stopped by governance (tool_denied)" in notice
    assert "run_shell" in notice and "already stopped" not in notice
    recorded = stop_in(first)
    assert recorded is not None and recorded.reason == "tool_denied"
    assert str(again["messages"][-1].content) == notice
    assert next(chat.messages).content == "I'll now call 1 tools (turn 2)."  # not called
    stored = agent.http.get(f"/api/v1/runs/{run.id}").json()
    assert (stored["status"], stored["stop_reason"], stored["output"]) == (
        "stopped", "tool_denied", notice)


# -- Claude Agent SDK: the notice in the result; the README's programs under a kill switch ----

def test_the_claude_sdk_result_after_a_stop_is_the_notice_not_an_empty_answer(
    agent: Agent, server: Server, team: Team
) -> None:
    """The CLI ends an agent its hook stopped with an empty ``result``: governed_messages puts
    the partial response and the notice there, and in the run's output."""
    from claude_agent_sdk import AssistantMessage, ClaudeAgentOptions, ResultMessage, TextBlock
    from claude_agent_sdk.types import PostToolUseHookInput, PreToolUseHookInput
    from governance_client.integrations.claude_agent_sdk import (
        governance_hooks,
        governed_messages,
    )

    set_policy(team, step_limits={"max_repeat_action": 1})
    base = {"session_id": "s", "transcript_path": "/dev/null", "cwd": "."}

    async def main() -> tuple[str, str | None]:
        with GovernanceClient(server.url, agent.token, deadline=10) as client, \
                client.run("support-bot", task=TASK) as run:
            options = ClaudeAgentOptions(hooks=governance_hooks(run))
            hooks = options.hooks or {}
            (pre,), (post,) = (hooks[e][0].hooks for e in ("PreToolUse", "PostToolUse"))

            async def cli() -> Any:  # what the CLI streams while it calls the hooks
                yield AssistantMessage(content=[TextBlock("Let me look that up.")], model="m")
                for i in range(2):
                    pre_input = PreToolUseHookInput(
                        hook_event_name="PreToolUse", tool_name="mcp__docs__search",
                        tool_input={"query": "refunds"}, tool_use_id=f"toolu_{i}", **base)
                    out = await pre(pre_input, f"toolu_{i}", {"signal": None})
                    if out.get("continue_") is False:
                        break
                    await post(PostToolUseHookInput(
                        hook_event_name="PostToolUse", tool_name="mcp__docs__search",
                        tool_input={"query": "refunds"}, tool_response="nothing",
                        tool_use_id=f"toolu_{i}", **base), f"toolu_{i}", {"signal": None})
                yield ResultMessage(subtype="success", duration_ms=1, duration_api_ms=1,
                                    is_error=False, num_turns=2, session_id="s", result="")

            answer = ""
            async for message in governed_messages(run, cli()):
                if isinstance(message, ResultMessage):
                    run.output = message.result
                    answer = message.result or ""
            return run.id, answer

    run_id, answer = asyncio.run(main())
    assert answer.startswith("Let me look that up.")
    assert "Stopped by governance (loop_detected)" in answer
    assert "mcp__docs__search was already called 1 time with" in answer
    stored = agent.http.get(f"/api/v1/runs/{run_id}").json()
    assert (stored["stop_reason"], stored["output"]) == ("loop_detected", answer)


README = Path(__file__).resolve().parents[1] / "governance_client" / "README.md"


def readme_program(heading: str) -> str:
    text = README.read_text()
    block = re.search(r"```python\n(.*?)```", text[text.index(heading):], re.S)
    assert block is not None
    return block.group(1)


@pytest.mark.parametrize("heading", ["### LangChain", "### LangGraph", "### OpenAI Agents SDK",
                                     "### Claude Agent SDK"])
def test_the_readme_programs_tell_the_user_about_a_kill_switch_at_start(
    heading: str, agent: Agent, server: Server, team: Team, capsys: Any
) -> None:
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel

    class Model(GenericFakeChatModel):
        def bind_tools(self, tools: Any, **kwargs: Any) -> Model:
            return self

    killswitch_engage(scope="team", team=team, reason=KILL_REASON)
    try:
        # The model is never called (the run cannot start); none is reachable from here.
        with mock.patch("langchain.chat_models.init_chat_model",
                        lambda *_a, **_k: Model(messages=iter([]))):
            exec(readme_program(heading), {  # the README's own program
                "__name__": "readme_program", "URL": server.url, "KEY": agent.token,
                "question": "How do refunds work?"})
    finally:
        killswitch_release(scope="team", team=team, reason="test over")

    printed = capsys.readouterr().out
    assert "Stopped by governance (killed)" in printed and KILL_REASON in printed
    assert "Traceback" not in printed
