"""`govctl` with a bad or hostile policy file (SPEC 10, 17): every one exits 1 with a reason
naming the file or the field, sends nothing, and costs what the file's size says. The
server's own answers are tests/test_govctl_e2e.py's; here a mock transport records what
would have been sent."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

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
    assert ("backtest: 9 recorded runs replayed, 5 would change (stopped by max_steps 2, "
            "no longer stopped 3).") in out.getvalue()


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
