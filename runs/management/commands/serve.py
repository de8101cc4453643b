from __future__ import annotations

import os
import shutil
import sys
import tempfile
from typing import Any

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError


class Command(BaseCommand):
    help = (
        "Run the production web server: granian, WSGI interface, several worker processes. "
        "See docs/serving.md for why WSGI and how the live streams are served."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
        parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
        parser.add_argument("--workers", type=int, default=int(os.environ.get("WEB_WORKERS", "2")))
        parser.add_argument(
            "--threads", type=int, default=int(os.environ.get("WEB_THREADS", "16")),
            help="blocking threads per worker: requests in flight, live streams included",
        )
        parser.add_argument("--interface", choices=["wsgi", "asgi"], default="wsgi")

    def handle(self, *args: Any, host: str, port: int, workers: int, threads: int,
               interface: str, **options: Any) -> None:
        granian = shutil.which("granian") or os.path.join(os.path.dirname(sys.executable),
                                                            "granian")
        if not os.path.exists(granian):
            raise CommandError("granian is not installed (pip install -e .)")
        target = f"governance.{interface}:application"
        # The dashboard's CSS/JS (and htmx from django-htmx) are served by granian itself from
        # STATIC_ROOT, so they cost no Python thread; collecting first keeps them current.
        call_command("collectstatic", interactive=False, verbosity=0)
        argv = [granian, "--interface", interface, "--host", host, "--port", str(port),
                "--workers", str(workers), "--no-ws", "--respawn-failed-workers",
                "--static-path-route", "/" + settings.STATIC_URL.strip("/"),
                "--static-path-mount", str(settings.STATIC_ROOT)]
        if interface == "wsgi":
            argv += ["--blocking-threads", str(threads)]
        argv.append(target)
        if os.environ.get("METRICS_TOKEN"):
            _prepare_metrics_dir()
        self.stdout.write(" ".join(argv[1:]))
        sys.stdout.flush()
        os.execv(granian, argv)


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
