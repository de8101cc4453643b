"""`make bench`'s `nodes` phase (`python -m bench --only nodes`): the real check through
HAProxy and PgBouncer against one web node and three, beside one node straight to PostgreSQL,
and what a check costs PostgreSQL (issue 32, "Throughput per node").

Four configurations, measured in alternating slices of the same run, runs already started
(checks only), at a fixed agent count:

- direct-1: one web node (`manage.py serve`, one worker process) straight to PostgreSQL:
  the baseline;
- unprepared-1: the same, with DATABASE_POOLER=transaction, still straight to PostgreSQL:
  what the server does differently behind a pooler in transaction mode (the check's
  statements sent whole, planned by PostgreSQL on every check, instead of prepared once per
  connection), apart from the pooler itself;
- proxied-1: one web node of deploy/stack.py: HAProxy in front, PgBouncer in transaction
  mode behind (DATABASE_POOLER=transaction);
- proxied-3: three web nodes of deploy/stack.py behind the same kind of HAProxy and PgBouncer.

Everything runs on this machine's CPUs, so proxied-1 / direct-1 is what the balancer and the
pooler cost (unprepared-1 splits it: the statements unprepared, then the two hops), and
proxied-3 / proxied-1 is not scaling: three nodes share the same cores.

What limits scaling is PostgreSQL, the one authority every check writes to: its CPU per
check is measured from /proc/<pid>/stat of the backends connected to the benchmark's
database (pg_stat_activity), so other databases of the same server (a shared machine) are
not counted, and from it how many checks one PostgreSQL core answers per second. The whole
server's CPU (every postgres process, background writers included, and whatever else uses
it meanwhile) is reported beside it as an upper bound. Every answer is checked against the
audit log, as in every other phase.

The stacks use loopback addresses, not network namespaces: two stacks run side by side in
this process (their namespaces would share names), and a veth pair would add a hop that a
real network replaces with a longer one anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import agents as ag
from . import scenarios as sc
from . import stack

DIRECT_1, UNPREPARED_1, PROXIED_1, PROXIED_3 = "direct-1", "unprepared-1", "proxied-1", \
    "proxied-3"
CONFIGS = (DIRECT_1, UNPREPARED_1, PROXIED_1, PROXIED_3)


def unavailable() -> str | None:
    """Why the phase cannot run here (HAProxy or PgBouncer missing), or None."""
    from deploy.stack import PgBouncer

    if not shutil.which("haproxy"):
        return "haproxy is not installed (apt-get install haproxy)"
    return PgBouncer.available()


# --- CPU accounting -------------------------------------------------------------------------

def process_tree(pid: int) -> list[int]:
    """`pid` and every descendant alive now (a web node: `serve`, granian, its workers)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*"):
            with contextlib.suppress(OSError):
                todo += [int(p) for p in (task / "children").read_text().split()]
    return found


def tree_cpu(pids: list[int]) -> float:
    """CPU seconds of these processes and their descendants."""
    return sum(stack.cpu_seconds(p) for root in pids for p in process_tree(root))


def backend_pids() -> list[int]:
    """The PostgreSQL backends connected to the benchmark's database now (the web nodes'
    connections, PgBouncer's server connections, this process's own)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database()")
        return [int(row[0]) for row in cursor.fetchall()]


class BackendCpu:
    """The CPU the benchmark database's backends spent between `start` and `stop`: backends
    there at both readings count their difference, those that appeared meanwhile all of
    theirs. A backend that came and went within the slice is missed; the nodes' pools and
    PgBouncer's server connections live for the whole run, so that is next to nothing."""

    def __init__(self) -> None:
        self.before: dict[int, float] = {}

    def start(self) -> None:
        self.before = {pid: stack.cpu_seconds(pid) for pid in backend_pids()}

    def stop(self) -> float:
        spent = 0.0
        for pid in backend_pids():
            now = stack.cpu_seconds(pid)
            spent += max(0.0, now - self.before.get(pid, 0.0))
        return spent


# --- The configurations ---------------------------------------------------------------------

@dataclass
class Config:
    """One way of serving the check: where the agents send it and whose CPU it spends."""

    name: str
    port: int
    web: list[int]  # the web nodes' root processes
    balancer: list[int] = field(default_factory=list)  # HAProxy
    pooler: list[int] = field(default_factory=list)  # PgBouncer


@dataclass
class NodesSlice(sc.Slice):
    """A slice with the balancer's and the pooler's CPU and the whole server's too."""

    cpu_balancer: float = 0.0
    cpu_pooler: float = 0.0
    cpu_postgres_all: float = 0.0
    cpu_by_node: list[float] = field(default_factory=list)


