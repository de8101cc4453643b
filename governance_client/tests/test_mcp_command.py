"""``governance-mcp`` installed without the ``[mcp]`` extra says what to install, in one line
(found by a newcomer: ``make demo`` installs the command, and it printed a traceback)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from governance_client import mcp_command

# The SDK made unimportable, as in an environment without the extra.
WITHOUT_SDK = ("import sys; sys.modules['mcp'] = None; "
               "from governance_client.mcp_command import main; sys.exit(main(['--help']))")


def test_without_the_sdk_the_command_says_what_to_install() -> None:
    done = subprocess.run([sys.executable, "-c", WITHOUT_SDK], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr == mcp_command.MISSING_SDK + "\n"


def test_with_the_sdk_the_command_is_the_gateway(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("mcp")
    with pytest.raises(SystemExit) as exited:
        mcp_command.main(["--help"])
    assert exited.value.code == 0
    assert "Govern every MCP tool call" in capsys.readouterr().out


def test_the_advice_installs_from_the_checkout_not_from_a_package_index() -> None:
    """The client is not on a package index (README): ``pip install "governance-client[mcp]"``
    finds nothing there, or whatever someone else published under that name."""
    assert 'pip install "governance-client' not in mcp_command.MISSING_SDK
    assert 'pip install "./governance_client[mcp]"' in mcp_command.MISSING_SDK
