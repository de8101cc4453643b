"""`govctl` reading answers it must not trust (SPEC 17): texts an agent wrote (action names,
reasons, notes) and a server's error messages shown as text a terminal cannot act on, and
answers that are not the operator API's said so in one line, never a traceback. A small
HTTP server on 127.0.0.1 answers as each test says, through the real transport."""

from __future__ import annotations

import contextlib
import io
import json
import threading
import unicodedata
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from governance_client.govctl import main

TOKEN = "gov_op_3f9c0a1b2c4d_s3cr3t-s3cr3t-s3cr3t"
# What a terminal acts on or draws other than as written: C0, DEL, C1, format characters
# (bidi overrides and isolates among them), line and paragraph separators, lone surrogates.
UNSAFE = {"Cc", "Cf", "Cs", "Zl", "Zp"}
ESC = "\x1b"
RUN_ID = "3f2a9c01-5d7e-4c1b-9a0e-2b6f8d4c1a77"


def unsafe_in(text: str) -> list[str]:
    return [ch for ch in text if ch != "\n" and unicodedata.category(ch) in UNSAFE]


Answer = tuple[int, Any, dict[str, str]]  # status, body (bytes, or data sent as JSON), headers


class Fake:
    """Answers each (method, path) as set in ``answers``; any other call is a 404 of the
    operator API's form. ``sent``: each call's method, path and JSON body."""

    def __init__(self) -> None:
        self.answers: dict[tuple[str, str], Answer] = {}
        self.sent: list[tuple[str, str, Any]] = []
        self.url = ""

    def answer(self, method: str, path: str, body: Any, status: int = 200,
               **headers: str) -> None:
        self.answers[(method, "/api/v1" + path)] = (status, body, headers)


@pytest.fixture
def fake() -> Iterator[Fake]:
    state = Fake()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            path = self.path.split("?")[0]
            state.sent.append((self.command, path, json.loads(raw) if raw else None))
            status, body, headers = state.answers.get((self.command, path), (404, {"error": {
                "code": "not_found", "message": "Not found.", "fields": {}}}, {}))
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(status)
            headers = {"Content-Type": "application/json", **headers}
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_PUT = do_POST = _answer

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    # A short poll: shutdown() waits for one (0.5 s by default, at every test).
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_port}"
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def govctl(fake: Fake, *args: str, token: str = TOKEN) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["--url", fake.url, "--token", token, *args], out=out)
    return code, out.getvalue(), err.getvalue()


# An agent's action named to read as another on a terminal: ESC [4D moves the cursor four
# columns back, so "pay." is written over and the line reads "search.docs".
DISGUISED = "pay.\x1b[4Dsearch.docs"
APPROVAL = {"id": "7b0e", "status": "pending", "run_id": "3f2a9c01-aaaa",
            "action": {"name": DISGUISED, "args": {"to": "evil\u202eknab", "amount": 900}},
            "expires_at": "2026-12-06T14:40:12.123456+00:00"}


def test_an_approvals_action_name_is_shown_escaped_not_obeyed(fake: Fake) -> None:
    fake.answer("GET", "/teams/support/approvals", {"approvals": [
        APPROVAL, {**APPROVAL, "id": "8c1f\n8c1f  approved", "status": "pending\x9b2K"}]})
    code, out, err = govctl(fake, "approvals", "list", "--team", "support")
    assert code == 0, err
    assert unsafe_in(out) == [], out
    assert "pay.\\x1b[4Dsearch.docs" in out
    assert '"evil\\u202eknab"' in out
    # One line per approval: a line break in a value cannot make a row of its own.
    assert len(out.splitlines()) == 2 and "8c1f\\n8c1f  approved" in out
    assert "pending\\x9b2K" in out


def test_json_stays_the_servers_exact_data_and_holds_no_control_character(fake: Fake) -> None:
    fake.answer("GET", "/teams/support/approvals", {"approvals": [APPROVAL]})
    code, out, _ = govctl(fake, "approvals", "list", "--team", "support", "--json")
    assert code == 0
    assert unsafe_in(out) == [] and json.loads(out) == [APPROVAL]


