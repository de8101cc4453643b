"""One runs-list read of big runs, measured in process: its bytes, its time and the worker's
peak memory (docs/performance.md, "A runs list of big runs").

    python -m bench.big_lists setup   # 500 runs of a 10,000-emoji task and a 100,000-emoji output
    python -m bench.big_lists read    # GET /api/v1/runs?agent=big-out&limit=500, then every page

Against the database of DATABASE_URL (unset: SQLite in DATA_DIR). `read` runs in its own
process, so its peak RSS is the read's, not the setup's.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from datetime import timedelta

import django

RUNS = 500
TASK = "\U0001f600" * 10_000
OUTPUT = "\U0001f600" * 100_000
KEY_FILE = "big_lists.key"


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def setup() -> None:
    from django.core.management import call_command
    from django.utils import timezone

    from policies.services import agent_key_create, team_ensure
    from runs.models import Run

    call_command("migrate", verbosity=0)
    team = team_ensure(slug="big-lists", name="Big lists")[0]
    Run.objects.filter(team=team).delete()
    version = team.policies.get(name="default").current
    now = timezone.now()
    for start in range(0, RUNS, 25):
        Run.objects.bulk_create([
            Run(team=team, agent="big-out", policy_version=version, status="completed",
                started_at=now - timedelta(seconds=i), ended_at=now, task=TASK, output=OUTPUT)
            for i in range(start, min(start + 25, RUNS))])
    with open(KEY_FILE, "w") as f:
        f.write(agent_key_create(team=team, name=f"big-{time.time()}").token)


def read() -> None:
    from django.test import Client

    with open(KEY_FILE) as f:
        token = f.read().strip()
    client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")
    client.get("/api/v1/runs?agent=big-out&limit=1")  # imports, caches, connection
    time.sleep(0.5)  # the bulk pacing's debt of that first call
    before = _rss_mb()
    url = "/api/v1/runs?agent=big-out&limit=500"
    started = time.perf_counter()
    answer = client.get(url)
    took = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    assert answer.status_code == 200, answer.content[:300]
    body = json.loads(answer.content)
    print(f"first page: {answer.status_code}, {len(answer.content) / 1e6:.1f} MB, "
          f"{len(body['runs'])} runs, {took:.2f} s; RSS {before:.0f} MB before, "
          f"peak {peak:.0f} MB", flush=True)
    seen = [r["run_id"] for r in body["runs"]]
    pages, biggest, total = 1, len(answer.content), took
    del answer
    while body.get("next_after"):
        time.sleep(0.1)
        started = time.perf_counter()
        answer = client.get(f"{url}&after={body['next_after']}")
        if answer.status_code == 429:
            time.sleep(float(answer["Retry-After"]))
            continue
        total += time.perf_counter() - started
        assert answer.status_code == 200, answer.content[:300]
        body = json.loads(answer.content)
        seen += [r["run_id"] for r in body["runs"]]
        pages, biggest = pages + 1, max(biggest, len(answer.content))
        del answer
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"all pages: {pages}, {len(seen)} runs ({len(set(seen))} distinct), biggest "
          f"{biggest / 1e6:.1f} MB, {total:.2f} s in all; peak RSS {peak:.0f} MB")


if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "governance.settings")
    django.setup()
    {"setup": setup, "read": read}[sys.argv[1]]()