def _stack_config(name: str, deployed: Any) -> Config:
    assert deployed.haproxy is not None and deployed.pgbouncer is not None
    assert deployed.pgbouncer.process is not None
    return Config(name=name, port=deployed.http_port,
                  web=[p.pid for node in deployed.web for p in node.processes],
                  balancer=[deployed.haproxy.pid], pooler=[deployed.pgbouncer.process.pid])


@contextlib.contextmanager
def configurations(*, threads: int) -> Iterator[dict[str, Config]]:
    """The four configurations, all running at once (so that their slices can alternate)."""
    from deploy.stack import Stack

    # The nodes log as the benchmark's own server does; the rest is deploy/stack.py's. Every
    # configuration serves the product's URLs (urlconf "": no bench endpoints).
    env = {"LOG_LEVEL": "WARNING"}
    with stack.Server(workers=1, threads=threads, urlconf="") as direct, \
            stack.Server(workers=1, threads=threads, urlconf="",
                         extra_env={"DATABASE_POOLER": "transaction"}) as unprepared, \
            Stack(stack.database_url(), web_nodes=1, threads=threads, env=env,
                  namespaces=False) as one, \
            Stack(stack.database_url(), web_nodes=3, threads=threads, env=env,
                  namespaces=False) as three:
        assert direct.process is not None and unprepared.process is not None
        yield {DIRECT_1: Config(name=DIRECT_1, port=direct.port, web=[direct.process.pid]),
               UNPREPARED_1: Config(name=UNPREPARED_1, port=unprepared.port,
                                    web=[unprepared.process.pid]),
               PROXIED_1: _stack_config(PROXIED_1, one),
               PROXIED_3: _stack_config(PROXIED_3, three)}


def run_slice(config: Config, team: sc.Team, *, agents: int, seconds: float,
              warmup: float) -> NodesSlice:
    """`agents` agents checking runs already started, through `config`, from empty run
    tables; the audit rows written are counted against the decisions they received."""
    sc.reset_runs()
    before = sc.max_decision_id()
    opts = ag.AgentOptions(host="127.0.0.1", port=config.port, token=team.token,
                           checks_only=True)
    backends = BackendCpu()
    nodes0 = [tree_cpu([pid]) for pid in config.web]
    balancer0, pooler0 = tree_cpu(config.balancer), tree_cpu(config.pooler)
    client0, postgres_all0 = time.process_time(), stack.postgres_cpu_seconds()
    backends.start()
    stats = asyncio.run(ag.run_load(opts, agents, seconds, warmup))
    postgres = backends.stop()
    by_node = [tree_cpu([pid]) - cpu0 for pid, cpu0 in zip(config.web, nodes0, strict=True)]
    return NodesSlice(
        stats=stats, rows=sc.decision_rows(after_id=before, team_id=team.team_id),
        cpu_server=sum(by_node), cpu_client=time.process_time() - client0,
        cpu_by_node=by_node,
        cpu_postgres=postgres, cpu_balancer=tree_cpu(config.balancer) - balancer0,
        cpu_pooler=tree_cpu(config.pooler) - pooler0,
        cpu_postgres_all=stack.postgres_cpu_seconds() - postgres_all0)


def summarize(slices: list[NodesSlice], *, config: str, agents: int) -> dict[str, Any]:
    point = sc.summarize(list(slices), scenario=config, agents=agents, mode="nodes")
    checks = max(1, point["checks"])
    for key, attr in (("balancer", "cpu_balancer"), ("pooler", "cpu_pooler"),
                      ("postgres_all", "cpu_postgres_all")):
        point[f"{key}_cpu_ms_per_check"] = round(
            sum(getattr(x, attr) for x in slices) * 1000 / checks, 3)
    # How evenly the balancer spread the checks: each node's share of the nodes' CPU.
    by_node = [sum(x.cpu_by_node[i] for x in slices) for i in range(len(slices[0].cpu_by_node))]
    point["node_cpu_shares"] = [round(c / max(1e-9, sum(by_node)), 2) for c in by_node]
    pg = point["postgres_cpu_ms_per_check"]
    # One core's worth of the backends' CPU, spent on nothing but checks.
    point["checks_per_s_per_postgres_core"] = round(1000 / pg) if pg else None
    return point


# --- The phase ------------------------------------------------------------------------------