def test_a_runs_json_is_shown_as_written_but_what_a_terminal_acts_on(fake: Fake) -> None:
    # Found by a tester: `runs show` printed an agent "café-bot" as "caf\\u00e9-bot".
    run = {"run_id": RUN_ID, "agent": "café-bot 🧑‍💻 日本", "output": "done\x1b[2J\u202e",
           "metadata": {"tag": "x\U000e0041y", "note": "line\nbreak"}}
    fake.answer("GET", f"/teams/support/runs/{RUN_ID}", run)
    fake.answer("GET", "/teams/support/runs", {"runs": [run]})
    for args in (("runs", "show", RUN_ID), ("runs", "list", "--json")):
        code, out, err = govctl(fake, *args, "--team", "support")
        assert code == 0, err
        assert "café-bot" in out and "日本" in out, out
        assert unsafe_in(out) == [], out
        assert "\\u001b[2J\\u202e" in out and "\\udb40\\udc41" in out
        assert json.loads(out) in (run, [run])  # still the server's exact data


def test_a_runs_list_says_where_the_next_page_starts(fake: Fake) -> None:
    """A page stops at --limit runs or at about 4 MB of JSON; the server names the next
    page's `after` (`next_after`), which `runs list` passes on as --after."""
    run = {"run_id": RUN_ID, "agent": "bot", "status": "completed", "stop_reason": None,
           "steps": 1, "cost_usd": 0.0, "started_at": "2026-12-06T14:40:12.123Z"}
    fake.answer("GET", "/teams/support/runs", {"runs": [run], "next_after": RUN_ID})
    code, out, err = govctl(fake, "runs", "list", "--team", "support", "--after", RUN_ID)
    assert code == 0, err
    assert out.splitlines()[-1] == f"more runs follow: add --after {RUN_ID}"
    code, out, err = govctl(fake, "runs", "list", "--team", "support", "--json")
    assert code == 0 and json.loads(out) == [run]
    assert f"more runs follow: add --after {RUN_ID}" in err
    fake.answer("GET", "/teams/support/runs", {"runs": [run], "next_after": None})
    code, out, err = govctl(fake, "runs", "list", "--team", "support")
    assert code == 0 and "more runs" not in out + err


def test_a_runs_decisions_rules_and_reasons_are_shown_escaped(fake: Fake) -> None:
    decision = {"id": 41, "step": 3, "outcome": "allow", "reason": "step_ok\u2066",
                "action": {"name": "search\u200b.docs\r"},
                "rule": {"name": "max_steps\x1b]0;t\x07", "scope": "run",
                         "limit": {"max\x1bsteps": "2\u2028"}, "observed": {"steps": 3}}}
    fake.answer("GET", "/teams/support/runs/r1/decisions", {"decisions": [decision]})
    code, out, err = govctl(fake, "runs", "decisions", "r1", "--team", "support")
    assert code == 0, err
    assert unsafe_in(out) == [] and len(out.splitlines()) == 1, out
    assert "search\\u200b.docs\\r" in out and "max_steps\\x1b]0;t\\x07" in out
    assert "step_ok\\u2066" in out and "max\\x1bsteps=2\\u2028" in out


def test_a_run_with_no_decisions_of_its_own_names_its_sub_agents(fake: Fake) -> None:
    # Found by a newcomer: "no decisions" of a root whose steps were all its sub-agents'.
    fake.answer("GET", "/teams/support/runs/r1/decisions", {"decisions": []})
    fake.answer("GET", "/teams/support/runs/r1", {"run_id": "r1", "steps": 4,
                                                  "children": ["c1", "c2\x1b[2J"]})
    code, out, err = govctl(fake, "runs", "decisions", "r1", "--team", "support")
    assert code == 0, err
    assert out.splitlines() == [
        "no decisions",
        "its steps (4) are its sub-agents' checks; their runs: c1, c2\\x1b[2J "
        "(govctl runs decisions --team support RUN)"], out
    fake.answer("GET", "/teams/support/runs/r2/decisions", {"decisions": []})
    fake.answer("GET", "/teams/support/runs/r2", {"run_id": "r2", "steps": 0, "children": []})
    code, out, _ = govctl(fake, "runs", "decisions", "r2", "--team", "support")
    assert (code, out) == (0, "no decisions\n")


def test_a_runs_agent_and_a_kill_switchs_reason_are_shown_escaped(fake: Fake) -> None:
    fake.answer("GET", "/teams/support/runs", {"runs": [{
        "run_id": "r1", "status": "stopped", "stop_reason": "max\x1b[2Jsteps",
        "agent": "bot\u202e", "steps": 3, "cost_usd": 0.5,
        "started_at": "2026-12-06T14:40:12+00:00", "parent_run_id": None}]})
    code, out, _ = govctl(fake, "runs", "list", "--team", "support")
    assert code == 0 and unsafe_in(out) == [] and "max\\x1b[2Jsteps" in out and "bot\\u202e" in out
    fake.answer("POST", "/killswitch", {
        "scope": "team", "team": "support", "agent": None, "run": None, "engaged": True,
        "changed": False, "message": "", "switch": {
            "engaged_by": "mallory\x1b[1A", "engaged_at": "2026-12-06T14:40:12+00:00",
            "released_at": None, "reason": "fine\nteam kill switch: released"}})
    code, out, _ = govctl(fake, "killswitch", "engage", "--scope", "team", "--team", "support",
                          "--reason", "x")
    assert code == 0 and unsafe_in(out) == [] and len(out.splitlines()) == 1, out
    assert "mallory\\x1b[1A" in out and "fine\\nteam kill switch" in out


