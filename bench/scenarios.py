"""The measurements: throughput points, metrics cost, soak, kill switch, live stream, attacks.

Every function returns plain JSON-ready dicts; bench/__main__.py orders them and
bench/report.py prints and stores them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from . import agents as ag
from .stack import ROOT, Server, base_env, postgres_cpu_seconds

REAL, DURABLE, BARE = "real", "durable", "bare"
# The minimal baseline application's endpoints (bench/minimal/), on a server of their own.
MIN_DURABLE, MIN_BARE = "min-durable", "min-bare"
MINIMAL = {MIN_DURABLE, MIN_BARE}
BARE_LIKE = {BARE, MIN_BARE}
CHECK_PATHS: dict[str, ag.CheckPath] = {
    REAL: ag.real_check_path,
    DURABLE: lambda run_id: f"/api/bench/runs/{run_id}/durable",
    BARE: lambda run_id: f"/api/bench/runs/{run_id}/bare",
    MIN_DURABLE: lambda run_id: f"/runs/{run_id}/durable",
    MIN_BARE: lambda run_id: f"/runs/{run_id}/bare",
}
# The ladder (bench/ladder.py, issue 33): the one-statement minimal durable check
# (bench/minimal/fast.py) behind one more layer at each rung, then the real check. Each
# rung's checks go to the server `run_slice` is given for it in `check_servers`.
LADDER_PATHS: dict[str, ag.CheckPath] = {
    "wsgi-min": lambda run_id: f"/runs/{run_id}/durable",
    "wsgi-2trips": lambda run_id: f"/runs/{run_id}/durable2",
    "wsgi-rules": lambda run_id: f"/runs/{run_id}/decided",
    "asgi-min": lambda run_id: f"/runs/{run_id}/inline",
    "asgi-pool": lambda run_id: f"/runs/{run_id}/pool",
    "django-cycle": lambda run_id: f"/runs/{run_id}/fast",
    "api-middleware": lambda run_id: f"/api/bench/runs/{run_id}/fast",
    "auth": lambda run_id: f"/api/bench/runs/{run_id}/fast-auth",
    "validation": lambda run_id: f"/api/bench/runs/{run_id}/fast-valid",
}
CHECK_PATHS.update(LADDER_PATHS, **{"real-metrics": ag.real_check_path})
MIX, CHECKS = "mix", "checks"  # start-checks-finish runs; or runs already started, checks only
# Checks only, one long slice per endpoint (a point of its own in the results): what the
# short alternating slices hide, a cost that grows as the runs do (docs/performance.md "Two
# more ties").
LONG = "long"


@dataclass
class Team:
    slug: str
    team_id: int
    token: str


# The checks-only mode's policy: one run per agent for a whole slice, never a repeated call.
LONG_POLICY: dict[str, Any] = {
    **ag.BENCH_POLICY,
    "step_limits": {"max_steps": 10000, "max_repeat_action": 3, "no_progress_window": 4},
    "budgets": {"max_seconds": 3600, "max_usd": 1000.0, "max_tool_calls": None},
}


def seed_team(slug: str, policy: dict[str, Any] | None = None) -> Team:
    """The benchmark's team with its policy (bench/agents.py BENCH_POLICY unless told) and a
    new key."""
    from policies.document import default_policy, parse_policy
    from policies.models import Team as TeamModel
    from policies.services import agent_key_create, policy_save, team_ensure

    team, _ = team_ensure(slug=slug, name=f"Benchmark {slug}")
    document = default_policy()
    for key, value in (policy or ag.BENCH_POLICY).items():
        document[key] = {**document[key], **value} if isinstance(value, dict) else value
    policy_save(team=team, document=parse_policy(document), actor=None, source="bench")
    token = agent_key_create(team=TeamModel.objects.get(pk=team.pk),
                             name=f"bench-{uuid.uuid4().hex[:6]}").token
    return Team(slug=slug, team_id=team.pk, token=token)


def reset_runs() -> None:
    """Every point starts from the same empty tables, so no point pays for an earlier one's
    rows (the teams, policies and keys stay)."""
    from django.db import connection

    from runs.audit.retention import audit_maintenance

    # The audit tables refuse TRUNCATE outside a maintenance transaction (docs/reliability.md).
    with audit_maintenance(), connection.cursor() as cursor:
        cursor.execute("TRUNCATE runs_run, runs_decision, runs_killswitch RESTART IDENTITY CASCADE")
        cursor.execute("SELECT to_regclass('bench_repeat_count')")
        row = cursor.fetchone()
        if row and row[0]:
            cursor.execute("TRUNCATE bench_repeat_count")


def decision_rows(*, after_id: int = 0, with_action: bool | None = None,
                  team_id: int | None = None) -> int:
    """Audit rows written since `after_id` (of one team's runs: an attack of another team
    writes its own meanwhile)."""
    from django.db import connection

    sql = "SELECT count(*) FROM runs_decision WHERE id > %s"
    params: list[Any] = [after_id]
    if team_id is not None:
        sql += " AND run_id IN (SELECT id FROM runs_run WHERE team_id = %s)"
        params.append(team_id)
    if with_action is True:
        sql += " AND action_name <> ''"
    elif with_action is False:
        sql += " AND action_name = ''"
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    return int(row[0]) if row else 0


def max_decision_id() -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT coalesce(max(id), 0) FROM runs_decision")
        row = cursor.fetchone()
    return int(row[0]) if row else 0


@dataclass
class Slice:
    """One stretch of load on one endpoint, with what the database and the CPUs saw."""

    stats: ag.LoadStats
    rows: int
    cpu_server: float
    cpu_client: float
    cpu_postgres: float = 0.0


def run_slice(server: Server, team: Team, *, scenario: str, agents: int, seconds: float,
              warmup: float, minimal: Server | None = None, mode: str = MIX,
              reset: bool = True, check_servers: dict[str, Server] | None = None) -> Slice:
    """`agents` agents for `seconds` against one check endpoint, from empty run tables (unless
    the caller emptied them already); the audit rows written are counted against the
    decisions the agents received. A minimal scenario sends its checks to `minimal`, the
    starts and finishes still to `server`."""
    if reset:
        reset_runs()
    before = max_decision_id()
    check_server = minimal if scenario in MINIMAL else None
    if check_servers and scenario in check_servers:
        check_server = check_servers[scenario]
        if check_server is server:
            check_server = None
    if scenario in MINIMAL and minimal is None:
        raise ValueError(f"{scenario} needs the minimal baseline's server")
    opts = ag.AgentOptions(host="127.0.0.1", port=server.port, token=team.token,
                           check_path=CHECK_PATHS[scenario],
                           verify_answers=scenario.startswith(REAL),
                           check_port=check_server.port if check_server else None,
                           checks_only=mode == CHECKS)

    def cpu() -> float:
        return server.cpu() + (check_server.cpu() if check_server else 0.0)

    cpu_server0, cpu_client0 = cpu(), time.process_time()
    cpu_postgres0 = postgres_cpu_seconds()
    stats = asyncio.run(ag.run_load(opts, agents, seconds, warmup))
    cpu_server, cpu_client = cpu() - cpu_server0, time.process_time() - cpu_client0
    cpu_postgres = postgres_cpu_seconds() - cpu_postgres0
    return Slice(stats=stats, rows=decision_rows(after_id=before, team_id=team.team_id),
                 cpu_server=cpu_server,
                 cpu_client=cpu_client, cpu_postgres=cpu_postgres)


def load_point(server: Server, team: Team, *, scenario: str, agents: int, seconds: float,
               warmup: float, minimal: Server | None = None) -> dict[str, Any]:
    """One point made of one slice."""
    return summarize([run_slice(server, team, scenario=scenario, agents=agents,
                                seconds=seconds, warmup=warmup, minimal=minimal)],
                     scenario=scenario, agents=agents)


def interleaved_points(server: Server, team: Team, *, scenarios: list[str], agents: int,
                       rounds: int, seconds: float, warmup: float,
                       minimal: Server | None = None, mode: str = MIX) -> list[dict[str, Any]]:
    """The scenarios' points at one concurrency, measured in alternating slices (real,
    durable, bare, real, ...): on a machine whose load drifts, every scenario sees the same
    drift, which is what makes their ratios meaningful."""
    slices: dict[str, list[Slice]] = {s: [] for s in scenarios}
    for _ in range(rounds):
        for scenario in scenarios:
            slices[scenario].append(run_slice(server, team, scenario=scenario, agents=agents,
                                              seconds=seconds, warmup=warmup, minimal=minimal,
                                              mode=mode))
    return [summarize(slices[s], scenario=s, agents=agents, mode=mode) for s in scenarios]


def summarize(slices: list[Slice], *, scenario: str, agents: int, mode: str = MIX
              ) -> dict[str, Any]:
    window = sum(max(1e-9, x.stats.window_end - x.stats.window_start) for x in slices)
    lat = [v for x in slices for v in x.stats.check_latencies]
    other = [v for x in slices for v in x.stats.other_latencies]
    checks = sum(x.stats.checks_total for x in slices)
    errors: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    returned = distinct = rows = 0
    audit_ok = True
    for x in slices:
        st = x.stats
        errors.update(st.errors)
        outcomes.update(st.outcomes)
        rows += x.rows
        if scenario in BARE_LIKE:
            # The bare endpoint writes nothing and answers decision_id 0: no row may appear.
            audit_ok = audit_ok and x.rows == 0
            returned += st.decisions_returned
            distinct += st.decisions_returned
        else:
            # Decision ids restart with each slice's empty tables: compare slice by slice.
            audit_ok = audit_ok and x.rows == len(st.decision_ids) == st.decisions_returned
            returned += st.decisions_returned
            distinct += len(st.decision_ids)
    return {
        "scenario": scenario,
        "mode": mode,
        "agents": agents,
        "seconds": round(window, 1),
        "slices": len(slices),
        "checks_per_s": round(sum(x.stats.checks_in_window for x in slices) / window, 1),
        "requests_per_s": round(sum(x.stats.requests_in_window for x in slices) / window, 1),
        "p50_ms": round(ag.percentile(lat, 50) * 1000, 2),
        "p95_ms": round(ag.percentile(lat, 95) * 1000, 2),
        "p99_ms": round(ag.percentile(lat, 99) * 1000, 2),
        "max_ms": round(max(lat, default=0.0) * 1000, 2),
        "start_finish_p50_ms": round(ag.percentile(other, 50) * 1000, 2),
        "start_finish_p99_ms": round(ag.percentile(other, 99) * 1000, 2),
        "agents_starved": max(agents - len(x.stats.agents_served) for x in slices),
        "checks": checks,
        "errors": sum(errors.values()),
        "error_kinds": dict(errors),
        "decisions_returned": distinct,
        "duplicate_decision_ids": returned - distinct,
        "audit_rows": rows,
        "audit_ok": audit_ok,
        "runs_started": sum(x.stats.runs_started for x in slices),
        "runs_finished": sum(x.stats.runs_finished for x in slices),
        "reconnects": sum(x.stats.reconnects for x in slices),
        "outcomes": dict(outcomes),
        # Worker CPU per check includes the runs' starts and finishes (about one of each per
        # 17 checks): a rate that a noisy neighbour disturbs less than throughput.
        "server_cpu_ms_per_check": round(
            sum(x.cpu_server for x in slices) * 1000 / max(1, checks), 3),
        "client_cpu_ms_per_check": round(
            sum(x.cpu_client for x in slices) * 1000 / max(1, checks), 3),
        "postgres_cpu_ms_per_check": round(
            sum(x.cpu_postgres for x in slices) * 1000 / max(1, checks), 3),
    }


# --- Metrics ---------------------------------------------------------------------------------

def scrape_metrics(server: Server) -> dict[str, Any]:
    """Read /metrics once: is it protected, and does the decision counter add up?"""
    import httpx

    anonymous = httpx.get(f"{server.url}/metrics", timeout=10)
    response = httpx.get(f"{server.url}/metrics", timeout=10,
                         headers={"Authorization": f"Bearer {server.metrics_token}"})
    decisions = 0.0
    families: set[str] = set()
    for line in response.text.splitlines():
        if line.startswith("# TYPE "):
            families.add(line.split()[2])
        elif line.startswith("governance_decisions_total{"):
            decisions += float(line.rsplit(" ", 1)[1])
    return {"status": response.status_code, "anonymous_status": anonymous.status_code,
            "decisions_counted": int(decisions), "families": sorted(families)}


# --- Soak ------------------------------------------------------------------------------------

def soak(server: Server, team: Team, *, agents: int, seconds: float, sample_every: float
         ) -> dict[str, Any]:
    """`agents` agents for `seconds`, sampling the RSS of every granian worker process.

    Growth is measured from the first sample taken after a fifth of the soak (imports,
    caches and connection pools are warm by then) to the last one.
    """
    samples: list[tuple[float, dict[int, int]]] = []
    stop = threading.Event()

    def sample() -> None:
        start = time.monotonic()
        while not stop.wait(sample_every):
            samples.append((time.monotonic() - start, server.rss()))

    reset_runs()
    before = max_decision_id()
    sampler = threading.Thread(target=sample, daemon=True)
    samples.append((0.0, server.rss()))
    sampler.start()
    opts = ag.AgentOptions(host="127.0.0.1", port=server.port, token=team.token)
    cpu_server0, cpu_client0 = server.cpu(), time.process_time()
    stats = asyncio.run(ag.run_load(opts, agents, seconds, min(10.0, seconds / 5)))
    stop.set()
    sampler.join()
    samples.append((seconds, server.rss()))
    point = summarize([Slice(stats=stats, rows=decision_rows(after_id=before),
                             cpu_server=server.cpu() - cpu_server0,
                             cpu_client=time.process_time() - cpu_client0)],
                      scenario="soak", agents=agents)
    base_t = seconds / 5
    base = next((s for t, s in samples if t >= base_t), samples[-1][1])
    last = samples[-1][1]
    growth = {
        str(pid): round((last.get(pid, 0) - rss) * 100 / rss, 1)
        for pid, rss in base.items() if rss and pid in last
    }
    return {
        **point,
        "rss_mib": {str(pid): [round(s.get(pid, 0) / 2**20, 1) for _, s in samples]
                    for pid in last},
        "rss_sample_times_s": [round(t, 1) for t, _ in samples],
        "rss_growth_pct": growth,
        "rss_growth_max_pct": max(growth.values(), default=0.0),
        "rss_ok": bool(growth) and max(growth.values()) <= 10.0,
        "workers_restarted": sorted(base) != sorted(last),
    }


# --- Kill switch under load ------------------------------------------------------------------

def _engage(team: Team, reason: str) -> tuple[str, float]:
    """Engage the team kill switch the way an operator would, and return when it returned.

    `manage.py killswitch` when the command exists; otherwise an engaged KillSwitch row is
    written directly (the check reads engaged rows, so the check path is measured the same;
    only the Celery fan-out is then not exercised)."""
    from django.core.management import get_commands

    if "killswitch" in get_commands():
        env = base_env()
        subprocess.run([sys.executable, "manage.py", "killswitch", "engage", "--scope", "team",
                        "--team", team.slug, "--reason", reason], cwd=ROOT, env=env,
                       check=True, capture_output=True, timeout=60)
        return "manage.py killswitch engage", time.monotonic()
    from django.utils import timezone

    from runs.models import KillSwitch

    KillSwitch.objects.create(scope="team", team_id=team.team_id, target=f"team:{team.team_id}",
                              reason=reason, engaged_by_label="bench", engaged_at=timezone.now())
    return "direct KillSwitch insert (no killswitch command yet)", time.monotonic()


def _release(team: Team) -> None:
    from django.core.management import get_commands

    if "killswitch" in get_commands():
        subprocess.run([sys.executable, "manage.py", "killswitch", "release", "--scope", "team",
                        "--team", team.slug, "--reason", "benchmark over"], cwd=ROOT,
                       env=base_env(), check=False, capture_output=True, timeout=60)
    from runs.models import KillSwitch

    KillSwitch.objects.filter(team_id=team.team_id, active=True).update(active=False)


def killswitch(server: Server, team: Team, *, agents: int, before_s: float, after_s: float
               ) -> dict[str, Any]:
    """Engage the team switch while `agents` agents run. Every check sent after the engage
    command returned must answer stop/killed (leaked allows = 0), and every run that was
    running when the switch committed must be over. How long that took is read from the
    database's own timestamps: the switch's `engaged_at` and the covered runs' `ended_at`."""
    from django.db.models import Max, Q

    from runs.models import Decision, KillSwitch, Run

    reset_runs()
    opts = ag.AgentOptions(host="127.0.0.1", port=server.port, token=team.token,
                           record_answers=True)
    result: dict[str, Any] = {}

    async def drive() -> ag.LoadStats:
        stats_task = asyncio.ensure_future(ag.run_load(opts, agents, before_s + after_s, 0.0))
        await asyncio.sleep(before_s)
        engage_started = time.monotonic()
        how, returned = await asyncio.to_thread(_engage, team, "benchmark: kill under load")
        result.update(method=how, engage_s=round(returned - engage_started, 3),
                      engage_returned=returned)
        return await stats_task

    stats = asyncio.run(drive())
    returned = result.pop("engage_returned")
    switch = (KillSwitch.objects.filter(team_id=team.team_id, scope="team")
              .order_by("-engaged_at").first())
    leaked = [a for a in stats.answers if a[1] >= returned and a[2] == "allow"]
    killed_answers = sum(1 for a in stats.answers if a[3] == "killed")
    covered = Run.objects.none()
    stopped_s = None
    if switch is not None:
        engaged_at = switch.engaged_at
        covered = Run.objects.filter(Q(ended_at__isnull=True) | Q(ended_at__gte=engaged_at),
                                     team_id=team.team_id, started_at__lt=engaged_at)
        last_end = covered.aggregate(last=Max("ended_at"))["last"]
        if last_end is not None and not covered.filter(status="running").exists():
            stopped_s = round(max(0.0, (last_end - engaged_at).total_seconds()), 3)
    still_running = covered.filter(status="running").count()
    by_fanout = Decision.objects.filter(run__team_id=team.team_id, action_name="",
                                        reason="killed").count()
    _release(team)
    return {
        **result,
        "agents": agents,
        "covered_runs": covered.count(),
        "all_covered_stopped_s": stopped_s,
        "covered_runs_still_running": still_running,
        "killed_by_check": killed_answers,
        "killed_by_fanout": by_fanout,
        "checks": stats.checks_total,
        "leaked_allows": len(leaked),
        "refused_starts": stats.refused_starts,
        "errors": sum(stats.errors.values()),
        "error_kinds": dict(stats.errors),
        "ok": switch is not None and not leaked and not stats.errors and still_running == 0,
    }


