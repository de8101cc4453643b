"""`python -m bench.ladder` (and `make bench`'s `ladder` phase): the real check against the
minimal durable check served the fastest way this stack allows, and what each layer between
them costs, measured (issue 33).

A ladder of endpoints, each adding one layer to the one before; every rung up to the real
check runs the same one-statement minimal durable check (bench/minimal/fast.py: the run's
UPDATE ... RETURNING, the repeat-count upsert and the audit INSERT, one round trip):

- wsgi-min: granian WSGI, a raw WSGI application (bench/minimal/wsgi_raw.py): the floor;
- asgi-min: granian ASGI, a raw ASGI application, the statement on the event loop: the
  ASGI interface;
- asgi-pool: the same, the statement on a thread pool: the hand-off from the loop to a
  thread and back;
- django-cycle: the product's ASGI application class with minimal settings (no middleware):
  Django's request cycle (request object, URL resolution, request_started / finished and
  the connection housekeeping);
- api-middleware: the product's server (`manage.py serve`) under /api/: the API's
  middleware chain and its pool;
- auth: the bearer key, parsed and hashed as the check does, looked up in the statement;
- validation: the check's body parsing and validation (CheckIn);
- real: the real check: ninja's dispatch, the check's two round trips and statements, the
  rules, the answer's serialisation, the key's last use, live-event publishing;
- real-metrics: the product's server with METRICS_TOKEN: the metrics.

Beside the ladder, not a layer of it (`--rungs` names it): `wsgi-2trips`, the floor's
statement in two round trips as the real check makes them (`BEGIN` and a locking read of
the run, then the write and `COMMIT`, each one pipelined message), on the wsgi-min server:
what the second round trip alone costs, served the fastest way. And `wsgi-rules`, on the same
server: the floor's one statement with the decision made before it by the product's own rules,
from the run's state the process keeps (bench/minimal/fast.py `durable_decided`): the most a
check that decides by those rules in one round trip could serve, everything else of the real
check left out.

The rungs are measured in alternating slices, runs already started (checks only), at 32
agents and one agent, with the old baseline (`min-durable`, three statements under the
product's application class) in the same rounds, so the old ratio stands beside the new.
What one layer costs is the difference of two rungs: in the workers' and PostgreSQL's CPU per
check (what a noisy neighbour disturbs least), in the time per check at 32 agents (1 /
throughput: capacity) and in the p50 of one agent alone (latency).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
from pathlib import Path
from typing import Any

from . import report, stack
from . import scenarios as sc

RUNGS = ("wsgi-min", "asgi-min", "asgi-pool", "django-cycle", "api-middleware", "auth",
         "validation", "real", "real-metrics")
OLD = "min-durable"
# Measured when named in `--rungs`, beside the ladder: not a layer between two rungs.
TWO_TRIPS = "wsgi-2trips"
DECIDED = "wsgi-rules"
EXTRA = (TWO_TRIPS, DECIDED)
WARMUP_S = 1.0
# `--other`: the real check served by another checkout (the tree before a change), measured
# in the same alternating rounds as this tree's: a change's before and after beside the floor.
OTHER = "real-other"
sc.CHECK_PATHS.setdefault(OTHER, sc.CHECK_PATHS["real"])


def measure(team: sc.Team, *, workers: int, threads: int, agents: list[int], rounds: int,
            seconds: float, warmup: float, server: stack.Server | None = None,
            rungs: tuple[str, ...] = RUNGS, other: Path | None = None) -> dict[str, Any]:
    """Every rung (and the old baseline, and with `other` the real check of that checkout)
    at each concurrency of `agents`, `rounds` slices each, alternating."""
    shape = {"workers": workers, "threads": threads}
    with contextlib.ExitStack() as stack_:
        product = server or stack_.enter_context(stack.Server(**shape))
        servers: dict[str, stack.Server] = {}
        if {"wsgi-min", *EXTRA} & set(rungs):
            servers["wsgi-min"] = servers[TWO_TRIPS] = servers[DECIDED] = \
                stack_.enter_context(stack.RawServer(interface="wsgi", **shape))
        if {"asgi-min", "asgi-pool"} & set(rungs):
            raw_asgi = stack_.enter_context(stack.RawServer(interface="asgi", **shape))
            servers["asgi-min"] = servers["asgi-pool"] = raw_asgi
        minimal = stack_.enter_context(stack.MinimalServer(**shape))
        servers["django-cycle"] = servers[OLD] = minimal
        if "real-metrics" in rungs:
            servers["real-metrics"] = stack_.enter_context(
                stack.Server(metrics=True, **shape))
        plan = [r for r in rungs] + [OLD]
        if other is not None:
            servers[OTHER] = stack_.enter_context(stack.Server(
                root=other, python=str(other / ".venv" / "bin" / "python"), **shape))
            plan.append(OTHER)
        for rung in plan:  # imports, connections, prepared statements
            sc.run_slice(product, team, scenario=rung, agents=8, seconds=1.5, warmup=0.5,
                         minimal=minimal, mode=sc.CHECKS, check_servers=servers)
        points: list[dict[str, Any]] = []
        for n in agents:
            slices: dict[str, list[sc.Slice]] = {r: [] for r in plan}
            for _ in range(rounds):
                for rung in plan:
                    slices[rung].append(sc.run_slice(
                        product, team, scenario=rung, agents=n, seconds=seconds,
                        warmup=warmup, minimal=minimal, mode=sc.CHECKS,
                        check_servers=servers))
            for rung in plan:
                point = sc.summarize(slices[rung], scenario=rung, agents=n, mode="ladder")
                points.append(point)
                print(report.point_line(point), flush=True)
    return {"agents": agents, "rounds": rounds, "seconds_per_slice": seconds,
            "rungs": list(rungs), "points": points,
            "layers": layers(points, tuple(r for r in rungs if r not in EXTRA)),
            "headline": headline(points)}


def _at(points: list[dict[str, Any]], scenario: str, agents: int) -> dict[str, Any] | None:
    return next((p for p in points if p["scenario"] == scenario and p["agents"] == agents),
                None)


def layers(points: list[dict[str, Any]], rungs: tuple[str, ...] = RUNGS
           ) -> list[dict[str, Any]]:
    """What each rung adds to the one below it, per check."""
    out = []
    many = max(p["agents"] for p in points)
    one = min(p["agents"] for p in points)
    for below, rung in itertools.pairwise(rungs):
        a, b = _at(points, below, many), _at(points, rung, many)
        a1, b1 = _at(points, below, one), _at(points, rung, one)
        if a is None or b is None:
            continue
        out.append({
            "layer": rung,
            "worker_cpu_us": round((b["server_cpu_ms_per_check"]
                                    - a["server_cpu_ms_per_check"]) * 1000),
            "postgres_cpu_us": round((b["postgres_cpu_ms_per_check"]
                                      - a["postgres_cpu_ms_per_check"]) * 1000),
            f"time_per_check_us_at_{many}": round(1e6 / b["checks_per_s"]
                                                  - 1e6 / a["checks_per_s"])
            if a["checks_per_s"] and b["checks_per_s"] else None,
            f"p50_us_at_{one}": round((b1["p50_ms"] - a1["p50_ms"]) * 1000)
            if a1 and b1 and one != many else None,
        })
    return out


def _ratio(a: dict[str, Any], b: dict[str, Any], field: str = "checks_per_s") -> float:
    return round(a[field] / b[field], 2)


def headline(points: list[dict[str, Any]]) -> dict[str, Any]:
    """The targets of issue 33: real / wsgi-min at 32 agents (>= 0.7 this round), its p99
    within 1.5x, one agent alone within 1.3x of the minimal's p50; and the old ratio."""
    out: dict[str, Any] = {}
    for n in sorted({p["agents"] for p in points}):
        real, fastest, old, two, decided, before = (
            _at(points, rung, n) for rung in ("real", "wsgi-min", OLD, TWO_TRIPS, DECIDED, OTHER))
        if real is None:
            continue
        if fastest:
            out[f"real_over_wsgi_min_{n}"] = _ratio(real, fastest)
            out[f"p99_real_over_wsgi_min_{n}"] = _ratio(real, fastest, "p99_ms")
            out[f"p50_real_over_wsgi_min_{n}"] = _ratio(real, fastest, "p50_ms")
        if old:
            out[f"real_over_min_durable_{n}"] = _ratio(real, old)
        if two and fastest:
            out[f"two_trips_over_wsgi_min_{n}"] = _ratio(two, fastest)
            out[f"real_over_two_trips_{n}"] = _ratio(real, two)
        if decided and fastest:
            out[f"rules_over_wsgi_min_{n}"] = _ratio(decided, fastest)
            out[f"p50_rules_over_wsgi_min_{n}"] = _ratio(decided, fastest, "p50_ms")
        if before and fastest:
            out[f"other_over_wsgi_min_{n}"] = _ratio(before, fastest)
            out[f"p50_other_over_wsgi_min_{n}"] = _ratio(before, fastest, "p50_ms")
        if before:
            out[f"real_over_other_{n}"] = _ratio(real, before)
    return out


