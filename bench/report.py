"""Printing and storing results: one line per measurement while it runs, then the one-screen
summary, the results JSON and chart under bench/results/, and a line in bench/history.jsonl.

Correctness decides the exit status (errors, audit rows = decisions, leaked allows, metrics
that add up); timings are compared with the targets and reported, never enforced, because
the machine is shared and a timing can only be judged by a person looking at the ratios.
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
from pathlib import Path
from typing import Any

from .stack import ROOT

RESULTS = ROOT / "bench" / "results"
HISTORY = ROOT / "bench" / "history.jsonl"
TARGET_AGENTS = 32


def point_line(p: dict[str, Any]) -> str:
    return (f"  {p.get('mode', 'mix'):6} {p['scenario']:11} {p['agents']:4} agents "
            f"{p['checks_per_s']:8.1f} checks/s  "
            f"p50 {p['p50_ms']:6.1f}  p95 {p['p95_ms']:6.1f}  p99 {p['p99_ms']:6.1f} ms  "
            f"errors {p['errors']}  audit {p['audit_rows']}/{p['decisions_returned']}  "
            f"cpu ms/check: workers {p['server_cpu_ms_per_check']:.2f}, PostgreSQL "
            f"{p.get('postgres_cpu_ms_per_check', 0.0):.2f}, load generator "
            f"{p['client_cpu_ms_per_check']:.2f}")


def micro_line(m: dict[str, Any]) -> str:
    return "  in-process costs (us per check): " + ", ".join(f"{k.removesuffix('_us')} {v}"
                                                   for k, v in m.items())


def backtest_line(b: dict[str, Any]) -> str:
    parts = [f"{label.replace('_', ' ')}: {b[label]['decisions_per_s']} decisions/s "
             f"({b[label]['seconds']} s, {b[label]['changed']} changed)"
             for label in ("recorded_keys", "recomputed_keys") if label in b]
    return (f"  backtest of {b['runs']} runs, {b['decisions']} recorded decisions: "
            + "; ".join(parts))


def soak_line(s: dict[str, Any]) -> str:
    rss = ", ".join(f"{v[0]}->{v[-1]} MiB" for v in s["rss_mib"].values())
    return (f"  soak {s['agents']} agents {s['seconds']:g} s: {s['checks_per_s']} checks/s, "
            f"p99 {s['p99_ms']} ms, errors {s['errors']}, audit "
            f"{s['audit_rows']}/{s['decisions_returned']}, worker RSS {rss} "
            f"(growth after warm-up {s['rss_growth_max_pct']}%)")


def killswitch_line(k: dict[str, Any]) -> str:
    return (f"  kill switch ({k['method']}, {k['agents']} agents): engage command took "
            f"{k['engage_s']} s; {k['covered_runs']} runs running at the commit, all over "
            f"{k['all_covered_stopped_s']} s after it ({k['killed_by_check']} killed answers, "
            f"{k['killed_by_fanout']} by the fan-out); leaked allows {k['leaked_allows']}; "
            f"errors {k['errors']}")


def fanout_line(f: dict[str, Any]) -> str:
    return (f"  kill switch fan-out ({f['covered_runs']} running runs, {f['agents']} agents "
            f"checking): engage took {f['engage_s']} s; every covered run killed "
            f"{f['all_covered_killed_s']} s after the commit (fan-out records from "
            f"{f['fanout_first_record_s']} s to {f['fanout_last_record_s']} s; "
            f"{f['killed_runs']} killed, "
            f"{f['runs_with_one_killed_record']} with one audit record, "
            f"{f['runs_with_several_killed_records']} with several); webhooks "
            f"{f['webhooks_received']}; leaked allows {f['leaked_allows']}; errors "
            f"{f['errors']}")


def longrun_line(r: dict[str, Any]) -> str:
    curve = ", ".join(f"{k}: {v}" for k, v in r["median_ms_from_step"].items())
    return (f"  one run, {r['checks']} sequential checks: median ms from step ({r['window']} "
            f"checks each) {curve}; last over first {r['last_over_first']}; errors "
            f"{r['errors']}")


def metrics_line(m: dict[str, Any]) -> str:
    return (f"  metrics at {TARGET_AGENTS} agents: off {m['off_checks_per_s']} checks/s "
            f"({m['off_worker_cpu_ms_per_check']} ms worker CPU/check), on "
            f"{m['on_checks_per_s']} checks/s ({m['on_worker_cpu_ms_per_check']} ms): cost "
            f"{m['cost_pct']}%; /metrics {m['scrape'].get('status')} with the token, "
            f"{m['scrape'].get('anonymous_status')} without; decisions counted "
            f"{m['scrape'].get('decisions_counted')} = audit rows "
            f"{m['scrape'].get('decisions_expected')}")


def tracing_line(t: dict[str, Any]) -> str:
    from .tracing import line

    return line(t)


def live_line(s: dict[str, Any]) -> str:
    if not s.get("measured"):
        return f"  live stream: not measured ({s.get('why')})"
    return "\n".join(_live_point(p) for p in s.get("points") or [s])


def _live_point(s: dict[str, Any]) -> str:
    nodes = s.get("web_nodes", 1)
    where = f" over {nodes} web nodes" if nodes > 1 else ""
    return (f"  live stream ({s['running_runs']} running runs, {s['watched_runs']} pages "
            f"open{where} in {s.get('pages_open_s', '?')} s "
            f"({s.get('pages_not_open_in_120_s', 0)} not yet), {s['checks_per_s']} checks/s, load "
            f"{s.get('load_average_1m', '?')}, clients' CPU {s.get('client_cpu_s', '?')} s in "
            f"{s.get('phase_s', '?')} s, server's CPU {s.get('server_cpu_per_s', '?')} s a "
            f"second while checked): decision to event p50 {s['p50_ms']} ms, p95 "
            f"{s['p95_ms']} ms, p99 {s['p99_ms']} ms over {s['events']} events "
            f"({s['events_missing']} missing), errors {s['errors']}")


def attack_lines(a: dict[str, Any]) -> list[str]:
    lines = []
    for name, r in a["attacks"].items():
        most = max((x["most_open"] for x in r["attack"]), default=0)
        lines.append(
            f"  under {name} ({most} attacking connections open at most), {a['agents']} "
            f"agents: p99 {r['with']['p99_ms']} ms against {r['without']['p99_ms']} ms "
            f"without: {r['p99_ratio']}x; checks/s {r['with']['checks_per_s']} against "
            f"{r['without']['checks_per_s']}; errors {r['errors']}")
    return lines


def _point(results: dict[str, Any], scenario: str, agents: int, mode: str = "mix"
           ) -> dict[str, Any] | None:
    return next((p for p in results["points"] if p["scenario"] == scenario
                 and p["agents"] == agents and p.get("mode", "mix") == mode), None)


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None, key: str = "checks_per_s"
           ) -> float | None:
    return round(a[key] / b[key], 2) if a and b and b[key] else None


def ratios(results: dict[str, Any], mode: str = "mix") -> list[dict[str, Any]]:
    """The real check over each baseline, per concurrency. The minimal baselines (issue 17)
    run outside the product's middleware, in an application of their own."""
    rows = []
    for agents in sorted({p["agents"] for p in results["points"]}):
        real, durable, bare, min_durable, min_bare = (
            _point(results, s, agents, mode)
            for s in ("real", "durable", "bare", "min-durable", "min-bare"))
        if real is None:
            continue
        rows.append({
            "agents": agents,
            "mode": mode,
            "real_over_min_durable": _ratio(real, min_durable),
            "real_over_min_bare": _ratio(real, min_bare),
            "p99_real_over_min_durable": _ratio(real, min_durable, "p99_ms"),
            "real_over_durable": round(real["checks_per_s"] / durable["checks_per_s"], 2)
            if durable and durable["checks_per_s"] else None,
            "real_over_bare": round(real["checks_per_s"] / bare["checks_per_s"], 2)
            if bare and bare["checks_per_s"] else None,
            "cpu_real_over_durable": round(
                real["server_cpu_ms_per_check"] / durable["server_cpu_ms_per_check"], 2)
            if durable and durable["server_cpu_ms_per_check"] else None,
        })
    return rows


