"""The tracing phase (SPEC 18): what OpenTelemetry costs the check.

The 32-agent real-check point with tracing off and on, in the same run: each slice on a fresh
server (tracing is chosen when a process starts), alternating off and on so that both see the
same drift of the machine's load. On, the server exports every span and its metrics over
OTLP/HTTP to a local receiver (bench/otlp_sink.py, its own process), which decodes and counts
them. Target: at most 5% of throughput.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx

from . import scenarios as sc
from . import stack
from .report import TARGET_AGENTS


@contextlib.contextmanager
def sink() -> Iterator[str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "bench.otlp_sink", str(port)],
                               cwd=stack.ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(url, timeout=1)
                break
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)


def measure(team: sc.Team, *, workers: int, threads: int, seconds: float, warmup: float,
            rounds: int, sampler_ratio: float | None = None) -> dict[str, Any]:
    slices: dict[str, list[sc.Slice]] = {"off": [], "on": []}
    checks_on = 0
    with sink() as url:
        tracing = {"OTEL_EXPORTER_OTLP_ENDPOINT": url, "OTEL_METRIC_EXPORT_INTERVAL": "5000"}
        if sampler_ratio is not None:  # head sampling: a share of the traces recorded
            tracing.update(OTEL_TRACES_SAMPLER="parentbased_traceidratio",
                           OTEL_TRACES_SAMPLER_ARG=str(sampler_ratio))
        for _ in range(rounds):
            for label in ("off", "on"):
                with stack.Server(workers=workers, threads=threads,
                                  extra_env=tracing if label == "on" else {}) as server:
                    warm = sc.run_slice(server, team, scenario=sc.REAL, agents=8, seconds=1.5,
                                        warmup=0.5)
                    measured = sc.run_slice(server, team, scenario=sc.REAL,
                                            agents=TARGET_AGENTS, seconds=seconds / rounds,
                                            warmup=warmup)
                    slices[label].append(measured)
                    if label == "on":
                        checks_on += warm.stats.checks_total + measured.stats.checks_total
                # Stopped: the server's processes flushed their spans as they exited.
        time.sleep(1.0)
        received = httpx.get(url, timeout=5).json()
    off = sc.summarize(slices["off"], scenario=sc.REAL, agents=TARGET_AGENTS)
    on = sc.summarize(slices["on"], scenario=sc.REAL, agents=TARGET_AGENTS)
    return {
        "sampler_ratio": sampler_ratio,
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
        "checks_sent_traced": checks_on,
        "received": received,
        "slices": {label: [round(x.stats.checks_in_window / max(
            1e-9, x.stats.window_end - x.stats.window_start), 1) for x in xs]
            for label, xs in slices.items()},
    }


def line(t: dict[str, Any]) -> str:
    got = t["received"]
    sampled = "" if t.get("sampler_ratio") is None else f" (sampling {t['sampler_ratio']})"
    return (f"  tracing{sampled} at {TARGET_AGENTS} agents: off {t['off_checks_per_s']} checks/s "
            f"({t['off_worker_cpu_ms_per_check']} ms worker CPU/check, p99 {t['off_p99_ms']} "
            f"ms), on {t['on_checks_per_s']} checks/s ({t['on_worker_cpu_ms_per_check']} ms, "
            f"p99 {t['on_p99_ms']} ms): cost {t['cost_pct']}%; the receiver decoded "
            f"{got.get('check_spans')} check spans of {t['checks_sent_traced']} checks sent, "
            f"{got.get('spans')} spans in all, {got.get('metric_requests')} metric exports")
