"""The server as a new user gets it: `pip install .` alone into a fresh virtual environment
gives a server that starts, and the application serves its own static files (hashed,
compressed, cacheable) under any host, here uvicorn."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import venv
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from setuptools import find_packages

from tests.conftest import free_port

pytestmark = pytest.mark.stack_independent

ROOT = Path(__file__).resolve().parent.parent


def test_the_distribution_lists_every_package() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"])
    found = set(find_packages(str(ROOT), include=["governance*", "policies*", "runs*",
                                                  "backtests*", "operator_api*"]))
    found |= set(find_packages(str(ROOT / "governance_client" / "src")))
    assert listed == found


def clean_env(**extra: str) -> dict[str, str]:
    """The machine's environment without this test run's settings and paths."""
    drop = {"DJANGO_SETTINGS_MODULE", "PYTHONPATH", "DATABASE_URL", "REDIS_URL", "VIRTUAL_ENV"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def wait_healthy(url: str, process: subprocess.Popen[bytes], seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the server exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"the server was not healthy within {seconds} s")


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def assets_of(html: str) -> dict[str, str]:
    """The stylesheet, htmx and icon a page links to."""
    css = re.search(r'<link rel="stylesheet" href="([^"]+)"', html)
    htmx = re.search(r'<script[^>]+src="([^"]*htmx[^"]*)"', html)
    icon = re.search(r'<link rel="icon" href="([^"]+)"', html)
    assert css and htmx and icon, html[:2000]
    return {"css": css.group(1), "htmx": htmx.group(1), "icon": icon.group(1)}


@pytest.fixture
def sources(tmp_path: Path) -> Path:
    """A copy of the sources, so that building leaves nothing in the work tree."""
    where = tmp_path / "src"
    ignore = shutil.ignore_patterns(".venv", ".git", "__pycache__", "*.sqlite3*", "staticfiles",
                                    "bench", "exports", "*.egg-info", "build", "screenshots*")
    shutil.copytree(ROOT, where, ignore=ignore)
    return where


@pytest.mark.slow
def test_pip_install_alone_gives_a_server_that_starts(sources: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "-q", str(sources)], check=True,
                   timeout=600, env=clean_env(), capture_output=True)
    data = tmp_path / "data"
    data.mkdir()
    # Run from an empty directory: nothing of the checkout can be imported by accident.
    env = clean_env(DATA_DIR=str(data))
    command = env_dir / "bin" / "agent-governance"
    subprocess.run([command, "migrate", "--noinput", "-v0"], cwd=data, env=env, check=True,
                   timeout=300)
    port = free_port()
    process = subprocess.Popen([command, "serve", "--port", str(port), "--workers", "1",
                                "--threads", "4"], cwd=data, env=env, start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process)
        login = httpx.get(f"{url}/accounts/login/", timeout=10)
        assert login.status_code == 200
        for asset in assets_of(login.text).values():
            assert httpx.get(url + asset, timeout=10).status_code == 200, asset
        start = httpx.post(f"{url}/api/v1/runs", json={"agent": "a"}, timeout=10)
        assert start.status_code == 401 and start.json()["error"]["code"] == "unauthorized"
    finally:
        stop(process)
    assert (data / "db.sqlite3").exists()


@pytest.fixture
def uvicorn_server(tmp_path: Path) -> Iterator[str]:
    env = clean_env(DATA_DIR=str(tmp_path), DATABASE_URL=f"sqlite:///{tmp_path / 'db.sqlite3'}",
                    STATIC_ROOT=str(tmp_path / "static"), PYTHONPATH=str(ROOT))
    manage = [sys.executable, str(ROOT / "manage.py")]
    subprocess.run([*manage, "migrate", "--noinput", "-v0"], env=env, check=True, timeout=300)
    subprocess.run([*manage, "collectstatic", "--noinput", "-v0"], env=env, check=True,
                   timeout=120)
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "governance.asgi:application", "--port", str(port),
         "--host", "127.0.0.1", "--log-level", "warning"],
        cwd=tmp_path, env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process)
        yield url
    finally:
        stop(process)


@pytest.mark.slow
def test_under_uvicorn_the_dashboard_has_its_css_and_htmx(uvicorn_server: str) -> None:
    page = httpx.get(f"{uvicorn_server}/accounts/login/", timeout=10)
    assert page.status_code == 200
    assets = assets_of(page.text)
    # Collected: hashed names, which browsers may keep for a year.
    assert re.search(r"/static/dashboard\.[0-9a-f]{12}\.css$", assets["css"]), assets
    assert re.search(r"/static/django_htmx/htmx-2\.min\.[0-9a-f]{12}\.js$", assets["htmx"])
    css = httpx.get(uvicorn_server + assets["css"], headers={"Accept-Encoding": "gzip"},
                    timeout=10)
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
    assert css.headers.get("content-encoding") == "gzip"
    assert "immutable" in css.headers["cache-control"]
    assert ".topbar" in css.text
    htmx = httpx.get(uvicorn_server + assets["htmx"], timeout=10)
    assert htmx.status_code == 200 and "javascript" in htmx.headers["content-type"]
    assert "htmx" in htmx.text
    icon = httpx.get(uvicorn_server + assets["icon"], timeout=10)
    assert icon.status_code == 200 and icon.headers["content-type"] == "image/svg+xml"
    # And for the pages that name no icon, the browser's default request finds it too.
    redirect = httpx.get(f"{uvicorn_server}/favicon.ico", timeout=10, follow_redirects=True)
    assert redirect.status_code == 200 and redirect.headers["content-type"] == "image/svg+xml"
