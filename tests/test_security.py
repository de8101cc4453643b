"""Security headers and deploy checks (throttling: tests/test_throttle.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.django_db


def test_every_page_carries_a_csp_without_inline_scripts(client):
    # A page (the probes, /healthz and /readyz, answer a load balancer before the chain:
    # governance/middleware.py ProbeMiddleware).
    csp = client.get("/accounts/login/")["Content-Security-Policy"]
    script_src = next(p for p in csp.split(";") if p.strip().startswith("script-src"))
    assert "'unsafe-inline'" not in script_src and "'unsafe-eval'" not in script_src
    assert "frame-ancestors 'none'" in csp


def test_check_deploy_is_clean_with_production_settings():
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "DATABASE_URL": "postgres://postgres@127.0.0.1:5432/governance",
        "SECRET_KEY": "a-long-production-secret-key-" + "x" * 40,
        "ALLOWED_HOSTS": "governance.example.com",
        "SECURE_SSL_REDIRECT": "true",
        "SECURE_COOKIES": "true",
        "DEBUG": "false",
    }
    result = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("debug", ["false", "true"])
def test_production_refuses_to_start_without_a_secret_key(debug):
    """Production is PostgreSQL: there is no installation file to keep a key in, and every
    server of a deployment must share one; DEBUG does not change that."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "DATABASE_URL": "postgres://postgres@127.0.0.1:5432/governance", "DEBUG": debug}
    for command in (["check"], ["serve", "--port", "1"]):
        result = subprocess.run([sys.executable, "manage.py", *command], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode != 0
        # One line naming the setting, not a traceback (found by a newcomer).
        assert result.stderr.startswith("manage.py: SECRET_KEY must be set"), result.stderr
        assert result.stderr.count("\n") == 1, result.stderr


# --- The embedded default's secret key ------------------------------------------------------

def embedded(tmp_path, *args: str, secret: str | None = None) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}"}
    if secret is not None:
        env["SECRET_KEY"] = secret
    return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


PRINT_KEY = ["shell", "-v", "0", "-c",
             "from django.conf import settings; print(settings.SECRET_KEY)"]


def test_the_embedded_default_makes_its_own_key_once_beside_the_database(tmp_path):
    first = embedded(tmp_path, *PRINT_KEY)
    assert first.returncode == 0, first.stderr
    key = first.stdout.strip()
    assert len(key) >= 50 and "insecure" not in key
    stored = tmp_path / "db.sqlite3.secret-key"
    assert stored.read_text().strip() == key
    assert embedded(tmp_path, *PRINT_KEY).stdout.strip() == key  # kept
    other = tmp_path / "elsewhere"
    other.mkdir()
    assert embedded(other, *PRINT_KEY).stdout.strip() != key  # per installation


def test_processes_starting_together_agree_on_one_key(tmp_path):
    """granian starts its workers at once: all of them must sign with the key that won."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}"}
    code = ("import django, os; os.environ.setdefault('DJANGO_SETTINGS_MODULE', "
            "'governance.settings'); django.setup(); from django.conf import settings; "
            "print(settings.SECRET_KEY)")
    started = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, text=True) for _ in range(6)]
    keys = {p.communicate(timeout=60)[0].strip() for p in started}
    assert len(keys) == 1 and len(keys.pop()) >= 50
    assert [p.name for p in tmp_path.iterdir() if "secret" in p.name] == ["db.sqlite3.secret-key"]


def test_the_key_file_is_ignored_by_git():
    for path in ("db.sqlite3.secret-key", "data/other.db.secret-key"):
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0


def test_check_deploy_says_when_the_embedded_key_is_in_use(tmp_path):
    without = embedded(tmp_path, "check", "--deploy")
    assert "governance.W001" in without.stderr + without.stdout
    assert "SECRET_KEY is not set" in without.stderr + without.stdout
    configured = embedded(tmp_path, "check", "--deploy", secret="s" * 60 + "-configured-key")
    assert "governance.W001" not in configured.stderr + configured.stdout