def test_a_servers_refusal_is_shown_escaped_on_stderr(fake: Fake) -> None:
    fake.answer("POST", "/approvals/7b0e/decide", {"error": {
        "code": "approval_decided\x1b[2K", "message": "Already approved.\u202e\nby: admin",
        "fields": {"note\x1b": "too long\x07"}}}, status=409)
    code, _, err = govctl(fake, "approvals", "decide", "7b0e", "deny", "--note", "no")
    assert code == 1
    assert unsafe_in(err) == [], err
    assert "approval_decided\\x1b[2K (409): Already approved.\\u202e\\nby: admin" in err
    assert "note\\x1b: too long\\x07" in err


POLICY = {"name": "default", "mode": "enforce",
          "step_limits": {"max_steps": 5, "max_repeat_action": 3, "no_progress_window": 4},
          "tools": {"allow": None, "deny": [DISGUISED, "a\u202eb", "tab\there", "line\nbreak"]}}


def test_an_export_is_terminal_safe_and_reads_back_as_the_servers_data(fake: Fake) -> None:
    yaml = pytest.importorskip("yaml")
    team = {"slug": "support", "name": "Support \u00e9quipe", "webhook_url": None}
    fake.answer("GET", "/teams/support/policies", {"team": team, "policies": [
        {"name": "default", "version": 2, "document": POLICY}]})
    code, out, err = govctl(fake, "policies", "export", "--team", "support")
    assert code == 0, err
    assert unsafe_in(out) == [], out
    assert yaml.safe_load(out) == {"teams": [{**team, "policies": [POLICY]}]}
    # Escaped in the scalars that need it only: a team's name with an accent reads as written.
    assert '- "a\\u202Eb"' in out and "name: Support \u00e9quipe" in out, out


def test_a_dry_runs_diff_and_backtest_are_terminal_safe(fake: Fake, tmp_path: Any) -> None:
    pytest.importorskip("yaml")
    fake.answer("PUT", "/teams/support/policies/default", {
        "changed": True, "version": 3, "document": POLICY})
    fake.answer("GET", "/teams/support/policies/default", {
        "version": 2, "document": {**POLICY, "tools": {"allow": None, "deny": []}}})
    fake.answer("POST", "/teams/support/policies/default/backtest", {
        "runs": 4, "changed": 1, "by_reason": {"tool_denied\x1b[1A": 1},
        "summary": "fine\x1b[2K\u202e"})
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"teams": [{"slug": "support", "policies": [POLICY]}]}))
    code, out, err = govctl(fake, "policies", "apply", str(path), "--dry-run")
    assert code == 0, err
    assert unsafe_in(out) == [], out
    assert "+  - \"pay.\\e[4Dsearch.docs\"" in out, out
    assert "1 stopped by tool_denied\\x1b[1A" in out and "backtest: fine\\x1b[2K\\u202e" in out


@pytest.mark.parametrize(("token", "said"), [
    # Found by a tester: httpx's "Illegal header value b'Bearer gov_op_...'" was the reason,
    # the whole token in it.
    (TOKEN + " ", "the token has a space at its end"),
    (TOKEN + "\n", "the token has a line break at its end"),
    ("\t" + TOKEN, "the token has a tab at its start"),
    (TOKEN[:20] + " " + TOKEN[20:], "the token has a space inside it"),
    (TOKEN[:20] + "\x00" + TOKEN[20:], "the token has a control character (U+0000) inside it"),
    (TOKEN + " \n", "the token has a space at its end"),
    (TOKEN + "\r\n", "the token has a carriage return at its end"),
    ("Bearer " + TOKEN, "give the token alone"),
    ("gov_0a1b2c3d4e5f_" + TOKEN[20:], "is not an operator token"),
])
def test_a_token_of_the_wrong_form_is_refused_without_showing_it(
        fake: Fake, token: str, said: str) -> None:
    code, out, err = govctl(fake, "approvals", "list", "--team", "support", token=token)
    assert code == 1 and said in err, err
    assert "copy it again" in err or "Bearer" in token or "gov_0" in token, err
    assert TOKEN[20:] not in err + out and fake.sent == []


