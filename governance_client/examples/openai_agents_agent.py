"""An OpenAI Agents SDK agent governed by the check API, through a tool input guardrail.

* ``governance_check`` (a tool input guardrail) checks every tool call before it runs; a stop
  raises ``ToolInputGuardrailTripwireTriggered``, which ends ``Runner.run``, carrying the
  decision as ``output_info``;
* ``GovernanceHooks.on_tool_end`` and ``report_tool_error`` report each outcome, so the next
  check carries it as ``last_result``.

The governance ``Run`` travels as the SDK's run context. The model is a scripted ``Model`` (no
OpenAI call, no API key) replaying the seed article's rename loop: the run is stopped with
``loop_detected`` at the 4th identical ``edit_file`` call.

Run it: ``python governance_client/examples/openai_agents_agent.py`` (against a real service with
GOVERNANCE_URL and GOVERNANCE_API_KEY (or GOVERNANCE_KEY) set, else against an
in-process fake).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

from agents import (
    Agent,
    RunConfig,
    RunContextWrapper,
    RunHooks,
    Runner,
    Tool,
    ToolGuardrailFunctionOutput,
    ToolInputGuardrailData,
    ToolInputGuardrailTripwireTriggered,
    function_tool,
    tool_input_guardrail,
)
from agents.items import ModelResponse, TResponseOutputItem, TResponseStreamEvent
from agents.models.interface import Model
from agents.usage import Usage
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

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


@dataclass
class Governed:
    """The SDK's run context: what tools, guardrails and hooks share."""

    run: Run
    workspace: Workspace


@dataclass
class Outcome:
    run_id: str
    stop: Decision | None
    answer: str
    workspace: Workspace
    model_calls: int


def _message(text: str, item_id: str) -> ResponseOutputMessage:
    return ResponseOutputMessage(
        id=item_id,
        type="message",
        role="assistant",
        status="completed",
        content=[ResponseOutputText(type="output_text", text=text, annotations=[])],
    )


class ScriptedModel(Model):
    """A ``Model`` that replays fixed turns instead of calling an LLM."""

    def __init__(self, turns: Iterable[list[TResponseOutputItem]]) -> None:
        self._turns = iter(turns)
        self.calls = 0

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        # *args/**kwargs: the SDK has grown keyword arguments over versions; none matter here.
        self.calls += 1
        return ModelResponse(output=next(self._turns), usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[TResponseStreamEvent]:
        raise NotImplementedError("the scripted model does not stream")


def rename_loop_turns() -> list[list[TResponseOutputItem]]:
    """The runaway model: the same edit_file call every turn, differently narrated."""
    turns: list[list[TResponseOutputItem]] = [
        [
            _message(narration(i), f"msg_{i}"),
            ResponseFunctionToolCall(
                id=f"fc_{i}",
                call_id=f"call_{i}",
                type="function_call",
                name="edit_file",
                arguments=json.dumps(EDIT_ARGS),
            ),
        ]
        for i in range(ITERATIONS)
    ]
    turns.append([_message("Renamed user_id to account_id in auth.py.", "msg_final")])
    return turns


@tool_input_guardrail
async def governance_check(data: ToolInputGuardrailData) -> ToolGuardrailFunctionOutput:
    governed: Governed = data.context.context
    args = json.loads(data.context.tool_arguments or "{}")
    # The client is synchronous: keep the event loop free while it talks to the service.
    decision = await asyncio.to_thread(governed.run.check, data.context.tool_name, args)
    if decision.allowed:
        return ToolGuardrailFunctionOutput.allow(output_info=decision)
    return ToolGuardrailFunctionOutput.raise_exception(output_info=decision)


def report_tool_error(context: RunContextWrapper[Any], error: Exception) -> str:
    context.context.run.report(error=error)
    return f"error: {error}"


class GovernanceHooks(RunHooks[Governed]):
    async def on_tool_end(
        self, context: RunContextWrapper[Governed], agent: Any, tool: Tool, result: object
    ) -> None:
        run = context.context.run
        # report_tool_error already reported a failure of this call: that report wins.
        if run.pending_result is None:
            run.report(result)


@function_tool(tool_input_guardrails=[governance_check], failure_error_function=report_tool_error)
def edit_file(context: RunContextWrapper[Governed], path: str, old: str, new: str) -> str:
    """Replace every occurrence of `old` with `new` in the file at `path`."""
    return context.context.workspace.edit_file(path, old, new)


async def run_agent(client: GovernanceClient) -> Outcome:
    workspace = Workspace()
    model = ScriptedModel(rename_loop_turns())
    agent = Agent[Governed](name=AGENT, instructions=SYSTEM_PROMPT, model=model, tools=[edit_file])
    stop: Decision | None = None
    with client.run(AGENT, task=TASK) as run:
        try:
            result = await Runner.run(
                agent,
                TASK,
                context=Governed(run, workspace),
                hooks=GovernanceHooks(),
                # Far above the loop, so that governance, not max_turns, stops it.
                max_turns=ITERATIONS + 5,
                run_config=RunConfig(tracing_disabled=True),
            )
        except ToolInputGuardrailTripwireTriggered as tripped:
            stop = tripped.output.output_info
            assert isinstance(stop, Decision)
            run.output = stop.user_notice(workspace.partial_response())
        else:
            run.output = str(result.final_output)
    return Outcome(run.id, stop, run.output, workspace, model.calls)


def main() -> int:
    with governance_client() as client:
        outcome = asyncio.run(run_agent(client))
    print(outcome.answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
