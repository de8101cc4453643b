"""Lets the test suite flush its PostgreSQL database despite the append-only audit tables.

Django empties the database after each transactional test with one TRUNCATE of every table,
which the audit triggers (runs/migrations/0002_audit_append_only.py) refuse. The flush runs in
one transaction (``execute_sql_flush``), so it is opened for maintenance first, exactly as the
retention command does; nothing else in the tests gets past the triggers.

Registered from tests/conftest.py: ``pytest_plugins = ["tests.conftest_audit"]``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings


@pytest.fixture(scope="session", autouse=True)
def _audit_tables_flushable() -> Iterator[None]:
    if not settings.DATABASES["default"]["ENGINE"].endswith("postgresql"):
        yield
        return
    from django.db.backends.postgresql.operations import DatabaseOperations

    from runs.audit.retention import MAINTENANCE_SETTING

    original = DatabaseOperations.execute_sql_flush

    def execute_sql_flush(self: Any, sql_list: list[str]) -> None:
        opening = f"SELECT set_config('{MAINTENANCE_SETTING}', 'on', true)"
        original(self, [opening, *sql_list])

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DatabaseOperations, "execute_sql_flush", execute_sql_flush)
        yield
