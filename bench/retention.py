"""Retention at a day's volume (issue 32): batch DELETE against dropping time partitions.

At 1,000 checks a second the audit log grows by 86.4 million rows a day; retention has to take
a day's rows away every day. Two ways are measured here on synthetic tables shaped like
`runs_decision` (the run, the step, the time, the `check_id`, the answer and a JSON action of
the size the check writes, with the same indexes), in the benchmark's database and its own
tables, never the product's:

- **flat**: one table, pruned as `prune_audit` prunes (runs/audit/retention.py): the oldest
  day's runs in batches of 500, each batch's decisions deleted by run, then the runs; then the
  `VACUUM` that makes the space reusable, timed apart (autovacuum does it in production, but it
  is work the database does all the same).
- **partitioned**: the same rows in a table partitioned by day; the oldest day leaves by
  `ALTER TABLE ... DETACH PARTITION ... CONCURRENTLY` and `DROP TABLE`.

Each is measured at two daily sizes; the slope (seconds and PostgreSQL CPU seconds per million
rows) extrapolates to 86.4 M rows. `python -m bench.retention [--quick] [--rows N,M]` runs it
alone; `make bench` runs it as the phase `retention`. The choice and its reasons are in
docs/performance.md ("Retention at a day's volume").
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from .stack import cpu_seconds, database_url

DAY_ROWS_AT_1000_PER_S = 86_400_000
STEPS = 20  # decisions per run, as bench/growth.py generates them
DAYS = 3  # the oldest goes; two stay, so the indexes hold more than what is deleted
BATCH_RUNS = 500  # runs/audit/retention.py BATCH
FULL_ROWS = (250_000, 1_000_000)  # rows per day, the two sizes of the slope
QUICK_ROWS = (20_000, 60_000)

COLUMNS = """
    id bigint GENERATED ALWAYS AS IDENTITY,
    run_id uuid NOT NULL,
    step integer NOT NULL,
    at timestamptz NOT NULL,
    check_id text NOT NULL,
    outcome text NOT NULL,
    reason text NOT NULL,
    action jsonb NOT NULL,
    answer jsonb NOT NULL
"""
# One day d (0 the oldest) of `rows` rows: rows / STEPS runs of STEPS decisions each.
FILL = """
INSERT INTO {table} (run_id, step, at, check_id, outcome, reason, action, answer)
SELECT r.run_id, s.step,
       timestamptz '2026-01-01' + make_interval(days => %(day)s)
         + make_interval(secs => ((r.n - 1) * (86400.0 - {steps} - 1) / %(runs)s) + s.step),
       md5(r.run_id::text || s.step), 'allow', '',
       jsonb_build_object('name', 'search.docs', 'type', 'tool',
                          'args', jsonb_build_object('q', repeat('x', 120), 'n', s.step)),
       jsonb_build_object('decision', 'allow', 'reason', '', 'step', s.step, 'message', '')
FROM (SELECT n, md5('{table}' || %(day)s || n)::uuid AS run_id
      FROM generate_series(1, %(runs)s) n) r
