"""`python -m bench` (make bench) and `python -m bench --quick` (make bench-quick, CI).

Exit status: 0 when the benchmark ran and every correctness check held (no errors, audit
rows = decisions returned at every point, no leaked allow under the kill switch, /metrics
consistent); 1 otherwise. Timings never fail it: they are reported against the targets.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from . import report, stack
from . import scenarios as sc
from .report import TARGET_AGENTS

PHASES = ("micro", "backtest", "points", "ladder", "soak", "killswitch", "fanout", "longrun",
          "stream", "attacks", "metrics", "tracing", "ratelimit", "growth", "retention", "nodes")
# Not in quick mode (CI) unless named in --only: it starts two multi-node stacks.
FULL_ONLY = {"nodes"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true",
                        help="short phases: proves the benchmark and the audit invariant "
                             "(CI), about 5 minutes")
    parser.add_argument("--agents", default="1,8,32,128",
                        help="comma-separated concurrency points (default 1,8,32,128)")
    parser.add_argument("--seconds", type=float,
                        help="seconds per point and scenario (default 12, quick 3)")
    parser.add_argument("--workers", type=int, default=2, help="server worker processes")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads per worker (default: the serve command's default)")
    parser.add_argument("--soak-seconds", type=float,
                        help="soak length at 32 agents (default 150, quick 10; 600 for the "
                             "10-minute soak)")
    parser.add_argument("--only", default="",
                        help=f"comma-separated phases to run, of: {', '.join(PHASES)}")
    parser.add_argument("--scenarios", default="real,durable,bare,min-durable,min-bare",
                        help="check endpoints to load in the start-checks-finish mix "
                             "(default real,durable,bare,min-durable,min-bare)")
    parser.add_argument("--checks-only-scenarios", default="real,min-durable,min-bare",
                        help="check endpoints to load with the runs already started "
                             "(default real,min-durable,min-bare; empty to skip)")
    parser.add_argument("--long-seconds", type=float,
                        help="one slice of this length per endpoint at 32 agents, runs "
                             "already started, after the checks-only points (default 30, "
                             "quick 0: skipped)")
    parser.add_argument("--fanout-runs", type=int,
                        help="running runs the fan-out phase kills (default 10000, quick 1000)")
    parser.add_argument("--longrun-steps", type=int,
                        help="checks of the one long run (default 5050, quick 400)")
    parser.add_argument("--attacks", default="",
                        help="comma-separated attacks of the attacks phase (default: every "
                             "one in bench/attacks.py ATTACKS)")
    parser.add_argument("--tracing-sampling", type=float, default=None,
                        help="the tracing phase's head sampling ratio (default: every trace)")
    parser.add_argument("--stream-runs", default="",
                        help="comma-separated running-run counts of the stream phase, each "
                             "with a page open on every run unless --stream-watched (default "
                             "200,1000; quick 200)")
    parser.add_argument("--stream-watched", type=int, default=0,
                        help="run pages the stream phase watches (default 0: every run's)")
    parser.add_argument("--stream-interval", type=float, default=1.0,
                        help="seconds between two checks of one run in the stream phase "
                             "(default 1)")
    parser.add_argument("--stream-nodes", type=int, default=1,
                        help="web nodes the stream phase's pages are spread over (default 1: "
                             "the benchmark's server; more: deploy/stack.py's nodes behind "
                             "HAProxy and PgBouncer, which need haproxy and pgbouncer)")
    parser.add_argument("--no-history", action="store_true",
                        help="do not append this run to bench/history.jsonl")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    quick = args.quick
    seconds = args.seconds or (3.0 if quick else 12.0)
    # Full mode splits each point into slices alternating between the scenarios.
    rounds = 1 if quick else 3
    warmup = 0.5 if quick else 1.0
    soak_seconds = args.soak_seconds or (10.0 if quick else 150.0)
    points = [int(a) for a in args.agents.split(",") if a]
    scenarios = [s for s in args.scenarios.split(",") if s]
    default = set(PHASES) - (FULL_ONLY if quick else set())
    phases = set(args.only.split(",")) if args.only else default
    started = time.monotonic()
    clock = PhaseClock()

    stack.fresh_database()
    stack.manage("migrate", "--noinput", "-v0")
    stack.setup_django()
    threads = args.threads or serve_default_threads()
    print(f"bench: {'quick' if quick else 'full'} mode, {args.workers} workers x {threads} "
          f"threads, points {points}, {seconds:g} s each; database {stack.DB_NAME}, redis "
          f"{stack.REDIS_URL}", flush=True)
    stack.create_minimal_tables()
    sc.reset_runs()
    team = sc.seed_team("bench")
    results: dict[str, Any] = {
        "mode": "quick" if quick else "full",
        # A partial run (--only) is stored under its own name, never over a whole run's.
        "name": ("quick" if quick else "full") + (
            "" if phases == default else "-" + "-".join(p for p in PHASES if p in phases)),
        "phases": [p for p in PHASES if p in phases],
        "started_at": report.now_iso(),
        "commit": report.commit(),
        "machine": stack.machine_description(),
        "server": {"workers": args.workers, "threads": threads},
        "seconds_per_point": seconds,
        "slices_per_point": rounds,
        "points": [],
    }
    if "micro" in phases:
        clock.start("micro")
        from . import micro

        results["micro"] = micro.measure(quick=quick)
        print(report.micro_line(results["micro"]), flush=True)
    if "backtest" in phases:
        clock.start("backtest")
        from . import backtest

        results["backtest"] = backtest.measure(quick=quick)
        print(report.backtest_line(results["backtest"]), flush=True)
        sc.reset_runs()  # the load points start from empty run tables, as before

    checks_only = [s for s in args.checks_only_scenarios.split(",") if s]
    with stack.Server(workers=args.workers, threads=threads) as server:
        if "points" in phases:
            clock.start("points")
            minimal = None
            if sc.MINIMAL & set(scenarios + checks_only):
                minimal = stack.MinimalServer(workers=args.workers, threads=threads).start()
            try:
                points_phase(results, server, team, minimal, scenarios=scenarios,
                             checks_only=checks_only, points=points, rounds=rounds,
                             seconds=seconds, warmup=warmup, quick=quick,
                             long_seconds=args.long_seconds if args.long_seconds is not None
                             else (0.0 if quick else 30.0))
            finally:
                if minimal is not None:
                    minimal.stop()
        if "ladder" in phases:
            clock.start("ladder")
            from . import ladder

            # The real check against the minimal durable check served the fastest way, and
            # each layer between them (issue 33); its own servers beside this one.
            results["ladder"] = ladder.measure(
                sc.seed_team("bench-ladder", policy=sc.LONG_POLICY), workers=args.workers,
                threads=threads, agents=[TARGET_AGENTS] if quick else [TARGET_AGENTS, 1],
                rounds=rounds, seconds=seconds / rounds,
                warmup=warmup, server=server,
                # and, but for --quick, the floor in two round trips (what the second costs)
                rungs=ladder.RUNGS if quick else ladder.RUNGS + ladder.EXTRA)
            for line in ladder.lines(results["ladder"]):
                print(line, flush=True)
        if "soak" in phases:
            clock.start("soak")
            results["soak"] = sc.soak(server, team, agents=32, seconds=soak_seconds,
                                      sample_every=max(1.0, soak_seconds / 30))
            print(report.soak_line(results["soak"]), flush=True)
        if "killswitch" in phases:
            clock.start("killswitch")
            worker = stack.CeleryWorker().start()  # the fan-out, as in production
            try:
                ks_team = sc.seed_team("bench-ks")
                results["killswitch"] = sc.killswitch(
                    server, ks_team, agents=32, before_s=2.0 if quick else 4.0,
                    after_s=4.0 if quick else 8.0)
            finally:
                worker.stop()
            print(report.killswitch_line(results["killswitch"]), flush=True)
        if "fanout" in phases:
            clock.start("fanout")
            worker = stack.CeleryWorker().start()
            try:
                fan_team = sc.seed_team("bench-fanout", policy=sc.LONG_POLICY)
                results["fanout"] = sc.killswitch_fanout(
                    server, fan_team, runs=args.fanout_runs or (1000 if quick else 10000), agents=8)
            finally:
                worker.stop()
            print(report.fanout_line(results["fanout"]), flush=True)
        if "longrun" in phases:
            clock.start("longrun")
            results["longrun"] = sc.long_run(
                server, sc.seed_team("bench-long", policy=sc.LONG_POLICY),
                steps=args.longrun_steps or (400 if quick else 5050))
            print(report.longrun_line(results["longrun"]), flush=True)
        if "stream" in phases:
            clock.start("stream")
            counts = [int(n) for n in args.stream_runs.split(",") if n] or (
                [200] if quick else [200, 1000])
            results["stream"] = live_stream(server, team, quick=quick, counts=counts,
                                            watched=args.stream_watched,
                                            interval=args.stream_interval,
                                            nodes=args.stream_nodes)
            print(report.live_line(results["stream"]), flush=True)
        if "attacks" in phases:
            clock.start("attacks")
            from .attacks import ATTACKS

            names = [a for a in args.attacks.split(",") if a] or list(ATTACKS)
            unknown = sorted(set(names) - set(ATTACKS))
            if unknown:
                raise SystemExit(f"unknown attacks {unknown}; known: {', '.join(ATTACKS)}")
            results["attacks"] = sc.attacks(server, team, names=names, agents=32,
                                            seconds=seconds / rounds, warmup=warmup,
                                            rounds=rounds)
            for line in report.attack_lines(results["attacks"]):
                print(line, flush=True)
        if "ratelimit" in phases:
            clock.start("ratelimit")
            from . import ratelimit

            results["ratelimit"] = ratelimit.measure(server, agents=8, seconds=seconds / rounds,
                                                     warmup=warmup, rounds=rounds)
            print(ratelimit.line(results["ratelimit"]), flush=True)
        if "growth" in phases:
            clock.start("growth")
            from . import growth

            growth.phase(results, server, quick=quick)

    if "metrics" in phases:
        clock.start("metrics")
        results["metrics"] = metrics_cost(team, args.workers, threads, seconds, warmup,
                                          rounds=1 if quick else 3)
        print(report.metrics_line(results["metrics"]), flush=True)
    if "tracing" in phases:
        clock.start("tracing")
        from . import tracing

        results["tracing"] = tracing.measure(team, workers=args.workers, threads=threads,
                                             seconds=seconds, warmup=warmup,
                                             rounds=1 if quick else 3,
                                             sampler_ratio=args.tracing_sampling)
        print(tracing.line(results["tracing"]), flush=True)

    if "retention" in phases:
        clock.start("retention")
        from . import retention

        retention.phase(results, quick=quick)

    if "nodes" in phases:
        clock.start("nodes")
        from . import nodes

        # The real check through HAProxy and PgBouncer to one node and three, beside one node
        # straight to PostgreSQL (issue 32); its own servers and stacks.
        results["nodes"] = nodes.measure(
            sc.seed_team("bench-nodes", policy=sc.LONG_POLICY), threads=threads,
            agents=TARGET_AGENTS, rounds=rounds, seconds=seconds / rounds, warmup=warmup)
        for line in nodes.lines(results["nodes"]):
            print(line, flush=True)

    clock.stop()
    results["phase_seconds"] = clock.seconds
    results["elapsed_s"] = round(time.monotonic() - started, 1)
    return 0 if report.finish(results, history=not args.no_history) else 1


class PhaseClock:
    """Each phase's wall time, printed as it ends and kept in the results: what to shorten
    when the benchmark takes too long (CI runs it in quick mode). A phase ends where the
    next starts; a server started between them counts in the next."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._current: tuple[str, float] | None = None

    def start(self, phase: str) -> None:
        self.stop()
        self._current = (phase, time.monotonic())

    def stop(self) -> None:
        if self._current is not None:
            phase, began = self._current
            self.seconds[phase] = round(time.monotonic() - began, 1)
            print(f"bench: the {phase} phase took {self.seconds[phase]:g} s", flush=True)
            self._current = None


