"""Backup and restore (docs/deploy.md, "Backup and restore"): `pg_dump -Fc` of a database in
use, `pg_restore` into a new database, and the copy is the same service: the audit log whole,
its append-only triggers still refusing changes, and a run started before the backup goes on
where it was, checked by a server started on the copy. PostgreSQL stack only."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import psycopg
import pytest

from runs.models import Decision
from tests.conftest import server_env, set_policy, start_server
from tests.conftest import test_database_url as database_url

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def pg_args(url: str) -> list[str]:
    parts = urlsplit(url)
    return ["-h", parts.hostname or "127.0.0.1", "-p", str(parts.port or 5432),
            "-U", parts.username or "postgres"]


def test_a_restored_copy_keeps_the_audit_log_its_triggers_and_resumes_runs(
        api: Any, team: Any, tmp_path: Path) -> None:
    if not (shutil.which("pg_dump") and shutil.which("pg_restore")):
        pytest.skip("pg_dump and pg_restore are not installed (postgresql-client)")
    set_policy(team, step_limits={"max_steps": 3})
    run = api.post("/api/v1/runs", {"agent": "bot"}, content_type="application/json").json()
    for i in range(2):
        answer = api.post(f"/api/v1/runs/{run['run_id']}/check",
                          {"action": {"name": "search", "args": {"i": i}}},
                          content_type="application/json").json()
        assert answer["decision"] == "allow"
    audited = Decision.objects.filter(run_id=run["run_id"]).count()

    source = database_url()
    name = urlsplit(source).path.lstrip("/")
    copy_name = f"{name}_restored"
    copy = urlunsplit(urlsplit(source)._replace(path=f"/{copy_name}"))
    dump = tmp_path / "governance.dump"
    # The commands of docs/deploy.md, "Backup and restore".
    subprocess.run(["pg_dump", *pg_args(source), "-Fc", "-f", str(dump), name], check=True,
                   timeout=120)
    subprocess.run(["dropdb", *pg_args(source), "--if-exists", copy_name], check=True)
    subprocess.run(["createdb", *pg_args(source), copy_name], check=True)
    server = None
    try:
        subprocess.run(["pg_restore", *pg_args(source), "--no-owner", "-d", copy_name,
                        str(dump)], check=True, timeout=120)
        with psycopg.connect(copy, autocommit=True) as db:
            count = db.execute("SELECT count(*) FROM runs_decision WHERE run_id = %s",
                               [run["run_id"]]).fetchone()[0]
            assert count == audited
            with pytest.raises(psycopg.DatabaseError, match="append-only"):
                db.execute("UPDATE runs_decision SET reason = 'changed' WHERE run_id = %s",
                           [run["run_id"]])
            with pytest.raises(psycopg.DatabaseError, match="append-only"):
                db.execute("DELETE FROM runs_decision WHERE run_id = %s", [run["run_id"]])
        # The run resumes on the copy: its third step allowed, its fourth stopped.
        server = start_server(workers=1, env=server_env(DATABASE_URL=copy))
        token = api.defaults["HTTP_AUTHORIZATION"]
        with httpx.Client(base_url=server.url, timeout=30,
                          headers={"Authorization": token}) as http:
            answers = [http.post(f"/api/v1/runs/{run['run_id']}/check",
                                 json={"action": {"name": "search", "args": {"i": i}}}).json()
                       for i in (2, 3)]
        assert [(a["decision"], a["step"]) for a in answers] == [("allow", 3), ("stop", 4)]
    finally:
        if server is not None:
            server.stop()
        subprocess.run(["dropdb", *pg_args(source), "--force", "--if-exists", copy_name],
                       check=False)
