"""Generate the sync client (client.py) from the async one (aio.py) with unasync.

    python governance_client/scripts/unasync_client.py          # writes client.py
    python governance_client/scripts/unasync_client.py --check  # exit 1 if it is not current

unasync strips ``async`` and ``await`` and renames, token by token, the async names below to
their sync twins. Three things it cannot do are done here, on the text: the module docstring
(the sync module's own, below), the class names inside docstrings and comments, and the
header saying the file is generated. What differs beyond names (how one attempt is bounded,
the default sleep) is written by hand in governance_client/_transport.py.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

import unasync

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "governance_client"
SOURCE = PACKAGE / "aio.py"
TARGET = PACKAGE / "client.py"

# Beyond unasync's own (__aenter__, asynccontextmanager, AsyncIterator, ...).
REPLACEMENTS = {
    "AsyncGovernanceClient": "GovernanceClient",
    "AsyncRun": "Run",
    "AsyncClient": "Client",  # httpx
    "AsyncBaseTransport": "BaseTransport",  # httpx
    "AsyncRetrying": "Retrying",  # tenacity
    "aclose": "close",
    "alock": "lock",  # RunCore's locks: asyncio.Lock / threading.RLock
    "AsyncSleep": "Sleep",
    "async_sleep": "sync_sleep",
    "asend_once": "send_once",
}

HEADER = """\
# Generated from aio.py by governance_client/scripts/unasync_client.py: do not edit.
# Edit aio.py and run the script again (a test fails while this file is not current).
"""

DOC = '''"""The agent's side of the check API (SPEC 5): start a run, check every action, finish.

Typical use::

    with GovernanceClient(url, key) as client, client.run("support-bot", task=question) as run:
        while True:
            action = model.next_action(history)
            decision = run.check(action.name, action.args)
            if not decision.allowed:
                run.output = decision.user_notice(partial_response)
                break
            run.report(execute(action))

``AsyncGovernanceClient`` (``governance_client.aio``) has the same surface for asyncio code.
"""'''


def generate() -> str:
    """client.py as aio.py makes it."""
    rule = unasync.Rule("/_async/", "/_sync/", additional_replacements=REPLACEMENTS)
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder, "_async", "aio.py")
        source.parent.mkdir()
        source.write_text(SOURCE.read_text(encoding="utf-8"), encoding="utf-8")
        unasync.unasync_files([str(source)], [rule])
        text = Path(folder, "_sync", "aio.py").read_text(encoding="utf-8")
    text = re.sub(r"\bAsync(GovernanceClient|Run)\b", r"\1", text)
    # The module docstring is the file's first statement: the sync module's own replaces it
    # (with the blank line after it, which unasync drops).
    text = re.sub(r'\A""".*?"""\n*', lambda _: DOC + "\n\n", text, count=1, flags=re.S)
    return HEADER + text


def main(argv: list[str]) -> int:
    text = generate()
    if "--check" in argv:
        if TARGET.read_text(encoding="utf-8") != text:
            print(f"{TARGET.name} is not generated from {SOURCE.name}: run {__file__}")
            return 1
        return 0
    TARGET.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
