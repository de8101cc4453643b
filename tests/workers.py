"""Real processes for end-to-end kill-switch tests: the Celery workers on the test database
and Redis, and a local webhook receiver that checks signatures.

The workers are the production commands (``celery -A governance worker``), one per pool of
the Makefile's ``worker`` target (``POOLS``; tests/test_worker_pools.py checks that they
agree), each in a process group of its own, so a test can SIGKILL all of them (main processes
and pool children) at once, as a crashed machine would.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, server_env

CELERY = Path(sys.executable).parent / "celery"

# The Makefile's worker pools, name: queues. The kill switch's queue has a worker of its own,
# so backtests, other bulk work and webhook receivers can never hold the process its fan-out
# waits for; the webhooks have one of their own too.
POOLS: dict[str, str] = {"killswitch": "killswitch", "webhooks": "webhooks",
                         "bulk": "default,bulk"}
QUEUES = ("killswitch", "webhooks", "default", "bulk")


@dataclass
class Worker:
    """The workers of one ``make worker``: a process (and process group) per pool."""

    processes: list[subprocess.Popen[bytes]]
    log_paths: list[Path]

    def log(self) -> str:
        return "\n".join(path.read_text(errors="replace") for path in self.log_paths)

    def alive(self) -> bool:
        return any(process.poll() is None for process in self.processes)

    def _signal(self, signum: int) -> None:
        for process in self.processes:
            # ProcessLookupError: every process of that group has exited already.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signum)

    def kill(self) -> None:
        """SIGKILL every worker (main processes and pool children): no ack, no cleanup."""
        if self.alive():
            self._signal(signal.SIGKILL)
        for process in self.processes:
            process.wait()

    def stop(self, timeout: float = 15) -> None:
        """Warm shutdown: the tasks at hand finish, reserved messages go back to Redis."""
        if self.alive():
            self._signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            try:
                for process in self.processes:
                    process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()


def start_worker(*, visibility_timeout: int = 5, env: dict[str, str] | None = None,
                 ready_timeout: float = 30, pools: dict[str, str] | None = None,
                 concurrency: int = 1) -> Worker:
    """Start ``celery -A governance worker -Q <queues> -n <pool>@%h`` for each pool of the
    Makefile's (``POOLS``), ``--concurrency 1 -P prefork`` unless told, on the test database
    and the test Redis; returns once every one is ready to consume."""
    worker_env = env or server_env(CELERY_VISIBILITY_TIMEOUT=str(visibility_timeout),
                                   LOG_LEVEL="INFO")
    worker = Worker(processes=[], log_paths=[])
    try:
        for name, queues in (pools or POOLS).items():
            log = Path(tempfile.mkstemp(prefix=f"celery-{name}-", suffix=".log")[1])
            worker.log_paths.append(log)
            worker.processes.append(subprocess.Popen(
                [str(CELERY), "-A", "governance", "worker", "-Q", queues,
                 "-n", f"{name}-{uuid.uuid4().hex[:8]}@%h", "--concurrency", str(concurrency),
                 "-P", "prefork", "-l", "info", "--without-gossip", "--without-mingle",
                 "--without-heartbeat", "--logfile", str(log)],
                cwd=ROOT, env=worker_env, start_new_session=True,
                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            ))
        _wait_ready(worker, ready_timeout)
    except BaseException:
        worker.kill()  # none of them outlives a failed start (they would consume the queues)
        for path in worker.log_paths:
            path.unlink(missing_ok=True)
        raise
    return worker


def _wait_ready(worker: Worker, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for process, log in zip(worker.processes, worker.log_paths, strict=True):
            if process.poll() is not None:
                raise RuntimeError(f"celery worker exited with {process.returncode}:\n"
                                   f"{log.read_text(errors='replace')}")
        if all(" ready." in log.read_text(errors="replace") for log in worker.log_paths):
            return
        time.sleep(0.1)
    raise RuntimeError(f"celery workers not ready in {timeout} s:\n{worker.log()}")


def purge_broker() -> None:
    """Drop queued and unacked messages left by an earlier test (their ids mean nothing now)."""
    from runs.live.events import redis_client

    client = redis_client()
    if client is not None:
        # Each queue is a list per step of priority (governance/settings.py routes).
        lists = [f"{queue}\x06\x16{step}" for queue in QUEUES for step in (3, 6, 9)]
        client.delete(*QUEUES, *lists, "unacked", "unacked_index", "unacked_mutex")


@pytest.fixture(name="workers")
def workers_fixture(transactional_db: Any) -> Iterator[list[Worker]]:
    """Import into a test module to use: the workers a test starts (``new_worker``) are
    stopped before its data is flushed, and the broker is left empty."""
    purge_broker()
    started: list[Worker] = []
    yield started
    for worker in started:
        worker.stop()
        for path in worker.log_paths:
            path.unlink(missing_ok=True)
    purge_broker()


def new_worker(workers: list[Worker], *, visibility_timeout: int = 5,
               concurrency: int = 1) -> Worker:
    worker = start_worker(visibility_timeout=visibility_timeout, concurrency=concurrency)
    workers.append(worker)
    return worker


def terminate(proc: subprocess.Popen[Any], timeout: float = 10) -> None:
    """SIGTERM, and SIGKILL if it has not exited within ``timeout``; waited for either way."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_for(predicate: Any, *, timeout: float, interval: float = 0.1, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or predicate}")
        time.sleep(interval)


# --- Webhook receiver ------------------------------------------------------------------------

@dataclass
class Receiver:
    """A local webhook endpoint: ``/<team slug>`` checks the signature with that team's
    secret, counts valid and invalid deliveries, answers after ``delay`` seconds with
    ``status`` (or the next of ``statuses`` while any are left)."""

    secrets: dict[str, str]
    delay: float = 0.0
    status: int = 200
    statuses: list[int] = field(default_factory=list)
    valid: Counter[str] = field(default_factory=Counter)
    invalid: Counter[str] = field(default_factory=Counter)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    first_request: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    server: ThreadingHTTPServer | None = None
    host: str = "127.0.0.1"  # another address for senders on other hosts (tests/test_multinode.py)

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://{self.host}:{self.server.server_address[1]}"

    def start(self) -> Receiver:
        from runs.webhooks.delivery import verify

        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                slug = self.path.strip("/")
                ok = verify(receiver.secrets.get(slug, ""),
                            self.headers.get("X-Governance-Timestamp", ""), body,
                            self.headers.get("X-Governance-Signature", ""))
                with receiver.lock:
                    (receiver.valid if ok else receiver.invalid)[slug] += 1
                    receiver.bodies.append(json.loads(body))
                    status = receiver.statuses.pop(0) if receiver.statuses else receiver.status
                receiver.first_request.set()
                time.sleep(receiver.delay)
                try:
                    self.send_response(status if ok else 401)
                    self.end_headers()
                    self.wfile.write(b"ok")
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the sender died waiting (a worker killed on purpose)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((self.host, 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
