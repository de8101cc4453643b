"""Shared fixtures: the stock users per team, agent keys, and real servers.

`server` starts the production server command (granian, several worker processes) on the
test database, so end-to-end tests talk HTTP to what a user would run. Tests that use it must
commit their data: mark them ``django_db(transaction=True)``.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx
import pytest
from django.conf import settings
from django.contrib.auth.hashers import PBKDF2PasswordHasher
from django.contrib.auth.models import User

from policies.models import Role, Team
from policies.services import agent_key_create, membership_set, policy_save, team_ensure

pytest_plugins = ["tests.conftest_audit"]

ROOT = Path(__file__).resolve().parent.parent
ON_POSTGRES = settings.DATABASES["default"]["ENGINE"].endswith("postgresql")
HAS_REDIS = bool(settings.REDIS_URL)


class FastPBKDF2PasswordHasher(PBKDF2PasswordHasher):
    iterations = 1


# --- Both check stores ----------------------------------------------------------------------
# A test inside pytest-django's transaction (a plain `django_db`) runs every check on the ORM
# path: the prepared statements run only outside a caller's transaction (the table
# `uses_prepared_statements` in runs/check/check_store.py). Marked `both_stores`, a test runs
# twice on PostgreSQL: `[orm]` as before, and `[prepared]` with its data committed
# (django_db(transaction=True)), where the same checks go through the two prepared round
# trips. On SQLite there is one store, so one run and the test's id unchanged.
STORES = ("orm", "prepared")


def pytest_generate_tests(metafunc: Any) -> None:
    if not ON_POSTGRES or metafunc.definition.get_closest_marker("both_stores") is None:
        return
    db = metafunc.definition.get_closest_marker("django_db")
    if (db is not None and db.kwargs.get("transaction")) or \
            {"transactional_db", "server", "agent"} & set(metafunc.fixturenames):
        return  # committed already: its checks run on the prepared statements
    metafunc.parametrize("check_store", STORES, indirect=True)


@pytest.fixture(autouse=True)
def check_store(request: Any) -> Iterator[str]:
    """The check store a `both_stores` test runs on ("orm" elsewhere). Counts the check
    transactions the test opens in this process, and fails a test whose checks did not run
    on the store it names (on `[prepared]`, a check that touches approvals starts on the
    prepared statements and goes on on the ORM: it counts as prepared)."""
    store = getattr(request, "param", None)
    if store is None:
        yield "orm"
        return
    from runs.check import check_store as cs

    opened = {"orm": 0, "prepared": 0}
    orm_init, pg_init = cs.OrmCheck.__init__, cs.PostgresCheck.__init__

    def orm(self: Any, *args: Any, **kwargs: Any) -> None:
        opened["orm"] += 1
        orm_init(self, *args, **kwargs)

    def prepared(self: Any, *args: Any, **kwargs: Any) -> None:
        opened["prepared"] += 1
        pg_init(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cs.OrmCheck, "__init__", orm)
        patch.setattr(cs.PostgresCheck, "__init__", prepared)
        yield store
    if store == "orm":
        assert opened["prepared"] == 0, "a check ran on the prepared statements"
    elif opened["orm"]:
        assert opened["prepared"], "the checks ran on the ORM only"


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    skip_pg = pytest.mark.skip(reason="needs DATABASE_URL=postgres://...")
    skip_redis = pytest.mark.skip(reason="needs REDIS_URL (Redis and a Celery worker)")
    # CI runs the suite once per stack; a test that uses neither the test database nor Redis
    # would prove the same thing twice, and the slowest of them (a fresh `pip install`, mypy,
    # import-linter runs) are minutes of CPU the other groups wait for. .ci/run sets this for
    # the production stack's groups; `make test` alone runs everything.
    skip_independent = pytest.mark.skip(
        reason="stack-independent: run by the embedded default's groups (SKIP_STACK_INDEPENDENT)")
    once = os.environ.get("SKIP_STACK_INDEPENDENT") == "1"
    # The attack tests take the machine to themselves (`attack_turn`): in CI, about half the
    # suites' time was the other groups waiting for them (15 of a 31-minute run). What they
    # measure, availability under attack, is the production stack's promise (SPEC 10: "on
    # the production stack started as the README says"), so .ci/run sets this for the
    # embedded default's groups, and the production stack's groups run them all.
    skip_attacks = pytest.mark.skip(
        reason="takes the machine to itself: run by the production stack's groups "
               "(SKIP_ATTACK_TESTS)")
    production_only = os.environ.get("SKIP_ATTACK_TESTS") == "1"
    committed = pytest.mark.django_db(transaction=True)
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if params.get("check_store") == "prepared":
            # The closest django_db marker wins: this one, over the module's plain one.
            item.add_marker(committed, append=False)
        if "postgres" in item.keywords and not ON_POSTGRES:
            item.add_marker(skip_pg)
        if "redis" in item.keywords and not HAS_REDIS:
            item.add_marker(skip_redis)
        if once and "stack_independent" in item.keywords:
            item.add_marker(skip_independent)
        if production_only and "attack_turn" in getattr(item, "fixturenames", ()):
            item.add_marker(skip_attacks)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_database_url() -> str:
    db = settings.DATABASES["default"]
    if ON_POSTGRES:
        auth = db["USER"] + (f":{db['PASSWORD']}" if db.get("PASSWORD") else "")
        return f"postgres://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"
    return f"sqlite:///{db['NAME']}"


def server_env(**extra: str) -> dict[str, str]:
    # Suites send many bad keys from 127.0.0.1 on purpose; throttling has its own tests.
    env = {**os.environ, "DATABASE_URL": test_database_url(), "DEBUG": "false",
           "SECRET_KEY": settings.SECRET_KEY, "PYTHONUNBUFFERED": "1",
           "THROTTLE_API_KEY_FAILURES": "100000",
           # Kill-switch tests deliver webhooks to receivers on loopback (tests/workers.py),
           # which only an allowed host may be (policies/egress.py).
           "WEBHOOK_ALLOWED_HOSTS": "127.0.0.1"}
    if settings.REDIS_URL:
        env["REDIS_URL"] = settings.REDIS_URL
    return {**env, **extra}


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log: IO[bytes] | None = None  # what the server printed (stdout and stderr)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self.log is not None:
            self.log.close()

    def log_tail(self, size: int = 4000) -> str:
        """The end of what the server printed, for a failure's message."""
        if self.log is None or self.log.closed:
            return ""
        self.log.flush()
        self.log.seek(0, os.SEEK_END)
        self.log.seek(max(0, self.log.tell() - size))
        return self.log.read().decode(errors="replace")


