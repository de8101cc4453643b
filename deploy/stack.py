"""The multi-node test stack: real PgBouncer, web nodes, a worker node and HAProxy on this
machine (docs/deploy.md, "A test stack on one machine").

    python -m deploy.stack up      # starts everything, prints the addresses, waits for Ctrl-C
    python -m deploy.stack pgbouncer --port 6432   # PgBouncer alone, in transaction mode

The tests (tests/test_pgbouncer.py, tests/test_multinode.py) use the same classes.
"""

from __future__ import annotations

import argparse
import os
import pwd
import shutil
import signal
import socket
import string
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx

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
        self.listen_addr = listen_addr  # one address, or several separated by commas
        self.host = listen_addr.split(",")[0]
        self.port = port or free_port(self.host)
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
        return urlunsplit(url._replace(netloc=f"{auth}@{self.host}:{self.port}"))

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
            wait_for_port(self.host, self.port, seconds=10, process=self.process,
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


# --- The multi-node stack ----------------------------------------------------------------------

@dataclass
class Node:
    """A host of the stack: its name, its address, the address it reaches the shared services
    at (PgBouncer, Redis), and, with namespaces, its network namespace and veth pair."""

    name: str
    address: str
    services: str
    netns: str | None = None
    veth: str | None = None
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    log: Path | None = None

    def command(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv] if self.netns else argv

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Every process of the host, by process group (each was started in its own)."""
        for process in self.processes:
            if process.poll() is None:
                with suppress(ProcessLookupError):
                    os.killpg(process.pid, sig)
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        self.processes = []


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be made here (not root, no `ip`, no permission), or None."""
    if os.geteuid() != 0:
        return "not root"
    if not shutil.which("ip"):
        return "no ip command (iproute2)"
    name = f"gov-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return made.stderr.strip() or "ip netns add failed"
    subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    return None


def _free_octet() -> int:
    """A second octet b such that no address of this host is in 10.b.0.0/16 (another stack's
    links, or a real network)."""
    shown = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    taken = {int(part.split(".")[1]) for part in shown.split() if part.startswith("10.")
             and part.count(".") == 3 and part.split(".")[1].isdigit()}
    start = os.getpid() % 150
    for step in range(150):
        octet = 100 + (start + step) % 150
        if octet not in taken:
            return octet
    raise RuntimeError("no free 10.b.0.0/16 for the stack's links")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Stack:
    """Three web nodes (`manage.py serve`) and one worker node (the three Celery pools of the
    Makefile's `worker`, and beat) as separate hosts: network namespaces, each joined to this
    host by a veth pair, or, where namespaces cannot be made, loopback addresses 127.0.0.x
    (said on stderr). HAProxy in front of the web nodes (health checks on /readyz, TLS with a
    self-signed certificate), PgBouncer in transaction mode between the nodes and PostgreSQL,
    one Redis of its own. Everything it made is removed by `stop`."""

    def __init__(self, database_url: str, *, web_nodes: int = 3, threads: int = 4,
                 env: dict[str, str] | None = None, namespaces: bool | None = None) -> None:
        self.database_url = database_url
        self.web_count = web_nodes
        self.threads = threads
        self.extra_env = env or {}
        self.tag = f"{os.getpid() % 10000:04d}"
        self.dir = Path(tempfile.mkdtemp(prefix="gov-stack-"))
        why = netns_unavailable() if namespaces is not False else "not asked for"
        self.namespaces = why is None
        self.why_loopback = why
        # 10.<b>.<node>.0/30 per node: b from the process id, so two stacks side by side differ.
        self.octet = _free_octet() if self.namespaces else 0
        self.nodes: list[Node] = []
        self.web: list[Node] = []
        self.worker: Node | None = None
        self.pgbouncer: PgBouncer | None = None
        self.redis: subprocess.Popen[bytes] | None = None
        self.haproxy: subprocess.Popen[bytes] | None = None
        self._pending: dict[str, subprocess.Popen[bytes]] = {}
        self.redis_port = free_port()
        self.http_port = free_port()
        self.https_port = free_port()
        self.web_port = 8000 if self.namespaces else free_port()
        self.secret_key = os.environ.get("SECRET_KEY") or "stack-only-secret-key-not-for-production"

    # -- addresses --------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def https_url(self) -> str:
        return f"https://127.0.0.1:{self.https_port}"

    def node_url(self, node: Node) -> str:
        return f"http://{node.address}:{self.web_port}"

    def _make_nodes(self) -> None:
        names = [f"web{i + 1}" for i in range(self.web_count)] + ["worker"]
        for index, name in enumerate(names, start=1):
            if not self.namespaces:
                node = Node(name=name, address=f"127.0.0.{10 + index}", services="127.0.0.1")
            else:
                host, inside = (f"10.{self.octet}.{index}.1", f"10.{self.octet}.{index}.2")
                netns, veth = f"gov-{self.tag}-{name}", f"gv{self.tag}n{index}"
                _ip("netns", "add", netns)
                node = Node(name=name, address=inside, services=host, netns=netns, veth=veth)
                self.nodes.append(node)  # removed by stop() from now on
                _ip("link", "add", veth, "type", "veth", "peer", "name", veth + "p")
                _ip("link", "set", veth + "p", "netns", netns)
                _ip("addr", "add", f"{host}/30", "dev", veth)
                _ip("link", "set", veth, "up")
                _ip("-n", netns, "addr", "add", f"{inside}/30", "dev", veth + "p")
                _ip("-n", netns, "link", "set", veth + "p", "up")
                _ip("-n", netns, "link", "set", "lo", "up")
            node.log = self.dir / f"{name}.log"
            if node not in self.nodes:
                self.nodes.append(node)
            if name.startswith("web"):
                self.web.append(node)
            else:
                self.worker = node

    # -- the shared services ----------------------------------------------------------------
    def _service_addresses(self) -> list[str]:
        return ["127.0.0.1", *sorted({node.services for node in self.nodes} - {"127.0.0.1"})]

    def _start_redis(self) -> None:
        binds = self._service_addresses()
        self.redis = subprocess.Popen(
            ["redis-server", "--bind", *binds, "--port", str(self.redis_port), "--save", "",
             "--appendonly", "no", "--protected-mode", "no", "--dir", str(self.dir)],
            stdout=open(self.dir / "redis.log", "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
            start_new_session=True)
        wait_for_port("127.0.0.1", self.redis_port, seconds=10, process=self.redis, what="redis")

    def _start_pgbouncer(self) -> None:
        self.pgbouncer = PgBouncer(self.database_url, pool_size=8,
                                   listen_addr=",".join(self._service_addresses()))
        self.pgbouncer.start()

    def node_env(self, node: Node) -> dict[str, str]:
        assert self.pgbouncer is not None
        url = urlsplit(self.pgbouncer.url)
        database = urlunsplit(url._replace(
            netloc=url.netloc.rsplit("@", 1)[0] + f"@{node.services}:{self.pgbouncer.port}"))
        return {
            **os.environ,
            "DATABASE_URL": database, "DATABASE_POOLER": "transaction",
            "REDIS_URL": f"redis://{node.services}:{self.redis_port}/0",
            "SECRET_KEY": self.secret_key, "DEBUG": "false", "PYTHONUNBUFFERED": "1",
            "ALLOWED_HOSTS": f"localhost,127.0.0.1,{node.address}",
            # HAProxy's address as the web node sees it: its X-Forwarded-For is believed.
            "TRUSTED_PROXIES": f"{node.services}/32",
            # Each host its own disk: `serve` collects the static files at start.
            "STATIC_ROOT": str(self.dir / f"static-{node.name}"),
            **self.extra_env,
        }

    def _spawn(self, node: Node, argv: list[str]) -> subprocess.Popen[bytes]:
        assert node.log is not None
        process = subprocess.Popen(
            node.command(argv), cwd=ROOT, env=self.node_env(node), start_new_session=True,
            stdout=open(node.log, "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115
        node.processes.append(process)
        return process

    # -- the nodes --------------------------------------------------------------------------
    def start_web(self, node: Node) -> None:
        """Start a web node (again) and wait until it is ready."""
        self._spawn_web(node)
        self._wait_web(node)

    def start_worker(self) -> None:
        """The Makefile's `worker`: one Celery worker per pool, one process each; and beat."""
        node = self.worker
        assert node is not None
        celery = str(Path(sys.executable).with_name("celery"))
        for queues, name in (("killswitch", "killswitch"), ("webhooks", "webhooks"),
                             ("default,bulk", "bulk")):
            self._spawn(node, [celery, "-A", "governance", "worker", "-Q", queues,
                               "-n", f"{name}@{node.name}-{self.tag}", "--concurrency", "1",
                               "-l", "info"])
        # The one beat of the deployment: the sweeps that restart what an outage left behind.
        self._spawn(node, [celery, "-A", "governance", "beat", "-l", "info",
                           "--schedule", str(self.dir / "celerybeat-schedule")])

    def _start_haproxy(self) -> None:
        cert = self.dir / "proxy.pem"
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
             "-subj", "/CN=localhost", "-keyout", str(self.dir / "proxy.key"),
             "-out", str(self.dir / "proxy.crt")], check=True, capture_output=True)
        cert.write_bytes((self.dir / "proxy.crt").read_bytes()
                         + (self.dir / "proxy.key").read_bytes())
        servers = "\n".join(f"    server {node.name} {node.address}:{self.web_port}"
                            for node in self.web)
        config = self.dir / "haproxy.cfg"
        config.write_text(string.Template((HERE / "haproxy.cfg").read_text()).substitute(
            bind="127.0.0.1", http_port=self.http_port, https_port=self.https_port,
            cert=cert, servers=servers))
        self.haproxy = subprocess.Popen(
            ["haproxy", "-W", "-db", "-f", str(config)],
            stdout=open(self.dir / "haproxy.log", "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT, start_new_session=True)
        wait_for_port("127.0.0.1", self.http_port, seconds=10, process=self.haproxy,
                      what="haproxy")

    def start(self) -> Stack:
        if self.why_loopback:
            print(f"deploy.stack: no network namespaces ({self.why_loopback}); the nodes are "
                  f"loopback addresses 127.0.0.11 and up instead", file=sys.stderr)
        try:
            self._make_nodes()
            self._start_redis()
            self._start_pgbouncer()
            for node in self.web:
                self._spawn_web(node)
            self.start_worker()
            for node in self.web:
                self._wait_web(node)
            self._start_haproxy()
            self.wait_balanced()
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn_web(self, node: Node) -> None:
        self._pending[node.name] = self._spawn(node, [
            sys.executable, "manage.py", "serve", "--host", node.address,
            "--port", str(self.web_port), "--workers", "1", "--threads", str(self.threads)])

    def _wait_web(self, node: Node) -> None:
        process = self._pending.pop(node.name)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"{node.name} exited:\n{self.log_tail(node)}")
            try:
                if httpx.get(f"{self.node_url(node)}/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{node.name} not ready in 90 s:\n{self.log_tail(node)}")

    def wait_balanced(self, seconds: float = 20) -> None:
        """Until HAProxy has every web node up (its health checks passed)."""
        deadline = time.monotonic() + seconds
        seen: set[str] = set()
        while time.monotonic() < deadline:
            try:
                response = httpx.get(f"{self.url}/readyz", timeout=2)
                if response.status_code == 200:
                    seen.add(response.headers.get("x-served-by", ""))
            except httpx.HTTPError:
                pass
            if seen >= {node.name for node in self.web}:
                return
            time.sleep(0.1)
        raise RuntimeError(f"HAProxy served from {sorted(seen)} only in {seconds} s")

    def log_tail(self, node: Node, size: int = 3000) -> str:
        if node.log is None or not node.log.exists():
            return ""
        return node.log.read_text(errors="replace")[-size:]

    def stop(self) -> None:
        for node in self.nodes:
            node.kill(signal.SIGTERM)
        for process in (self.haproxy, self.redis):
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        if self.pgbouncer is not None:
            self.pgbouncer.stop()
        for node in self.nodes:
            if node.veth:
                subprocess.run(["ip", "link", "delete", node.veth], capture_output=True)
            if node.netns:
                subprocess.run(["ip", "netns", "delete", node.netns], capture_output=True)
        self.nodes = []
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.stack", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="the whole stack, until Ctrl-C")
    up.add_argument("--web-nodes", type=int, default=3)
    up.add_argument("--loopback", action="store_true",
                    help="loopback addresses even where namespaces could be made")
    bouncer = sub.add_parser("pgbouncer", help="PgBouncer alone, in transaction mode")
    bouncer.add_argument("--port", type=int, default=6432)
    args = parser.parse_args(argv)
    database_url = os.environ.get("DATABASE_URL", "")
    if not database_url.startswith("postgres"):
        parser.error("DATABASE_URL must name the PostgreSQL database (postgres://...)")
    if args.command == "pgbouncer":
        with PgBouncer(database_url, port=args.port) as pg:
            print(f"PgBouncer (transaction mode): DATABASE_URL={pg.url} "
                  f"DATABASE_POOLER=transaction", flush=True)
            _wait_for_interrupt()
        return 0
    with Stack(database_url, web_nodes=args.web_nodes,
               namespaces=False if args.loopback else None) as stack:
        print(f"HAProxy: {stack.url} and {stack.https_url} (self-signed)", flush=True)
        for node in stack.nodes:
            print(f"{node.name}: {node.address} ({node.netns or 'loopback'}), log {node.log}",
                  flush=True)
        _wait_for_interrupt()
    return 0


def _wait_for_interrupt() -> None:
    with suppress(KeyboardInterrupt):
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        while True:
            time.sleep(3600)


if __name__ == "__main__":
    raise SystemExit(main())
