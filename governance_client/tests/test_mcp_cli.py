"""``governance-mcp``'s command line and the words of a refused call (the gateway end to end,
with the SDK's client, an upstream and the service: the project's tests/test_mcp_gateway.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("mcp")

from governance_client.mcp_gateway.cli import parse
from governance_client.mcp_gateway.session import _id_in, blocked, refusal


def test_the_environment_replaces_url_and_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOVERNANCE_URL", "http://gov:8000")
    monkeypatch.setenv("GOVERNANCE_KEY", "agk_1")
    args, config = parse(["--agent", "a", "--", "npx", "-y", "server", "--flag"])
    assert (config.url, config.key, config.agent) == ("http://gov:8000", "agk_1", "a")
    assert args.command == ["npx", "-y", "server", "--flag"]  # its own flags stay its own
    assert (config.fail_open, config.max_wait, config.name, config.policy) == (
        False, 30.0, None, None)


def test_http_mode_and_options() -> None:
    args, config = parse(["--url", "u", "--key", "k", "--agent", "a", "--fail-open",
                          "--max-wait", "5", "--name", "files", "--policy", "strict",
                          "--upstream-url", "http://up/mcp", "--listen", "127.0.0.1:9000"])
    assert (args.host, args.port, args.command) == ("127.0.0.1", 9000, [])
    assert (config.fail_open, config.max_wait, config.name, config.policy) == (
        True, 5.0, "files", "strict")


@pytest.mark.parametrize("argv", [
    ["--agent", "a", "--", "cmd"],                                   # no URL nor key
    ["--url", "u", "--key", "k", "--agent", "a"],                    # no upstream
    ["--url", "u", "--key", "k", "--agent", "a", "--listen", "h:1"],  # --listen alone
    ["--url", "u", "--key", "k", "--agent", "a", "--upstream-url", "x", "--listen", "h:99999"],
    ["--url", "u", "--key", "k", "--agent", "a", "--upstream-url", "x", "--listen", "h:1",
     "--", "cmd"],                                                   # both upstreams
    ["--url", "u", "--key", "k", "--agent", "a", "--max-wait", "-1", "--", "cmd"],
])
def test_bad_command_lines_exit_2_with_a_message(argv: list[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GOVERNANCE_URL", raising=False)
    monkeypatch.delenv("GOVERNANCE_KEY", raising=False)
    with pytest.raises(SystemExit) as exited:
        parse(argv)
    assert exited.value.code == 2


def test_a_refused_call_says_reason_message_and_next_action() -> None:
    text = blocked("loop_detected", "search was called 3 times.", "Return the partial response.")
    assert text == ("Blocked by governance (loop_detected): search was called 3 times. "
                    "Return the partial response.")
    assert refusal(text) == {"content": [{"type": "text", "text": text}], "isError": True}
    assert blocked("killed", None) == "Blocked by governance (killed): no detail given."


def test_the_id_of_a_malformed_answer_is_read_when_it_can_be() -> None:
    from mcp_types import jsonrpc_message_adapter
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as bad:
        jsonrpc_message_adapter.validate_json('{"jsonrpc": "2.0", "id": 9, "result": 3}')
    assert _id_in(bad.value) == 9
    with pytest.raises(ValidationError) as garbage:
        jsonrpc_message_adapter.validate_json("not json")
    assert _id_in(garbage.value) is None


@pytest.mark.parametrize("from_env", [False, True])
def test_a_key_with_a_space_at_its_end_is_refused_without_showing_it(
        from_env: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by a tester: such a key made every check fail as if the service were down, so
    with --fail-open every call ran ungoverned, and the key was logged whole."""
    key = "gov_0743ab12cd34_S3cr3tS3cr3tS3cr3t "
    monkeypatch.setenv("GOVERNANCE_KEY", key)
    argv = ["--url", "u", "--agent", "a", "--fail-open", "--", "cmd"]
    with pytest.raises(SystemExit) as exited:
        parse(argv if from_env else ["--key", key, *argv])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "the agent key has a space at its end" in error and "S3cr3t" not in error


def test_the_config_never_shows_the_key() -> None:
    _, config = parse(["--url", "u", "--key", "gov_0743ab12cd34_S3cr3t", "--agent", "a", "--",
                       "cmd"])
    assert "S3cr3t" not in repr(config)
