"""The live stream under load: from a decision to its event on a connected SSE client.

`runs` runs are running (200, 1,000); agents check them at a steady pace (each run about once
a `per_run_interval`, a second by default) while an operator's browsers, simulated by SSE
clients with a logged-in session, watch `watched` of the run pages (by default one on each;
`teams/<slug>/runs/<id>/stream`, the dashboard's timeline stream). For every decision on a
watched run, the latency is the time from the agent receiving the answer to the stream
delivering the `step` event with that decision's id.

On one server (`Target.of_server`), or on the web nodes of deploy/stack.py (`--stream-nodes
3`): the agents check through its HAProxy, and the pages are spread over the nodes, each
page on one node's own address, as a browser's stream stays on the node that took it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

from . import agents as ag
from .client import Connection, HttpError
from .nodes import tree_cpu
from .stack import Server


@dataclass
class Target:
    """Where the agents check, where the pages are read from, and whose CPU is the
    server's."""

    agents: tuple[str, int]
    pages: list[tuple[str, int]]
    pids: list[int]

    @classmethod
    def of_server(cls, server: Server) -> Target:
        at = ("127.0.0.1", server.port)
        return cls(agents=at, pages=[at],
                   pids=[server.process.pid] if server.process is not None else [])


# Pages one signed-in viewer of the phase holds: under DASHBOARD_STREAMS_PER_VIEWER (24 a
# process), past which a viewer's streams are refused (SPEC 10). With one viewer for every
# page, the phase measured 48 pages of its 200 or 1,000 (24 in each of two processes) from
# the day that cap came (d9f1b0c), the others refused, and counted their decisions missing.
PAGES_PER_VIEWER = 10


def session_cookie(team_id: int, viewer: int = 0) -> str:
    """A viewer of the team, logged in through Django's session machinery."""
    from django.contrib.auth.models import User
    from django.test import Client

    from policies.models import Role, Team
    from policies.services import membership_set

    user, _ = User.objects.get_or_create(username=f"bench-viewer-{viewer}")
    membership_set(team=Team.objects.get(pk=team_id), user=user, role=Role.VIEWER, actor=None)
    client = Client()
    client.force_login(user)
    return str(client.cookies["sessionid"].value)


async def _watch(at: tuple[str, int], path: str, cookie: str, seen: dict[int, float],
                 stop: asyncio.Event, errors: list[str], ready: asyncio.Event) -> None:
    """Read one SSE stream, noting when each event id arrives; reconnects when the server
    ends the stream (streams have a bounded lifetime). ``ready`` is set at its first event
    (the page's first look)."""
    last_id = ""
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(*at)
        except OSError as exc:
            errors.append(f"sse connect: {exc}")
            return
        head = (f"GET {path} HTTP/1.1\r\nHost: {at[0]}:{at[1]}\r\nAccept: text/event-stream\r\n"
                f"Cookie: sessionid={cookie}\r\n")
        if last_id:
            head += f"Last-Event-ID: {last_id}\r\n"
        writer.write((head + "\r\n").encode())
        try:
            status_line = await reader.readuntil(b"\r\n")
            if b" 200 " not in status_line:
                errors.append(f"sse status {status_line.decode(errors='replace').strip()}")
                return
            await reader.readuntil(b"\r\n\r\n")
            buffer = b""
            while not stop.is_set():
                # No timeout per read: the phase cancels its streams when it ends. A
                # `wait_for` per read made a task and a timer twice a second per quiet
                # stream: at 1,000 pages the clients took 5.0 s of CPU in a 40 s phase with
                # it, 1.7 s without, from the two cores the server is measured on.
                chunk = await reader.read(65536)
                if not chunk:
                    break
                now = time.monotonic()
                if b"event: refused" in chunk:
                    # Past the viewer's cap: this page measures nothing; said, not counted.
                    errors.append("sse refused: too many streams for one viewer")
                    ready.set()
                    return
                if b"event:" in chunk:
                    ready.set()
                buffer += chunk
                # Chunked framing interleaves size lines; event fields are whole lines, so
                # scanning lines for "id: " is enough here.
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.startswith(b"id:"):
                        # Kept whatever it is, as a browser keeps it: a run page's looks end
                        # with `<decision id>~<page state>`, which lets a reconnect resume
                        # without a full look; only a step's id is a decision's.
                        last_id = value = line[3:].strip().decode()
                        if value.isdigit():
                            seen.setdefault(int(value), now)
        finally:
            writer.close()


