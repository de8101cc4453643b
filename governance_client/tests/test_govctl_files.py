"""`govctl` with a bad or hostile policy file (SPEC 10, 17): every one exits 1 with a reason
naming the file or the field, sends nothing, and costs what the file's size says. The
server's own answers are tests/test_govctl_e2e.py's; here a mock transport records what
would have been sent."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from governance_client.govctl import main

GOOD = """\
teams:
  - slug: support
    policies:
      - name: default
        step_limits: {max_steps: 5, max_repeat_action: 3, no_progress_window: 4}
"""


def laughs() -> str:
    """Nine aliases of nine aliases...: a few hundred bytes, 3.4 billion values once walked."""
    text = "x0: &a0 [x, x, x, x, x, x, x, x, x]\n"
    for i in range(1, 10):
        text += f"x{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]\n"
    return text + GOOD.replace("step_limits:", "tools: {deny: *a9}\n        step_limits:")


def govctl(tmp_path: Path, content: str | bytes, *args: str, name: str = "p.yaml"
           ) -> tuple[int, str, list[httpx.Request]]:
    sent: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        if request.method == "GET":
            return httpx.Response(200, json={"team": {"slug": "support"}, "policies": []})
        return httpx.Response(200, json={"changed": True, "version": 2})

    path = tmp_path / name
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["--url", "http://governance.test", "--token", "gov_op_x_y", "policies",
                     "apply", str(path), *args], out=io.StringIO(),
                    transport=httpx.MockTransport(answer))
    return code, err.getvalue(), sent


def test_a_good_file_is_sent_to_its_policys_path(tmp_path):
    code, err, sent = govctl(tmp_path, GOOD)
    assert code == 0, err
    # Checked first (a dry run), then saved: a file is applied all or nothing.
    assert [(r.method, r.url.path) for r in sent] == [
        ("PUT", "/api/v1/teams/support/policies/default"),
        ("PUT", "/api/v1/teams/support/policies/default")]
    assert [json.loads(r.content)["dry_run"] for r in sent if "dry_run" in
            json.loads(r.content)] == [True]


@pytest.mark.parametrize(("content", "says"), [
    # A name that is a path: `support/../other` saved team other's policy.
    (GOOD.replace("slug: support", 'slug: "support/../other"'), "teams[0].slug"),
    (GOOD.replace("name: default", 'name: "../../../approvals/x/decide?"'),
     "teams[0].policies[0].name"),
    (GOOD.replace("name: default", 'name: "a#b"'), "teams[0].policies[0].name"),
    (GOOD.replace("name: default", 'name: ".."'), "teams[0].policies[0].name"),
    # The document's own rules, as `manage.py apply_policies` reads them (found by an
    # attacker: govctl saved what it refuses).
    (GOOD.replace("slug: support", "slug: SUPPORT"), "teams[0].slug 'SUPPORT' is not a team"),
    (GOOD + GOOD[len("teams:\n"):], "teams[1].slug 'support': team slugs must be unique"),
    (GOOD + GOOD[GOOD.index("      - name"):],
     "teams[0].policies[1].name 'default': policy names must be unique in a team"),
    # What the server's reader refuses (docs/policies.md, "Bounds of a document"), refused
    # before this process walks it or encodes it as JSON.
    (laughs(), "holds more than 50000 values"),
    ("teams: &t\n  - slug: support\n    policies:\n      - name: default\n        x: *t\n",
     "nests more than 16 levels"),
    ("teams: " + "[" * 3000 + "]" * 3000 + "\n", "nests more than 16 levels"),
    (GOOD + "        mode: shadow\n        mode: enforce\n", "found the key 'mode' twice"),
    (GOOD.replace("max_steps: 5", "max_steps: 2024-02-30"), "is not valid YAML"),
    (b"teams: \xff\xfe\n", "is not UTF-8 text"),
    # A tab says so (found by a newcomer: PyYAML's words do not).
    (GOOD.replace("    policies:", "\tpolicies:"), "YAML indents with spaces, never tabs"),
    (GOOD + "#" * (256 * 1024), "is over 256 KiB"),
    # Unknown keys are errors (SPEC 3), the request's own above all: a policy's
    # `dry_run: true` made the save a dry run, and govctl said "version 1" of what was not
    # saved (found by a tester); `note` or `confirm_stops` would have stood for the flags.
    (GOOD + "        dry_run: true\n", "teams[0].policies[0].dry_run: unknown field"),
    (GOOD + "        note: from the file\n", "teams[0].policies[0].note: unknown field"),
    (GOOD + "        confirm_stops: true\n",
     "teams[0].policies[0].confirm_stops: unknown field"),
    (GOOD + "        since: 1d\n", "teams[0].policies[0].since: unknown field"),
    (GOOD + "        limit: 1\n", "teams[0].policies[0].limit: unknown field"),
    # A team's and the document's keys are govctl's alone to read: an unknown one was
    # passed over without a word.
    (GOOD.replace("    policies:", "    dry_run: true\n    policies:"),
     "teams[0].dry_run: unknown field"),
    ("dry_run: true\n" + GOOD, "dry_run: unknown field"),
])
def test_a_bad_file_exits_1_with_the_reason_and_sends_nothing(tmp_path, content, says):
    code, err, sent = govctl(tmp_path, content)
    assert code == 1 and says in err, err
    assert "Traceback" not in err
    assert sent == []


def test_a_json_file_too_deep_is_refused_without_a_traceback(tmp_path):
    deep = '{"teams": ' + "[" * 5000 + "]" * 5000 + "}"
    code, err, sent = govctl(tmp_path, deep, name="p.json")
    assert code == 1 and "nests more than 16 levels" in err and sent == []


def test_an_approval_id_or_team_that_is_a_path_is_refused(tmp_path):
    for args in (["approvals", "decide", "../../killswitch", "approve"],
                 ["approvals", "list", "--team", "support/../other"],
                 ["policies", "export", "--team", "x?y"]):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(["--url", "http://governance.test", "--token", "gov_op_x_y", *args],
                        out=io.StringIO(), transport=httpx.MockTransport(
                            lambda request: pytest.fail(f"sent {request.url}")))
        assert code == 1 and "is not a name the API has" in err.getvalue()


def test_a_dry_run_says_in_words_which_runs_the_draft_stops_and_which_it_no_longer_does(
        tmp_path):
    # Found by a newcomer: the backtest's `by_reason` key `none` (runs the draft does not
    # stop) was printed as "(none 3)".
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/backtest"):
            return httpx.Response(200, json={"runs": 9, "changed": 5, "by_reason": {
                "max_steps": 2, "none": 3}})
        if request.method == "GET":
            return httpx.Response(200, json={"version": 1, "document": {"name": "default"}})
        return httpx.Response(200, json={"changed": True, "version": 2,
                                         "document": {"name": "default", "mode": "shadow"}})

    path = tmp_path / "p.yaml"
    path.write_text(GOOD)
    out = io.StringIO()
    code = main(["--url", "http://governance.test", "--token", "gov_op_x_y", "policies",
                 "apply", str(path), "--dry-run"], out=out,
                transport=httpx.MockTransport(answer))
    assert code == 0
    assert ("5 of the 9 ended runs of support/default started within 30 days (the newest "
            "1,000 at most), replayed whole, would change (2 stopped by max_steps, 3 no "
            "longer stopped).") in out.getvalue()


@pytest.mark.parametrize("url", ["http://governance.test", "http://governance.test/",
                                 "http://governance.test/api/v1", "http://governance.test/api/v1/"])
def test_the_url_may_be_given_with_the_apis_prefix(tmp_path, url):
    # Found by a newcomer: --url .../api/v1 answered "not_found (404): Not Found".
    sent: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200, json={"team": {"slug": "support", "name": "S"},
                                         "policies": []})

    code = main(["--url", url, "--token", "gov_op_x_y", "policies", "export", "--team",
                 "support"], out=io.StringIO(), transport=httpx.MockTransport(answer))
    assert code == 0
    assert [r.url.path for r in sent] == ["/api/v1/teams/support/policies"]


@pytest.mark.parametrize(("url", "token", "said"), [
    ("http://[::1", "gov_op_x_y", "is not a URL"),
    ("http://governance.test", "gov_op_x_\u00e9\u20ac", "copy it again"),
])
def test_a_url_or_token_no_server_can_be_asked_with_is_a_reason_not_a_traceback(
        capsys: pytest.CaptureFixture[str], url: str, token: str, said: str) -> None:
    # Found by an attacker: a traceback of httpx's (InvalidURL, UnicodeEncodeError).
    code = main(["--url", url, "--token", token, "policies", "export", "--team", "support"],
                out=io.StringIO(), transport=httpx.MockTransport(lambda r: httpx.Response(200)))
    assert code == 1
    assert said in capsys.readouterr().err


def test_a_busy_servers_429_is_sent_again_after_its_retry_after() -> None:
    """A team's share of the server's time used up answers 429 with Retry-After
    (docs/serving.md): govctl waits and sends the call again, a few times at most."""
    from governance_client.govctl import RETRIES_429, Api

    sent: list[str] = []

    def busy_then_answer(request: httpx.Request) -> httpx.Response:
        sent.append(request.url.path)
        if len(sent) < 3:
            return httpx.Response(429, headers={"Retry-After": "0"}, json={"error": {
                "code": "too_many_requests", "message": "busy", "fields": {}}})
        return httpx.Response(200, json={"teams": []})

    api = Api("http://127.0.0.1:1", "gov_op_x", transport=httpx.MockTransport(busy_then_answer))
    assert api.call("GET", "/teams") == (200, {"teams": []})
    assert sent == ["/api/v1/teams"] * 3

    sent.clear()
    always = Api("http://127.0.0.1:1", "gov_op_x", transport=httpx.MockTransport(
        lambda request: sent.append(request.url.path) or httpx.Response(
            429, headers={"Retry-After": "0"}, json={"error": {
                "code": "too_many_requests", "message": "busy", "fields": {}}})))
    with pytest.raises(Exception, match="too_many_requests"):
        always.call("GET", "/teams")
    assert len(sent) == RETRIES_429 + 1


CONFIRM_409 = {"error": {
    "code": "confirmation_required",
    "message": "Policy default would stop 147 of its 147 most recent ended runs (started within "
               "30 days) at their first step: tool_denied 147. Send it again with "
               "\"confirm_stops\": true to save it.",
    "fields": {},
    "impacts": [{"policy": "default", "runs": 147, "stopped_at_once": 147,
                 "by_reason": {"tool_denied": 147}, "since_days": 30}]}}


def dry_run_to_confirm(tmp_path: Path, content: str) -> tuple[int, str, str, list[Any]]:
    """A dry run whose changes of `default` the server asks to confirm (409 without
    confirm_stops), as a deny-all of a busy policy is: the PUTs and backtests it sent."""
    bodies: list[Any] = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        bodies.append((request.method, request.url.path, body))
        if request.url.path.endswith("/backtest"):
            return httpx.Response(200, json={
                "runs": 148, "changed": 148, "by_reason": {"tool_denied": 148},
                "summary": "This draft would stop 145 of 148 runs earlier; stop 3 runs later "
                           "or for another reason; and cause no rate-limit wait and no "
                           "approval request."})
        if request.method == "GET":
            return httpx.Response(200, json={"version": 3, "document": {"name": "default"}})
        if request.url.path.endswith("/default") and not body.get("confirm_stops"):
            return httpx.Response(409, json=CONFIRM_409)
        return httpx.Response(200, json={"changed": True, "version": 4 if "default" in
                                         request.url.path else 1, "document": body})

    path = tmp_path / "p.yaml"
    path.write_text(content)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["--url", "http://governance.test", "--token", "gov_op_x_y", "policies",
                     "apply", str(path), "--dry-run"], out=out,
                    transport=httpx.MockTransport(answer))
    return code, out.getvalue(), err.getvalue(), bodies


def test_a_dry_run_counts_a_change_to_confirm_once_as_refused(tmp_path):
    # Found by a newcomer: a file of one policy to confirm said "1 policy would change",
    # then "nothing saved: 1 of 2 policies refused".
    code, out, err, _ = dry_run_to_confirm(tmp_path, GOOD)
    assert code == 1
    assert "policy support/default: would change (version 3 -> 4)" in out
    assert "1 policy would change only with --confirm-stops (dry run: nothing saved)" in out
    assert "nothing saved: 1 of 1 policy refused" in err, err

    # With a policy the apply would save beside it: each counted once, in its own words.
    other = GOOD + GOOD[GOOD.index("      - name"):].replace("name: default", "name: other")
    code, out, err, _ = dry_run_to_confirm(tmp_path, other)
    assert code == 1
    assert ("1 policy would change; 1 policy would change only with --confirm-stops "
            "(dry run: nothing saved)") in out, out
    assert "policy support/other: new (version 1)" in out
    assert "nothing saved: 1 of 2 policies refused" in err, err


def test_a_dry_runs_counts_each_say_what_they_are_of(tmp_path):
    # Found by a newcomer: "148 recorded runs replayed, 148 would change", then "145 of 148
    # runs earlier", then "147 of its 147 most recent ended runs" (printed twice, in two
    # wordings), with nothing saying which runs each count was of.
    code, out, err, sent = dry_run_to_confirm(tmp_path, GOOD)
    assert code == 1
    assert ("backtest: 148 of the 148 ended runs of support/default started within 30 days "
            "(the newest 1,000 at most), replayed whole, would change (148 stopped by "
            "tool_denied).") in out, out
    # The window and bound said are the ones asked for.
    (backtest,) = [body for method, path, body in sent if path.endswith("/backtest")]
    assert (backtest["since"], backtest["limit"]) == ("30d", 1000)
    # The save's own count once, and what it is of.
    assert err.count("147") == 3 and "147 of 147 recent runs" not in err, err
    assert "that count is the save's own check" in err and "can differ" in err, err


def test_without_pyyaml_the_advice_installs_from_the_checkout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The client is not on a package index (README): the advice was
    ``pip install 'governance-client[cli]'``, which finds nothing there."""
    import sys

    from governance_client import govctl

    monkeypatch.setitem(sys.modules, "yaml", None)
    with pytest.raises(govctl.Refused) as refused:
        govctl._yaml()
    assert "governance-client[" not in str(refused.value)
    assert "./governance_client[cli]" in str(refused.value)