START_SECONDS = 90


def start_server(*, workers: int = 2, threads: int | None = None,
                 env: dict[str, str] | None = None) -> Server:
    """`manage.py serve`, the production command, on a free port; waits for /healthz.
    `threads` is the API pool's size per worker (default: the command's own).

    A free port can be taken between `free_port` and the server's bind (CI runs two suites
    side by side, each starting servers): `serve` then refuses it, and another is tried."""
    for _ in range(3):
        server = _start_on(free_port(), workers=workers, threads=threads, env=env)
        if server is not None:
            return server
    raise RuntimeError("three free ports in a row were taken before the server bound them")


def _start_on(port: int, *, workers: int, threads: int | None,
              env: dict[str, str] | None) -> Server | None:
    sized = ["--threads", str(threads)] if threads else []
    log = tempfile.TemporaryFile()  # noqa: SIM115 (the Server closes it when it stops)
    process = subprocess.Popen(
        [sys.executable, "manage.py", "serve", "--port", str(port), "--workers", str(workers),
         *sized],
        cwd=ROOT, env=env or server_env(), start_new_session=True,
        stdout=log, stderr=subprocess.STDOUT,
    )
    server = Server(url=f"http://127.0.0.1:{port}", process=process, log=log)
    # Generous: a start is 2.5 s of CPU, and in CI each suite's groups start servers side by
    # side (5 at once after an attack module hands the machine back); a start that took over
    # 30 s there failed tests that a start is not what they test. It says when it is slow.
    began = time.monotonic()
    deadline = began + START_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            printed = server.log_tail()
            server.stop()
            if f"port {port} on 127.0.0.1 is in use" in printed:
                return None
            raise RuntimeError(f"server exited with {process.returncode}:\n{printed}")
        try:
            if httpx.get(f"{server.url}/healthz", timeout=1).status_code == 200:
                took = time.monotonic() - began
                if took > 30:
                    print(f"the server on port {port} took {took:.0f} s to start")
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    printed = server.log_tail()
    server.stop()
    raise RuntimeError(f"server did not become healthy in {START_SECONDS} s:\n{printed}")


# The lock files of every suite on this machine, not of one checkout: an attack takes the
# machine, and another checkout's suites (a second CI run, a clone being tried) load it too.
_TURNS = Path(tempfile.gettempdir()) / "governance-test-turns"
_holding_attack_turn = False