# --- Kill switch fan-out at scale -----------------------------------------------------------

class _WebhookCounter:
    """A local webhook receiver that counts the deliveries per path (no signature check: the
    tests prove the signatures; the benchmark proves exactly-once at scale)."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        counts: Counter[str] = Counter()
        self.counts = counts

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                counts[self.path] += 1
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/fanout"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _seed_running_runs(team: Team, count: int) -> None:
    """`count` running runs of the team, written directly (starting them over the API would
    take minutes and measure the start, not the kill)."""
    from django.utils import timezone

    from policies.models import Policy
    from runs.models import Run

    version_id = Policy.objects.filter(team_id=team.team_id).values_list(
        "current_id", flat=True).first()
    now = timezone.now()
    for first in range(0, count, 2000):
        Run.objects.bulk_create([
            Run(team_id=team.team_id, agent="bench-fanout", policy_version_id=version_id,
                started_at=now, task=f"seeded run {i}", steps=i % 20, tool_calls=i % 20)
            for i in range(first, min(count, first + 2000))])


def killswitch_fanout(server: Server, team: Team, *, runs: int, agents: int,
                      timeout_s: float = 120.0) -> dict[str, Any]:
    """`runs` running runs of one team (plus `agents` agents checking runs of their own) and
    a team kill switch engaged by the command: how long after the engage's commit every
    covered run is killed with its audit record, whether the team's webhook arrives exactly
    once, and whether any check sent after the engage returned was allowed."""
    from django.db.models import Count, Max, Min

    from policies.models import Team as TeamModel
    from runs.models import Decision, KillSwitch, Run

    reset_runs()
    receiver = _WebhookCounter()
    TeamModel.objects.filter(pk=team.team_id).update(webhook_url=receiver.url)
    _seed_running_runs(team, runs)
    opts = ag.AgentOptions(host="127.0.0.1", port=server.port, token=team.token,
                           record_answers=True, checks_only=True)
    result: dict[str, Any] = {}

    async def drive() -> ag.LoadStats:
        load = asyncio.ensure_future(ag.run_load(opts, agents, 6.0, 0.0))
        await asyncio.sleep(2.0)
        engage_started = time.monotonic()
        how, returned = await asyncio.to_thread(_engage, team, "benchmark: fan-out at scale")
        result.update(method=how, engage_s=round(returned - engage_started, 3),
                      engage_returned=returned)
        return await load

    try:
        stats = asyncio.run(drive())
        returned = result.pop("engage_returned")
        switch = (KillSwitch.objects.filter(team_id=team.team_id, scope="team")
                  .order_by("-engaged_at").first())
        assert switch is not None
        covered = Run.objects.filter(team_id=team.team_id, started_at__lt=switch.engaged_at)
        deadline = time.monotonic() + timeout_s
        while covered.filter(status="running").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        still_running = covered.filter(status="running").count()
        last_end = covered.aggregate(last=Max("ended_at"))["last"]
        stopped_s = round((last_end - switch.engaged_at).total_seconds(), 3) \
            if last_end is not None and not still_running else None
        deadline = time.monotonic() + 30
        while not receiver.counts and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(2.0)  # a second delivery of the same switch would arrive meanwhile
        per_run = (Decision.objects.filter(run__team_id=team.team_id, reason="killed")
                   .values("run_id").annotate(n=Count("id")))
        with_record = sum(1 for r in per_run if r["n"] == 1)
        doubled = sum(1 for r in per_run if r["n"] > 1)
        killed = covered.filter(status="killed").count()
        # The fan-out's own records: the first one says when the worker began (the task's
        # queueing and the worker's pick-up before it), the last when it was done.
        span = Decision.objects.filter(run__team_id=team.team_id, reason="killed",
                                       action_name="").aggregate(first=Min("at"), last=Max("at"))
        first_s = round((span["first"] - switch.engaged_at).total_seconds(), 3) \
            if span["first"] else None
        last_s = round((span["last"] - switch.engaged_at).total_seconds(), 3) \
            if span["last"] else None
        leaked = [a for a in stats.answers if a[1] >= returned and a[2] == "allow"]
    finally:
        receiver.close()
        _release(team)
    webhooks = sum(receiver.counts.values())
    return {
        **result,
        "seeded_runs": runs,
        "agents": agents,
        "covered_runs": covered.count(),
        "killed_runs": killed,
        "runs_with_one_killed_record": with_record,
        "runs_with_several_killed_records": doubled,
        "all_covered_killed_s": stopped_s,
        "fanout_first_record_s": first_s,
        "fanout_last_record_s": last_s,
        "covered_runs_still_running": still_running,
        "webhooks_received": webhooks,
        "leaked_allows": len(leaked),
        "errors": sum(stats.errors.values()),
        "error_kinds": dict(stats.errors),
        "ok": (not still_running and killed == with_record == covered.count() and not doubled
               and webhooks == 1 and not leaked and not stats.errors),
    }


# --- Cost as one run grows -------------------------------------------------------------------

def analyze_runs() -> None:
    """ANALYZE the tables the check reads (what autovacuum does; it may be off here)."""
    from django.db import connection

    with connection.cursor() as cursor:
        for table in ("runs_run", "runs_decision", "runs_runmemory"):
            cursor.execute("SELECT to_regclass(%s)", [table])
            if cursor.fetchone()[0]:
                cursor.execute(f"ANALYZE {table}")


def long_run(server: Server, team: Team, *, steps: int, window: int = 50,
             reference_step: int = 10) -> dict[str, Any]:
    """One agent, one run, `steps` sequential checks with distinct args, progress and
    results: the median latency of the checks in windows of `window` steps at a few points
    of the run's life, each against step 10 measured at the same time (target: step 5,000
    within 1.2x of step 10).

    A shared machine's load changes over the minutes a long run takes, more than the cost
    being measured, so each window is paired: its checks alternate with those of a fresh
    reference run at steps 10 to 10 + `window` (advanced to step 10 first, past the first
    checks' one-time costs), on the same connection. `over_step_10` is the long run's median
    over the reference's, per window; `last_over_first` is the last window's.

    The run tables are analyzed once the runs exist, before the first window, as autovacuum
    does on a production server (the benchmark's server may run without it): the check's
    prepared statements are planned once per connection, and a plan made on tables never
    analyzed may look the run and its check_id up by the team's and the run's indexes,
    whose cost grows with every version of every run's row (docs/performance.md)."""
    from .client import Connection

    reset_runs()
    marks = sorted({m for m in (reference_step, 100, 500, 1000, 2000, 3000, 4000,
                                steps - window) if reference_step <= m <= steps - window})
    latencies: list[float] = []
    reference: dict[int, list[float]] = {}
    errors: Counter[str] = Counter()

    async def drive() -> None:
        conn = Connection("127.0.0.1", server.port, token=team.token)

        async def start() -> str | None:
            status, started = await conn.post_json("/api/v1/runs", {
                "agent": "bench-long-run", "task": "one long run"})
            if status != 201:
                errors[f"start {status}"] += 1
                return None
            return ag.real_check_path(started["run_id"])

        async def check(path: str, seed: str, i: int) -> float | None:
            sent = time.monotonic()
            status, answer = await conn.post_json(path, ag.long_body(seed, i))
            took = time.monotonic() - sent
            if status != 200 or answer.get("decision") != "allow":
                errors[f"check {status} {answer.get('reason') if status == 200 else ''}"] += 1
                return None
            return took

        try:
            path = await start()
            if path is None:
                return
            seed = uuid.uuid4().hex
            for i in range(steps):
                paired = None
                if any(m <= i < m + window for m in marks):
                    mark = max(m for m in marks if m <= i)
                    if mark not in reference:
                        ref_path, ref_seed = await start(), uuid.uuid4().hex
                        if ref_path is None:
                            return
                        for j in range(reference_step):
                            if await check(ref_path, ref_seed, j) is None:
                                return
                        if not reference:
                            await asyncio.to_thread(analyze_runs)
                        reference[mark] = []
                        ref = (ref_path, ref_seed)
                    paired = reference_step + len(reference[mark])
                took = await check(path, seed, i)
                if took is None:
                    return
                latencies.append(took)
                if paired is not None:
                    ref_took = await check(ref[0], ref[1], paired)
                    if ref_took is None:
                        return
                    reference[mark].append(ref_took)
        finally:
            await conn.close()

    asyncio.run(drive())

    def median_ms(values: list[float]) -> float:
        return round(ag.percentile(values, 50) * 1000, 2)

    done = [m for m in marks if len(latencies) >= m + window and
            len(reference.get(m, ())) == window]
    curve = {str(m): median_ms(latencies[m:m + window]) for m in done}
    at_reference = {str(m): median_ms(reference[m]) for m in done}
    over = {m: round(curve[m] / at_reference[m], 2) for m in curve if at_reference[m]}
    return {
        "steps": steps, "window": window, "median_ms_from_step": curve,
        "reference_step": reference_step, "reference_ms": at_reference, "over_step_10": over,
        "last_over_first": over.get(str(done[-1])) if done else None,
        "checks": len(latencies), "errors": sum(errors.values()), "error_kinds": dict(errors),
    }


# --- Attacks: the check's p99 under slow or greedy clients (SPEC 10) -------------------------

def _watched_run(server: Server, team: Team) -> str:
    """A running run of the team for the attack's run streams to watch."""
    import httpx

    response = httpx.post(f"{server.url}/api/v1/runs", json={"agent": "bench-watched"},
                          headers={"Authorization": f"Bearer {team.token}"}, timeout=10)
    response.raise_for_status()
    return str(response.json()["run_id"])


# The other team's policy for `heavy_rate_limits`: 50 rules (the most a policy may have)
# matching every action, never full, so every check pays for every rule.
HEAVY_RATE_POLICY: dict[str, Any] = {
    "step_limits": {"max_steps": 10000, "max_repeat_action": 3, "no_progress_window": 1000},
    "budgets": {"max_seconds": 3600, "max_usd": None, "max_tool_calls": None},
    "rate_limits": [{"match": "*" if i % 2 else f"tool{i}.*", "per": ("agent", "team")[i % 2],
                     "max": 100_000, "window_s": 3600} for i in range(50)],
}
# `heavy_args`: the other team's policy, so that its heavy checks go on being allowed.
HEAVY_ARGS_POLICY: dict[str, Any] = {
    "step_limits": {"max_steps": 10000, "max_repeat_action": 3, "no_progress_window": 1000},
    "budgets": {"max_seconds": 3600, "max_usd": None, "max_tool_calls": None},
}
POLLED_APPROVALS = 50
# `heavy_reads`: the other team's run of 1,000 decisions (the most a page gives), each with
# about 60 KB of arguments (a check's body may be 64 KiB), uploaded as local decisions.
HEAVY_READ_DECISIONS = 1000
HEAVY_READ_ARGS_BYTES = 60_000


# `heavy_pages`: the other team's audit page at its heaviest, a page of policy versions each
# diffed on it (their before and after together just under the page's AUDIT_DETAIL_SHOWN).
HEAVY_PAGE_VERSIONS = 50
HEAVY_PAGE_PATTERNS = 256  # the most a list of a policy may have
# `account_guesses`: the other team's people, whose passwords one address guesses in turn.
GUESSED_ACCOUNTS = 80


def neighbour_state(server: Server, name: str) -> dict[str, Any]:
    """Another team's state for the attacks a tenant makes on its neighbours: its keys and,
    for the long polls, pending approvals to wait on (made after the runs were reset)."""
    import httpx

    from policies.models import Team as TeamModel
    from policies.services import agent_key_create

    if name == "heavy_rate_limits":
        return {"other_tokens": [seed_team("bench-heavy-rl", policy=HEAVY_RATE_POLICY).token]}
    if name == "heavy_args":
        return {"other_tokens": [seed_team("bench-heavy-args", policy=HEAVY_ARGS_POLICY).token]}
    if name == "heavy_reads":
        return _heavy_read_state(server)
    if name == "heavy_pages":
        return _heavy_page_state()
    if name == "account_guesses":
        return _account_guess_state()
    if name == "unknown_run_flood":
        return {"other_tokens": [seed_team("bench-unknown-runs").token]}
    if name != "long_polls":
        return {}
    neighbour = seed_team("bench-polls", policy={
        "approvals": {"tools": ["payments.*"], "timeout_s": 3600},
        "budgets": {"max_seconds": 3600}})
    model = TeamModel.objects.get(pk=neighbour.team_id)
    tokens = [neighbour.token] + [
        agent_key_create(team=model, name=f"bench-poll-{uuid.uuid4().hex[:6]}").token
        for _ in range(4)]
    approvals = []
    with httpx.Client(base_url=server.url, timeout=10) as http:
        for i in range(POLLED_APPROVALS):
            auth = {"Authorization": f"Bearer {tokens[i % len(tokens)]}"}
            run = http.post("/api/v1/runs", json={"agent": f"poller-{i}"}, headers=auth)
            run.raise_for_status()
            answer = http.post(f"/api/v1/runs/{run.json()['run_id']}/check", headers=auth, json={
                "check_id": f"pay-{i}", "action": {"name": "payments.refund", "args": {"n": i}}})
            answer.raise_for_status()
            approvals.append(answer.json()["approval"]["id"])
    return {"other_tokens": tokens, "approval_ids": approvals}


def _heavy_read_state(server: Server) -> dict[str, Any]:
    import httpx

    from policies.models import Team as TeamModel
    from policies.services import agent_key_create

    neighbour = seed_team("bench-heavy-reads", policy=HEAVY_RATE_POLICY)
    model = TeamModel.objects.get(pk=neighbour.team_id)
    tokens = [neighbour.token] + [
        agent_key_create(team=model, name=f"bench-reader-{uuid.uuid4().hex[:6]}").token
        for _ in range(3)]
    auth = {"Authorization": f"Bearer {neighbour.token}"}
    per_upload = 16  # 16 entries of 60 KB: under an upload's 1 MiB
    with httpx.Client(base_url=server.url, timeout=30, headers=auth) as http:
        run = http.post("/api/v1/runs", json={"agent": "bench-heavy-reader"})
        run.raise_for_status()
        run_id = run.json()["run_id"]
        for first in range(0, HEAVY_READ_DECISIONS, per_upload):
            entries = [{"check_id": f"heavy-{i}", "decision": "allow", "reason": "step_ok",
                        "action": {"name": f"tool{i % 50}.call", "args": {
                            "blob": os.urandom(HEAVY_READ_ARGS_BYTES // 2).hex()}}}
                       for i in range(first, min(first + per_upload, HEAVY_READ_DECISIONS))]
            while (answer := http.post(f"/api/v1/runs/{run_id}/local-decisions",
                                       json={"decisions": entries})).status_code == 429:
                time.sleep(float(answer.headers.get("Retry-After", "1")))
            answer.raise_for_status()
    return {"other_tokens": tokens, "other_run_id": run_id}


def _heavy_page_state() -> dict[str, Any]:
    from policies.document import default_policy, parse_policy
    from policies.models import Team as TeamModel
    from policies.services import policy_save

    from .live import session_cookie

    neighbour = seed_team("bench-heavy-pages")
    model = TeamModel.objects.get(pk=neighbour.team_id)
    for version in range(HEAVY_PAGE_VERSIONS):
        tools = {"allow": [f"t{version}.x{i}.*" for i in range(HEAVY_PAGE_PATTERNS)],
                 "deny": [f"dy{i}.*" for i in range(HEAVY_PAGE_PATTERNS)]}
        redact = [f"r{i}" for i in range(HEAVY_PAGE_PATTERNS)]
        policy_save(team=model, document=parse_policy({**default_policy("wide"),
                                                       "tools": tools,
                                                       "redact_args": redact}),
                    actor=None, source="bench")
    return {"other_team_slug": model.slug,
            "other_session_cookie": session_cookie(model.pk, viewer=900)}


def _account_guess_state() -> dict[str, Any]:
    from django.contrib.auth.hashers import make_password
    from django.contrib.auth.models import User

    from policies.models import Membership, Role
    from policies.models import Team as TeamModel

    neighbour = seed_team("bench-guessed")
    model = TeamModel.objects.get(pk=neighbour.team_id)
    password = make_password("bench-not-guessed-1")  # one slow hash for all of them
    names = [f"bench-guessed-{model.pk}-{i}" for i in range(GUESSED_ACCOUNTS)]
    for name in names:
        user, _ = User.objects.get_or_create(username=name, defaults={"password": password})
        Membership.objects.get_or_create(user=user, team=model,
                                         defaults={"role": Role.VIEWER})
    return {"other_usernames": names}


@contextlib.contextmanager
def _attacked(server: Server, name: str) -> Iterator[Server]:
    """The server the attack `name` is measured on: `server` itself, or for a Redis fault a
    second server of the same shape whose REDIS_URL is refused or never answers (ready when
    it is alive: its readiness is what the fault degrades)."""
    from . import attacks as at

    if name not in at.REDIS_FAULTS:
        yield server
        return
    hung = at.HungRedis() if name == "redis_hung" else None
    url = hung.url if hung is not None else at.refused_redis_url()
    faulted = dataclasses.replace(server, port=0, process=None, log_path=None,
                                  extra_env={**server.extra_env, "REDIS_URL": url},
                                  ready_path="/healthz")
    try:
        with faulted:
            yield faulted
    finally:
        if hung is not None:
            hung.close()


def attacks(server: Server, team: Team, *, names: list[str], agents: int, seconds: float,
            warmup: float, rounds: int) -> dict[str, Any]:
    """For each attack of bench/attacks.py: the real check at `agents` agents without it and
    with it, in alternating slices (`rounds` of each), and the ratio of their p99s (SPEC 10:
    at most 2x). Every check must still be answered right: errors count as for any point."""
    from . import attacks as at
    from .live import session_cookie

    cookie = session_cookie(team.team_id)
    out: dict[str, Any] = {"agents": agents, "attacks": {}}
    for name in names:
        attack = at.ATTACKS[name]
        slices: dict[str, list[Slice]] = {"without": [], "with": []}
        seen: list[dict[str, Any]] = []
        with _attacked(server, name) as attacked:
            for _ in range(rounds):
                slices["without"].append(run_slice(server, team, scenario=REAL, agents=agents,
                                                   seconds=seconds, warmup=warmup))
                reset_runs()
                target = at.Target(port=attacked.port, team_slug=team.slug,
                                   session_cookie=cookie, run_id=_watched_run(attacked, team),
                                   **neighbour_state(attacked, name))
                with at.running(attack, target, settle=1.5) as stats:
                    slices["with"].append(run_slice(attacked, team, scenario=REAL,
                                                    agents=agents, seconds=seconds,
                                                    warmup=warmup, reset=False))
                seen.append({"opened": stats.opened, "most_open": stats.most_open,
                             "answers": dict(stats.answers),
                             "closed_by_server": stats.closed_by_server,
                             "errors": dict(stats.errors)})
        without = summarize(slices["without"], scenario=REAL, agents=agents)
        under = summarize(slices["with"], scenario=REAL, agents=agents)
        out["attacks"][name] = {
            "without": {k: without[k] for k in ("checks_per_s", "p50_ms", "p99_ms", "errors")},
            "with": {k: under[k] for k in ("checks_per_s", "p50_ms", "p99_ms", "errors")},
            "p99_ratio": round(under["p99_ms"] / without["p99_ms"], 2)
            if without["p99_ms"] else None,
            "errors": without["errors"] + under["errors"],
            "error_kinds": {**without["error_kinds"], **under["error_kinds"]},
            "audit_ok": without["audit_ok"] and under["audit_ok"],
            "agents_starved": max(without["agents_starved"], under["agents_starved"]),
            "attack": seen,
        }
    return out
