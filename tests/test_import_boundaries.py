"""The import boundaries of docs/architecture.md, as import-linter contracts (pyproject.toml):
they hold for the code as it is, and each one fails when a forbidden import comes back."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.stack_independent

ROOT = Path(__file__).resolve().parent.parent
CLIENT_SRC = ROOT / "governance_client" / "src"


def lint_imports(cwd: Path, *pythonpath: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in pythonpath)}
    return subprocess.run(
        [sys.executable, "-c",
         "import sys; from importlinter.cli import lint_imports;"
         " sys.exit(lint_imports(no_cache=True, no_logo=True))"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
    )


def test_the_code_keeps_every_contract() -> None:
    result = lint_imports(ROOT, ROOT, CLIENT_SRC)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.fixture(scope="module")
def copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The packages and their contracts, somewhere a forbidden import can be added."""
    where = tmp_path_factory.mktemp("boundaries")
    ignore = shutil.ignore_patterns("__pycache__", "migrations", "tests", "examples")
    for package in ("governance", "policies", "runs", "backtests", "operator_api"):
        shutil.copytree(ROOT / package, where / package, ignore=ignore)
    shutil.copytree(CLIENT_SRC / "governance_client", where / "src" / "governance_client",
                    ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", where / "pyproject.toml")
    return where


@pytest.mark.parametrize(("module", "line", "contract"), [
    ("policies/probe.py", "from runs.models import Run", "policies know nothing of runs"),
    ("policies/probe.py", "from governance.middleware import sign_in_throttle",
     "the apps use only the project's shared web module"),
    ("runs/webhooks/probe.py", "from governance.celery import app",
     "the apps use only the project's shared web module"),
    ("src/governance_client/probe.py", "import django",
     "the client needs nothing of Django or the server"),
    ("src/governance_client/probe.py", "from runs import models",
     "the client needs nothing of Django or the server"),
    ("src/governance_client/keys.py", "import socket", "the pure rules do no I/O"),
    ("runs/check/probe.py", "from runs.dashboard import presenters",
     "the check path does not depend on the screens"),
    ("src/governance_client/replay.py", "import threading", "the pure rules do no I/O"),
    ("runs/check/probe.py", "from backtests import selectors",
     "backtests only read: nothing of the policies or the runs depends on them"),
    ("backtests/probe.py", "from governance.celery import app",
     "the apps use only the project's shared web module"),
    ("operator_api/probe.py", "from runs.dashboard import presenters",
     "the operator API calls the services, never the screens or the check"),
    ("operator_api/probe.py", "from runs.check.services import run_check",
     "the operator API calls the services, never the screens or the check"),
    ("runs/probe.py", "from operator_api import api",
     "nothing of the apps depends on the operator API"),
    ("runs/webhooks/probe.py", "from runs.killswitch.tasks import killswitch_fanout_task",
     "webhooks are a transport: they know nothing of what sends them"),
    ("runs/killswitch/selectors.py", "from runs.killswitch.services import killswitch_engage",
     "the kill switch and webhook reads change nothing"),
    ("runs/webhooks/selectors.py", "from runs.live.events import publish_team_event",
     "the kill switch and webhook reads change nothing"),
    ("governance/middleware.py", "from runs.check.api import error",
     "the project takes of the agent API only its edge"),
    # The import circle that once was: approvals and abandon took answer builders from the
    # check's services; and the owners below must stay free of what uses them.
    ("runs/approvals/services.py", "from runs.check.services import run_check",
     "the check's layers: answers, records and states below the services"),
    ("runs/check/abandon.py", "from runs.check.services import run_check",
     "the check's layers: answers, records and states below the services"),
    ("runs/check/records.py", "from runs.killswitch.services import killswitch_kill_run",
     "the check's layers: answers, records and states below the services"),
    # Reads that wrote (issue 25): a selector or presenter that settles, abandons or looks
    # first itself, and a look first from anywhere but a view, the API or a stream.
    ("runs/dashboard/presenters.py", "from runs.first_look import look",
     "the run and approval reads change nothing: selectors and presenters"),
    ("runs/dashboard/presenters.py", "from runs.approvals.services import settle_if_due",
     "the run and approval reads change nothing: selectors and presenters"),
    ("runs/audit/selectors.py", "from runs.check.abandon import abandon_if_idle",
     "the run and approval reads change nothing: selectors and presenters"),
    ("runs/dashboard/selectors.py", "from runs.check.rate_limits import prune_hits",
     "the run and approval reads change nothing: selectors and presenters"),
    ("runs/approvals/selectors.py", "from runs.live.events import publish_team_event",
     "the run and approval reads change nothing: selectors and presenters"),
    ("runs/templatetags/approval_tags.py", "from runs.approvals.services import expire_due",
     "the run and approval reads change nothing: selectors and presenters"),
    ("runs/killswitch/views.py", "from runs.first_look import look",
     "only the views look first: the reads' one place that writes"),
    ("runs/check/edge.py", "from runs.first_look import look_at_run",
     "only the views look first: the reads' one place that writes"),
    ("runs/check/check_store.py", "from runs.killswitch.fanout import killswitch_kill_run",
     "the check's layers: answers, records and states below the services"),
    ("runs/killswitch/fanout.py", "from runs.killswitch.services import killswitch_engage",
     "the check's layers: answers, records and states below the services"),
    ("runs/killswitch/selectors.py", "from runs.killswitch.fanout import killswitch_fanout",
     "the kill switch and webhook reads change nothing"),
    # The check's services know nothing of a run's start and finish or of the uploads, and
    # those two know nothing of each other.
    ("runs/check/services.py", "from runs.check.lifecycle import run_start",
     "the check's layers: answers, records and states below the services"),
    ("runs/check/local.py", "from runs.check.lifecycle import run_finish",
     "the check's layers: answers, records and states below the services"),
])
def test_a_forbidden_import_breaks_its_contract(copy: Path, module: str, line: str,
                                                 contract: str) -> None:
    path = copy / module
    before = path.read_text() if path.exists() else None
    # Appended, so it is an import of the module whether or not the module existed.
    path.write_text((before or "") + f"\n{line}  # noqa\n")
    try:
        result = lint_imports(copy, copy, copy / "src")
    finally:
        if before is None:
            path.unlink()
        else:
            path.write_text(before)
    assert result.returncode != 0, result.stdout
    assert f"{contract} BROKEN" in result.stdout, result.stdout


# The policies app's templates name tag libraries, which import-linter cannot see: the same
# boundary, checked on the {% load %} lines. run_counts is the one bridge, a runs library made
# for the policies pages (it counts runs on old versions), so that policies' Python stays free
# of runs.
TEMPLATE_BRIDGES = {"run_counts"}
LOAD = re.compile(r"{%\s*load\s+(.*?)\s*%}")


def test_policies_templates_load_no_runs_tag_library_but_the_bridge() -> None:
    from django.template.backends.django import get_installed_libraries

    libraries = get_installed_libraries()
    assert libraries["dashboard_tags"] == "governance.templatetags.dashboard_tags"
    loaded = set()
    for template in (ROOT / "policies" / "templates").rglob("*.html"):
        for names in LOAD.findall(template.read_text()):
            words = names.split()
            # "{% load a b from lib %}" loads from lib; otherwise every word is a library.
            loaded |= {words[-1]} if "from" in words else set(words)
    assert "dashboard_tags" in loaded  # the formats are used there
    from_runs = {name for name in loaded if libraries[name].startswith("runs.")}
    assert from_runs <= TEMPLATE_BRIDGES, from_runs
