"""The production stack the benchmark runs against: its database, the server, a Celery worker.

Everything here starts real processes with the same commands the README gives for
production (`manage.py serve`, `celery -A governance worker`), pointed at a database and a
Redis db of the benchmark's own, so a benchmark never touches data it did not make.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
PG_ADMIN_URL = os.environ.get("BENCH_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
DB_NAME = os.environ.get("BENCH_DB_NAME", "governance_bench")
REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/6")
SECRET_KEY = "bench-only-secret-key-not-used-anywhere-else"
LOG_DIR = Path(tempfile.gettempdir()) / "governance-bench"


def database_url() -> str:
    base = PG_ADMIN_URL.rsplit("/", 1)[0]
    return f"{base}/{DB_NAME}".replace("postgresql://", "postgres://", 1)


def base_env(**extra: str) -> dict[str, str]:
    """The environment of every process of the benchmark's stack."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "governance.settings",
        "DATABASE_URL": database_url(),
        "REDIS_URL": REDIS_URL,
        "SECRET_KEY": SECRET_KEY,
        "DEBUG": "false",
        "PYTHONUNBUFFERED": "1",
        "LOG_LEVEL": "WARNING",
        # The fan-out phase's webhook receiver listens on loopback, which webhooks refuse
        # unless listed (docs/killswitch.md).
        "WEBHOOK_ALLOWED_HOSTS": "127.0.0.1",
    }
    # Metrics are switched on per server by the caller, never inherited by accident.
    env.pop("METRICS_TOKEN", None)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    # So is tracing (the tracing phase, bench/tracing.py): no OTEL_* of the caller's shell.
    for name in [n for n in env if n.startswith("OTEL_")]:
        env.pop(name)
    env.update(extra)
    return env


def fresh_database() -> None:
    """Drop and create the benchmark's database (PostgreSQL, trust auth).

    Every run starts from an empty schema: a database left by an older checkout may hold
    columns whose migrations were since renamed, which `migrate` cannot reconcile (seen: a
    DuplicateColumn on a machine that had run an earlier branch), and a run's numbers should
    never depend on rows an earlier run left.
    """
    import psycopg

    with psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{DB_NAME}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{DB_NAME}"')


