"""Helpers for fault tests (tests/test_faults.py): throwaway PostgreSQL and Redis instances
that a test may stop and kill at will, management commands against them, and a load of
agents that records every answer with its timing.

Nothing here touches the machine's shared PostgreSQL or Redis: other suites use them.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import ROOT, free_port


def _pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


PG_BIN = _pg_bin()
HAS_PG_BINARIES = PG_BIN is not None and shutil.which("runuser") is not None
HAS_REDIS_SERVER = shutil.which("redis-server") is not None


def as_postgres(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """PostgreSQL refuses to run as root: its tools run as the `postgres` user."""
    return subprocess.run(["runuser", "-u", "postgres", "--", *argv], capture_output=True,
                          text=True, timeout=timeout, check=True)


@dataclass
class ThrowawayPostgres:
    """A PostgreSQL cluster of its own in a temporary directory, on a free port."""

    root: Path
    port: int

    @property
    def datadir(self) -> Path:
        return self.root / "data"

    def url(self, database: str = "governance_faults") -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{database}"

    @classmethod
    def create(cls) -> ThrowawayPostgres:
        assert PG_BIN is not None
        root = Path(tempfile.mkdtemp(prefix="governance-faults-pg-"))
        shutil.chown(root, "postgres", "postgres")
        pg = cls(root=root, port=free_port())
        # --no-sync and the settings in start(): a test cluster, durability is not its job
        # (immediate shutdown is not an OS crash: committed WAL survives it anyway).
        as_postgres(str(PG_BIN / "initdb"), "-D", str(pg.datadir), "-U", "postgres",
                    "-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync")
        return pg

    def start(self) -> None:
        assert PG_BIN is not None
        options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 "
                   "-c fsync=off -c full_page_writes=off -c max_connections=60 "
                   "-c shared_buffers=16MB")
        as_postgres(str(PG_BIN / "pg_ctl"), "start", "-w", "-t", "60", "-D", str(self.datadir),
                    "-l", str(self.root / "server.log"), "-o", options)

    def stop(self, mode: str = "immediate") -> None:
        assert PG_BIN is not None
        as_postgres(str(PG_BIN / "pg_ctl"), "stop", "-w", "-t", "60", "-m", mode,
                    "-D", str(self.datadir))

    def running(self) -> bool:
        assert PG_BIN is not None
        result = subprocess.run(["runuser", "-u", "postgres", "--", str(PG_BIN / "pg_ctl"),
                                 "status", "-D", str(self.datadir)], capture_output=True)
        return result.returncode == 0

    def create_database(self, name: str = "governance_faults") -> None:
        import psycopg

        with psycopg.connect(self.url("postgres"), autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')

    def query(self, sql: str, params: list[Any] | None = None) -> list[tuple[Any, ...]]:
        import psycopg

        with psycopg.connect(self.url(), connect_timeout=5) as conn:
            return conn.execute(sql, params).fetchall()

    def destroy(self) -> None:
        with contextlib.suppress(Exception):
            if self.running():
                self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def throwaway_postgres() -> Iterator[ThrowawayPostgres]:
    pg = ThrowawayPostgres.create()
    try:
        pg.start()
        pg.create_database()
        yield pg
    finally:
        pg.destroy()


@dataclass
class ThrowawayRedis:
    """A redis-server of its own on a free port, without persistence."""

    root: Path
    port: int
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.root)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        import redis

        client = redis.Redis(port=self.port, socket_timeout=1, socket_connect_timeout=1)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError):
                if client.ping():
                    return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def freeze(self) -> None:
        """SIGSTOP: connections are still accepted by the kernel, nothing is answered."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: no goodbye to its clients, like a crash."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a frozen process dies only once thawed
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)


@contextlib.contextmanager
def throwaway_redis() -> Iterator[ThrowawayRedis]:
    redis_server = ThrowawayRedis(root=Path(tempfile.mkdtemp(prefix="governance-faults-redis-")),
                                  port=free_port())
    try:
        redis_server.start()
        yield redis_server
    finally:
        redis_server.kill()
        shutil.rmtree(redis_server.root, ignore_errors=True)


def manage(*args: str, env: dict[str, str], timeout: float = 180) -> str:
    """`manage.py ...` in a subprocess (its own settings, e.g. another DATABASE_URL)."""
    result = subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=timeout, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result.stdout


