"""Claude Agent SDK: ``governance_hooks`` and ``governed_messages`` (extra ``claude-agent-sdk``).

Two lines of wiring::

    options = ClaudeAgentOptions(hooks=governance_hooks(run), ...)
    async for message in governed_messages(run, query(prompt=task, options=options)):
        ...

* ``PreToolUse`` asks the check (``run.check`` with the tool's name, input and
  ``tool_use_id``). Allowed: no opinion (``{}``), so the SDK's own permission rules still
  apply; the repeated-error directive goes to Claude as ``additionalContext``. Stopped: the
  call is denied with the stop notice as ``permissionDecisionReason``, and by default
  (``stop_agent=True``) the agent stops (``continue: false``, the notice as ``stopReason``);
  with ``stop_agent=False`` Claude reads the reason and may answer with its partial response.
  The notice is the run's first stop (with parallel calls, the calls checked after it are
  only told the run is over), and becomes ``run.output``.
* ``PostToolUse`` reports the tool's response, ``PostToolUseFailure`` its error, per
  ``tool_use_id``.
* ``governed_messages`` passes the messages of ``query`` (or of
  ``ClaudeSDKClient.receive_response()``) through; after a stop, the ``ResultMessage``'s
  ``result`` is the partial response followed by the stop notice. Without it the user would
  get what the CLI gives: an empty ``result``, the agent having been stopped before it said
  anything.

Tool names are the SDK's: built-in tools by name (``Read``, ``Bash``), MCP tools as
``mcp__<server>__<tool>``; the policy's tool patterns are written against those names.

Subagents (the ``Task`` tool's sub-sessions) are governed as child runs of ``run`` (SPEC 20):
the ``Task`` call itself is checked on ``run``; a ``SubagentStart`` hook starts a child run
(its agent: the subagent's type), and every tool call the SDK reports with that ``agent_id``
is checked on the child, so it counts on ``run`` too and ``run``'s limits bound it;
``SubagentStop`` finishes it. A subagent's stop denies its call without ending the whole
agent (a child's stop does not stop its parent); the main thread's does.

A check answered ``pending`` or ``wait`` waits inside the hook; the ``PreToolUse`` matcher's
timeout (``check_timeout``, default one hour) must be longer than such waits, or the SDK
gives up on the hook first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import AsyncIterable, AsyncIterator, Mapping
from typing import Any, cast

from claude_agent_sdk import (
    AssistantMessage,
    HookContext,
    HookInput,
    HookJSONOutput,
    HookMatcher,
    Message,
    ResultMessage,
    TextBlock,
)
from claude_agent_sdk.types import HookEvent, SyncHookJSONOutput

from .._core import FinishStatus
from ..aio import AsyncRun
from ..client import Run
from ..decision import Decision

__all__ = ["governance_hooks", "governed_messages"]

_AGENT_CHARS = re.compile(r"[^A-Za-z0-9._-]")  # what a run's agent name may hold (SPEC 5)


def governance_hooks(
    run: Run | AsyncRun,
    *,
    matcher: str | None = None,
    stop_agent: bool = True,
    check_timeout: float = 3600,
) -> dict[HookEvent, list[HookMatcher]]:
    """The ``hooks`` of ``ClaudeAgentOptions`` that govern every tool call (``matcher``: the
    SDK's tool-name pattern, default every tool) and every subagent as a child run."""
    children: dict[str, Run | AsyncRun] = {}

    async def child_of(data: Mapping[str, Any]) -> Run | AsyncRun:
        """The run a hook's call belongs to: ``run``, or its subagent's child run (started
        on the first sight of the subagent, should its SubagentStart not have come)."""
        agent_id = data.get("agent_id")
        if not agent_id:
            return run
        if agent_id not in children:
            name = _AGENT_CHARS.sub("-", str(data.get("agent_type") or "subagent"))[:100]
            if isinstance(run, AsyncRun):
                children[agent_id] = await run.start_subagent(name or "subagent")
            else:
                children[agent_id] = await asyncio.to_thread(run.start_subagent,
                                                             name or "subagent")
        return children[agent_id]

    async def check(target: Run | AsyncRun, name: str, args: dict[str, Any],
                    call_id: str | None) -> Decision:
        if isinstance(target, AsyncRun):
            return await target.check(name, args, call_id=call_id)
        return await asyncio.to_thread(target.check, name, args, call_id=call_id)

    async def subagent_start(input_data: HookInput, tool_use_id: str | None,
                             context: HookContext) -> HookJSONOutput:
        await child_of(cast(Mapping[str, Any], input_data))
        return {}

    async def subagent_stop(input_data: HookInput, tool_use_id: str | None,
                            context: HookContext) -> HookJSONOutput:
        child = children.get(str(cast(Mapping[str, Any], input_data).get("agent_id")))
        if child is not None and not child.finished:
            status: FinishStatus = "stopped" if child.stop_decision is not None \
                else "completed"
            if isinstance(child, AsyncRun):
                await child.finish(status)
            else:
                await asyncio.to_thread(child.finish, status)
        return {}

    async def pre_tool_use(input_data: HookInput, tool_use_id: str | None,
                           context: HookContext) -> HookJSONOutput:
        data = cast(Mapping[str, Any], input_data)
        call_id = data.get("tool_use_id") or tool_use_id
        tool_input = data.get("tool_input")
        target = await child_of(data)
        decision = await check(target, str(data.get("tool_name")),
                               tool_input if isinstance(tool_input, dict) else {}, call_id)
        if decision.allowed:
            if decision.directive is None:
                return {}
            return {"hookSpecificOutput": {
                "hookEventName": "PreToolUse",
                "additionalContext": str(decision.directive.get("content")),
            }}
        notice = (target.stop_decision or decision).user_notice()
        target.output = notice  # stored even if the program reads nothing after the stop
        answer: SyncHookJSONOutput = {"hookSpecificOutput": {
            "hookEventName": "PreToolUse",
            "permissionDecision": "deny",
            "permissionDecisionReason": notice,
        }}
        if stop_agent and target is run:
            answer["continue_"] = False
            answer["stopReason"] = notice
        return answer

    async def post_tool_use(input_data: HookInput, tool_use_id: str | None,
                            context: HookContext) -> HookJSONOutput:
        data = cast(Mapping[str, Any], input_data)
        (await child_of(data)).report(data.get("tool_response"),
                                      call_id=data.get("tool_use_id") or tool_use_id)
        return {}

    async def post_tool_use_failure(input_data: HookInput, tool_use_id: str | None,
                                    context: HookContext) -> HookJSONOutput:
        data = cast(Mapping[str, Any], input_data)
        (await child_of(data)).report(error=str(data.get("error") or "tool error"),
                                      call_id=data.get("tool_use_id") or tool_use_id)
        return {}

    return {
        "PreToolUse": [HookMatcher(matcher=matcher, hooks=[pre_tool_use],
                                   timeout=check_timeout)],
        "PostToolUse": [HookMatcher(matcher=matcher, hooks=[post_tool_use])],
        "PostToolUseFailure": [HookMatcher(matcher=matcher, hooks=[post_tool_use_failure])],
        "SubagentStart": [HookMatcher(hooks=[subagent_start])],
        "SubagentStop": [HookMatcher(hooks=[subagent_stop])],
    }


async def governed_messages(run: Run | AsyncRun, messages: AsyncIterable[Message]
                            ) -> AsyncIterator[Message]:
    """``messages`` as they come; once governance stopped the agent, the ``ResultMessage``
    carries the partial response (Claude's result, else its last words) and the stop notice
    as its ``result``, which is also set as ``run.output``."""
    last_text: str | None = None
    async for message in messages:
        if isinstance(message, AssistantMessage):
            text = "\n".join(b.text for b in message.content if isinstance(b, TextBlock))
            if text.strip():
                last_text = text.strip()
        elif isinstance(message, ResultMessage):
            stop = _stop_of(run)
            if stop is not None:
                partial = message.result if (message.result or "").strip() else last_text
                message = dataclasses.replace(message, result=stop.user_notice(partial))
                run.output = message.result
        yield message


def _stop_of(run: Run | AsyncRun) -> Decision | None:
    """The stop to tell: the run's first (the one that explains; with parallel calls the
    later ones only say the run is over), else the last check's when it was not allowed (an
    outage, a wait given up on)."""
    if run.stop_decision is not None:
        return run.stop_decision
    last = run.last_decision
    return last if last is not None and not last.allowed else None
