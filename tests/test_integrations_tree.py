"""SPEC 20 through the shipped integrations against the real server, on scripted models: an
OpenAI Agents SDK handoff loop is stopped at the policy's step (the handoffs' receiving agents
are child runs of the root), and a Claude Agent SDK subagent's checks appear as a child run.
The fake-service twins of these, with the sub-agent's spend and LangGraph subgraphs, are in
governance_client/tests/test_client_tree_integrations.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from governance_client import AsyncGovernanceClient
from policies.models import Team
from runs.models import Decision, Run
from tests.conftest import Agent, Server, set_policy

pytest.importorskip("agents")
pytest.importorskip("claude_agent_sdk")

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


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


def _handoff(name: str, i: int) -> Any:
    from openai.types.responses import ResponseFunctionToolCall
    return ResponseFunctionToolCall(id=f"fc_{i}", call_id=f"call_{i}", type="function_call",
                                    name=name, arguments="{}")


def test_an_agents_sdk_handoff_loop_is_stopped_at_the_policys_step(server: Server,
                                                                   agent: Agent, team: Team):
    from agents import Agent as SdkAgent
    from agents import RunConfig, Runner
    from governance_client.integrations.openai_agents import govern_agent

    set_policy(team, step_limits={"max_steps": 6, "max_repeat_action": 100,
                                  "no_progress_window": 100})
    triage = SdkAgent(name="triage", model=_scripted(
        [[_handoff("transfer_to_billing", i)] for i in range(20)]))
    billing = SdkAgent(name="billing", handoffs=[triage], model=_scripted(
        [[_handoff("transfer_to_triage", 100 + i)] for i in range(20)]))
    triage.handoffs = [billing]

    async def main() -> tuple[str, str]:
        async with AsyncGovernanceClient(server.url, agent.token, deadline=10) as client, \
                client.run("triage") as run:
            result = await Runner.run(govern_agent(triage, run), "help", max_turns=50,
                                      run_config=RunConfig(tracing_disabled=True))
            return run.id, str(result.final_output)

    root_id, output = asyncio.run(main())
    assert "max_steps" in output
    root = Run.objects.get(pk=root_id)
    children = Run.objects.filter(parent_run_id=root_id)
    assert root.steps == 7 and children.count() == 6
    assert Decision.objects.filter(run__in=children, outcome="allow").count() == 5
    assert not children.filter(status="running").exists()


def test_a_claude_subagents_checks_appear_as_a_child_run(server: Server, agent: Agent,
                                                         team: Team):
    from claude_agent_sdk import ClaudeAgentOptions
    from governance_client.integrations.claude_agent_sdk import governance_hooks

    base = {"session_id": "s", "transcript_path": "/dev/null", "cwd": "."}

    async def main() -> str:
        async with AsyncGovernanceClient(server.url, agent.token, deadline=10) as client, \
                client.run("coder") as run:
            hooks = ClaudeAgentOptions(hooks=governance_hooks(run)).hooks or {}
            (pre,), (start,), (stop,) = (hooks[e][0].hooks for e in
                                         ("PreToolUse", "SubagentStart", "SubagentStop"))
            assert await pre({"hook_event_name": "PreToolUse", "tool_name": "Task",
                              "tool_input": {"prompt": "explore"}, "tool_use_id": "t0",
                              **base}, "t0", {"signal": None}) == {}
            await start({"hook_event_name": "SubagentStart", "agent_id": "a1",
                         "agent_type": "Explore", **base}, None, {"signal": None})
            for i in range(1, 3):
                assert await pre({"hook_event_name": "PreToolUse", "tool_name": "Grep",
                                  "tool_input": {"pattern": f"p{i}"}, "tool_use_id": f"t{i}",
                                  "agent_id": "a1", "agent_type": "Explore", **base},
                                 f"t{i}", {"signal": None}) == {}
            await stop({"hook_event_name": "SubagentStop", "agent_id": "a1",
                        "agent_type": "Explore", "agent_transcript_path": "/dev/null",
                        "stop_hook_active": False, **base}, None, {"signal": None})
            return run.id

    root_id = asyncio.run(main())
    child = Run.objects.get(parent_run_id=root_id)
    assert (child.agent, child.status, child.steps) == ("Explore", "completed", 2)
    assert list(Decision.objects.filter(run=child).values_list("action_name", flat=True)) \
        == ["Grep", "Grep"]
    assert Run.objects.get(pk=root_id).steps == 3
    assert json.loads(json.dumps(str(child.root_run_id))) == root_id


def test_a_subagent_under_an_agent_bound_key_runs_as_a_child_of_that_agent(
        server: Server, team: Team):
    # The client's README makes the key with `--agent`; such a key may start runs of that
    # agent only (SPEC 5), and the integrations' child run for a sub-agent named otherwise
    # was refused (422): the exception ended the agent's run as failed. The sub-agent now
    # runs as a child of the key's agent, its own name in the child's metadata.
    from claude_agent_sdk import ClaudeAgentOptions
    from governance_client.integrations.claude_agent_sdk import governance_hooks

    from policies.services import agent_key_create

    token = agent_key_create(team=team, name="bound", agent="coder").token
    base = {"session_id": "s", "transcript_path": "/dev/null", "cwd": "."}

    async def main() -> str:
        async with AsyncGovernanceClient(server.url, token, deadline=10) as client, \
                client.run("coder") as run:
            hooks = ClaudeAgentOptions(hooks=governance_hooks(run)).hooks or {}
            (pre,), (start,) = (hooks[e][0].hooks for e in ("PreToolUse", "SubagentStart"))
            await start({"hook_event_name": "SubagentStart", "agent_id": "a1",
                         "agent_type": "Explore", **base}, None, {"signal": None})
            assert await pre({"hook_event_name": "PreToolUse", "tool_name": "Grep",
                              "tool_input": {"pattern": "p"}, "tool_use_id": "t1",
                              "agent_id": "a1", "agent_type": "Explore", **base},
                             "t1", {"signal": None}) == {}
            return run.id

    root_id = asyncio.run(main())
    child = Run.objects.get(parent_run_id=root_id)
    assert (child.agent, child.metadata, child.steps) == ("coder", {"subagent": "Explore"}, 1)
    assert Run.objects.get(pk=root_id).status == "completed"