@pytest.fixture(scope="module")
def attack_turn() -> Iterator[None]:
    """The attack tests (tests/test_attacks.py, tests/test_availability.py, ...) assert that
    valid checks are answered within a deadline while an attack runs on this machine. CI runs
    several groups of both stacks' suites side by side (.ci/run), and an attack beside other
    suites measured the machine, not the server (a valid check took 2.3 s in 1 of 5 tries
    with one other suite; a run of four groups and other work missed the 2 s deadline once).
    So an attack module has the machine to itself: it takes the turn exclusively, and every
    other test of every suite on this machine takes it shared (`pytest_runtest_protocol`), so the
    others finish the test at hand and wait meanwhile. The gate makes the attack's wait
    first in line: without it, shared holders that overlap could keep it waiting forever."""
    global _holding_attack_turn
    _TURNS.mkdir(exist_ok=True)
    with open(_TURNS / "attack-tests.gate", "a") as gate, \
            open(_TURNS / "attack-tests.lock", "a") as lock:  # closing releases the locks
        fcntl.flock(gate, fcntl.LOCK_EX)  # no other test starts from now
        fcntl.flock(lock, fcntl.LOCK_EX)  # the ones running have ended
        _holding_attack_turn = True
        try:
            yield
        finally:
            _holding_attack_turn = False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Any other test waits while an attack module of another suite runs (`attack_turn`).
    Around the whole test, setup included: a wait inside it would hold the test's database
    transaction open, which the server ends after 10 s idle (settings.py)."""
    if _holding_attack_turn or "attack_turn" in getattr(item, "fixturenames", ()):
        yield
        return
    _TURNS.mkdir(exist_ok=True)
    with open(_TURNS / "attack-tests.lock", "a") as lock:
        with open(_TURNS / "attack-tests.gate", "a") as gate:
            fcntl.flock(gate, fcntl.LOCK_EX)
            fcntl.flock(lock, fcntl.LOCK_SH)
        yield


@pytest.fixture(scope="session")
def server(django_db_setup: Any, django_db_blocker: Any) -> Iterator[Server]:
    """One production server (2 worker processes) for the whole session."""
    srv = start_server()
    yield srv
    srv.stop()


@pytest.fixture(scope="session", autouse=True)
def _quiet_test_database_at_the_end(request: Any, django_db_blocker: Any) -> Iterator[None]:
    """PostgreSQL ends a dead client's backend a moment after the client exits; dropping the
    test database before that fails with "is being accessed by other users". Runs last
    before the test database is dropped, and names any session still there."""
    if not ON_POSTGRES:
        yield
        return
    request.getfixturevalue("django_db_setup")
    yield
    import warnings

    from django.db import connection

    query = ("SELECT pid, application_name, client_port, state, left(query, 80) "
             "FROM pg_stat_activity WHERE datname = current_database() "
             "AND pid <> pg_backend_pid()")
    deadline = time.monotonic() + 10
    with django_db_blocker.unblock(), connection.cursor() as cursor:
        while True:
            cursor.execute(query)
            others = cursor.fetchall()
            if not others or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    if others:
        warnings.warn(f"sessions still open on the test database: {others}; their clients: "
                      f"{[_owner_of_port(row[2]) for row in others]}", stacklevel=1)


def _owner_of_port(port: int | None) -> str:
    """Which local process holds a database session's client end (the socket's owner and
    its command line), so that a session left open says whose it is."""
    if not port:
        return "?"
    try:
        found = subprocess.run(["ss", "-Htnp", f"sport = :{port}"], capture_output=True,
                               text=True, timeout=5).stdout
        pid = found.split("pid=", 1)[1].split(",", 1)[0]
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            command = cmdline.read().replace(b"\0", b" ").decode(errors="replace")
        return f"{pid}: {command[:200]}"
    except (OSError, IndexError, subprocess.SubprocessError):
        return "?"


@pytest.fixture(scope="session", autouse=True)
def _client_journal_of_the_session(tmp_path_factory: Any) -> Iterator[Path]:
    """Clients made by the tests keep their journal (governance_client.journal) in a folder of
    the session, never in the user's cache."""
    folder = tmp_path_factory.mktemp("journal")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GOVERNANCE_JOURNAL_DIR", str(folder))
        yield folder


@pytest.fixture(scope="session", autouse=True)
def _fast_password_hashing() -> Iterator[None]:
    """The stock users are made for nearly every test; the production hasher is slow on
    purpose. One PBKDF2 iteration keeps the hash format, so servers started by tests (with the
    real hasher) still accept these passwords in browser sign-ins."""
    from django.test import override_settings

    with override_settings(PASSWORD_HASHERS=["tests.conftest.FastPBKDF2PasswordHasher"]):
        yield