def test_a_token_a_server_answers_with_is_masked(fake: Fake) -> None:
    # A proxy, or a server at a wrong --url, quoting the header back: into a CI job's log.
    fake.answer("GET", "/teams/support/approvals", {"error": {
        "code": "unauthorized", "message": f"bad header: Bearer {TOKEN}", "fields": {}}},
        status=401)
    code, out, err = govctl(fake, "approvals", "list", "--team", "support")
    assert code == 1 and TOKEN not in err and TOKEN[20:] not in err, err
    assert "bad header: Bearer gov_op_3f9c0a1b2c4d_..." in err, err
    fake.answer("GET", "/teams/support/approvals", {"approvals": [
        {**APPROVAL, "action": {"name": TOKEN, "args": {"t": TOKEN}}}]})
    code, out, err = govctl(fake, "approvals", "list", "--team", "support")
    assert code == 0 and TOKEN[20:] not in out, out


def not_the_api(fake: Fake, status: int, kind: str) -> str:
    return (f"govctl: the server at {fake.url} answered something that is not the operator "
            f"API (HTTP {status}, {kind}): is --url right? (GOVCTL_DEBUG=1 shows where "
            "govctl stopped reading it)\n")


@pytest.mark.parametrize(("status", "body", "headers", "kind"), [
    # Found by a tester, each a traceback: a proxy's login page (TypeError), an object
    # without the listing (KeyError 'runs'), a list (TypeError).
    (200, b"<html><form>Sign in</form></html>", {"Content-Type": "text/html"}, "text/html"),
    (200, {}, {}, "application/json"),
    (200, [1, 2], {}, "application/json"),
    (200, b"", {"Content-Type": "text/plain; charset=utf-8"}, "text/plain"),
    # The listing's rows not of its form, and JSON nested past Python's stack.
    (200, {"runs": [1]}, {}, "application/json"),
    (200, {"runs": [{"run_id": "r1"}]}, {}, "application/json"),
    (200, {"runs": [{"run_id": "r1", "status": "running", "agent": "a", "steps": 1,
                     "cost_usd": "free", "started_at": None}]}, {}, "application/json"),
    (200, b"[" * 100_000 + b"]" * 100_000, {}, "application/json"),
    # A refusal that is not the API's: a gateway's page.
    (502, b"<html>Bad Gateway</html>", {"Content-Type": "text/html"}, "text/html"),
    (404, {"detail": "Not Found"}, {}, "application/json"),
])
def test_an_answer_that_is_not_the_operator_apis_is_said_in_one_line(
        fake: Fake, status: int, body: Any, headers: dict[str, str], kind: str) -> None:
    fake.answer("GET", "/teams/support/runs", body, status, **headers)
    code, out, err = govctl(fake, "runs", "list", "--team", "support")
    assert (code, out, err) == (1, "", not_the_api(fake, status, kind))


@pytest.mark.parametrize("command", ["show", "decisions"])
def test_a_runs_first_8_characters_are_refused_saying_to_give_the_whole_id(
        fake: Fake, command: str) -> None:
    # Found by a newcomer: the dashboard shows 8 characters, and the API answered "No such
    # run." to them.
    code, out, err = govctl(fake, "runs", command, "3f2a9c01", "--team", "support")
    assert (code, out) == (1, "") and "give the whole id" in err
    assert fake.sent == []
    # The whole id without its hyphens is one the API takes (found by a review).
    govctl(fake, "runs", command, RUN_ID.replace("-", ""), "--team", "support")
    assert len(fake.sent) == 1


def test_an_https_url_on_a_plain_http_server_says_to_try_http(fake: Fake) -> None:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["--url", fake.url.replace("http://", "https://"), "--token", TOKEN,
                     "runs", "list", "--team", "support"], out=out)
    assert code == 1 and "try --url http://" in err.getvalue(), err.getvalue()


def test_a_stream_that_cannot_write_a_character_gets_its_escape(fake: Fake) -> None:
    # A pipe in a legacy code page (found by a review: JSON with emoji as written raised
    # UnicodeEncodeError there).
    fake.answer("GET", f"/teams/support/runs/{RUN_ID}", {"run_id": RUN_ID, "agent": "bot 🤖"})
    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="cp1252")
    code = main(["--url", fake.url, "--token", TOKEN, "runs", "show", RUN_ID, "--team",
                 "support"], out=out)
    out.flush()
    assert code == 0 and b"bot \\U0001f916" in raw.getvalue(), raw.getvalue()


