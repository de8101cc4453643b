"""Real processes for end-to-end kill-switch tests: a Celery worker on the test database and
Redis, and a local webhook receiver that checks signatures.

The worker is the production command (``celery -A governance worker``) in its own process
group, so a test can SIGKILL all of it at once, as a crashed machine would.
"""

from __future__ import annotations

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


@dataclass
class Worker:
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole worker (main process and pool children): no ack, no cleanup."""
        if self.alive():
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self, timeout: float = 15) -> None:
        """Warm shutdown: the task at hand finishes, reserved messages go back to Redis."""
        if self.alive():
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()


def start_worker(*, visibility_timeout: int = 5, env: dict[str, str] | None = None,
                 ready_timeout: float = 30) -> Worker:
    """Start ``celery -A governance worker -Q killswitch,default --concurrency 1 -P prefork``
    on the test database and the test Redis; returns once it is ready to consume."""
    log = Path(tempfile.mkstemp(prefix="celery-worker-", suffix=".log")[1])
    worker_env = env or server_env(CELERY_VISIBILITY_TIMEOUT=str(visibility_timeout),
                                   LOG_LEVEL="INFO")
    process = subprocess.Popen(
        [str(CELERY), "-A", "governance", "worker", "-Q", "killswitch,default",
         "--concurrency", "1", "-P", "prefork", "-l", "info", "--without-gossip",
         "--without-mingle", "--without-heartbeat", "-n", f"test-{uuid.uuid4().hex[:8]}@%h",
         "--logfile", str(log)],
        cwd=ROOT, env=worker_env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )
    worker = Worker(process=process, log_path=log)
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if not worker.alive():
            raise RuntimeError(f"celery worker exited with {process.returncode}:\n{worker.log()}")
        if " ready." in worker.log():
            return worker
        time.sleep(0.1)
    worker.kill()
    raise RuntimeError(f"celery worker not ready in {ready_timeout} s:\n{worker.log()}")


def purge_broker() -> None:
    """Drop queued and unacked messages left by an earlier test (their ids mean nothing now)."""
    from runs.live.events import redis_client

    client = redis_client()
    if client is not None:
        client.delete("killswitch", "default", "unacked", "unacked_index", "unacked_mutex")


@pytest.fixture(name="workers")
def workers_fixture(transactional_db: Any) -> Iterator[list[Worker]]:
    """Import into a test module to use: the workers a test starts (``new_worker``) are
    stopped before its data is flushed, and the broker is left empty."""
    purge_broker()
    started: list[Worker] = []
    yield started
    for worker in started:
        worker.stop()
        worker.log_path.unlink(missing_ok=True)
    purge_broker()


def new_worker(workers: list[Worker], *, visibility_timeout: int = 5) -> Worker:
    worker = start_worker(visibility_timeout=visibility_timeout)
    workers.append(worker)
    return worker


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

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

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

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
