"""A worker's start leaves what it loaded out of the garbage collector's reach
(governance/asgi.py `freeze_startup_objects`): a full collection otherwise walks every object
the process holds, 140 to 180 ms with the GIL held, set off by any request that builds many
containers (found by an attacker: a team's checks of 29,000 nested arrays made another team's
check p99 500 ms, SPEC 10). Run in a process of its own: a freeze lasts until it exits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROGRAM = r"""
import asyncio, gc, json, sys
import governance.asgi as asgi

async def start():
    sent = []
    messages = iter([{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}])
    async def receive():
        return next(messages)
    async def send(message):
        sent.append(message["type"])
    await asgi.application({"type": "lifespan"}, receive, send)
    return sent

before = gc.get_freeze_count()
sent = asyncio.run(start())
print(json.dumps({"sent": sent, "before": before, "frozen": gc.get_freeze_count(),
                  "left": len(gc.get_objects()), "views": "runs.check.api" in sys.modules}))
"""


def test_a_workers_start_freezes_what_it_loaded() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env["DJANGO_SETTINGS_MODULE"] = "governance.settings"
    done = subprocess.run([sys.executable, "-c", PROGRAM], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["sent"] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert result["before"] == 0 and result["views"]
    # Most of what the process holds is frozen: a full collection walks the rest only.
    assert result["frozen"] > 50_000 and result["frozen"] > 5 * result["left"], result