def measure(team: sc.Team, *, threads: int, agents: int, rounds: int, seconds: float,
            warmup: float) -> dict[str, Any]:
    """Each configuration `rounds` times, alternating, `seconds` a slice."""
    why = unavailable()
    if why:
        return {"measured": False, "why": why}
    load_before = os.getloadavg()[0]
    slices: dict[str, list[NodesSlice]] = {c: [] for c in CONFIGS}
    try:
        with configurations(threads=threads) as configs:
            for config in configs.values():  # imports, connections, the pools filled
                run_slice(config, team, agents=8, seconds=1.5, warmup=0.5)
            for _ in range(rounds):
                for name in CONFIGS:
                    slices[name].append(run_slice(configs[name], team, agents=agents,
                                                  seconds=seconds, warmup=warmup))
    except RuntimeError as exc:
        # A stack that would not start (deploy/stack.py says why): a failure of the run, but
        # the phases measured before this one keep their results.
        return {"measured": False, "failed": True, "why": f"failed: {exc}"[:2000]}
    points = [summarize(slices[c], config=c, agents=agents) for c in CONFIGS]
    return {"measured": True, "agents": agents, "rounds": rounds,
            "seconds_per_slice": seconds, "threads_per_node": threads,
            "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "points": points, "headline": headline(points)}


def headline(points: list[dict[str, Any]]) -> dict[str, Any]:
    """The ratios, and what one PostgreSQL core serves (through the pooler: how production
    runs; and straight)."""
    at = {p["scenario"]: p for p in points}
    direct, unprepared, one, three = (at.get(DIRECT_1), at.get(UNPREPARED_1),
                                      at.get(PROXIED_1), at.get(PROXIED_3))

    def ratio(a: dict[str, Any] | None, b: dict[str, Any] | None, key: str) -> float | None:
        return round(a[key] / b[key], 2) if a and b and b[key] else None

    # Through PgBouncer: both proxied configurations' checks, weighted by their counts.
    pooled = [p for p in (one, three) if p and p["checks"]]
    pg_pooled = round(sum(p["postgres_cpu_ms_per_check"] * p["checks"] for p in pooled)
                      / sum(p["checks"] for p in pooled), 3) if pooled else None

    return {
        "proxied_1_over_direct_1": ratio(one, direct, "checks_per_s"),
        "unprepared_1_over_direct_1": ratio(unprepared, direct, "checks_per_s"),
        "proxied_1_over_unprepared_1": ratio(one, unprepared, "checks_per_s"),
        "proxied_3_over_proxied_1": ratio(three, one, "checks_per_s"),
        "p99_proxied_1_over_direct_1": ratio(one, direct, "p99_ms"),
        "p50_proxied_1_over_direct_1": ratio(one, direct, "p50_ms"),
        "postgres_cpu_ms_per_check_direct": direct["postgres_cpu_ms_per_check"]
        if direct else None,
        "postgres_cpu_ms_per_check_unprepared": unprepared["postgres_cpu_ms_per_check"]
        if unprepared else None,
        "postgres_cpu_ms_per_check_proxied": pg_pooled,
        "checks_per_s_per_postgres_core_direct": direct["checks_per_s_per_postgres_core"]
        if direct else None,
        "checks_per_s_per_postgres_core_proxied": round(1000 / pg_pooled)
        if pg_pooled else None,
    }


def lines(result: dict[str, Any]) -> list[str]:
    if not result.get("measured"):
        return [f"  nodes: not measured ({result.get('why')})"]
    out = [f"nodes, runs already started, {result['agents']} agents, {result['rounds']} "
           f"alternating slices of {result['seconds_per_slice']:g} s, one worker x "
           f"{result['threads_per_node']} threads a node (load average "
           f"{result['load_average'][0]} -> {result['load_average'][1]}):",
           f"  {'config':10} {'checks/s':>9} {'p50 ms':>7} {'p99 ms':>7} {'errors':>6} "
           f"{'audit':>13}  CPU ms/check: nodes / HAProxy / PgBouncer / PostgreSQL backends "
           f"(whole server) -> checks/s per PostgreSQL core"]
    for p in result["points"]:
        audit = f"{p['audit_rows']}={p['decisions_returned']}"
        out.append(f"  {p['scenario']:10} {p['checks_per_s']:9.1f} {p['p50_ms']:7.1f} "
                   f"{p['p99_ms']:7.1f} {p['errors']:6} {audit:>13}  "
                   f"{p['server_cpu_ms_per_check']:.2f} / {p['balancer_cpu_ms_per_check']:.2f} "
                   f"/ {p['pooler_cpu_ms_per_check']:.2f} / {p['postgres_cpu_ms_per_check']:.2f}"
                   f" ({p['postgres_all_cpu_ms_per_check']:.2f}) -> "
                   f"{p['checks_per_s_per_postgres_core']}"
                   + (f"; nodes' CPU shares {p['node_cpu_shares']}"
                      if len(p["node_cpu_shares"]) > 1 else ""))
    out.append("  " + ", ".join(f"{k} {v}" for k, v in result["headline"].items()))
    return out
