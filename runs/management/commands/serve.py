from __future__ import annotations

import contextlib
import errno
import os
import resource
import shutil
import socket
import sys
import tempfile
from typing import Any

from django.conf import settings
from django.core.checks import Tags
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.db import DEFAULT_DB_ALIAS


class Command(BaseCommand):
    help = (
        "Run the production web server: granian's ASGI interface, several worker processes, "
        "each with an API thread pool and a dashboard thread pool apart. See docs/serving.md."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
        parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
        parser.add_argument("--workers", type=int, default=int(os.environ.get("WEB_WORKERS", "2")))
        parser.add_argument(
            "--threads", type=int, default=int(os.environ.get("WEB_THREADS", "4")),
            help="API threads per worker: /api/ requests (checks) in flight at once",
        )
        parser.add_argument(
            "--dashboard-threads", type=int,
            default=int(os.environ.get("WEB_DASHBOARD_THREADS", "4")),
            help="dashboard threads per worker: page requests in flight at once (open live "
                 "streams hold none)",
        )
        parser.add_argument(
            "--max-connections", type=int,
            default=int(os.environ.get("WEB_MAX_CONNECTIONS", "2048")),
            help="connections one worker serves at once, idle and slow ones included",
        )

    def handle(self, *args: Any, host: str, port: int, workers: int, threads: int,
               dashboard_threads: int, max_connections: int, **options: Any) -> None:
        granian = shutil.which("granian") or os.path.join(os.path.dirname(sys.executable),
                                                            "granian")
        if not os.path.exists(granian):
            raise CommandError("granian is not installed (pip install -e .)")
        host = listen_address(host, port)
        # The checks that need the database (an OIDC_ROLE_MAP naming a team that does not
        # exist, SPEC 17) stop this start too, not only `migrate` and `check --database`:
        # Django runs a command's own checks without the database.
        self.check(tags=[Tags.database], databases=[DEFAULT_DB_ALIAS])
        # The dashboard's CSS/JS (and htmx from django-htmx) are served by granian itself from
        # STATIC_ROOT, so they cost no Python thread; collecting first keeps them current.
        call_command("collectstatic", interactive=False, verbosity=0)
        if min(threads, dashboard_threads, max_connections) < 1:
            raise CommandError("--threads, --dashboard-threads and --max-connections must be "
                               "at least 1")
        # The workers read their pool sizes from the environment (governance/settings.py).
        os.environ["WEB_THREADS"] = str(threads)
        os.environ["WEB_DASHBOARD_THREADS"] = str(dashboard_threads)
        argv = granian_argv(granian, "governance.asgi:application", host=host, port=port,
                            workers=workers, max_connections=max_connections,
                            static=(settings.STATIC_URL, str(settings.STATIC_ROOT)))
        if os.environ.get("METRICS_TOKEN"):
            _prepare_metrics_dir()
        raise_open_files_limit()
        self.stdout.write(" ".join(argv[1:]))
        sys.stdout.flush()
        os.execv(granian, argv)


def listen_address(host: str, port: int) -> str:
    """The numeric address to listen on (granian takes no host name), once the port is known
    to be free there. granian listens with SO_REUSEPORT, so a second server started on a port
    another one listens on started without a word and the kernel split the connections
    between the two (an old deployment left running would answer part of the checks). A plain
    bind first, which any listener on the port refuses, makes that an error instead."""
    if not 1 <= port <= 65535:
        raise CommandError(f"--port must be from 1 to 65535, not {port}")
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise CommandError(f"--host {host!r} is not an address of this machine: "
                           f"{exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        # Connections of a previous server still in TIME_WAIT do not count as in use.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise CommandError(f"port {port} on {host} is in use (another server listens "
                                   "there): stop it or choose --port / PORT") from None
            raise CommandError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return str(address[0])


def raise_open_files_limit() -> None:
    """Lift the soft limit on open files to the hard one (granian's workers inherit it). Every
    connection is a descriptor: under a soft limit of 1024 (a common default) a thousand idle
    connections stopped a process from accepting any more, well below its --max-connections.
    The per-address cap (MAX_IDLE_CONNECTIONS_PER_ADDRESS) keeps one source from taking them
    all; the body deadline ends everyone's."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        # A kernel ceiling below the hard limit (fs.nr_open) leaves the soft one as it was.
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def granian_argv(granian: str, app: str, *, host: str, port: int, workers: int,
                 max_connections: int, static: tuple[str, str] | None = None) -> list[str]:
    """The granian command line of `serve`; the benchmark's minimal baseline is served by the
    same one (bench/stack.py), so that their ratios compare applications, not servers."""
    # Headers that never finish are dropped by granian itself (Python never sees them)
    # after the same deadline a body has (governance/asgi.py); so is a connection that sends
    # nothing, and a keep-alive one idle between requests. HTTP/1 only: under `--http auto`
    # granian first waits for a connection's first bytes to choose the protocol, with no
    # deadline at all, so a connection that sent nothing stayed open for good.
    header_ms = min(60_000, max(1, settings.REQUEST_BODY_SECONDS * 1000))
    argv = [granian, "--interface", "asgi", "--host", host, "--port", str(port),
            "--workers", str(workers), "--no-ws", "--respawn-failed-workers",
            "--http", "1", "--http1-header-read-timeout", str(header_ms),
            "--backlog", str(max(128, max_connections)),
            "--backpressure", str(max_connections),
            # A stop (deploy, restart) is not held up by open live streams: they resume.
            "--workers-kill-timeout", "5"]
    if static is not None:
        url, root = static
        argv += ["--static-path-route", "/" + url.strip("/"), "--static-path-mount", root]
    return [*argv, app]


def _prepare_metrics_dir() -> None:
    """Metrics on: the workers share prometheus_client's multiprocess files, in a directory
    emptied at each start so that counts never mix two servers' lives (runs/check/metrics.py)."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path:
        path = tempfile.mkdtemp(prefix="governance-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = path  # inherited by the exec'd granian
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(path):
        if name.endswith(".db"):
            os.remove(os.path.join(path, name))
