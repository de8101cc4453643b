"""What the LangChain middleware and the LangGraph tool node share: one tool call, checked
before it runs, reported after, answered with the stop notice when governance stops it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, ToolMessage

from ..aio import AsyncRun
from ..client import Run
from ..decision import Decision

#: ``ToolMessage.artifact`` key of the answer to a stopped call (never sent to the model).
STOP_ARTIFACT = "governance_stop"
#: ``name`` of the final AIMessage that ends a governed agent.
STOP_NAME = "governance"

PartialResponse = Callable[[Any], str | None]
GovernedRun = Run | AsyncRun


def messages_of(state: Any) -> Sequence[BaseMessage]:
    if isinstance(state, dict):
        return state.get("messages") or []
    if isinstance(state, list):
        return state
    return getattr(state, "messages", None) or []


def last_ai_text(state: Any) -> str | None:
    """The default partial response: what the model last said in words (not a tool call)."""
    for message in reversed(messages_of(state)):
        if isinstance(message, AIMessage) and message.name != STOP_NAME:
            text = message.text if isinstance(message.text, str) else str(message.text)
            if text.strip():
                return text.strip()
    return None


def recorded_stop(message: BaseMessage) -> Decision | None:
    """The stop a message records: a stopped call's ToolMessage (``artifact``), or the final
    message a stop ended the agent with (``response_metadata``, which no provider is sent)."""
    if isinstance(message, ToolMessage):
        holder = message.artifact
    elif isinstance(message, AIMessage) and message.name == STOP_NAME:
        holder = message.response_metadata
    else:
        return None
    if isinstance(holder, dict) and holder.get(STOP_ARTIFACT):
        return Decision.from_state(holder[STOP_ARTIFACT])
    return None


def stop_in(state: Any, run: GovernedRun | None = None) -> Decision | None:
    """The governance stop that ended the state's last turn, if any: in its last tool results,
    or in the final message of an agent it ended (so a finished state or a checkpoint says it
    too). With ``run``, also the run's own stop once the run is over: a new turn on the same
    thread must end at once rather than call the model again."""
    for message in reversed(messages_of(state)):
        if isinstance(message, ToolMessage | AIMessage):
            recorded = recorded_stop(message)
            if recorded is not None:
                return recorded
            if isinstance(message, ToolMessage):
                continue
        break
    if run is not None:
        return run_stop(run, state)
    return None


def run_stop(run: GovernedRun, state: Any = None) -> Decision | None:
    """The stop of a run that is over (None while it runs): the first stop this client saw,
    else (a run resumed by its external_id) the last one the thread records, else the
    service's word for the run."""
    if run.stop_decision is not None:
        return run.stop_decision
    if run.status not in ("stopped", "killed"):
        return None
    for message in reversed(messages_of(state)):
        recorded = recorded_stop(message)
        if recorded is not None:
            return recorded
    reason = str(run.data.get("stop_reason") or run.status)
    return Decision(decision="stop", reason=reason,
                    message=f"This run is already {run.status}.",
                    next_action="Start a new run for new work.")


def shown_stop(run: GovernedRun, decision: Decision) -> Decision:
    """What a stopped call shows: the run's first stop. With parallel calls, the calls
    checked after it are answered "the run is already stopped", which explains nothing
    (the loop, the denied tool, the operator's note are in the first)."""
    return run.stop_decision or decision


def final_message(decision: Decision, state: Any, partial: PartialResponse | None) -> AIMessage:
    text = (partial or last_ai_text)(state)
    return AIMessage(content=decision.user_notice(text), name=STOP_NAME,
                     response_metadata={STOP_ARTIFACT: decision.to_state()})


def text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p if isinstance(p, str) else str(p.get("text", "")) for p in content
                         if isinstance(p, str | dict))
    return str(content)


class ToolCallGovernor:
    """Checks one tool call (a ``ToolCallRequest``) and reports its outcome."""

    def __init__(self, run: GovernedRun, *, nudge_in_result: bool,
                 handle_tool_errors: bool = False) -> None:
        self.run = run
        self.nudge_in_result = nudge_in_result
        self.handle_tool_errors = handle_tool_errors
        #: Directives received and not yet injected (the middleware injects them itself).
        self.directives: list[dict[str, Any]] = []

    def _check_sync(self, call: dict[str, Any]) -> Decision:
        if isinstance(self.run, AsyncRun):
            raise TypeError("an AsyncRun governs async agents: use ainvoke / astream")
        return self.run.check(call["name"], call.get("args") or {}, call_id=call.get("id"))

    async def _check_async(self, call: dict[str, Any]) -> Decision:
        if isinstance(self.run, AsyncRun):
            return await self.run.check(call["name"], call.get("args") or {},
                                        call_id=call.get("id"))
        # The sync client blocks: keep the event loop free while it talks to the service.
        return await asyncio.to_thread(self.run.check, call["name"], call.get("args") or {},
                                       call_id=call.get("id"))

    def stopped(self, call: dict[str, Any], decision: Decision) -> ToolMessage:
        decision = shown_stop(self.run, decision)
        return ToolMessage(
            content=decision.user_notice(), tool_call_id=str(call.get("id")),
            name=call.get("name"), status="error",
            artifact={STOP_ARTIFACT: decision.to_state()},
        )

    def failed(self, call: dict[str, Any], exc: Exception) -> ToolMessage:
        """A tool's exception as the model sees it: an error result it can react to."""
        return ToolMessage(content=f"Error: {type(exc).__name__}: {exc}",
                           tool_call_id=str(call.get("id")), name=call.get("name"),
                           status="error")

    def report(self, call: dict[str, Any], result: Any) -> Any:
        call_id = call.get("id")
        if isinstance(result, ToolMessage):
            text = text_of(result.content)
            if result.status == "error":
                self.run.report(error=text or "tool error", call_id=call_id)
            else:
                self.run.report(text, call_id=call_id)
        else:
            # A Command or another object: it ran, its content is not comparable.
            self.run.report(call_id=call_id)
        return result

    def nudged(self, result: Any, decision: Decision) -> Any:
        if decision.directive is None:
            return result
        if self.nudge_in_result and isinstance(result, ToolMessage):
            # Appended to this call's own result: a message of its own between the results
            # of parallel calls would break the pairing providers require.
            content = text_of(result.content) + "\n\n" + str(decision.directive.get("content"))
            return result.model_copy(update={"content": content})
        self.directives.append(decision.directive)
        return result

    def wrap(self, request: Any, handler: Callable[[Any], Any]) -> Any:
        call = request.tool_call
        decision = self._check_sync(call)
        if not decision.allowed:
            return self.stopped(call, decision)
        try:
            result = handler(request)
        except Exception as exc:
            self.run.report(error=exc, call_id=call.get("id"))
            if not self.handle_tool_errors:
                raise
            result = self.failed(call, exc)
            return self.nudged(result, decision)
        return self.nudged(self.report(call, result), decision)

    async def awrap(self, request: Any, handler: Callable[[Any], Awaitable[Any]]) -> Any:
        call = request.tool_call
        decision = await self._check_async(call)
        if not decision.allowed:
            return self.stopped(call, decision)
        try:
            result = await handler(request)
        except Exception as exc:
            self.run.report(error=exc, call_id=call.get("id"))
            if not self.handle_tool_errors:
                raise
            result = self.failed(call, exc)
            return self.nudged(result, decision)
        return self.nudged(self.report(call, result), decision)