def points_phase(results: dict[str, Any], server: stack.Server, team: sc.Team,
                 minimal: stack.Server | None, *, scenarios: list[str], checks_only: list[str],
                 points: list[int], rounds: int, seconds: float, warmup: float,
                 quick: bool, long_seconds: float = 0.0) -> None:
    """The throughput points: every concurrency in the start-checks-finish mix, then with the
    runs already started (checks only), then one long slice of each checks-only endpoint but
    the bare one at 32 agents (`long_seconds`, 0 to skip). Quick mode loads the minimal
    baselines and the checks-only points at 32 agents only, to stay short."""
    # One short unmeasured round first: imports, caches, connections, prepared
    # statements are then warm for every scenario alike.
    for scenario in scenarios:
        sc.load_point(server, team, scenario=scenario, agents=8, seconds=1.5, warmup=0.5,
                      minimal=minimal)
    for agents in points:
        # Quick mode (CI) loads the minimal baselines at 32 agents only, to stay short.
        at = [s for s in scenarios if not quick or agents == 32 or s not in sc.MINIMAL]
        for point in sc.interleaved_points(
                server, team, scenarios=at, agents=agents, rounds=rounds,
                seconds=seconds / rounds, warmup=warmup, minimal=minimal):
            results["points"].append(point)
            print(report.point_line(point), flush=True)
    if not checks_only:
        return
    # Runs as long as a slice: a policy with room for thousands of steps, nothing repeated.
    long_team = sc.seed_team("bench-long", policy=sc.LONG_POLICY)
    for agents in ([a for a in points if a == 32] or points[-1:]) if quick else points:
        for point in sc.interleaved_points(
                server, long_team, scenarios=checks_only, agents=agents, rounds=rounds,
                seconds=seconds / rounds, warmup=warmup, minimal=minimal, mode=sc.CHECKS):
            results["points"].append(point)
            print(report.point_line(point), flush=True)
    if long_seconds <= 0:
        return
    for scenario in [s for s in checks_only if s != "min-bare"]:
        point = sc.summarize([sc.run_slice(server, long_team, scenario=scenario,
                                           agents=TARGET_AGENTS, seconds=long_seconds,
                                           warmup=warmup, minimal=minimal, mode=sc.CHECKS)],
                             scenario=scenario, agents=TARGET_AGENTS, mode=sc.LONG)
        results["points"].append(point)
        print(report.point_line(point), flush=True)


