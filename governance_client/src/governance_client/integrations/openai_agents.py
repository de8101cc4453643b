"""OpenAI Agents SDK: ``govern_agent`` (extra ``openai-agents``).

One line of wiring::

    result = await Runner.run(govern_agent(agent, run), task)

``govern_agent`` returns a copy of the agent (the original is left alone) whose function tools
carry a tool input guardrail that checks every call before it runs (``run.check`` with the
call's name, args and id) and a tool output guardrail that reports each result; a tool's
failure is reported as an error (through its ``failure_error_function``, which still answers
the model as before).

On a stop the call is not run, and by default the run ends cleanly: the SDK's
``tool_use_behavior`` makes ``result.final_output`` the partial response (the model's last
words) followed by the stop's reason and next step; no exception. With ``raise_on_stop=True``
the guardrail raises instead (``ToolInputGuardrailTripwireTriggered``, the decision in
``.output.output_info``). The repeated-error directive is appended to the result the model
reads for that call. ``run.output`` is set to the final output (``str()`` of a structured
one), the stop notice included.

Works with a ``Run`` (sync client, called in a thread) or an ``AsyncRun``.

Sub-agents are governed as child runs (SPEC 20), so that a sub-agent cannot escape the run's
limits with a fresh budget:

- a **handoff** is checked as an action of the agent that hands off (``handoff:<agent>``,
  type ``other``); allowed, the receiving agent is governed by a new child run of ``run``
  (its checks count on ``run`` too, and ``run``'s limits bound it), finished when that agent
  ends or hands off again. A stopped handoff ends the run cleanly with the stop's notice (or
  raises with ``raise_on_stop=True``): a handoff loop stops at the policy's step. A stop of
  the receiving agent (or of a handoff it makes) ends the whole agent: ``run`` gets its
  notice as output and is finished ``stopped`` (``Run.subagent_stopped``), though the stop
  was its child's;
- an **agent used as a tool** (``Agent.as_tool``) is checked as the tool call it is, then
  runs governed by a child run of the calling agent's run, finished when the tool returns.
  Only the tool's name and description are carried over to the governed copy (not an
  ``as_tool`` call's ``custom_output_extractor``, ``run_config`` or ``hooks``); for those,
  start the child yourself: ``run.child(agent=...)`` inside your own function tool, and
  ``govern_agent(sub_agent, child)`` there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
from collections.abc import Callable
from typing import Any, cast

from agents import (
    Agent,
    AgentHooks,
    FunctionTool,
    Handoff,
    RunContextWrapper,
    ToolGuardrailFunctionOutput,
    ToolInputGuardrailData,
    ToolOutputGuardrailData,
    tool_input_guardrail,
    tool_output_guardrail,
)
from agents import handoff as make_handoff
from agents.agent import ToolsToFinalOutputResult
from agents.items import ModelResponse
from agents.models.interface import Model
from agents.tool import (
    FunctionToolResult,
    resolve_function_tool_failure_error_function,
    set_function_tool_failure_error_function,
)
from agents.usage import Usage
from openai.types.responses import ResponseOutputMessage, ResponseOutputText

from .._core import ActionType, FinishStatus
from ..aio import AsyncRun
from ..client import Run
from ..decision import Decision

__all__ = ["GovernanceState", "govern_agent"]


@dataclasses.dataclass
class GovernanceState:
    """What the guardrails, the hooks and the tool-use behaviour of one governed agent share."""

    run: Run | AsyncRun
    stop: Decision | None = None
    last_text: str | None = None
    #: Decisions by tool call id, for the output guardrail's nudge.
    decisions: dict[str, Decision] = dataclasses.field(default_factory=dict)
    failed: set[str] = dataclasses.field(default_factory=set)
    #: A child run this state's agent runs in (SPEC 20): finished when the agent ends.
    child: bool = False
    #: The run whose children the handoffs start (the run given to govern_agent).
    root: Run | AsyncRun | None = None
    #: A handoff's receiver: the run whose agent ends with this agent's final output (the
    #: run given to govern_agent, or an agent-as-tool call's child run). None: ``run``.
    owner: Run | AsyncRun | None = None
    #: What a model call costs (``llm_cost``), and the spend not yet sent with a check.
    llm_cost: Callable[[Any], float] | None = None
    unbilled: float = 0.0

    async def check(self, name: str, args: dict[str, Any], call_id: str | None,
                    type: ActionType = "tool") -> Decision:
        # The model's spend since the last check goes with this one (SPEC 5.2 `cost_usd`):
        # a sub-agent's spend counts on every ancestor too (SPEC 20).
        cost, self.unbilled = (self.unbilled or None), 0.0
        if isinstance(self.run, AsyncRun):
            return await self.run.check(name, args, call_id=call_id, type=type,
                                        cost_usd=cost)
        # The sync client blocks: keep the event loop free while it talks to the service.
        return await asyncio.to_thread(self.run.check, name, args, call_id=call_id,
                                       type=type, cost_usd=cost)

    async def start_child(self, agent: str) -> Run | AsyncRun:
        if isinstance(self.run, AsyncRun):
            return await self.run.start_subagent(agent)
        return await asyncio.to_thread(self.run.start_subagent, agent)

    def ended(self, output: str, stop: Decision | None = None) -> None:
        """This agent produced the run's final output (``stop``: a governance stop's notice).
        It is the output of this state's run and, for a handoff's receiver, of the run whose
        agent ends with it, which a sub-agent's stop then leaves ``stopped`` rather than
        ``completed`` with no output (found by a newcomer)."""
        self.run.output = output
        if self.owner is not None:
            self.owner.output = output
            if stop is not None:
                self.owner.subagent_stopped(stop, output)

    async def finish_child(self) -> None:
        """End this state's child run as its block would: stopped if a decision stopped it
        (or a sub-agent's stop ended it), else completed."""
        if not self.child or self.run.finished:
            return
        status: FinishStatus = self.run.exit_status()
        if isinstance(self.run, AsyncRun):
            await self.run.finish(status)
        else:
            await asyncio.to_thread(self.run.finish, status)


class _Hooks(AgentHooks[Any]):
    """Records the model's last words (the partial response) and delegates to the agent's
    own hooks, if it had any."""

    def __init__(self, state: GovernanceState, inner: AgentHooks[Any] | None) -> None:
        self.state, self.inner = state, inner

    def __getattribute__(self, name: str) -> Any:
        # Every hook the agent had keeps running; only on_llm_end, on_end and on_handoff are
        # ours as well.
        if name.startswith("on_") and name not in ("on_llm_end", "on_end", "on_handoff"):
            inner = object.__getattribute__(self, "inner")
            if inner is not None:
                return getattr(inner, name)
        return object.__getattribute__(self, name)

    async def on_llm_end(self, context: Any, agent: Any, response: Any) -> None:
        if self.state.llm_cost is not None:
            self.state.unbilled += float(self.state.llm_cost(response))
        texts = []
        for item in getattr(response, "output", []) or []:
            if getattr(item, "type", None) == "message":
                for part in getattr(item, "content", []) or []:
                    text = getattr(part, "text", None)
                    if isinstance(text, str):
                        texts.append(text)
        if texts and "".join(texts).strip():
            self.state.last_text = "\n".join(texts).strip()
        if self.inner is not None:
            await self.inner.on_llm_end(context, agent, response)

    async def on_end(self, context: Any, agent: Any, output: Any) -> None:
        # The agent produced the final output: it is the run's output (the README's promise
        # that a run stores its final response), and its child run, if it has one, is over.
        if output is not None:
            self.state.ended(output if isinstance(output, str) else str(output))
        await self.state.finish_child()
        if self.inner is not None:
            await self.inner.on_end(context, agent, output)

    async def on_handoff(self, context: Any, agent: Any, source: Any) -> None:
        if self.inner is not None:
            await self.inner.on_handoff(context, agent, source)


def govern_agent(
    agent: Agent[Any],
    run: Run | AsyncRun,
    *,
    raise_on_stop: bool = False,
    partial_response: Callable[[GovernanceState], str | None] | None = None,
    llm_cost: Callable[[Any], float] | None = None,
) -> Agent[Any]:
    """A copy of ``agent`` governed by ``run`` (see the module docstring). ``llm_cost``:
    what one model call cost in USD, from its ``ModelResponse`` (e.g. from
    ``response.usage`` and your model's prices); sent with the next check as ``cost_usd``,
    so ``max_usd`` bounds the agent and its sub-agents."""
    return _govern(agent, GovernanceState(run, llm_cost=llm_cost),
                   raise_on_stop=raise_on_stop, partial_response=partial_response)


def _govern(agent: Agent[Any], state: GovernanceState, *, raise_on_stop: bool,
            partial_response: Callable[[GovernanceState], str | None] | None) -> Agent[Any]:
    run = state.run
    options = {"raise_on_stop": raise_on_stop, "partial_response": partial_response}

    @tool_input_guardrail(name="governance_check")
    async def check(data: ToolInputGuardrailData) -> ToolGuardrailFunctionOutput:
        ctx = data.context
        try:
            args = json.loads(ctx.tool_arguments or "{}")
        except ValueError:
            args = {"_unparsed_arguments": ctx.tool_arguments}
        if not isinstance(args, dict):
            args = {"_arguments": args}
        decision = await state.check(ctx.tool_name, args, ctx.tool_call_id)
        state.decisions[ctx.tool_call_id] = decision
        if decision.allowed:
            return ToolGuardrailFunctionOutput.allow(output_info=decision)
        if state.stop is None:
            state.stop = decision
        if raise_on_stop:
            # The agent ends here too, by an exception: said as use_behavior says it.
            stop = run.stop_decision or decision
            partial = (partial_response or (lambda s: s.last_text))(state)
            state.ended(stop.user_notice(partial), stop)
            return ToolGuardrailFunctionOutput.raise_exception(output_info=decision)
        # The run's first stop explains; parallel calls checked after it only hear "over".
        shown = run.stop_decision or decision
        return ToolGuardrailFunctionOutput.reject_content(shown.user_notice(),
                                                          output_info=decision)

    @tool_output_guardrail(name="governance_report")
    async def report(data: ToolOutputGuardrailData) -> ToolGuardrailFunctionOutput:
        call_id = data.context.tool_call_id
        if call_id not in state.failed:  # a failure was reported already, as an error
            run.report(data.output, call_id=call_id)
        decision = state.decisions.pop(call_id, None)
        if decision is not None and decision.directive is not None:
            # A message of its own would sit between the results of parallel calls.
            nudged = f"{data.output}\n\n{decision.directive.get('content')}"
            return ToolGuardrailFunctionOutput.reject_content(nudged, output_info=decision)
        return ToolGuardrailFunctionOutput.allow()

    tools = [_governed_tool(t, state, check, report, options) if isinstance(t, FunctionTool)
             else t for t in agent.tools]
    handoffs = [_governed_handoff(h, state, options) for h in agent.handoffs]
    behaviour = agent.tool_use_behavior

    async def use_behavior(context: RunContextWrapper[Any], results: list[FunctionToolResult]
                           ) -> ToolsToFinalOutputResult:
        if state.stop is not None:
            partial = (partial_response or (lambda s: s.last_text))(state)
            stop = run.stop_decision or state.stop
            output = stop.user_notice(partial)
            state.ended(output, stop)
            return ToolsToFinalOutputResult(is_final_output=True, final_output=output)
        return await _delegate(behaviour, context, results)

    return agent.clone(tools=tools, handoffs=handoffs, tool_use_behavior=use_behavior,
                       hooks=_Hooks(state, agent.hooks))


class _StopModel(Model):
    """The model of an agent a stopped handoff would have reached: it answers the stop's
    notice as its final output, with no tool call, so the run ends there."""

    def __init__(self, notice: str) -> None:
        self.notice = notice

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        text = ResponseOutputText(type="output_text", text=self.notice, annotations=[])
        message = ResponseOutputMessage(id="msg_governance_stop", type="message",
                                        role="assistant", status="completed", content=[text])
        return ModelResponse(output=[message], usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("a stopped handoff does not stream")


def _governed_handoff(item: Agent[Any] | Handoff[Any, Any], state: GovernanceState,
                      options: dict[str, Any]) -> Handoff[Any, Any]:
    """A handoff checked on the handing-off agent's run, whose receiving agent runs governed
    by a new child run of the root of this governance (SPEC 20)."""
    target = make_handoff(item) if isinstance(item, Agent) else item
    invoke = target.on_invoke_handoff

    async def governed(ctx: RunContextWrapper[Any], input_json: str) -> Agent[Any]:
        receiving = await invoke(ctx, input_json)
        decision = await state.check(f"handoff:{receiving.name}", {}, None, type="other")
        if not decision.allowed:
            state.stop = state.stop or decision
            stop = state.run.stop_decision or decision
            notice = stop.user_notice(state.last_text)
            state.ended(notice, stop)
            await state.finish_child()
            if options["raise_on_stop"]:
                # Its user_notice() is the stop's (a GovernanceError's own told the user the
                # service had refused a request and to try again later).
                from ..errors import GovernanceStop
                raise GovernanceStop(stop, notice)
            return receiving.clone(model=_StopModel(notice), tools=[], handoffs=[],
                                   input_guardrails=[], output_guardrails=[])
        await state.finish_child()  # control moves on: the handing-off agent is done
        root = state.root if state.root is not None else state.run
        child = await GovernanceState(root).start_child(receiving.name)
        sub = GovernanceState(child, child=True, root=root, llm_cost=state.llm_cost,
                              owner=state.owner or state.run)
        return _govern(receiving, sub, **options)

    return dataclasses.replace(target, on_invoke_handoff=governed)


def _governed_agent_tool(tool: FunctionTool, state: GovernanceState,
                         options: dict[str, Any]) -> FunctionTool:
    """An agent used as a tool: each call runs that agent governed by a new child run of the
    calling agent's run, finished when the call returns (SPEC 20)."""
    inner: Agent[Any] = tool._agent_instance

    async def invoke(ctx: Any, input_json: str) -> Any:
        child = await state.start_child(inner.name)
        sub = GovernanceState(child, child=True, root=state.run, llm_cost=state.llm_cost)
        governed = _govern(inner, sub, **options).as_tool(tool.name, tool.description)
        try:
            return await governed.on_invoke_tool(ctx, input_json)
        finally:
            await sub.finish_child()

    return dataclasses.replace(tool, on_invoke_tool=invoke)


def _governed_tool(tool: FunctionTool, state: GovernanceState, check: Any, report: Any,
                   options: dict[str, Any]) -> FunctionTool:
    if getattr(tool, "_is_agent_tool", False):
        tool = _governed_agent_tool(tool, state, options)
    copy = dataclasses.replace(
        tool,
        tool_input_guardrails=[*(tool.tool_input_guardrails or []), check],
        tool_output_guardrails=[*(tool.tool_output_guardrails or []), report],
    )
    original = resolve_function_tool_failure_error_function(tool)
    if original is not None:
        def failed(ctx: Any, error: Exception) -> Any:
            call_id = getattr(ctx, "tool_call_id", None)
            if call_id is not None:
                state.failed.add(call_id)
            state.run.report(error=error, call_id=call_id)
            return original(ctx, error)

        set_function_tool_failure_error_function(copy, failed)
    return copy


async def _delegate(behaviour: Any, context: RunContextWrapper[Any],
                    results: list[FunctionToolResult]) -> ToolsToFinalOutputResult:
    """The agent's own tool_use_behavior, for the turns governance did not stop."""
    if callable(behaviour):
        result = behaviour(context, results)
        return cast(ToolsToFinalOutputResult,
                    await result if inspect.isawaitable(result) else result)
    if behaviour == "stop_on_first_tool" and results:
        return ToolsToFinalOutputResult(is_final_output=True, final_output=results[0].output)
    if isinstance(behaviour, dict):
        names = set(behaviour.get("stop_at_tool_names", ()))
        for result in results:
            if result.tool.name in names:
                return ToolsToFinalOutputResult(is_final_output=True, final_output=result.output)
    return ToolsToFinalOutputResult(is_final_output=False)