async def _agent(at: tuple[str, int], token: str, runs: list[str], per_run_interval: float,
                 deadline: float, answered: dict[int, tuple[str, float]],
                 errors: list[str]) -> None:
    conn = Connection(*at, token=token)
    step = 0
    try:
        while time.monotonic() < deadline:
            started = time.monotonic()
            for run_id in runs:
                body = ag.script(ag.NORMAL, uuid.uuid4().hex)[1 + step % 18]
                try:
                    status, answer = await conn.post_json(f"/api/v1/runs/{run_id}/check", body)
                except HttpError as exc:
                    errors.append(f"check {exc}")
                    continue
                if status == 200 and isinstance(answer, dict):
                    answered[int(answer["decision_id"])] = (run_id, time.monotonic())
                else:
                    errors.append(f"check {status}")
            step += 1
            await asyncio.sleep(max(0.0, per_run_interval - (time.monotonic() - started)))
    finally:
        await conn.close()


def measure(target: Target, *, team_slug: str, team_id: int, token: str, runs: int = 200,
            watched: int = 200, agents: int = 20, per_run_interval: float = 1.0,
            seconds: float = 15.0) -> dict[str, Any]:
    from django.urls import reverse

    from .scenarios import reset_runs

    reset_runs()
    cookies = [session_cookie(team_id, viewer)
               for viewer in range(max(1, -(-watched // PAGES_PER_VIEWER)))]

    async def drive() -> dict[str, Any]:
        conn = Connection(*target.agents, token=token)
        run_ids = []
        for i in range(runs):
            status, body = await conn.post_json("/api/v1/runs", {"agent": f"bench-agent-{i % 16}"})
            if status != 201:
                raise RuntimeError(f"could not start run {i}: {status} {body}")
            run_ids.append(body["run_id"])
        await conn.close()
        watched_ids = run_ids[:watched]
        seen: dict[int, float] = {}
        answered: dict[int, tuple[str, float]] = {}
        errors: list[str] = []
        stop = asyncio.Event()
        ready = [asyncio.Event() for _ in watched_ids]
        opened = time.monotonic()
        cpu_at_start = time.process_time()
        streams = [
            asyncio.ensure_future(_watch(
                target.pages[i % len(target.pages)],
                reverse("runs:run_stream", args=[team_slug, run_id]),
                cookies[i // PAGES_PER_VIEWER], seen, stop,
                errors, ready[i]))
            for i, run_id in enumerate(watched_ids)
        ]
        # The pages are open: every stream has sent its first look (the page's state), as a
        # browser's would have before anyone watches it. Measured, not part of the latency.
        # A timing, not an error: pages still waiting for their first look after 120 s are
        # counted, and measured all the same once they have it.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(r.wait() for r in ready)), 120)
        all_open_s = time.monotonic() - opened
        not_open = sum(1 for r in ready if not r.is_set())
        deadline = time.monotonic() + seconds
        share = [run_ids[i::agents] for i in range(agents)]
        # The server's CPU while the agents check (its processes: `serve` and its workers,
        # on every node): what the checks and the open pages' streams cost it together.
        server_cpu = tree_cpu(target.pids)
        await asyncio.gather(*(_agent(target.agents, token, mine, per_run_interval, deadline,
                                      answered, errors) for mine in share))
        server_cpu = tree_cpu(target.pids) - server_cpu
        await asyncio.sleep(3.0)  # the last events arrive
        stop.set()
        for stream in streams:
            stream.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        client_cpu_s = time.process_time() - cpu_at_start
        watched_set = set(watched_ids)
        latencies = [max(0.0, seen[d] - t) for d, (run_id, t) in answered.items()
                     if run_id in watched_set and d in seen]
        expected = sum(1 for run_id, _ in answered.values() if run_id in watched_set)
        return {
            "measured": True,
            "running_runs": runs,
            "web_nodes": len(target.pages),
            "watched_runs": watched,
            "pages_open_s": round(all_open_s, 2),  # from opening them to every first look
            "pages_not_open_in_120_s": not_open,
            "per_run_interval_s": per_run_interval,
            "checks_per_s": round(len(answered) / seconds, 1),
            # The machine's other work shows here: its 1-minute load average at the end.
            "load_average_1m": round(os.getloadavg()[0], 2),
            # The clients' own CPU (the pages' readers and the agents, this process), taken
            # from the cores the server is measured on.
            "client_cpu_s": round(client_cpu_s, 1),
            "server_cpu_per_s": round(server_cpu / seconds, 2),
            "phase_s": round(time.monotonic() - opened, 1),
            "events": len(latencies),
            "events_expected": expected,
            "events_missing": expected - len(latencies),
            "p50_ms": round(ag.percentile(latencies, 50) * 1000, 1),
            "p95_ms": round(ag.percentile(latencies, 95) * 1000, 1),
            "p99_ms": round(ag.percentile(latencies, 99) * 1000, 1),
            "max_ms": round(max(latencies, default=0.0) * 1000, 1),
            "errors": len(errors),
            "error_kinds": sorted(set(errors))[:5],
        }

    return asyncio.run(drive())