def correctness(results: dict[str, Any]) -> list[str]:
    """Every failed correctness check, in words (empty: all held)."""
    failed = []
    for p in results["points"] + (results.get("ladder") or {}).get("points", []) + \
            (results.get("nodes") or {}).get("points", []):
        if p["errors"]:
            failed.append(f"{p['scenario']} at {p['agents']} agents: {p['errors']} errors "
                          f"{p['error_kinds']}")
        if p.get("agents_starved"):
            failed.append(f"{p['scenario']} at {p['agents']} agents: {p['agents_starved']} "
                          "agents got no check answered in a measured slice")
        if not p["audit_ok"]:
            failed.append(f"{p['scenario']} at {p['agents']} agents: audit rows "
                          f"{p['audit_rows']} != decisions {p['decisions_returned']}")
    soak = results.get("soak")
    if soak and (soak["errors"] or not soak["audit_ok"]):
        failed.append(f"soak: errors {soak['error_kinds']}, audit "
                      f"{soak['audit_rows']}/{soak['decisions_returned']}")
    bt = results.get("backtest")
    if bt and not bt["ok"]:
        failed.append("backtest: not every generated run and decision was replayed")
    ks = results.get("killswitch")
    if ks and not ks["ok"]:
        failed.append(f"kill switch: leaked allows {ks['leaked_allows']}, errors "
                      f"{ks['error_kinds']}, runs still running "
                      f"{ks['covered_runs_still_running']}")
    rl = results.get("ratelimit")
    if rl and (rl["errors"] or not rl["audit_ok"] or rl["waits"]):
        failed.append(f"rate limit points: errors {rl['errors']}, audit ok {rl['audit_ok']}, "
                      f"waits {rl['waits']} (the rule is never full)")
    fan = results.get("fanout")
    if fan and not fan["ok"]:
        failed.append(f"kill switch fan-out: {fan['covered_runs_still_running']} runs still "
                      f"running, {fan['killed_runs']} killed of {fan['covered_runs']}, "
                      f"{fan['runs_with_one_killed_record']} with one record, "
                      f"{fan['runs_with_several_killed_records']} with several, webhooks "
                      f"{fan['webhooks_received']}, leaked allows {fan['leaked_allows']}, "
                      f"errors {fan['error_kinds']}")
    long = results.get("longrun")
    if long and long["errors"]:
        failed.append(f"long run: errors {long['error_kinds']}")
    metrics = results.get("metrics")
    if metrics:
        scrape = metrics["scrape"]
        if metrics["errors"] or not metrics["audit_ok"]:
            failed.append(f"metrics points: errors {metrics['errors']}, audit ok "
                          f"{metrics['audit_ok']}")
        if scrape.get("status") != 200 or scrape.get("anonymous_status") != 401:
            failed.append(f"/metrics answered {scrape.get('status')} with the token and "
                          f"{scrape.get('anonymous_status')} without")
        if scrape.get("decisions_counted") != scrape.get("decisions_expected"):
            failed.append(f"/metrics counted {scrape.get('decisions_counted')} decisions, the "
                          f"audit log has {scrape.get('decisions_expected')}")
    traced = results.get("tracing")
    if traced and (traced["errors"] or not traced["audit_ok"]):
        failed.append(f"tracing points: errors {traced['errors']}, audit ok "
                      f"{traced['audit_ok']}")
    failed += [f"growth: {f}" for f in (results.get("growth") or {}).get("failures", [])]
    nodes = results.get("nodes")
    if nodes and nodes.get("failed"):
        failed.append(f"nodes: {nodes['why']}")
    live = results.get("stream")
    for point in (live or {}).get("points") or ([live] if live else []):
        if point.get("measured") and point["errors"]:
            failed.append(f"live stream at {point['running_runs']} runs: errors "
                          f"{point['error_kinds']}")
    for name, r in (results.get("attacks") or {}).get("attacks", {}).items():
        if r["errors"] or not r["audit_ok"] or r["agents_starved"]:
            failed.append(f"under {name}: errors {r['error_kinds']}, audit ok "
                          f"{r['audit_ok']}, agents starved {r['agents_starved']}")
    return failed


