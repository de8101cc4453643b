"""The seed article's runaway agent, shared by the examples.

The task: rename ``user_id`` to ``account_id`` in auth.py. The first edit works; then the agent
forgets it did it and repeats the very same ``edit_file`` call, 47 times, only rephrasing its
narration ("I'll now" → "Let me" → "I need to"), each repeat failing with "no matches found".
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from governance_client import GovernanceClient
from governance_client.testing import FakeGovernance

AGENT = "rename-bot"
TASK = "Rename the variable user_id to account_id in auth.py."
SYSTEM_PROMPT = "You are a coding agent. Use the tools to edit files."
ITERATIONS = 47
EDIT_ARGS = {"path": "auth.py", "old": "user_id", "new": "account_id"}
PHRASES = ("I'll now", "Let me", "I need to")


def narration(iteration: int) -> str:
    return f"{PHRASES[iteration % len(PHRASES)]} rename `user_id` to `account_id` in auth.py"


@dataclass
class Workspace:
    """The files the agent edits, in memory."""

    files: dict[str, str] = field(
        default_factory=lambda: {
            "auth.py": "def login(user_id):\n"
            "    session['user'] = user_id\n"
            "    return load_profile(user_id)\n"
        }
    )
    #: What the successful tool calls did: the material of a partial response.
    done: list[str] = field(default_factory=list)

    def edit_file(self, path: str, old: str, new: str) -> str:
        if path not in self.files:
            raise FileNotFoundError(f"no such file: {path}")
        matches = self.files[path].count(old)
        if matches == 0:
            raise ValueError("no matches found")
        self.files[path] = self.files[path].replace(old, new)
        result = f"edit_file({path}, {old} → {new}): {matches} matches replaced"
        self.done.append(result)
        return result

    def partial_response(self) -> str:
        if not self.done:
            return "Nothing was done yet."
        return "Done so far:\n" + "\n".join(f"- {line}" for line in self.done)


def governance_client(fake: FakeGovernance | None = None) -> GovernanceClient:
    """The real service if GOVERNANCE_URL and an agent key (GOVERNANCE_API_KEY, or
    GOVERNANCE_KEY as the MCP gateway names it) are set, else an in-process fake
    (max_repeat_action=3, like a new policy), so the example runs with nothing else. A URL
    without a key says so: the example would otherwise run on the fake unnoticed."""
    url = os.environ.get("GOVERNANCE_URL")
    key = os.environ.get("GOVERNANCE_API_KEY") or os.environ.get("GOVERNANCE_KEY")
    if url and key:
        return GovernanceClient(url, key)
    if url:
        print(f"GOVERNANCE_URL is {url}, but neither GOVERNANCE_API_KEY nor GOVERNANCE_KEY is "
              "set: running against an in-process fake, not the service.", file=sys.stderr)
    return (fake or FakeGovernance(max_repeat_action=3)).client()
