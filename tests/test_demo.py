"""The README's run command: `manage.py demo` serves a styled, live dashboard and prints an
agent key that works with the printed curl walk-through."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import ROOT, free_port, server_env

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def test_the_demo_serves_the_dashboard_its_assets_and_the_api():
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "manage.py", "demo", "--port", str(port), "--agents", "1"],
        cwd=ROOT, env=server_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        key = None
        deadline = time.monotonic() + 30
        while key is None and time.monotonic() < deadline:
            line = process.stdout.readline()
            if line.strip().startswith("KEY="):
                key = line.strip().removeprefix("KEY=")
        assert key, "the demo printed no agent key"
        for _ in range(100):
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert httpx.get(f"{base}/accounts/login/").status_code == 200
        assert httpx.get(f"{base}/static/dashboard.css").status_code == 200
        assert httpx.get(f"{base}/static/django_htmx/htmx-2.min.js").status_code == 200
        headers = {"Authorization": f"Bearer {key}"}
        run = httpx.post(f"{base}/api/v1/runs", headers=headers, json={"agent": "curl-demo"})
        answers = [httpx.post(f"{base}/api/v1/runs/{run.json()['run_id']}/check",
                              headers=headers,
                              json={"action": {"name": "search.docs",
                                               "args": {"query": "refund policy"}}}).json()
                   for _ in range(4)]
        assert [a["decision"] for a in answers] == ["allow", "allow", "allow", "stop"]
        assert answers[3]["reason"] == "loop_detected"
        login = httpx.Client(base_url=base)
        page = login.get("/accounts/login/")
        token = page.text.split('name="csrfmiddlewaretoken" value="')[1].split('"')[0]
        signed_in = login.post("/accounts/login/", data={
            "username": "admin", "password": "demo-admin", "csrfmiddlewaretoken": token})
        assert signed_in.status_code == 302
        # The simulated agent is already at work: runs appear without anyone calling the API.
        for _ in range(50):
            listed = httpx.get(f"{base}/api/v1/runs", headers=headers).json()["runs"]
            if any(r["agent"] != "curl-demo" for r in listed):
                break
            time.sleep(0.2)
        assert any(r["agent"] != "curl-demo" for r in listed)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=10)