def live_stream(server: stack.Server, team: sc.Team, *, quick: bool, counts: list[int],
                watched: int, interval: float, nodes: int = 1) -> dict[str, Any]:
    """One point per running-run count, a page open on each run (or on `watched` of them);
    the phase's own fields are its largest point's. With ``nodes`` above 1, on that many web
    nodes of deploy/stack.py (loopback addresses, one `serve` worker process a node)."""
    from django.urls import NoReverseMatch, reverse

    from . import live

    try:
        reverse("runs:run_stream", args=["x", "00000000-0000-0000-0000-000000000000"])
    except NoReverseMatch:
        return {"measured": False, "why": "no dashboard run stream in this build"}
    if nodes > 1:
        from deploy.stack import Stack

        from .nodes import unavailable

        why = unavailable()
        if why:
            return {"measured": False, "why": why}
        with Stack(stack.database_url(), web_nodes=nodes, env={"LOG_LEVEL": "WARNING"},
                   namespaces=False) as deployed:
            target = live.Target(
                agents=("127.0.0.1", deployed.http_port),
                pages=[(node.address, deployed.web_port) for node in deployed.web],
                pids=[p.pid for node in deployed.web for p in node.processes])
            return _live_points(target, team, quick=quick, counts=counts, watched=watched,
                                interval=interval)
    return _live_points(live.Target.of_server(server), team, quick=quick, counts=counts,
                        watched=watched, interval=interval)