def manage(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> str:
    result = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=env or base_env(),
        capture_output=True, text=True, timeout=timeout, check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result.stdout


def setup_django() -> None:
    """Configure Django in this process against the benchmark's database (for seeding and
    counting audit rows; the load itself goes over HTTP)."""
    for key, value in base_env().items():
        if key in {"DJANGO_SETTINGS_MODULE", "DATABASE_URL", "REDIS_URL", "SECRET_KEY", "DEBUG"}:
            os.environ[key] = value
    import django

    django.setup()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _children(pid: int) -> list[int]:
    found: list[int] = []
    task_dir = Path(f"/proc/{pid}/task")
    try:
        for task in task_dir.iterdir():
            text = (task / "children").read_text()
            found += [int(p) for p in text.split()]
    except OSError:
        pass
    return found


def rss_bytes(pid: int) -> int:
    """Resident set size from /proc (VmRSS), 0 when the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process, from /proc/PID/stat."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def postgres_cpu_seconds() -> float:
    """CPU time of every PostgreSQL process on this machine (backends, WAL writer, and through
    the postmaster's children counters, the backends that exited). The benchmark's database
    shares the server with nothing busy while it runs, so a difference of two readings is
    what the load cost PostgreSQL."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != "postgres":
                continue
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        total += sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    return total / ticks


@dataclass
class Server:
    """`manage.py serve` (granian, WSGI, several worker processes) on a free port."""

    workers: int
    threads: int
    metrics: bool = False
    urlconf: str = "bench.urls"
    extra_env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    metrics_token: str = "bench-metrics-token"
    ready_path: str = "/readyz"  # what says the server is up (a faulted one: /healthz)
    # The checkout served and its interpreter: this one, unless another tree is compared
    # with it (bench/ab.py).
    root: Path = ROOT
    python: str = sys.executable

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Server:
        self.port = free_port()
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"server-{self.port}.log"
        env = base_env(BENCH_URLCONF=self.urlconf, **self.extra_env)
        if self.metrics:
            env["METRICS_TOKEN"] = self.metrics_token
        log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            self.command(), cwd=self.root, env=env, start_new_session=True, stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.process.returncode}: {self.log_tail()}")
            try:
                if httpx.get(f"{self.url}{self.ready_path}", timeout=2).status_code == 200 and \
                        len(self.worker_pids()) >= self.workers:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not become ready in 60 s: {self.log_tail()}")

    def command(self) -> list[str]:
        return [self.python, "manage.py", "serve", "--port", str(self.port),
                "--workers", str(self.workers), "--threads", str(self.threads)]

    def worker_pids(self) -> list[int]:
        """The granian worker processes (children of the granian main process)."""
        if self.process is None:
            return []
        return sorted(_children(self.process.pid))

    def rss(self) -> dict[int, int]:
        return {pid: rss_bytes(pid) for pid in self.worker_pids()}

    def cpu(self) -> float:
        return sum(cpu_seconds(pid) for pid in self.worker_pids())

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        stop_group(self.process)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def stop_group(process: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM the process group (granian's or Celery's workers included), SIGKILL if slow."""
    if process is None or process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@dataclass
class MinimalServer(Server):
    """The minimal baseline application (bench/minimal/: no middleware, its own settings),
    served exactly as `manage.py serve` serves the product: the same granian command line
    (`granian_argv`), the same ASGI application class (the body read on the event loop, the
    view on the API pool of ``threads`` threads), minus the static files it has none of."""

    def command(self) -> list[str]:
        from runs.management.commands.serve import granian_argv

        granian = str(Path(sys.executable).with_name("granian"))
        return granian_argv(granian, "bench.minimal.asgi:application", host="127.0.0.1",
                            port=self.port, workers=self.workers, max_connections=2048)

    def start(self) -> Server:
        self.extra_env = {**self.extra_env, "WEB_THREADS": str(self.threads)}
        return super().start()


def create_minimal_tables() -> None:
    """The minimal baseline's one table of its own (its repeat counts), in the bench database."""
    from django.db import connection

    from bench.minimal.views import CREATE_TABLE

    with connection.cursor() as cursor:
        cursor.execute(CREATE_TABLE)


@dataclass
class CeleryWorker:
    """The kill switch's own Celery worker and the webhooks' one, as in production (`make
    worker` starts them beside the bulk one, which the benchmark has no work for)."""

    POOLS = ("killswitch", "webhooks")  # each consumes the queue of its name
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self) -> CeleryWorker:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        celery = str(Path(sys.executable).with_name("celery"))
        for pool in self.POOLS:
            log = (LOG_DIR / f"celery-{pool}.log").open("wb")
            self.processes.append(subprocess.Popen(
                [celery, "-A", "governance", "worker", "-Q", pool, "-n", f"{pool}@%h",
                 "--concurrency", "1", "-l", "warning", "--without-gossip", "--without-mingle"],
                cwd=ROOT, env=base_env(), start_new_session=True, stdout=log,
                stderr=subprocess.STDOUT,
            ))
        time.sleep(3)  # no readiness probe without a result backend; startup takes ~2 s
        if any(process.poll() is not None for process in self.processes):
            self.stop()
            raise RuntimeError("a Celery worker exited at once; see " + str(LOG_DIR))
        return self

    def stop(self) -> None:
        for process in self.processes:
            stop_group(process)


def machine_description() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu_model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_kib = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    except OSError:
        pass
    pg_version = ""
    try:
        import psycopg

        with psycopg.connect(PG_ADMIN_URL, connect_timeout=5) as conn:
            row = conn.execute("SHOW server_version").fetchone()
            pg_version = row[0] if row else ""
    except Exception:  # a description, never a reason to fail the benchmark
        pg_version = "unknown"
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model,
        "memory_gib": round(mem_kib / 1024 / 1024, 1),
        "python": sys.version.split()[0],
        "postgresql": pg_version,
        "load_average_at_start": os.getloadavg()[0],
    }


@dataclass
class RawServer(Server):
    """A bench-only application without any framework (bench/minimal/wsgi_raw.py or
    asgi_raw.py) under granian, the same worker count and flags as `manage.py serve` but the
    interface: WSGI with ``threads`` blocking threads per worker, or ASGI (issue 33)."""

    interface: str = "wsgi"

    def command(self) -> list[str]:
        from runs.management.commands.serve import granian_argv

        granian = str(Path(sys.executable).with_name("granian"))
        module = "bench.minimal.wsgi_raw:application" if self.interface == "wsgi" \
            else "bench.minimal.asgi_raw:application"
        argv = granian_argv(granian, module, host="127.0.0.1", port=self.port,
                            workers=self.workers, max_connections=2048)
        argv[argv.index("--interface") + 1] = self.interface
        if self.interface == "wsgi":
            argv[-1:-1] = ["--blocking-threads", str(self.threads)]
        return argv

    def start(self) -> Server:
        self.extra_env = {**self.extra_env, "WEB_THREADS": str(self.threads)}
        return super().start()
