"""Security headers and deploy checks (throttling: tests/test_throttle.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.django_db


def test_every_page_carries_a_csp_without_inline_scripts(client):
    csp = client.get("/healthz")["Content-Security-Policy"]
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


def test_production_refuses_to_start_without_a_secret_key():
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "DATABASE_URL": "postgres://postgres@127.0.0.1:5432/governance", "DEBUG": "false"}
    result = subprocess.run([sys.executable, "manage.py", "check"], cwd=ROOT, env=env,
                            capture_output=True, text=True)
    assert result.returncode != 0
    assert "SECRET_KEY" in result.stderr
