"""Security headers, deploy checks and throttling of bad credentials."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from django.test import Client

from governance.middleware import api_key_throttle, sign_in_throttle
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


def test_bad_api_keys_are_throttled_per_source(monkeypatch):
    monkeypatch.setattr(api_key_throttle, "limit", 3)
    bad = Client(HTTP_AUTHORIZATION="Bearer gov_000000000000_nope")
    codes = [bad.get("/api/v1/runs").status_code for _ in range(5)]
    assert codes == [401, 401, 401, 401, 429]
    refused = bad.get("/api/v1/runs")
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "rate_limited"
    assert int(refused["Retry-After"]) >= 1
    elsewhere = Client(REMOTE_ADDR="10.9.8.7", HTTP_AUTHORIZATION="Bearer gov_000000000000_nope")
    assert elsewhere.get("/api/v1/runs").status_code == 401


def test_failed_sign_ins_are_throttled_per_source(monkeypatch, users):
    from django.conf import settings
    from django.shortcuts import resolve_url

    monkeypatch.setattr(sign_in_throttle, "limit", 2)
    login = resolve_url(settings.LOGIN_URL)
    browser = Client()
    for _ in range(3):
        assert browser.post(login, {"username": "admin", "password": "wrong"}).status_code == 200
    refused = browser.post(login, {"username": "admin", "password": "pw-admin-123"})
    assert refused.status_code == 429
    assert b"Too many sign-in attempts" in refused.content
