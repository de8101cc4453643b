"""One-line integrations with agent frameworks, each behind its optional extra:

* ``governance_client.integrations.langchain``: ``GovernanceMiddleware`` for ``create_agent``
  (extra ``langchain``);
* ``governance_client.integrations.langgraph``: ``GovernedToolNode`` and ``govern_graph``
  for hand-built graphs (extra ``langgraph``);
* ``governance_client.integrations.openai_agents``: ``govern_agent`` for the OpenAI Agents SDK
  (extra ``openai-agents``);
* ``governance_client.integrations.claude_agent_sdk``: ``governance_hooks`` for the Claude
  Agent SDK (extra ``claude-agent-sdk``).

Importing this package imports no framework; each module imports only its own.
"""
