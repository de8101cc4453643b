"""Backup and restore (docs/backup.md): a `pg_dump` of a live database,
restored with `pg_restore` into a new database, serves as the old one did. The audit log is
whole, its append-only triggers hold, and a run that was running resumes where it was, on a
server started against the restored database. The commands are the ones the docs give."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import httpx
import psycopg
import pytest
from django.db import connection

from policies.models import Team
from tests.conftest import Server, server_env, set_policy, start_server
from tests.conftest import test_database_url as database_url

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres, pytest.mark.slow]


def _admin_url(url: str) -> str:
    return url.rsplit("/", 1)[0] + "/postgres"


def _run(*command: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{command[0]} failed: {result.stderr[-2000:]}"


def test_a_dump_restored_into_a_new_database_serves_as_before(
        server: Server, team: Team, agent_token: str, tmp_path: Path):
    set_policy(team, step_limits={"max_steps": 50, "max_repeat_action": 50},
               budgets={"max_seconds": None})
    headers = {"Authorization": f"Bearer {agent_token}"}
    with httpx.Client(base_url=server.url, timeout=30, headers=headers) as http:
        finished = http.post("/api/v1/runs", json={"agent": "bot"}).json()["run_id"]
        for i in range(3):
            http.post(f"/api/v1/runs/{finished}/check",
                      json={"action": {"name": "search", "args": {"i": i}}}).raise_for_status()
        http.post(f"/api/v1/runs/{finished}/finish", json={"status": "completed"})
        running = http.post("/api/v1/runs", json={"agent": "bot"}).json()["run_id"]
        for i in range(4):
            answer = http.post(f"/api/v1/runs/{running}/check",
                               json={"action": {"name": "search", "args": {"i": i}}}).json()
            assert answer["decision"] == "allow", answer

    source = database_url()
    dump = tmp_path / "governance.dump"
    # docs/deploy.md: the custom format, which pg_restore reads (and can restore in parallel).
    _run("pg_dump", "--format=custom", "--no-owner", f"--file={dump}", source)

    restored_name = f"governance_restore_{uuid.uuid4().hex[:8]}"
    restored = source.rsplit("/", 1)[0] + "/" + restored_name
    with psycopg.connect(_admin_url(source), autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{restored_name}"')
    other: Server | None = None
    try:
        _run("pg_restore", "--no-owner", "--exit-on-error", f"--dbname={restored}", str(dump))

        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*), max(id) FROM runs_decision")
            source_decisions = cursor.fetchone()
        with psycopg.connect(restored, autocommit=True) as db:
            assert db.execute("SELECT count(*), max(id) FROM runs_decision").fetchone() \
                == source_decisions
            # The append-only triggers came with the schema: an edit is refused.
            with pytest.raises(psycopg.Error, match="append-only"):
                db.execute("UPDATE runs_decision SET reason = 'edited'")
            with pytest.raises(psycopg.Error, match="append-only"):
                db.execute("DELETE FROM runs_decision")

        # A server on the restored database: the running run resumes at its next step, the
        # finished one stays finished, and new ids do not collide with restored ones.
        other = start_server(workers=1, env=server_env(DATABASE_URL=restored))
        with httpx.Client(base_url=other.url, timeout=30, headers=headers) as http:
            answer = http.post(f"/api/v1/runs/{running}/check",
                               json={"action": {"name": "search", "args": {"i": 99}}}).json()
            assert answer["decision"] == "allow" and answer["step"] == 5, answer
            assert http.get(f"/api/v1/runs/{finished}").json()["status"] == "completed"
            new_run = http.post("/api/v1/runs", json={"agent": "bot"})
            assert new_run.status_code == 201, new_run.text
            answer = http.post(f"/api/v1/runs/{new_run.json()['run_id']}/check",
                               json={"action": {"name": "search", "args": {}}}).json()
            assert answer["decision"] == "allow", answer
        with psycopg.connect(restored, autocommit=True) as db:
            assert db.execute("SELECT count(*) FROM runs_decision").fetchone()[0] \
                == source_decisions[0] + 2
    finally:
        if other is not None:
            other.stop()
        with psycopg.connect(_admin_url(source), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{restored_name}" WITH (FORCE)')