def targets(results: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met) — met None when not measured in this run."""
    out: list[tuple[str, str, bool | None]] = []
    ratio = next((r for r in ratios(results) if r["agents"] == TARGET_AGENTS), None)
    real = _point(results, "real", TARGET_AGENTS)
    if ratio and ratio["real_over_durable"] is not None:
        out.append(("real >= 0.7 x durable at 32 agents", f"{ratio['real_over_durable']}x",
                    ratio["real_over_durable"] >= 0.7))
    if real:
        out.append(("p99 <= 50 ms at 32 agents", f"{real['p99_ms']} ms", real["p99_ms"] <= 50))
        out.append(("0 errors at 32 agents", str(real["errors"]), real["errors"] == 0))
    head = (results.get("ladder") or {}).get("headline") or {}
    n = TARGET_AGENTS
    if head.get(f"real_over_wsgi_min_{n}") is not None:
        out.append((f"real >= 0.7 x the minimal durable check served the fastest way (WSGI) "
                    f"at {n} agents", f"{head[f'real_over_wsgi_min_{n}']}x (old baseline: "
                    f"{head.get(f'real_over_min_durable_{n}')}x)",
                    head[f"real_over_wsgi_min_{n}"] >= 0.7))
        out.append((f"real p99 <= 1.5 x the fastest minimal's at {n} agents",
                    f"{head[f'p99_real_over_wsgi_min_{n}']}x",
                    head[f"p99_real_over_wsgi_min_{n}"] <= 1.5))
    if head.get("p50_real_over_wsgi_min_1") is not None:
        out.append(("one agent alone: real p50 <= 1.3 x the fastest minimal's",
                    f"{head['p50_real_over_wsgi_min_1']}x",
                    head["p50_real_over_wsgi_min_1"] <= 1.3))
    soak = results.get("soak")
    if soak:
        out.append(("worker RSS growth <= 10% in the soak", f"{soak['rss_growth_max_pct']}%",
                    soak["rss_ok"]))
    metrics = results.get("metrics")
    if metrics and metrics.get("cost_pct") is not None:
        out.append(("metrics cost < 5%", f"{metrics['cost_pct']}%", metrics["cost_pct"] < 5))
    traced = results.get("tracing")
    if traced and traced.get("cost_pct") is not None:
        out.append(("tracing cost <= 5% (SPEC 18)", f"{traced['cost_pct']}%",
                    traced["cost_pct"] <= 5))
    fan = results.get("fanout")
    if fan and fan.get("all_covered_killed_s") is not None and fan["covered_runs"] >= 10000:
        out.append(("fan-out: 10,000 runs killed <= 2 s after the commit",
                    f"{fan['all_covered_killed_s']} s", fan["all_covered_killed_s"] <= 2.0))
    long = results.get("longrun")
    if long and long.get("last_over_first") is not None and long["steps"] >= 5000:
        out.append(("one run: step 5,000 within 1.2x of step 10", f"{long['last_over_first']}x",
                    long["last_over_first"] <= 1.2))
    growth = results.get("growth")
    if growth and growth["history_rows_target"] >= 10_000_000 and growth["history_over_empty"]:
        out.append(("10 M audit rows >= 0.9x the empty log", f"{growth['history_over_empty']}x",
                    growth["history_over_empty"] >= 0.9))
    ks = results.get("killswitch")
    if ks:
        out.append(("kill switch: 0 leaked allows", str(ks["leaked_allows"]),
                    ks["leaked_allows"] == 0))
    for name, r in (results.get("attacks") or {}).get("attacks", {}).items():
        ratio = r["p99_ratio"]
        out.append((f"p99 under {name} <= 2 x without it", f"{ratio}x",
                    None if ratio is None else ratio <= 2.0))
    return out


def summary(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        f"Agent governance benchmark: {results['mode']} mode, {results['started_at']}, "
        f"commit {results['commit']}",
        f"Machine: {m['cpus']} CPUs ({m['cpu_model']}), {m['memory_gib']} GiB, PostgreSQL "
        f"{m['postgresql']}, Python {m['python']}, load average at start "
        f"{m['load_average_at_start']:.1f}; server {results['server']['workers']} workers x "
        f"{results['server']['threads']} threads; {results['seconds_per_point']:g} s per point "
        f"in {results.get('slices_per_point', 1)} slice(s) alternating between scenarios",
        "",
        "agents mode   scenario     checks/s   p50 ms   p95 ms   p99 ms  start/finish p99  errors  "
        "audit rows = decisions",
    ]
    for p in results["points"]:
        audit = "none written" if p["scenario"] in ("bare", "min-bare") else \
            f"{p['audit_rows']} = {p['decisions_returned']}"
        lines.append(f"{p['agents']:6} {p.get('mode', 'mix'):6} {p['scenario']:11} "
                     f"{p['checks_per_s']:9.1f} "
                     f"{p['p50_ms']:8.1f} {p['p95_ms']:8.1f} {p['p99_ms']:8.1f} "
                     f"{p.get('start_finish_p99_ms', 0.0):17.1f} "
                     f"{p['errors']:7}  {audit} {'ok' if p['audit_ok'] else 'MISMATCH'}")
    for mode, title in (("mix", "start-checks-finish mix"),
                        ("checks", "runs already started, checks only"),
                        ("long", "runs already started, checks only, one long slice each")):
        rows = ratios(results, mode)
        if not rows:
            continue
        lines.append("")
        lines.append(f"ratios, {title}")
        lines.append("        agents: real/durable  real/bare  real/min-durable  real/min-bare"
                     "  p99 real/min-durable  (worker CPU per check real/durable)")
        for r in rows:
            lines.append(f"        {r['agents']:6}: {r['real_over_durable']!s:>12}  "
                         f"{r['real_over_bare']!s:>9}  {r['real_over_min_durable']!s:>16}  "
                         f"{r['real_over_min_bare']!s:>13}  "
                         f"{r['p99_real_over_min_durable']!s:>20}  "
                         f"({r['cpu_real_over_durable']})")
        at = [p for p in results["points"] if p["agents"] == TARGET_AGENTS
              and p.get("mode", "mix") == mode]
        if at:
            lines.append(f"  CPU per check at {TARGET_AGENTS} agents, ms (starts and finishes "
                         "included in the mix): workers / PostgreSQL / load generator")
            for p in at:
                lines.append(f"  {p['scenario']:11} {p['server_cpu_ms_per_check']:6.2f} / "
                             f"{p.get('postgres_cpu_ms_per_check', 0.0):6.2f} / "
                             f"{p['client_cpu_ms_per_check']:6.2f}")
    lines.append("")
    for key, fmt in (("micro", micro_line), ("backtest", backtest_line), ("soak", soak_line),
                     ("killswitch", killswitch_line), ("fanout", fanout_line),
                     ("longrun", longrun_line),
                     ("stream", live_line), ("metrics", metrics_line),
                     ("tracing", tracing_line)):
        if key in results:
            lines.extend(line.strip() for line in fmt(results[key]).splitlines())
    if "attacks" in results:
        lines.extend(line.strip() for line in attack_lines(results["attacks"]))
    if "retention" in results:
        from .retention import line as retention_line

        lines.append(retention_line(results["retention"]).strip())
    if "ladder" in results:
        from .ladder import lines as ladder_lines

        lines.append("")
        lines.extend(ladder_lines(results["ladder"]))
    if "nodes" in results:
        from .nodes import lines as nodes_lines

        lines.append("")
        lines.extend(nodes_lines(results["nodes"]))
    lines.append("")
    lines.append("targets:")
    for name, measured, met in targets(results):
        verdict = "met" if met else ("NOT MET" if met is False else "not measured")
        lines.append(f"  {name}: {measured} ({verdict})")
    failed = correctness(results)
    lines.append("correctness: " + ("all checks held" if not failed else "FAILED"))
    lines.extend(f"  - {f}" for f in failed)
    lines.append(f"elapsed {results['elapsed_s']} s")
    return "\n".join(lines)


def chart(results: dict[str, Any], path: Path) -> str | None:
    """Throughput and p99 against concurrency, per scenario. None when matplotlib is absent
    (a bench-only dependency): the JSON and the summary carry the same numbers."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for scenario, style in (("real", "o-"), ("durable", "s--"), ("bare", "^:"),
                            ("min-durable", "d-."), ("min-bare", "v:")):
        points = sorted((p for p in results["points"] if p["scenario"] == scenario
                         and p.get("mode", "mix") == "mix"),
                        key=lambda p: p["agents"])
        if not points:
            continue
        xs = [p["agents"] for p in points]
        left.plot(xs, [p["checks_per_s"] for p in points], style, label=scenario)
        right.plot(xs, [p["p99_ms"] for p in points], style, label=scenario)
    agents = sorted({p["agents"] for p in results["points"]})
    for ax, title, unit in ((left, "Throughput", "checks/s"), (right, "p99 latency", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(agents, [str(a) for a in agents])
        ax.set_xlabel("simulated agents")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    right.axhline(50, color="grey", linewidth=0.8)
    fig.suptitle(f"check endpoint, {results['mode']} mode, {results['started_at'][:16]}, "
                 f"{results['server']['workers']}x{results['server']['threads']} granian")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path.relative_to(ROOT))


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True, timeout=10, check=False)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def history_line(results: dict[str, Any]) -> dict[str, Any]:
    real = _point(results, "real", TARGET_AGENTS) or {}
    ratio = next((r for r in ratios(results) if r["agents"] == TARGET_AGENTS), {})
    return {
        "at": results["started_at"],
        "commit": results["commit"],
        "mode": results["mode"],
        "phases": results["phases"],
        "server": f"{results['server']['workers']}x{results['server']['threads']}",
        "load_average_at_start": round(results["machine"]["load_average_at_start"], 1),
        "real_32_checks_per_s": real.get("checks_per_s"),
        "real_32_p99_ms": real.get("p99_ms"),
        "real_32_worker_cpu_ms": real.get("server_cpu_ms_per_check"),
        "real_over_durable_32": ratio.get("real_over_durable"),
        "real_over_bare_32": ratio.get("real_over_bare"),
        "real_over_min_durable_32": ratio.get("real_over_min_durable"),
        "real_over_min_bare_32": ratio.get("real_over_min_bare"),
        "real_over_min_durable_32_checks_only": next(
            (r["real_over_min_durable"] for r in ratios(results, "checks")
             if r["agents"] == TARGET_AGENTS), None),
        "real_over_min_durable_32_long": next(
            (r["real_over_min_durable"] for r in ratios(results, "long")
             if r["agents"] == TARGET_AGENTS), None),
        "ladder": (results.get("ladder") or {}).get("headline"),
        "nodes": (results.get("nodes") or {}).get("headline"),
        "metrics_cost_pct": (results.get("metrics") or {}).get("cost_pct"),
        "tracing_cost_pct": (results.get("tracing") or {}).get("cost_pct"),
        "soak_rss_growth_pct": (results.get("soak") or {}).get("rss_growth_max_pct"),
        "killswitch_all_stopped_s": (results.get("killswitch") or {}).get(
            "all_covered_stopped_s"),
        "fanout_runs": (results.get("fanout") or {}).get("covered_runs"),
        "fanout_all_killed_s": (results.get("fanout") or {}).get("all_covered_killed_s"),
        "longrun_last_over_first": (results.get("longrun") or {}).get("last_over_first"),
        "live_p99_ms": (results.get("stream") or {}).get("p99_ms"),
        "live_running_runs": (results.get("stream") or {}).get("running_runs"),
        "backtest_decisions_per_s": ((results.get("backtest") or {}).get("recomputed_keys")
                                     or {}).get("decisions_per_s"),
        "attack_p99_ratios": {name: r["p99_ratio"] for name, r in
                              (results.get("attacks") or {}).get("attacks", {}).items()},
        "growth_10m_over_empty": (results.get("growth") or {}).get("history_over_empty"),
        "retention_86m_flat_s": sum(((results.get("retention") or {}).get("flat_at_86m")
                                     or {}).get(k, 0) for k in ("delete_s", "vacuum_s")) or None,
        "retention_partition_drop_s": (results.get("retention") or {}).get("partition_drop_s"),
        "correct": not correctness(results),
    }


def finish(results: dict[str, Any], *, history: bool) -> bool:
    """Store, print, and say whether every correctness check held."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    json_path = RESULTS / f"{results['name']}.json"
    png = chart(results, RESULTS / f"{results['name']}.png") if results["points"] else None
    results["chart"] = png
    results["correctness_failures"] = correctness(results)
    json_path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    if history:
        with HISTORY.open("a") as out:
            out.write(json.dumps(history_line(results)) + "\n")
    print()
    print(summary(results))
    if png:
        chart_note = f", chart: {png}"
    elif results["points"]:
        chart_note = ", no chart (matplotlib is not installed)"
    else:
        chart_note = ""
    print(f"results: {json_path.relative_to(ROOT)}{chart_note}")
    return not results["correctness_failures"]


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
