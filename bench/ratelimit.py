"""The cost of a rate limit (SPEC 12): the real check with one matching rule against the
same check without, in the same run, on the same server, in alternating slices (so both see
the same drift of a shared machine's load).

The rule matches every action of the benchmark's agents with a `max` they never reach, so
every check pays the whole price and none waits: the extra round trip (the rule's advisory
lock, then the window read) and the count of every action. Two windows are measured: 1 s (a
few dozen actions per agent name in the window) and 60 s (the agent's whole slice,
thousands): the read is two key lookups per rule either way (runs/check/rate_limits.py), so
the two should cost the same.
"""

from __future__ import annotations

from typing import Any

from . import scenarios as sc
from .stack import Server

# Never reached by the benchmark's agents: every check is allowed and pays the full count.
NEVER_FULL = 100_000


def _with_rule(team: sc.Team, window_s: int) -> None:
    from policies.models import Policy
    from policies.services import policy_save

    policy = Policy.objects.select_related("current").get(team_id=team.team_id, name="default")
    document = {**policy.current.document, "rate_limits": [
        {"match": "*", "per": "agent", "max": NEVER_FULL, "window_s": window_s}]}
    policy_save(team=policy.team, document=document, actor=None, source="bench")


def measure(server: Server, *, agents: int, seconds: float, warmup: float, rounds: int
            ) -> dict[str, Any]:
    teams = {"none": sc.seed_team("bench-rl-none")}
    for window_s in (1, 60):
        label = f"rule_{window_s}s"
        teams[label] = sc.seed_team(f"bench-rl-{window_s}s")
        _with_rule(teams[label], window_s)
    slices: dict[str, list[sc.Slice]] = {label: [] for label in teams}
    for team in teams.values():  # warm: connections, prepared statements, caches
        sc.run_slice(server, team, scenario=sc.REAL, agents=agents, seconds=1.0, warmup=0.3)
    # Statistics, as autovacuum keeps them on live tables.
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("ANALYZE runs_raterule, runs_ratecount, runs_rateslot")
    for _ in range(rounds):
        for label, team in teams.items():
            slices[label].append(sc.run_slice(server, team, scenario=sc.REAL, agents=agents,
                                              seconds=seconds, warmup=warmup))
    points = {label: sc.summarize(xs, scenario=sc.REAL, agents=agents)
              for label, xs in slices.items()}
    none = points["none"]
    out: dict[str, Any] = {"agents": agents, "slices": rounds,
                           "errors": sum(p["errors"] for p in points.values()),
                           "audit_ok": all(p["audit_ok"] for p in points.values()),
                           "waits": sum(p["outcomes"].get("wait", 0) for p in points.values())}
    for label, p in points.items():
        out[label] = {k: p[k] for k in ("checks_per_s", "p50_ms", "p99_ms",
                                        "server_cpu_ms_per_check", "postgres_cpu_ms_per_check",
                                        "checks")}
        if label != "none":
            out[label]["p50_extra_ms"] = round(p["p50_ms"] - none["p50_ms"], 2)
            out[label]["throughput_cost_pct"] = round(
                (none["checks_per_s"] - p["checks_per_s"]) * 100 / none["checks_per_s"], 1
            ) if none["checks_per_s"] else None
    return out


def line(m: dict[str, Any]) -> str:
    parts = [f"  rate limit at {m['agents']} agents: no rule {m['none']['checks_per_s']} "
             f"checks/s, p50 {m['none']['p50_ms']} ms"]
    for label in ("rule_1s", "rule_60s"):
        r = m[label]
        parts.append(f"{label.replace('_', ' ')} {r['checks_per_s']} checks/s, p50 "
                     f"{r['p50_ms']} ms (+{r['p50_extra_ms']} ms, throughput -"
                     f"{r['throughput_cost_pct']}%, PostgreSQL CPU "
                     f"{r['postgres_cpu_ms_per_check']} vs {m['none']['postgres_cpu_ms_per_check']}"
                     " ms/check)")
    return "; ".join(parts) + f"; waits {m['waits']}, errors {m['errors']}"
