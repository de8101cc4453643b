"""An agent key the client cannot send is refused when the client is made, and no message or
log line repeats a key. Found by a tester: a key with a trailing space made httpx refuse the
Authorization header ("Illegal header value b'Bearer gov_...'", the whole key in the text) on
every attempt; the client took that for an outage, so with fail_mode="open" every action ran
ungoverned ("decided locally") and the key was logged."""

from __future__ import annotations

import logging
import traceback

import httpx
import pytest

from governance_client import AsyncGovernanceClient, GovernanceClient, GovernanceUnavailable
from governance_client.errors import agent_key_problem, masked_key

KEY = "gov_0743ab12cd34_" + "S3cr3t-" * 6  # the form the service issues


@pytest.mark.parametrize(("key", "problem"), [
    (KEY + " ", "the agent key has a space at its end"),
    (KEY + "\n", "the agent key has a line break at its end"),
    (KEY + " \r\n", "the agent key has a space at its end"),
    ("\t" + KEY, "the agent key has a tab at its start"),
    (KEY[:10] + " " + KEY[10:], f"the agent key has a space inside it (character 11 of "
                                f"{len(KEY) + 1})"),
    (KEY[:10] + "\x00" + KEY[10:], "the agent key has a control character (U+0000) inside it"),
    (KEY + "\u00e9", "the agent key has a character that is not ASCII (U+00E9) at its end"),
    ("", "the agent key is empty"),
])
@pytest.mark.parametrize("make", [GovernanceClient, AsyncGovernanceClient])
def test_a_key_no_request_can_carry_is_refused_at_once_naming_the_problem_not_the_key(
        make: type, key: str, problem: str) -> None:
    with pytest.raises(ValueError) as refused:
        # fail-open would have run every action ungoverned with such a key.
        make("http://governance.test", key, fail_mode="open")
    message = str(refused.value)
    assert message.startswith(problem), message
    assert KEY[8:] not in message and "S3cr3t" not in message


def test_a_key_of_the_issued_form_is_taken_as_it_is() -> None:
    assert agent_key_problem(KEY) is None
    assert agent_key_problem("test-key") is None
    assert masked_key(KEY) == "gov_0743…"
    assert masked_key("short-key") == "…"  # too short to show any of it


def illegal_header(request: httpx.Request) -> httpx.Response:
    """What httpx raises for a header it cannot send: the value, so the key, in its text."""
    raise httpx.LocalProtocolError(
        f"Illegal header value b'{request.headers['Authorization']}'", request=request)


def test_no_error_or_log_line_repeats_the_key(caplog: pytest.LogCaptureFixture) -> None:
    """Whatever makes a transport name the Authorization header, the error says the key's
    masked form only, and so does the chain a traceback prints."""
    caplog.set_level(logging.DEBUG)
    transport = httpx.MockTransport(illegal_header)
    with GovernanceClient("http://governance.test", KEY, transport=transport,
                          backoff=0) as closed, pytest.raises(GovernanceUnavailable) as failed:
        closed.start_run("bot")
    printed = "".join(traceback.format_exception(failed.value))
    assert "gov_0743…" in printed and "S3cr3t" not in printed
    with GovernanceClient("http://governance.test", KEY, transport=transport, backoff=0,
                          fail_mode="open", journal=False) as open_:
        run = open_.start_run("bot")  # started locally, and logged so
        decision = run.check("search", {"q": "x"})
    assert run.local and decision.local
    assert caplog.records and "S3cr3t" not in caplog.text
    assert "S3cr3t" not in repr(decision)


def test_a_clients_settings_never_print_the_key() -> None:
    from governance_client._core import Settings

    settings = Settings(base_url="http://127.0.0.1:9", api_key="gov_0743_secretpart")
    assert "secretpart" not in repr(settings) and "secretpart" not in str(settings)