@pytest.fixture(autouse=True)
def _fresh_throttles() -> Iterator[None]:
    """Every test comes from 127.0.0.1: what one test's failures left in this process's
    memory must not refuse the next one's (the counts are rows, gone with each test)."""
    from django.core.cache import cache

    from governance.middleware import (
        api_key_throttle,
        sign_in_address_throttle,
        sign_in_checks_throttle,
        sign_in_throttle,
    )

    for throttle in (api_key_throttle, sign_in_throttle, sign_in_address_throttle,
                     sign_in_checks_throttle):
        throttle.forget()
    from governance.logfilters import RefusalsWithoutTraceback

    for refusals in logging.getLogger("django.request").filters:
        if isinstance(refusals, RefusalsWithoutTraceback):
            refusals.forget()
    # Rolled-back tests hand their ids out again on SQLite: a parsed policy cached by
    # version id in one test must not be another test's version of the same id.
    from runs.check.policy_cache import rules_for_version, version_label

    rules_for_version.cache_clear()
    version_label.cache_clear()
    # A test that stopped the cache's Redis must not break the next one.
    with contextlib.suppress(Exception):
        cache.clear()
    yield


# --- Stock data ------------------------------------------------------------------------------

@dataclass
class Agent:
    """An agent's view of the API: a key and an HTTP client."""

    token: str
    http: httpx.Client

    def start(self, agent: str = "support-bot", **body: Any) -> dict[str, Any]:
        response = self.http.post("/api/v1/runs", json={"agent": agent, **body})
        assert response.status_code in (200, 201), response.text
        return response.json()

    def check(self, run_id: str, name: str = "search.docs", args: dict[str, Any] | None = None,
              **body: Any) -> dict[str, Any]:
        response = self.http.post(
            f"/api/v1/runs/{run_id}/check", json={"action": {"name": name, "args": args or {},
                                                             **body.pop("action", {})}, **body}
        )
        assert response.status_code == 200, response.text
        return response.json()


@pytest.fixture
def team(db: Any) -> Team:
    return team_ensure(slug="support", name="Customer support")[0]


@pytest.fixture
def other_team(db: Any) -> Team:
    return team_ensure(slug="billing", name="Billing")[0]


def set_policy(team: Team, **changes: Any) -> None:
    """Give the team's default policy new values (a new version), e.g.
    ``set_policy(team, step_limits={"max_steps": 5}, mode="shadow")``."""
    from policies.document import parse_policy

    document = {**team.policies.get(name="default").current.document}
    if "step_limits" in changes and "warnings" not in changes:
        # New step limits take the warnings a new policy would get under them (SPEC 16), as
        # a file's policy does: a warning the stored version had may not fit them.
        document.pop("warnings", None)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(document.get(key), dict):
            document[key] = {**document[key], **value}
        else:
            document[key] = value
    policy_save(team=team, document=parse_policy(document), actor=None, source="test")


@pytest.fixture
def users(team: Team, other_team: Team) -> dict[str, User]:
    """admin, operator, viewer of `team`; outsider is admin of `other_team` only."""
    made = {}
    for name, role, member_of in [
        ("admin", Role.ADMIN, team), ("operator", Role.OPERATOR, team),
        ("viewer", Role.VIEWER, team), ("outsider", Role.ADMIN, other_team),
    ]:
        user = User.objects.create_user(name, f"{name}@example.com", "pw-" + name + "-123")
        membership_set(team=member_of, user=user, role=role, actor=None)
        made[name] = user
    made["superuser"] = User.objects.create_superuser("root", "root@example.com", "pw-root-123")
    return made


@pytest.fixture
def agent_token(team: Team) -> str:
    return agent_key_create(team=team, name="test-key").token


@pytest.fixture
def api(client: Any, agent_token: str) -> Any:
    """Django's test client with the agent key: fast, in-process API calls."""
    client.defaults["HTTP_AUTHORIZATION"] = f"Bearer {agent_token}"
    return client


@pytest.fixture
def agent(server: Server, transactional_db: Any, team: Team, agent_token: str) -> Iterator[Agent]:
    """An agent talking HTTP to the real multi-process server."""
    with httpx.Client(base_url=server.url, timeout=30,
                      headers={"Authorization": f"Bearer {agent_token}"}) as http:
        yield Agent(token=agent_token, http=http)
