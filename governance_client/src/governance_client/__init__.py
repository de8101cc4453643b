"""Agent-side client for the agent governance check API."""