def test_govctl_debug_shows_where_the_reading_stopped(
        fake: Fake, monkeypatch: pytest.MonkeyPatch) -> None:
    # A misread answer is said in one line; one of govctl's own mistakes reading the API's
    # answer would be said the same way, so GOVCTL_DEBUG=1 gives its traceback instead.
    fake.answer("GET", "/teams/support/runs", {"runs": [{"run_id": "r1"}]})
    monkeypatch.setenv("GOVCTL_DEBUG", "0")
    assert govctl(fake, "runs", "list", "--team", "support")[0] == 1
    monkeypatch.setenv("GOVCTL_DEBUG", "1")
    with pytest.raises(KeyError):
        govctl(fake, "runs", "list", "--team", "support")


@pytest.mark.parametrize("args", [
    ("approvals", "list", "--team", "support"),
    ("approvals", "decide", "7b0e", "approve"),
    ("killswitch", "engage", "--scope", "team", "--team", "support", "--reason", "x"),
    ("runs", "decisions", "r1", "--team", "support"),
    ("runs", "show", "r1", "--team", "support"),
    ("policies", "export", "--team", "support"),
])
def test_every_command_says_so_of_an_empty_object(fake: Fake, args: tuple[str, ...]) -> None:
    for method, path in [("GET", "/teams/support/approvals"), ("POST", "/approvals/7b0e/decide"),
                         ("POST", "/killswitch"), ("GET", "/teams/support/runs/r1/decisions"),
                         ("GET", "/teams/support/policies")]:
        fake.answer(method, path, {"x": [1]})
    fake.answer("GET", "/teams/support/runs/r1", b"<html></html>", 200,
                **{"Content-Type": "text/html"})
    code, out, err = govctl(fake, *args)
    assert (code, out) == (1, "") and len(err.splitlines()) == 1, err
    assert "is not the operator API" in err, err


def test_an_apply_says_so_of_an_answer_without_its_fields(fake: Fake, tmp_path: Any) -> None:
    fake.answer("PUT", "/teams/support/policies/default", {"version": "x"})
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"teams": [{"slug": "support", "policies": [POLICY]}]}))
    code, out, err = govctl(fake, "policies", "apply", str(path))
    assert (code, out, err) == (1, "", not_the_api(fake, 200, "application/json"))


def test_a_refusals_fields_as_a_list_are_listed(fake: Fake) -> None:
    # Found by a tester: `fields` a list, not the API's object, was an AttributeError.
    fake.answer("GET", "/teams/support/runs", {"error": {
        "code": "invalid_request", "message": "Bad.", "fields": ["limit", {"a": 1}],
        "impacts": [1, "x"]}}, 422)
    code, out, err = govctl(fake, "runs", "list", "--team", "support")
    assert (code, out) == (1, "")
    assert err == "govctl: invalid_request (422): Bad.\n  limit\n  {'a': 1}\n", err


@pytest.mark.parametrize("retry_after", ["\u00b2", "1.5", "-1", "", "99999999999999999999"])
def test_a_429s_retry_after_that_is_not_seconds_is_not_waited_for(
        fake: Fake, retry_after: str) -> None:
    # Found by a tester: Retry-After "²" ("²".isdigit() is True) was int()'s ValueError.
    fake.answer("GET", "/teams/support/runs", {"error": {
        "code": "too_many_requests", "message": "Busy.", "fields": {}}}, 429,
        **{"Retry-After": retry_after})
    code, out, err = govctl(fake, "runs", "list", "--team", "support")
    assert (code, out, err) == (1, "", "govctl: too_many_requests (429): Busy.\n")
    assert len(fake.sent) == 1


def test_an_apply_to_a_login_page_says_so_once_and_stops(fake: Fake, tmp_path: Any) -> None:
    # Not one refusal per policy, then "nothing saved: 2 of 2 policies refused": the server
    # is not the operator API, and that is the one thing to say.
    page = (b"<html>Sign in</html>", 200, {"Content-Type": "text/html"})
    for path in ("/teams/support/policies", "/teams/support/policies/default",
                 "/teams/support/policies/other"):
        for method in ("GET", "PUT"):
            fake.answer(method, path, page[0], page[1], **page[2])
    document = {"teams": [{"slug": "support", "name": "Support", "policies": [
        POLICY, {**POLICY, "name": "other"}]}]}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(document))
    code, out, err = govctl(fake, "policies", "apply", str(path))
    assert (code, out, err) == (1, "", not_the_api(fake, 200, "text/html"))
    assert [path for _, path, _ in fake.sent] == ["/api/v1/teams/support/policies"]