def lines(result: dict[str, Any]) -> list[str]:
    many = max(result["agents"])
    one = min(result["agents"])
    out = [f"ladder, runs already started, {result['rounds']} alternating slices of "
           f"{result['seconds_per_slice']:g} s (what each layer adds per check):",
           f"  {'layer':15} {'worker CPU us':>13} {'PostgreSQL us':>13} "
           f"{'time/check us @' + str(many):>18} {'p50 us @' + str(one):>12}"]
    for layer in result["layers"]:
        out.append(f"  {layer['layer']:15} {layer['worker_cpu_us']:13} "
                   f"{layer['postgres_cpu_us']:13} "
                   f"{layer[f'time_per_check_us_at_{many}']!s:>18} "
                   f"{layer.get(f'p50_us_at_{one}')!s:>12}")
    out.append("  " + ", ".join(f"{k} {v}" for k, v in result["headline"].items()))
    return out


def interface_attacks(team: sc.Team, *, workers: int, threads: int, agents: int, rounds: int,
                      seconds: float, warmup: float,
                      names: tuple[str, ...] = ("slow_bodies", "unfinished_headers")
                      ) -> dict[str, Any]:
    """Whether granian's WSGI interface holds SPEC 10's slow-client attacks: the wsgi-min
    rung at `agents` agents without and with each attack, alternating slices. A WSGI
    application reads its body on its own thread: if granian handed a request over before
    its body had arrived, 200 slow bodies would hold every blocking thread, and the valid
    checks would stop."""
    from . import attacks as at

    out: dict[str, Any] = {}
    shape = {"workers": workers, "threads": threads}
    with stack.Server(**shape) as product, \
            stack.RawServer(interface="wsgi", **shape) as wsgi:
        servers: dict[str, stack.Server] = {"wsgi-min": wsgi}
        sc.run_slice(product, team, scenario="wsgi-min", agents=8, seconds=1.5, warmup=0.5,
                     mode=sc.CHECKS, check_servers=servers)
        for name in names:
            slices: dict[str, list[sc.Slice]] = {"without": [], "with": []}
            seen = []
            for _ in range(rounds):
                slices["without"].append(sc.run_slice(
                    product, team, scenario="wsgi-min", agents=agents, seconds=seconds,
                    warmup=warmup, mode=sc.CHECKS, check_servers=servers))
                sc.reset_runs()
                with at.running(at.ATTACKS[name], at.Target(port=wsgi.port),
                                settle=1.5) as stats:
                    slices["with"].append(sc.run_slice(
                        product, team, scenario="wsgi-min", agents=agents, seconds=seconds,
                        warmup=warmup, mode=sc.CHECKS, check_servers=servers, reset=False))
                seen.append({"most_open": stats.most_open, "answers": dict(stats.answers),
                             "closed_by_server": stats.closed_by_server})
            without = sc.summarize(slices["without"], scenario="wsgi-min", agents=agents)
            under = sc.summarize(slices["with"], scenario="wsgi-min", agents=agents)
            out[name] = {
                "without": {k: without[k] for k in ("checks_per_s", "p50_ms", "p99_ms")},
                "with": {k: under[k] for k in ("checks_per_s", "p50_ms", "p99_ms")},
                "p99_ratio": round(under["p99_ms"] / without["p99_ms"], 2)
                if without["p99_ms"] else None,
                "errors": without["errors"] + under["errors"],
                "error_kinds": {**without["error_kinds"], **under["error_kinds"]},
                "agents_starved": max(without["agents_starved"], under["agents_starved"]),
                "attack": seen,
            }
            print(f"  granian WSGI under {name}: p99 {under['p99_ms']} ms against "
                  f"{without['p99_ms']} without ({out[name]['p99_ratio']}x); checks/s "
                  f"{under['checks_per_s']} against {without['checks_per_s']}; errors "
                  f"{out[name]['errors']}, agents starved {out[name]['agents_starved']}; "
                  f"attack {seen}", flush=True)
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ladder", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", default="32,1")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0, help="seconds per slice")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--rungs", default=",".join(RUNGS))
    parser.add_argument("--other", type=Path,
                        help="another checkout (with its own .venv): its real check is "
                             "measured as the rung real-other, in the same rounds")
    parser.add_argument("--attacks", action="store_true",
                        help="instead of the ladder: the wsgi-min rung under the slow-body "
                             "and unfinished-header attacks (SPEC 10), alternating slices")
    args = parser.parse_args(argv)
    if args.seconds <= WARMUP_S:
        # The warm-up is inside each slice: a slice no longer measured nothing (0 checks/s).
        parser.error(f"--seconds must be more than the {WARMUP_S:g} s warm-up of each slice")
    rungs = tuple(r for r in args.rungs.split(",") if r)
    unknown = set(rungs) - set(RUNGS) - set(EXTRA)
    if unknown:
        parser.error(f"unknown rungs {sorted(unknown)}; known: {', '.join(RUNGS + EXTRA)}")
    stack.fresh_database()
    stack.manage("migrate", "--noinput", "-v0")
    stack.setup_django()
    stack.create_minimal_tables()
    team = sc.seed_team("bench-long", policy=sc.LONG_POLICY)
    if args.attacks:
        held = interface_attacks(team, workers=args.workers, threads=args.threads,
                                 agents=int(args.agents.split(",")[0]), rounds=args.rounds,
                                 seconds=args.seconds, warmup=WARMUP_S)
        return 0 if all(not r["errors"] and not r["agents_starved"]
                        for r in held.values()) else 1
    result = measure(team, workers=args.workers, threads=args.threads,
                     agents=[int(a) for a in args.agents.split(",") if a],
                     rounds=args.rounds, seconds=args.seconds, warmup=WARMUP_S, rungs=rungs,
                     other=args.other.resolve() if args.other else None)
    for line in lines(result):
        print(line)
    ok = all(p["errors"] == 0 and p["audit_ok"] for p in result["points"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