def _live_points(target: Any, team: sc.Team, *, quick: bool, counts: list[int], watched: int,
                 interval: float) -> dict[str, Any]:
    from . import live

    points = [live.measure(target, team_slug=team.slug, team_id=team.team_id, token=team.token,
                           runs=n, watched=min(n, watched or n), agents=max(20, n // 10),
                           per_run_interval=interval, seconds=5.0 if quick else 15.0)
              for n in counts]
    return {**points[-1], "points": points}


def metrics_cost(team: sc.Team, workers: int, threads: int, seconds: float, warmup: float,
                 rounds: int) -> dict[str, Any]:
    """The 32-agent real-check point with metrics off and on: `rounds` slices of each, every
    slice on a fresh server (metrics are chosen when a server starts), alternating off and on
    so that both see the same drift of the machine's load."""
    slices: dict[str, list[sc.Slice]] = {"off": [], "on": []}
    scrape: dict[str, Any] = {}
    for _ in range(rounds):
        for label in ("off", "on"):
            with stack.Server(workers=workers, threads=threads, metrics=label == "on") as server:
                warm = sc.run_slice(server, team, scenario=sc.REAL, agents=8, seconds=1.5,
                                    warmup=0.5)  # imports, connections, prepared statements
                measured = sc.run_slice(server, team, scenario=sc.REAL, agents=32,
                                        seconds=seconds / rounds, warmup=warmup)
                slices[label].append(measured)
                if label == "on":
                    # Every decision this server made, the warm-up's included, is counted.
                    scrape = sc.scrape_metrics(server)
                    scrape["decisions_expected"] = warm.rows + measured.rows
    off = sc.summarize(slices["off"], scenario=sc.REAL, agents=32)
    on = sc.summarize(slices["on"], scenario=sc.REAL, agents=32)
    return {
        "off_checks_per_s": off["checks_per_s"],
        "on_checks_per_s": on["checks_per_s"],
        "cost_pct": round((off["checks_per_s"] - on["checks_per_s"]) * 100
                          / off["checks_per_s"], 1) if off["checks_per_s"] else None,
        "off_worker_cpu_ms_per_check": off["server_cpu_ms_per_check"],
        "on_worker_cpu_ms_per_check": on["server_cpu_ms_per_check"],
        "off_p99_ms": off["p99_ms"],
        "on_p99_ms": on["p99_ms"],
        "errors": off["errors"] + on["errors"],
        "audit_ok": off["audit_ok"] and on["audit_ok"],
        "scrape": scrape,
        "slices": {label: [round(x.stats.checks_in_window / max(
            1e-9, x.stats.window_end - x.stats.window_start), 1) for x in xs]
            for label, xs in slices.items()},
    }


def serve_default_threads() -> int:
    """The serve command's own default, so the benchmark measures what production runs."""
    from runs.management.commands.serve import Command

    parser = Command().create_parser("manage.py", "serve")
    return int(parser.parse_args([]).threads)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
