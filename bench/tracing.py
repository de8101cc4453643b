"""The tracing phase (SPEC 18): what OpenTelemetry costs the check.

The 32-agent real-check point with tracing off and on, in the same run: each slice on a fresh
server (tracing is chosen when a process starts), alternating off and on so that both see the
same drift of the machine's load. On, the server exports every span and its metrics over
OTLP/HTTP to a local receiver (bench/otlp_sink.py, its own process), which decodes and counts
them. Target: at most 5% of throughput.

Where the traced check's extra CPU goes is measured beside it, in processes of their own
(`python -m bench.tracing CHECKS` runs the calls a check makes to runs/telemetry.py, as
runs/check/api.py makes them, configured by its OTEL_* environment: `cpu_per_check` points
it at the same receiver): the span's work and the
metrics' on the request's thread, the encoding and sending on the exporter's threads.
"""

from __future__ import annotations

import contextlib
import json
import os
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
        cpu = cpu_per_check(url, checks=2_000 if seconds < 10 else 5_000,
                            sampler_ratio=sampler_ratio)
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
        "cpu_us_per_check": cpu,
        "received": received,
        "slices": {label: [round(x.stats.checks_in_window / max(
            1e-9, x.stats.window_end - x.stats.window_start), 1) for x in xs]
            for label, xs in slices.items()},
    }


# The calls a traced check makes (runs/check/api.py's check_operation, the audit's counter),
# one round at a time: best of ROUNDS, so that a busy machine disturbs it less.
ROUNDS = 5


def _checks(count: int, offset: int) -> None:
    from runs import telemetry

    meta = {"REQUEST_METHOD": "POST", "PATH_INFO": "/api/v1/runs/x/check"}
    for i in range(offset, offset + count):
        with telemetry.check_span(meta) as trace:
            telemetry.check_facts(run_id="99d356f1-8e3c-4272-90dd-20c8aef910ef", team="bench",
                                  agent="bench-agent", policy=("long", 3))
            telemetry.decision_made(team="bench", outcome="allow", reason="ok")
            telemetry.check_trace_id()
            telemetry.check_answered(trace, name="search.docs", status=200, answer={
                "decision": "allow", "reason": "ok", "decision_id": 10_000 + i,
                "step": i % 50, "rule": None})


def _measure_here(checks: int) -> dict[str, float]:
    """In this process, as its environment configures telemetry: the best round's CPU per
    check on this (the request's) thread, and the exporting threads' CPU per check once
    everything is flushed."""
    from runs import telemetry

    per_round = max(1, checks // ROUNDS)
    _checks(200, 0)  # set up: the providers, the exporter's session, the instruments
    telemetry.flush(10.0)
    began_process, began_thread = time.process_time(), time.thread_time()
    best = float("inf")
    for r in range(ROUNDS):
        started = time.thread_time()
        _checks(per_round, 1_000 + r * per_round)
        best = min(best, (time.thread_time() - started) / per_round)
    telemetry.flush(30.0)
    exporting = (time.process_time() - began_process) - (time.thread_time() - began_thread)
    return {"request_thread_us": round(best * 1e6, 1),
            "export_us": round(max(0.0, exporting) / (per_round * ROUNDS) * 1e6, 1)}


def cpu_per_check(url: str, *, checks: int, sampler_ratio: float | None = None
                  ) -> dict[str, float]:
    """The traced check's telemetry CPU, per check, by part: three processes, tracing with
    metrics, tracing without, and tracing off (the calls when nothing is configured)."""
    base = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}
    # The queue holds every span of the run: measured here is the work, not the drops a
    # loop far faster than a server's checks would cause.
    on = {**base, "OTEL_EXPORTER_OTLP_ENDPOINT": url, "OTEL_METRIC_EXPORT_INTERVAL": "5000",
          "OTEL_BSP_MAX_QUEUE_SIZE": str(checks * 2)}
    if sampler_ratio is not None:
        on.update(OTEL_TRACES_SAMPLER="parentbased_traceidratio",
                  OTEL_TRACES_SAMPLER_ARG=str(sampler_ratio))

    def measured(env: dict[str, str]) -> dict[str, float]:
        done = subprocess.run([sys.executable, "-m", "bench.tracing", str(checks)],
                              cwd=stack.ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"the tracing CPU measurement failed: {done.stderr[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    both = measured(on)
    spans = measured({**on, "OTEL_METRICS_EXPORTER": "none"})
    off = measured(base)
    return {"spans_us": spans["request_thread_us"],
            "metrics_us": round(max(0.0, both["request_thread_us"]
                                    - spans["request_thread_us"]), 1),
            "request_thread_us": both["request_thread_us"],
            "export_us": both["export_us"],
            "total_us": round(both["request_thread_us"] + both["export_us"], 1),
            "off_us": off["request_thread_us"]}


def line(t: dict[str, Any]) -> str:
    got = t["received"]
    sampled = "" if t.get("sampler_ratio") is None else f" (sampling {t['sampler_ratio']})"
    return (f"  tracing{sampled} at {TARGET_AGENTS} agents: off {t['off_checks_per_s']} checks/s "
            f"({t['off_worker_cpu_ms_per_check']} ms worker CPU/check, p99 {t['off_p99_ms']} "
            f"ms), on {t['on_checks_per_s']} checks/s ({t['on_worker_cpu_ms_per_check']} ms, "
            f"p99 {t['on_p99_ms']} ms): cost {t['cost_pct']}%; the receiver decoded "
            f"{got.get('check_spans')} check spans of {t['checks_sent_traced']} checks sent, "
            f"{got.get('spans')} spans in all, {got.get('metric_requests')} metric exports"
            + _cpu_line(t.get("cpu_us_per_check"), t["off_worker_cpu_ms_per_check"]))


def _cpu_line(cpu: dict[str, float] | None, off_ms: float | None) -> str:
    if not cpu:
        return ""
    share = f" ({cpu['total_us'] / (off_ms * 10):.0f}% of an untraced check's worker CPU)" \
        if off_ms else ""
    return (f"; in process, per check: the span {cpu['spans_us']} us and the metrics "
            f"{cpu['metrics_us']} us on the request's thread, the export {cpu['export_us']} us "
            f"on its threads, {cpu['total_us']} us in all{share}; tracing off "
            f"{cpu['off_us']} us")


if __name__ == "__main__":
    # A process of its own (cpu_per_check): telemetry is set up once per process, from the
    # environment it starts with.
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "governance.settings")
    os.environ.setdefault("SECRET_KEY", stack.SECRET_KEY)
    import django

    django.setup()
    print(json.dumps(_measure_here(int(sys.argv[1]))), flush=True)
