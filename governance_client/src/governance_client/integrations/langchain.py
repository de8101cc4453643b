"""LangChain 1.x agents (``create_agent``): ``GovernanceMiddleware`` (extra ``langchain``).

One line of wiring::

    agent = create_agent(model, tools, middleware=[GovernanceMiddleware(run)])

* every tool call is checked before it runs (``run.check`` with its name, args and id) and its
  result reported after (``run.report``, per tool call id, errors included);
* a stopped call is not run: the model is not called again, and the agent ends on an
  ``AIMessage`` (``name="governance"``) with the partial response, the stop's reason and its
  next step; ``run.output`` is set to it, so the run's ``with`` block stores it;
* the repeated-error directive (``Decision.directive``) is injected as a ``HumanMessage``
  before the next model call;
* a check answered ``pending`` or ``wait`` (SPEC 11, 12) waits inside ``run.check``, as the
  client does everywhere.

Works with ``invoke`` and ``ainvoke``, with a ``Run`` (sync client) or an ``AsyncRun``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from langchain.agents.middleware import AgentMiddleware, AgentState, hook_config
from langchain_core.messages import AIMessage, HumanMessage

from ._lc import (
    STOP_ARTIFACT,
    STOP_NAME,
    GovernedRun,
    PartialResponse,
    ToolCallGovernor,
    final_message,
    messages_of,
    stop_in,
)

__all__ = ["STOP_ARTIFACT", "STOP_NAME", "GovernanceMiddleware", "stop_in"]


class GovernanceMiddleware(AgentMiddleware):
    """Governs a ``create_agent`` agent with one governance run (see the module docstring).

    ``partial_response(state)`` gives the text the stop notice starts with (default: the
    model's last words). A tool that raises is reported as an error and, with
    ``handle_tool_errors`` (default), answered to the model as an error ``ToolMessage`` so
    that it can change approach (the repeated-error rule counts these); ``False`` re-raises.
    """

    def __init__(self, run: GovernedRun, *, partial_response: PartialResponse | None = None,
                 handle_tool_errors: bool = True) -> None:
        super().__init__()
        self.run = run
        self.partial_response = partial_response
        self.governor = ToolCallGovernor(run, nudge_in_result=False,
                                         handle_tool_errors=handle_tool_errors)

    # -- Tools ------------------------------------------------------------------------------

    def wrap_tool_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
        return self.governor.wrap(request, handler)

    async def awrap_tool_call(self, request: Any, handler: Callable[[Any], Awaitable[Any]]
                              ) -> Any:
        return await self.governor.awrap(request, handler)

    # -- Between model calls ----------------------------------------------------------------

    @hook_config(can_jump_to=["end"])
    def before_model(self, state: AgentState, runtime: Any) -> dict[str, Any] | None:
        # A stop in this turn, or a new turn of a run that is over: the model is not called.
        decision = stop_in(state, self.run)
        if decision is not None:
            final = final_message(decision, state, self.partial_response)
            self.run.output = str(final.content)
            return {"messages": [final], "jump_to": "end"}
        if self.governor.directives:
            directives, self.governor.directives = self.governor.directives, []
            return {"messages": [HumanMessage(content=str(d.get("content")))
                                 for d in directives]}
        return None

    @hook_config(can_jump_to=["end"])
    async def abefore_model(self, state: AgentState, runtime: Any) -> dict[str, Any] | None:
        return self.before_model(state, runtime)

    def after_agent(self, state: AgentState, runtime: Any) -> dict[str, Any] | None:
        # The answer the user gets is what the run stores (a stop already set it, and a
        # stopped run keeps its notice).
        if stop_in(state, self.run) is not None:
            return None
        for message in reversed(messages_of(state)):
            if isinstance(message, AIMessage):
                if message.name != STOP_NAME and isinstance(message.content, str):
                    self.run.output = message.content
                break
        return None

    async def aafter_agent(self, state: AgentState, runtime: Any) -> dict[str, Any] | None:
        return self.after_agent(state, runtime)
