"""The multi-node test stack: real PgBouncer, web nodes, a worker node and HAProxy on this
machine (docs/deploy.md, "A test stack on one machine").

    python -m deploy.stack up      # starts everything, prints the addresses, waits for Ctrl-C
    python -m deploy.stack pgbouncer --port 6432   # PgBouncer alone, in transaction mode

The tests (tests/test_pgbouncer.py, tests/test_multinode.py) use the same classes.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_for_port(host: str, port: int, *, seconds: float, process: subprocess.Popen | None = None,
                  what: str = "") -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{what or 'process'} exited with {process.returncode}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what or 'process'} did not listen on {host}:{port} in {seconds} s")


class PgBouncer:
    """PgBouncer (Debian's package) in transaction mode in front of the PostgreSQL of
    `database_url`, on a port of its own, with its configuration in a temporary directory
    (deploy/pgbouncer.ini filled in). PgBouncer refuses to run as root: as root it runs as
    `nobody`."""

    def __init__(self, database_url: str, *, listen_addr: str = "127.0.0.1",
                 port: int | None = None, pool_size: int = 20) -> None:
        self.database_url = database_url
        url = urlsplit(database_url)
        self.pg_host = url.hostname or "127.0.0.1"
        self.pg_port = url.port or 5432
        self.user = url.username or "postgres"
        self.password = url.password or ""
        self.listen_addr = listen_addr
        self.port = port or free_port(listen_addr)
        self.pool_size = pool_size
        self.dir: Path | None = None
        self.process: subprocess.Popen[bytes] | None = None

    @staticmethod
    def available() -> str | None:
        """Why PgBouncer cannot run here, or None."""
        if shutil.which("pgbouncer"):
            return None
        return "pgbouncer is not installed (apt-get install pgbouncer)"

    @property
    def url(self) -> str:
        """`database_url` with PgBouncer's address instead of PostgreSQL's."""
        url = urlsplit(self.database_url)
        auth = self.user + (f":{self.password}" if self.password else "")
        return urlunsplit(url._replace(netloc=f"{auth}@{self.listen_addr}:{self.port}"))

    def config(self) -> str:
        assert self.dir is not None
        # The password file PgBouncer checks clients against: plain text (trust when none).
        (self.dir / "users.txt").write_text(f'"{self.user}" "{self.password}"\n')
        return (HERE / "pgbouncer.ini").read_text().format(
            pg_host=self.pg_host, pg_port=self.pg_port, listen_addr=self.listen_addr,
            listen_port=self.port, auth_type="plain" if self.password else "trust",
            auth_file=self.dir / "users.txt", pool_size=self.pool_size,
            pidfile=self.dir / "pgbouncer.pid", logfile=self.dir / "pgbouncer.log")

    def start(self) -> PgBouncer:
        self.dir = Path(tempfile.mkdtemp(prefix="pgbouncer-"))
        ini = self.dir / "pgbouncer.ini"
        ini.write_text(self.config())
        command = ["pgbouncer", str(ini)]
        if os.geteuid() == 0:
            nobody = pwd.getpwnam("nobody")
            for path in [self.dir, *self.dir.iterdir()]:
                os.chown(path, nobody.pw_uid, nobody.pw_gid)
            command = ["pgbouncer", "-u", "nobody", str(ini)]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for_port(self.listen_addr, self.port, seconds=10, process=self.process,
                          what=f"pgbouncer ({self.log_tail()})")
        except RuntimeError:
            self.stop()
            raise
        return self

    def log_tail(self, size: int = 3000) -> str:
        if self.dir is None or not (self.dir / "pgbouncer.log").exists():
            return ""
        return (self.dir / "pgbouncer.log").read_text(errors="replace")[-size:]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # PgBouncer's immediate shutdown
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self) -> PgBouncer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
