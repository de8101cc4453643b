"""Clients made by these tests keep their journal (governance_client.journal) in a folder of
the session, never in the user's cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def _journal_of_the_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    folder = tmp_path_factory.mktemp("journal")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GOVERNANCE_JOURNAL_DIR", str(folder))
        yield folder
