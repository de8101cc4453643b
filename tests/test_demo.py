"""The README's run command: `manage.py demo` serves a styled, live dashboard and prints an
agent key that works with the printed curl walk-through."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from django.contrib.auth.models import User
from django.contrib.sessions.models import Session
from django.test import Client

from governance.logfilters import RefusalsWithoutTraceback
from policies.models import AgentKey, Policy
from policies.services import agent_key_create, policy_save
from runs.management.commands.demo import (
    QuietAgentTraffic,
    demo_setup,
    port_from_env,
    port_problem,
)
from tests.conftest import ROOT, free_port, server_env

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def test_the_demo_serves_the_dashboard_its_assets_and_the_api(tmp_path):
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "manage.py", "demo", "--agents", "1"],
        cwd=ROOT, env=server_env(PORT=str(port), DEMO_KEY_FILE=str(tmp_path / "key")),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
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


def test_running_the_demo_setup_again_leaves_an_operators_work_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("DEMO_KEY_FILE", str(tmp_path / "key"))
    first = demo_setup()
    assert "policy support/default" in first.created and "agent key" in first.created
    # An operator edits a policy, signs in, changes a password and makes a key of their own.
    policy = Policy.objects.get(team__slug="support", name="default")
    edited = {**policy.current.document,
              "step_limits": {**policy.current.document["step_limits"], "max_steps": 30}}
    policy_save(team=policy.team, document=edited, actor=None, source="dashboard")
    operator = User.objects.get(username="operator")
    operator.set_password("changed-by-them")
    operator.save()
    browser = Client()
    assert browser.login(username="admin", password="demo-admin")
    assert browser.get("/teams/support/").status_code == 200
    agent_key_create(team=policy.team, name="their key")
    sessions = set(Session.objects.values_list("session_key", flat=True))
    keys = set(AgentKey.objects.values_list("pk", "revoked_at"))
    versions = {p.pk: p.current_id for p in Policy.objects.all()}

    second = demo_setup()

    assert second.created == []
    assert second.token == first.token  # the same key is printed again
    policy.refresh_from_db()
    assert policy.current.document["step_limits"]["max_steps"] == 30
    assert {p.pk: p.current_id for p in Policy.objects.all()} == versions
    assert set(Session.objects.values_list("session_key", flat=True)) == sessions
    assert browser.get("/teams/support/").status_code == 200  # still signed in
    assert Client().login(username="operator", password="changed-by-them")
    assert set(AgentKey.objects.values_list("pk", "revoked_at")) == keys
    assert set(second.kept_passwords) == {"admin", "operator", "viewer"}


def test_a_revoked_or_lost_demo_key_is_replaced_once(tmp_path, monkeypatch):
    monkeypatch.setenv("DEMO_KEY_FILE", str(tmp_path / "key"))
    first = demo_setup()
    (tmp_path / "key").unlink()
    second = demo_setup()
    assert second.token != first.token and "agent key" in second.created
    assert (tmp_path / "key").stat().st_mode & 0o077 == 0  # readable by its owner only
    assert demo_setup().token == second.token


def test_the_port_comes_from_port_and_a_bad_one_is_refused(monkeypatch):
    from django.core.management.base import CommandError

    monkeypatch.setenv("PORT", "8123")
    assert port_from_env() == 8123
    monkeypatch.delenv("PORT")
    assert port_from_env() == 8000
    for bad in ("http", "0", "70000"):
        monkeypatch.setenv("PORT", bad)
        with pytest.raises(CommandError, match="not a port number"):
            port_from_env()


def test_a_taken_port_is_said_first_and_nothing_is_created(tmp_path):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    # The port after it taken too: the message suggests one that is free (it suggested the
    # next one whatever it was).
    next_holder = socket.socket()
    with contextlib.suppress(OSError):  # taken by someone else already: skipped all the same
        next_holder.bind(("127.0.0.1", port + 1))
        next_holder.listen()
    try:
        assert "already in use" in (port_problem("127.0.0.1", port) or "")
        keys = AgentKey.objects.count()
        done = subprocess.run(
            [sys.executable, "manage.py", "demo", "--no-agents"], cwd=ROOT,
            env=server_env(PORT=str(port), DEMO_KEY_FILE=str(tmp_path / "key")),
            capture_output=True, text=True, timeout=60)
    finally:
        holder.close()
        next_holder.close()
    assert done.returncode != 0
    assert f"Port {port} is already in use" in done.stderr
    suggested = int(done.stderr.split("PORT=")[-1].split()[0])
    assert suggested > port + 1
    assert "Agent key" not in done.stdout and "KEY=" not in done.stdout
    assert AgentKey.objects.count() == keys and not (tmp_path / "key").exists()


def test_with_sso_on_the_printout_does_not_send_the_password_accounts_to_sso():
    """Under SSO the demo's operator and viewer cannot sign in at all (password accounts,
    and SSO never finds an account by its name): the printout said they "sign in with SSO",
    and a newcomer who did was refused for having no mapped group."""
    from runs.management.commands.demo import demo_logins

    base = "http://127.0.0.1:8000"
    plain = " ".join(demo_logins(base, "all"))
    assert "operator / demo-operator, or viewer / demo-viewer" in plain
    for mode in ("superusers", "off"):
        text = " ".join(" ".join(demo_logins(base, mode)).split())
        assert "demo-operator" not in text
        assert "sign in with SSO." not in text  # the old advice, which was refused
        assert "operator and viewer (password accounts) cannot sign in" in text
        assert "OIDC_ROLE_MAP" in text and "OIDC_PASSWORD_LOGIN=all" in text
        # With the form gone, admin's password signs nobody in either.
        assert ("admin / demo-admin" in text) == (mode == "superusers")


def record(line: str, status: int) -> logging.LogRecord:
    rec = logging.LogRecord("django.server", logging.INFO, __file__, 1, '"%s" %s %s',
                            (line, str(status), "12"), None)
    rec.status_code = status
    return rec


def test_the_demo_does_not_log_every_agent_call_but_logs_pages_and_errors():
    quiet = QuietAgentTraffic()
    assert not quiet.filter(record("POST /api/v1/runs/x/check HTTP/1.1", 200))
    assert not quiet.filter(record("GET /teams/support/runs/stream HTTP/1.1", 200))
    assert quiet.filter(record("GET /teams/support/ HTTP/1.1", 200))
    assert quiet.filter(record("POST /api/v1/runs HTTP/1.1", 422))


def test_a_refusal_is_logged_as_one_line_without_a_traceback(caplog):
    user = User.objects.create_user("nobody", password="pw")
    client = Client()
    client.force_login(user)
    logger = logging.getLogger("django.request")
    assert any(isinstance(f, RefusalsWithoutTraceback) for f in logger.filters)
    with caplog.at_level(logging.WARNING, logger="django.request"):
        assert client.get("/killswitch/").status_code == 403  # only superusers
    refusals = [r for r in caplog.records if r.name == "django.request"]
    assert refusals and all(r.exc_info is None for r in refusals)
    assert "Forbidden" in refusals[0].getMessage()


def test_a_request_refused_for_its_host_is_one_line_on_the_console(caplog):
    import io
    import sys

    console = next(h for h in logging.getLogger().handlers
                   if isinstance(h, logging.StreamHandler) and h.stream in (sys.stderr,
                                                                            sys.stdout))
    with caplog.at_level(logging.WARNING, logger="django.security.DisallowedHost"):
        assert Client(HTTP_HOST="evil.example").get("/accounts/login/").status_code == 400
    [record] = [r for r in caplog.records if r.name == "django.security.DisallowedHost"]
    out = io.StringIO()
    printed = logging.StreamHandler(out)
    printed.filters = console.filters
    printed.handle(record)
    assert "evil.example" in out.getvalue() and "Traceback" not in out.getvalue()


def test_refusals_are_logged_at_most_so_many_a_minute_then_counted(monkeypatch):
    """A client sending wrong keys as fast as it can wrote a log line per refusal (50 a
    second under the benchmark's `bad_keys` attack); errors are never held back."""
    from governance import logfilters

    clock = [1000.0]
    monkeypatch.setattr(logfilters.time, "monotonic", lambda: clock[0])
    refusals = RefusalsWithoutTraceback()

    def refused(status: int = 401) -> logging.LogRecord:
        made = logging.LogRecord("django.request", logging.WARNING, __file__, 1, "%s: %s",
                                 ("Unauthorized", "/api/v1/runs"), None)
        made.status_code = status
        return made

    kept = [refusals.filter(refused()) for _ in range(logfilters.REFUSALS_PER_MINUTE + 40)]
    assert kept.count(True) == logfilters.REFUSALS_PER_MINUTE
    assert refusals.filter(refused(500))  # an error always
    twice = refused()
    assert refusals.filter(twice) is False and refusals.filter(twice) is False  # logger, handler
    clock[0] += 61
    first = refused()
    assert refusals.filter(first) and refusals.filter(first)  # decided once, kept at both
    assert first.getMessage() == ("Unauthorized: /api/v1/runs (and 41 more refusals not logged "
                                  "in the minute before)")
