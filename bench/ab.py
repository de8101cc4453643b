"""`python -m bench.ab --other ../other-checkout`: this tree's check against another tree's,
in one run (docs/performance.md "Python cuts of issue 17, measured").

Starts this tree's server and the other checkout's (its own `.venv`, its own code, the same
serve command and shape), and the minimal durable baseline, against the benchmark's
database, and loads them in alternating slices, runs already started (the benchmark's
checks-only points): a change is measured against what it changed on the same minutes of
machine load, which two benchmark runs minutes apart cannot do on a shared machine. Both
trees must run on this tree's migrations (the database is migrated by this tree).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from . import scenarios as sc
from . import stack


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__)
    parser.add_argument("--other", required=True, type=Path,
                        help="another checkout of the project, with its own .venv")
    parser.add_argument("--agents", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=4.0, help="seconds per slice")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=4)
    args = parser.parse_args(argv)
    other_root = args.other.resolve()
    if not (other_root / ".venv" / "bin" / "python").exists():
        parser.error(f"{other_root} has no .venv (run `make install` there)")

    stack.fresh_database()
    stack.manage("migrate", "--noinput", "-v0")
    stack.setup_django()
    stack.create_minimal_tables()
    team = sc.seed_team("bench-long", policy=sc.LONG_POLICY)
    shape = {"workers": args.workers, "threads": args.threads}
    other = stack.Server(root=other_root, python=str(other_root / ".venv" / "bin" / "python"),
                         **shape)
    slices: dict[str, list[sc.Slice]] = {"other": [], "this": [], "min-durable": []}
    with other, stack.Server(**shape) as this, stack.MinimalServer(**shape) as minimal:
        plan: list[tuple[str, stack.Server, str]] = [
            ("other", other, sc.REAL), ("this", this, sc.REAL), ("min-durable", this,
                                                                 "min-durable")]
        for _, server, scenario in plan:  # imports, connections, prepared statements
            sc.run_slice(server, team, scenario=scenario, agents=8, seconds=2, warmup=0.5,
                         minimal=minimal, mode=sc.CHECKS)
        for _ in range(args.rounds):
            for label, server, scenario in plan:
                slices[label].append(sc.run_slice(
                    server, team, scenario=scenario, agents=args.agents,
                    seconds=args.seconds, warmup=1.0, minimal=minimal, mode=sc.CHECKS))
    ok = True
    print(f"checks only, {args.agents} agents, {args.rounds} x {args.seconds:g} s slices "
          f"alternating; other = {other_root}")
    for label, taken in slices.items():
        point: dict[str, Any] = sc.summarize(
            taken, scenario=sc.REAL if label != "min-durable" else "min-durable",
            agents=args.agents, mode=sc.CHECKS)
        ok = ok and point["errors"] == 0 and point["audit_ok"]
        print(f"  {label:12} {point['checks_per_s']:8.1f} checks/s  p99 "
              f"{point['p99_ms']:7.1f} ms  cpu ms/check: workers "
              f"{point['server_cpu_ms_per_check']}, PostgreSQL "
              f"{point['postgres_cpu_ms_per_check']}  errors {point['errors']}  audit "
              f"{'ok' if point['audit_ok'] else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