LOOSE_POLICY = """\
teams:
  - slug: {slug}
    policies:
      - name: default
        step_limits: {{max_steps: 10000, max_repeat_action: 1000, no_progress_window: 1000}}
        budgets: {{max_seconds: null, max_usd: null}}
"""


def seed_team(env: dict[str, str], slug: str, tmp: Path) -> str:
    """A team whose runs only stop when told, and a key for it, through the commands."""
    document = tmp / f"{slug}.yaml"
    document.write_text(LOOSE_POLICY.format(slug=slug), encoding="utf-8")
    manage("apply_policies", str(document), env=env)
    return manage("create_agent_key", "--team", slug, "--name", "faults", env=env
                  ).strip().splitlines()[-1]


def worker_pids(server_pid: int) -> list[int]:
    """The granian worker processes: the children of the server's main process."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(server_pid)], capture_output=True,
                         text=True, check=False).stdout
    return sorted(int(pid) for pid in out.split())


@dataclass
class Answer:
    run_id: str
    sent: float  # time.monotonic() when the request started
    took: float
    status: int | None  # None: the connection failed (no HTTP answer)
    body: dict[str, Any] | None
    error: str | None = None

    @property
    def decision(self) -> str | None:
        return (self.body or {}).get("decision")

    @property
    def error_code(self) -> str | None:
        return ((self.body or {}).get("error") or {}).get("code")


@dataclass
class Load:
    """Agents checking runs from threads, each its own connection, until stopped.

    Every check has new args, so under a loose policy every answer is an allow while the
    stores are up. A short pause between checks leaves CPU to the server on a small machine.
    """

    url: str
    token: str
    run_ids: list[str]
    threads_per_run: int = 2
    pause_s: float = 0.02
    timeout_s: float = 15
    answers: list[Answer] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _agent(self, run_id: str, n: int) -> None:
        headers = {"Authorization": f"Bearer {self.token}"}
        with httpx.Client(base_url=self.url, headers=headers, timeout=self.timeout_s) as http:
            i = 0
            while not self._stop.is_set():
                i += 1
                body = {"action": {"name": "fetch.page", "args": {"agent": n, "i": i}}}
                sent = time.monotonic()
                try:
                    response = http.post(f"/api/v1/runs/{run_id}/check", json=body)
                    try:
                        parsed = response.json()
                    except ValueError:
                        parsed = None
                    answer = Answer(run_id, sent, time.monotonic() - sent, response.status_code,
                                    parsed)
                except httpx.HTTPError as exc:
                    answer = Answer(run_id, sent, time.monotonic() - sent, None, None,
                                    f"{type(exc).__name__}: {exc}")
                with self._lock:
                    self.answers.append(answer)
                time.sleep(self.pause_s)

    def start(self) -> Load:
        for n, run_id in enumerate(self.run_ids * self.threads_per_run):
            thread = threading.Thread(target=self._agent, args=(run_id, n), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> list[Answer]:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.timeout_s + 5)
        return self.answers

    def since(self, moment: float) -> list[Answer]:
        with self._lock:
            return [a for a in self.answers if a.sent >= moment]

    def wait_for(self, predicate: Callable[[list[Answer]], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                snapshot = list(self.answers)
            if predicate(snapshot):
                return True
            time.sleep(0.05)
        return False


def start_runs(url: str, token: str, count: int) -> list[str]:
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"},
                      timeout=30) as http:
        runs = [http.post("/api/v1/runs", json={"agent": "fault-bot"}) for _ in range(count)]
    assert all(r.status_code == 201 for r in runs), [r.text for r in runs]
    return [r.json()["run_id"] for r in runs]


def env_without(env: dict[str, str], *names: str) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in names}


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@dataclass
class HungListener:
    """A TCP port that accepts connections and never answers: a Redis that hangs (a frozen
    process behind a live kernel, a proxy whose backend is gone). The connections it took
    stay open until ``close``."""

    sock: socket.socket
    held: list[socket.socket] = field(default_factory=list)
    _closed: threading.Event = field(default_factory=threading.Event)

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self._closed.set()
        self.sock.close()
        for conn in self.held:
            with contextlib.suppress(OSError):
                conn.close()


@contextlib.contextmanager
def hung_listener() -> Iterator[HungListener]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(512)
    listener = HungListener(sock=sock)
    threading.Thread(target=listener._accept, daemon=True).start()
    try:
        yield listener
    finally:
        listener.close()


def refused_port() -> int:
    """A loopback port nothing listens on (connections are refused at once)."""
    return free_port()