CROSS JOIN generate_series(1, {steps}) AS s(step)
"""


def _backend_cpu(conn: Any) -> float:
    """CPU seconds of this connection's own backend: the machine's other PostgreSQL work (the
    benchmark's servers, other databases) does not count."""
    return cpu_seconds(conn.info.backend_pid)


def _table_size(conn: Any, table: str) -> int:
    return conn.execute("SELECT pg_total_relation_size(%s)", (table,)).fetchone()[0]


def _create_flat(conn: Any, rows: int) -> None:
    conn.execute("DROP TABLE IF EXISTS bench_ret_flat, bench_ret_runs")
    conn.execute(f"CREATE TABLE bench_ret_flat ({COLUMNS}, PRIMARY KEY (id))")
    conn.execute("CREATE TABLE bench_ret_runs (id uuid PRIMARY KEY, ended_at timestamptz)")
    for day in range(DAYS):
        conn.execute(FILL.format(table="bench_ret_flat", steps=STEPS),
                     {"day": day, "runs": rows // STEPS})
    conn.execute("INSERT INTO bench_ret_runs SELECT run_id, max(at) FROM bench_ret_flat "
                 "GROUP BY run_id")
    # The indexes of runs_decision that a delete maintains: the run's steps and its check_ids.
    conn.execute("CREATE INDEX ON bench_ret_flat (run_id, step)")
    conn.execute("CREATE UNIQUE INDEX ON bench_ret_flat (run_id, check_id)")
    conn.execute("CREATE INDEX ON bench_ret_runs (ended_at, id)")
    conn.execute("VACUUM ANALYZE bench_ret_flat")
    conn.execute("VACUUM ANALYZE bench_ret_runs")


def _create_partitioned(conn: Any, rows: int) -> None:
    conn.execute("DROP TABLE IF EXISTS bench_ret_part")
    conn.execute(f"CREATE TABLE bench_ret_part ({COLUMNS}, PRIMARY KEY (id, at)) "
                 "PARTITION BY RANGE (at)")
    for day in range(DAYS):
        conn.execute(f"CREATE TABLE bench_ret_part_{day} PARTITION OF bench_ret_part FOR VALUES "
                     f"FROM ('2026-01-01'::timestamptz + interval '{day} days') "
                     f"TO ('2026-01-01'::timestamptz + interval '{day + 1} days')")
    for day in range(DAYS):
        conn.execute(FILL.format(table="bench_ret_part", steps=STEPS),
                     {"day": day, "runs": rows // STEPS})
    # A partitioned unique index must include the partition key: (run_id, check_id, at).
    conn.execute("CREATE INDEX ON bench_ret_part (run_id, step)")
    conn.execute("CREATE UNIQUE INDEX ON bench_ret_part (run_id, check_id, at)")
    conn.execute("VACUUM ANALYZE bench_ret_part")


def _prune_flat(conn: Any) -> dict[str, Any]:
    """The oldest day's runs in batches, as prune_audit does (without its export)."""
    cutoff = "2026-01-02"
    deleted = 0
    cpu0, t0 = _backend_cpu(conn), time.monotonic()
    while True:
        with conn.transaction():
            ids = [r[0] for r in conn.execute(
                "SELECT id FROM bench_ret_runs WHERE ended_at < %s ORDER BY ended_at, id "
                "LIMIT %s FOR UPDATE", (cutoff, BATCH_RUNS))]
            if not ids:
                break
            deleted += conn.execute("DELETE FROM bench_ret_flat WHERE run_id = ANY(%s)",
                                    (ids,)).rowcount
            conn.execute("DELETE FROM bench_ret_runs WHERE id = ANY(%s)", (ids,))
    delete_s, delete_cpu = time.monotonic() - t0, _backend_cpu(conn) - cpu0
    cpu0, t0 = _backend_cpu(conn), time.monotonic()
    conn.execute("VACUUM bench_ret_flat")
    conn.execute("VACUUM bench_ret_runs")
    vacuum_s, vacuum_cpu = time.monotonic() - t0, _backend_cpu(conn) - cpu0
    return {"rows_deleted": deleted, "delete_s": round(delete_s, 3),
            "delete_pg_cpu_s": round(delete_cpu, 3), "vacuum_s": round(vacuum_s, 3),
            "vacuum_pg_cpu_s": round(vacuum_cpu, 3)}


def _drop_partition(conn: Any) -> dict[str, Any]:
    rows = conn.execute("SELECT count(*) FROM bench_ret_part_0").fetchone()[0]
    cpu0, t0 = _backend_cpu(conn), time.monotonic()
    # CONCURRENTLY cannot run in a transaction block: the connection is in autocommit.
    conn.execute("ALTER TABLE bench_ret_part DETACH PARTITION bench_ret_part_0 CONCURRENTLY")
    conn.execute("DROP TABLE bench_ret_part_0")
    return {"rows_dropped": rows, "drop_s": round(time.monotonic() - t0, 3),
            "drop_pg_cpu_s": round(_backend_cpu(conn) - cpu0, 3)}


def _slope(small: dict[str, Any], large: dict[str, Any], key: str, rows_key: str) -> float:
    """Seconds per million rows between the two sizes (the fixed part cancels out)."""
    drows = (large[rows_key] - small[rows_key]) / 1e6
    return (large[key] - small[key]) / drows if drows > 0 else 0.0


def measure(*, quick: bool = False, sizes: tuple[int, ...] | None = None) -> dict[str, Any]:
    import psycopg

    sizes = tuple(sizes or (QUICK_ROWS if quick else FULL_ROWS))
    out: dict[str, Any] = {"day_rows": list(sizes), "days": DAYS, "steps_per_run": STEPS,
                           "batch_runs": BATCH_RUNS, "flat": [], "partitioned": []}
    with psycopg.connect(database_url(), autocommit=True, connect_timeout=5) as conn:
        conn.execute("SET statement_timeout = 0")
        conn.execute("SET maintenance_work_mem = '256MB'")
        # One process does all the work, so its own CPU counter is the whole cost.
        conn.execute("SET max_parallel_maintenance_workers = 0")
        try:
            for rows in sizes:
                print(f"  retention: {DAYS} days of {rows:,} rows, flat", flush=True)
                _create_flat(conn, rows)
                flat = {"day_rows": rows, "table_bytes": _table_size(conn, "bench_ret_flat"),
                        **_prune_flat(conn)}
                conn.execute("DROP TABLE bench_ret_flat, bench_ret_runs")
                print(f"  retention: {DAYS} days of {rows:,} rows, partitioned", flush=True)
                _create_partitioned(conn, rows)
                part = {"day_rows": rows, **_drop_partition(conn)}
                conn.execute("DROP TABLE bench_ret_part")
                out["flat"].append(flat)
                out["partitioned"].append(part)
        finally:
            conn.execute("DROP TABLE IF EXISTS bench_ret_flat, bench_ret_runs, bench_ret_part")
    small, large = out["flat"][0], out["flat"][-1]
    per_m = {key: _slope(small, large, key, "rows_deleted")
             for key in ("delete_s", "delete_pg_cpu_s", "vacuum_s", "vacuum_pg_cpu_s")}
    day_m = DAY_ROWS_AT_1000_PER_S / 1e6
    out["flat_per_million_rows"] = {k: round(v, 3) for k, v in per_m.items()}
    out["flat_at_86m"] = {
        "delete_s": round(per_m["delete_s"] * day_m),
        "vacuum_s": round(per_m["vacuum_s"] * day_m),
        "pg_cpu_s": round((per_m["delete_pg_cpu_s"] + per_m["vacuum_pg_cpu_s"]) * day_m),
    }
    # The pg CPU a day of retention costs, against the CPU of one core for a day.
    out["flat_at_86m"]["core_share_pct"] = round(
        100 * out["flat_at_86m"]["pg_cpu_s"] / 86_400, 2)
    out["partition_drop_s"] = max(p["drop_s"] for p in out["partitioned"])
    return out


def line(m: dict[str, Any]) -> str:
    f = m["flat_at_86m"]
    return (f"  retention: batch DELETE {m['flat_per_million_rows']['delete_s']} s + VACUUM "
            f"{m['flat_per_million_rows']['vacuum_s']} s per million rows -> at 86.4 M rows a "
            f"day {f['delete_s']} s + {f['vacuum_s']} s, {f['pg_cpu_s']} s of PostgreSQL CPU "
            f"({f['core_share_pct']}% of one core's day); dropping a day's partition "
            f"{m['partition_drop_s']} s")


def phase(results: dict[str, Any], *, quick: bool) -> None:
    results["retention"] = measure(quick=quick)
    print(line(results["retention"]), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.retention", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes (seconds)")
    parser.add_argument("--rows", default="", help="comma-separated rows per day, two or more")
    args = parser.parse_args(argv)
    sizes = tuple(int(r) for r in args.rows.split(",") if r) or None
    result = measure(quick=args.quick, sizes=sizes)
    print(line(result))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
