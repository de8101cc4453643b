"""client.py is generated from aio.py (scripts/unasync_client.py): written once, the two
clients cannot drift apart. This fails when one was edited without generating again."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "unasync_client.py"


def test_the_sync_client_is_the_current_generation_of_the_async_one() -> None:
    spec = importlib.util.spec_from_file_location("unasync_client", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    generated = script.generate()
    assert script.TARGET.read_text(encoding="utf-8") == generated, (
        "client.py is not aio.py's generation: edit aio.py, then run "
        "governance_client/scripts/unasync_client.py")
