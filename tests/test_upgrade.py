"""Upgrades while agents run (docs/deploy.md, "Upgrades"): the previous release's server keeps
answering checks while this release's migrations run, and afterwards on the new schema; this
release's server then continues the runs the old one started.

The previous release is the commit named in deploy/PREVIOUS_RELEASE (each release moves it
forward), taken from this repository's history with `git archive` and run with this checkout's
environment. A migration that breaks the previous release's server (a NOT NULL column without a
database default that its INSERT leaves out, a renamed column, a dropped table) fails here.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import psycopg
import pytest
from django.conf import settings

from tests.conftest import ROOT, Server, server_env, start_server

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

POLICY = """
teams:
  - slug: upgrade
    name: Upgrade
    policies:
      - name: default
        step_limits: {max_steps: 500, max_repeat_action: 500, no_progress_window: 500}
        budgets: {max_seconds: null, max_usd: null, max_tool_calls: null}
"""


def _previous_release(tmp_path: Path) -> Path:
    commit = (ROOT / "deploy" / "PREVIOUS_RELEASE").read_text().strip()
    known = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=ROOT,
                           capture_output=True)
    if known.returncode != 0:
        pytest.skip(f"the previous release {commit[:12]} is not in this clone's history "
                    "(a shallow clone): fetch it to run the upgrade test")
    target = tmp_path / "previous"
    target.mkdir()
    archive = subprocess.run(["git", "archive", "--format=tar", commit], cwd=ROOT,
                             capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return target


def _env(checkout: Path, database_url: str) -> dict[str, str]:
    # The checkout's own packages first: its server and its copy of the client's rules.
    return server_env(DATABASE_URL=database_url,
                      PYTHONPATH=f"{checkout}:{checkout / 'governance_client' / 'src'}")


def _manage(checkout: Path, database_url: str, *args: str) -> str:
    result = subprocess.run([sys.executable, "manage.py", *args], cwd=checkout,
                            env=_env(checkout, database_url), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, f"manage.py {' '.join(args)} in {checkout.name}: " \
        f"{result.stdout[-2000:]}{result.stderr[-3000:]}"
    return result.stdout


def _serve_from(checkout: Path, env: dict[str, str]) -> Server:
    from tests import conftest

    original = conftest.ROOT
    conftest.ROOT = checkout  # _start_on starts `manage.py serve` in conftest.ROOT
    try:
        return start_server(workers=1, env=env)
    finally:
        conftest.ROOT = original


@pytest.fixture
def database_url() -> str:
    db = settings.DATABASES["default"]
    base = f"postgres://{db['USER']}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}"
    name = f"governance_upgrade_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(f"{base}/postgres", autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    yield f"{base}/{name}"
    with psycopg.connect(f"{base}/postgres", autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_the_previous_release_serves_through_and_after_this_release_s_migrations(
        tmp_path: Path, database_url: str):
    previous = _previous_release(tmp_path)
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)

    # The database as the previous release left it, with a run under way.
    _manage(previous, database_url, "migrate", "--noinput", "-v0")
    _manage(previous, database_url, "apply_policies", str(policy))
    key = _manage(previous, database_url, "create_agent_key", "--team", "upgrade",
                  "--name", "upgrade").strip().splitlines()[-1]
    headers = {"Authorization": f"Bearer {key}"}
    old = _serve_from(previous, _env(previous, database_url))
    new: Server | None = None
    try:
        with httpx.Client(base_url=old.url, timeout=30, headers=headers) as http:
            run_id = http.post("/api/v1/runs", json={"agent": "bot"}).json()["run_id"]
            assert http.post(f"/api/v1/runs/{run_id}/check",
                             json={"action": {"name": "search", "args": {"i": 0}}}
                             ).json()["decision"] == "allow"

        # Agents keep checking through the old server while this release migrates.
        answers: list[int] = []
        migrating = threading.Event()
        migrating.set()

        def keep_checking() -> None:
            with httpx.Client(base_url=old.url, timeout=30, headers=headers) as http:
                i = 1
                while migrating.is_set():
                    answers.append(http.post(
                        f"/api/v1/runs/{run_id}/check",
                        json={"action": {"name": "search", "args": {"i": i}}}).status_code)
                    i += 1
                    time.sleep(0.05)

        checker = threading.Thread(target=keep_checking)
        checker.start()
        try:
            _manage(ROOT, database_url, "migrate", "--noinput", "-v0")
        finally:
            migrating.clear()
            checker.join(timeout=60)
        assert answers and set(answers) == {200}, answers

        # The old release's commands on the new schema: a policy change, a new key.
        policy.write_text(POLICY.replace("max_steps: 500", "max_steps: 400"))
        _manage(previous, database_url, "apply_policies", str(policy))
        _manage(previous, database_url, "create_agent_key", "--team", "upgrade",
                "--name", "after-upgrade")

        # The old server on the new schema: a new run, its checks, its finish.
        with httpx.Client(base_url=old.url, timeout=30, headers=headers) as http:
            other = http.post("/api/v1/runs", json={"agent": "bot"})
            assert other.status_code == 201, other.text
            other_id = other.json()["run_id"]
            answer = http.post(f"/api/v1/runs/{other_id}/check",
                               json={"action": {"name": "search", "args": {}}})
            assert answer.status_code == 200 and answer.json()["decision"] == "allow", answer.text
            done = http.post(f"/api/v1/runs/{other_id}/finish", json={"status": "completed"})
            assert done.status_code == 200, done.text
            step = http.get(f"/api/v1/runs/{run_id}").json()["steps"]

        # This release's server continues the run the old one started.
        new = start_server(workers=1, env=_env(ROOT, database_url))
        with httpx.Client(base_url=new.url, timeout=30, headers=headers) as http:
            answer = http.post(f"/api/v1/runs/{run_id}/check",
                               json={"action": {"name": "search", "args": {"i": "new"}}}).json()
            assert answer["decision"] == "allow" and answer["step"] == step + 1, answer
    finally:
        old.stop()
        if new is not None:
            new.stop()
