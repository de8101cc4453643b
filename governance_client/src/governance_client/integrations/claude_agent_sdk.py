"""Claude Agent SDK: ``governance_hooks`` (extra ``claude-agent-sdk``).

One line of wiring::

    options = ClaudeAgentOptions(hooks=governance_hooks(run), ...)

* ``PreToolUse`` asks the check (``run.check`` with the tool's name, input and
  ``tool_use_id``). Allowed: no opinion (``{}``), so the SDK's own permission rules still
  apply; the repeated-error directive goes to Claude as ``additionalContext``. Stopped: the
  call is denied with the stop notice as ``permissionDecisionReason``, and by default
  (``stop_agent=True``) the agent stops (``continue: false``, the notice as ``stopReason``);
  with ``stop_agent=False`` Claude reads the reason and may answer with its partial response.
* ``PostToolUse`` reports the tool's response, ``PostToolUseFailure`` its error, per
  ``tool_use_id``.

A check answered ``pending`` or ``wait`` waits inside the hook; the ``PreToolUse`` matcher's
timeout (``check_timeout``, default one hour) must be longer than such waits, or the SDK
gives up on the hook first.
"""

from __future__ import annotations

import asyncio
from typing import Any

from claude_agent_sdk import HookMatcher

from ..aio import AsyncRun
from ..client import Run
from ..decision import Decision

__all__ = ["governance_hooks"]


def governance_hooks(
    run: Run | AsyncRun,
    *,
    matcher: str | None = None,
    stop_agent: bool = True,
    check_timeout: float = 3600,
) -> dict[str, list[HookMatcher]]:
    """The ``hooks`` of ``ClaudeAgentOptions`` that govern every tool call (``matcher``: the
    SDK's tool-name pattern, default every tool)."""

    async def check(name: str, args: dict[str, Any], call_id: str | None) -> Decision:
        if isinstance(run, AsyncRun):
            return await run.check(name, args, call_id=call_id)
        return await asyncio.to_thread(run.check, name, args, call_id=call_id)

    async def pre_tool_use(input_data: Any, tool_use_id: str | None, context: Any
                           ) -> dict[str, Any]:
        call_id = input_data.get("tool_use_id") or tool_use_id
        tool_input = input_data.get("tool_input")
        decision = await check(input_data["tool_name"],
                               tool_input if isinstance(tool_input, dict) else {}, call_id)
        if decision.allowed:
            if decision.directive is None:
                return {}
            return {"hookSpecificOutput": {
                "hookEventName": "PreToolUse",
                "additionalContext": str(decision.directive.get("content")),
            }}
        notice = decision.user_notice()
        answer: dict[str, Any] = {"hookSpecificOutput": {
            "hookEventName": "PreToolUse",
            "permissionDecision": "deny",
            "permissionDecisionReason": notice,
        }}
        if stop_agent:
            answer |= {"continue_": False, "stopReason": notice}
        return answer

    async def post_tool_use(input_data: Any, tool_use_id: str | None, context: Any
                            ) -> dict[str, Any]:
        run.report(input_data.get("tool_response"),
                   call_id=input_data.get("tool_use_id") or tool_use_id)
        return {}

    async def post_tool_use_failure(input_data: Any, tool_use_id: str | None, context: Any
                                    ) -> dict[str, Any]:
        run.report(error=str(input_data.get("error") or "tool error"),
                   call_id=input_data.get("tool_use_id") or tool_use_id)
        return {}

    return {
        "PreToolUse": [HookMatcher(matcher=matcher, hooks=[pre_tool_use],
                                   timeout=check_timeout)],
        "PostToolUse": [HookMatcher(matcher=matcher, hooks=[post_tool_use])],
        "PostToolUseFailure": [HookMatcher(matcher=matcher, hooks=[post_tool_use_failure])],
    }
