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
reads for that call. ``run.output`` is set to the final output.

Works with a ``Run`` (sync client, called in a thread) or an ``AsyncRun``.
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
    RunContextWrapper,
    ToolGuardrailFunctionOutput,
    ToolInputGuardrailData,
    ToolOutputGuardrailData,
    tool_input_guardrail,
    tool_output_guardrail,
)
from agents.agent import ToolsToFinalOutputResult
from agents.tool import (
    FunctionToolResult,
    resolve_function_tool_failure_error_function,
    set_function_tool_failure_error_function,
)

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

    async def check(self, name: str, args: dict[str, Any], call_id: str) -> Decision:
        if isinstance(self.run, AsyncRun):
            return await self.run.check(name, args, call_id=call_id)
        # The sync client blocks: keep the event loop free while it talks to the service.
        return await asyncio.to_thread(self.run.check, name, args, call_id=call_id)


class _Hooks(AgentHooks[Any]):
    """Records the model's last words (the partial response) and delegates to the agent's
    own hooks, if it had any."""

    def __init__(self, state: GovernanceState, inner: AgentHooks[Any] | None) -> None:
        self.state, self.inner = state, inner

    def __getattribute__(self, name: str) -> Any:
        # Every hook the agent had keeps running; only on_llm_end is ours as well.
        if name.startswith("on_") and name != "on_llm_end":
            inner = object.__getattribute__(self, "inner")
            if inner is not None:
                return getattr(inner, name)
        return object.__getattribute__(self, name)

    async def on_llm_end(self, context: Any, agent: Any, response: Any) -> None:
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


def govern_agent(
    agent: Agent[Any],
    run: Run | AsyncRun,
    *,
    raise_on_stop: bool = False,
    partial_response: Callable[[GovernanceState], str | None] | None = None,
) -> Agent[Any]:
    """A copy of ``agent`` governed by ``run`` (see the module docstring)."""
    state = GovernanceState(run)

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

    tools = [_governed_tool(t, state, check, report) if isinstance(t, FunctionTool) else t
             for t in agent.tools]
    behaviour = agent.tool_use_behavior

    async def use_behavior(context: RunContextWrapper[Any], results: list[FunctionToolResult]
                           ) -> ToolsToFinalOutputResult:
        if state.stop is not None:
            partial = (partial_response or (lambda s: s.last_text))(state)
            output = (run.stop_decision or state.stop).user_notice(partial)
            run.output = output
            return ToolsToFinalOutputResult(is_final_output=True, final_output=output)
        return await _delegate(behaviour, context, results)

    return agent.clone(tools=tools, tool_use_behavior=use_behavior,
                       hooks=_Hooks(state, agent.hooks))


def _governed_tool(tool: FunctionTool, state: GovernanceState, check: Any, report: Any
                   ) -> FunctionTool:
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
