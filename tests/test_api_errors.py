"""Bad input answers the right SPEC 5.3 error as JSON and changes nothing."""

from __future__ import annotations

import json

import pytest
from django.test import Client
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies.services import agent_key_create, agent_key_revoke
from runs.models import Decision, Run

pytestmark = pytest.mark.django_db


@pytest.fixture
def run_id(api):
    return api.post("/api/v1/runs", {"agent": "bot"}, content_type="application/json").json()[
        "run_id"]


def post(api, path, body, raw=False):
    data = body if raw else json.dumps(body)
    return api.post(path, data, content_type="application/json")


def assert_error(response, status, code):
    assert response.status_code == status, response.content
    assert response["Content-Type"].startswith("application/json")
    body = response.json()
    assert body["error"]["code"] == code
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def assert_nothing_counted(run_id):
    run = Run.objects.get(pk=run_id)
    assert (run.steps, run.tool_calls, run.status) == (0, 0, "running")
    assert not Decision.objects.filter(run_id=run_id).exists()


def test_it_answers_400_for_a_body_that_is_not_json(api, run_id):
    for raw in ["{bad", "", "[1, 2", "NaN", '{"action": {"name": "x"}, "cost_usd": NaN}']:
        response = post(api, f"/api/v1/runs/{run_id}/check", raw, raw=True)
        if raw == "":
            assert_error(response, 422, "invalid_request")
        else:
            assert_error(response, 400, "invalid_json")
    assert_nothing_counted(run_id)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "action"),
        ({"action": {}}, "action.name"),
        ({"action": {"name": ""}}, "action.name"),
        ({"action": {"name": "x" * 201}}, "action.name"),
        ({"action": {"name": "x", "args": [1]}}, "action.args"),
        ({"action": {"name": "x", "args": "q"}}, "action.args"),
        ({"action": {"name": "x", "type": "shell"}}, "action.type"),
        ({"action": {"name": "x"}, "progress": "p" * 257}, "progress"),
        ({"action": {"name": "x"}, "progress": True}, "progress"),
        ({"action": {"name": "x"}, "progress": {"a": 1}}, "progress"),
        ({"action": {"name": "x"}, "cost_usd": -0.01}, "cost_usd"),
        ({"action": {"name": "x"}, "cost_usd": "0.1"}, "cost_usd"),
        ({"action": {"name": "x"}, "last_result": {}}, "last_result.status"),
        ({"action": {"name": "x"}, "last_result": {"status": "meh"}}, "last_result.status"),
        ({"action": {"name": "x"}, "last_result": {"status": "ok", "digest": "d" * 129}},
         "last_result.digest"),
        ({"action": {"name": "x"}, "last_result": {"status": "error", "error": "e" * 2001}},
         "last_result.error"),
        ({"action": {"name": "x"}, "last_result": {"status": "ok", "summary": "s" * 2001}},
         "last_result.summary"),
        ({"action": {"name": "x"}, "check_id": "c" * 101}, "check_id"),
    ],
)
def test_it_answers_422_naming_the_bad_field(api, run_id, body, field):
    error = assert_error(post(api, f"/api/v1/runs/{run_id}/check", body), 422, "invalid_request")
    assert field in error["fields"], error
    assert_nothing_counted(run_id)


@pytest.mark.parametrize("cost", ["0.1", True, [1], {"usd": 1}])
def test_a_cost_that_is_not_a_number_is_refused_as_such(api, run_id, cost):
    body = {"action": {"name": "x"}, "cost_usd": cost}
    error = assert_error(post(api, f"/api/v1/runs/{run_id}/check", body), 422, "invalid_request")
    assert error["fields"] == {"cost_usd": "Input should be a number (US dollars)"}, error
    assert_nothing_counted(run_id)


@pytest.mark.parametrize("progress", [{}, [1], True, {"step": 2}])
def test_a_progress_of_the_wrong_kind_is_refused_saying_what_it_may_be(api, run_id, progress):
    body = {"action": {"name": "x"}, "progress": progress}
    error = assert_error(post(api, f"/api/v1/runs/{run_id}/check", body), 422, "invalid_request")
    assert error["fields"] == {
        "progress": "Input should be a string of at most 256 characters or a finite number"}
    assert_nothing_counted(run_id)


@pytest.mark.parametrize(("body", "field", "limit"), [
    ({"action": {"name": "x" * 201}}, "action.name", 200),
    ({"action": {"name": "x"}, "progress": "p" * 257}, "progress", 256),
    ({"action": {"name": "x"}, "check_id": "c" * 101}, "check_id", 100),
    ({"action": {"name": "x"}, "last_result": {"status": "ok", "digest": "d" * 129}},
     "last_result.digest", 128),
])
def test_a_text_too_long_is_refused_in_characters(api, run_id, body, field, limit):
    error = assert_error(post(api, f"/api/v1/runs/{run_id}/check", body), 422, "invalid_request")
    assert error["fields"] == {field: f"String should have at most {limit} characters"}
    assert_nothing_counted(run_id)


@pytest.mark.both_stores
def test_unknown_fields_are_ignored(api, run_id):
    response = post(api, f"/api/v1/runs/{run_id}/check",
                    {"action": {"name": "x", "color": "red"}, "mood": "happy"})
    assert response.status_code == 200
    assert response.json()["decision"] == "allow"


def test_it_answers_413_for_a_check_body_over_64_kib(api, run_id):
    big = {"action": {"name": "x", "args": {"blob": "a" * (64 * 1024)}}}
    assert_error(post(api, f"/api/v1/runs/{run_id}/check", big), 413, "payload_too_large")
    assert_nothing_counted(run_id)


def test_deeply_nested_args_are_refused(api, run_id):
    args: dict = {}
    node = args
    for _ in range(40):
        node["n"] = {}
        node = node["n"]
    response = post(api, f"/api/v1/runs/{run_id}/check", {"action": {"name": "x", "args": args}})
    assert_error(response, 422, "invalid_request")
    assert_nothing_counted(run_id)


def test_very_deep_json_is_refused_without_a_crash(api, run_id):
    raw = '{"action": {"name": "x", "args": ' + '{"a": ' * 5000 + "1" + "}" * 5000 + "}}"
    response = post(api, f"/api/v1/runs/{run_id}/check", raw, raw=True)
    assert response.status_code in (400, 413, 422)
    assert_nothing_counted(run_id)


@pytest.mark.parametrize("header", [None, "Bearer nope", "Bearer gov_aaaaaaaaaaaa_x", "Basic x"])
@pytest.mark.both_stores
def test_it_answers_401_without_a_valid_key(run_id, header):
    client = Client()
    extra = {"HTTP_AUTHORIZATION": header} if header else {}
    response = client.post(f"/api/v1/runs/{run_id}/check", json.dumps({"action": {"name": "x"}}),
                           content_type="application/json", **extra)
    assert_error(response, 401, "unauthorized")
    assert_nothing_counted(run_id)


@pytest.mark.both_stores
def test_a_revoked_key_is_refused(client, team):
    new = agent_key_create(team=team, name="k")
    agent_key_revoke(key=new.key, actor=None)
    response = client.get("/api/v1/runs", HTTP_AUTHORIZATION=f"Bearer {new.token}")
    assert_error(response, 401, "unauthorized")


@pytest.mark.both_stores
def test_a_key_with_a_right_prefix_and_wrong_secret_is_refused(client, team):
    token = agent_key_create(team=team, name="k").token
    forged = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
    response = client.get("/api/v1/runs", HTTP_AUTHORIZATION=f"Bearer {forged}")
    assert_error(response, 401, "unauthorized")


@pytest.mark.parametrize("run", ["00000000-0000-0000-0000-000000000000", "not-a-uuid", "1"])
@pytest.mark.both_stores
def test_it_answers_404_for_an_unknown_run(api, run):
    assert_error(post(api, f"/api/v1/runs/{run}/check", {"action": {"name": "x"}}), 404,
                 "not_found")
    assert_error(api.get(f"/api/v1/runs/{run}"), 404, "not_found")


def test_it_answers_404_as_json_for_an_unknown_api_path(api):
    assert_error(api.get("/api/v1/nothing-here"), 404, "not_found")


def test_it_answers_405_as_json(api, run_id):
    assert_error(api.get(f"/api/v1/runs/{run_id}/check"), 405, "method_not_allowed")
    assert_error(api.delete(f"/api/v1/runs/{run_id}"), 405, "method_not_allowed")


def test_it_answers_422_for_an_unknown_policy(api):
    error = assert_error(post(api, "/api/v1/runs", {"agent": "bot", "policy": "nope"}), 422,
                         "invalid_request")
    assert "policy" in error["fields"]
    assert not Run.objects.exists()


@pytest.mark.parametrize(
    ("body", "field"),
    [({}, "agent"), ({"agent": "has space"}, "agent"), ({"agent": "x" * 101}, "agent"),
     ({"agent": "a", "metadata": [1]}, "metadata"), ({"agent": "a", "external_id": ""},
                                                       "external_id")],
)
def test_starting_a_run_validates_every_field(api, body, field):
    error = assert_error(post(api, "/api/v1/runs", body), 422, "invalid_request")
    assert field in error["fields"]
    assert not Run.objects.exists()


def test_finish_validates_its_status(api, run_id):
    error = assert_error(post(api, f"/api/v1/runs/{run_id}/finish", {"status": "done"}), 422,
                         "invalid_request")
    assert "status" in error["fields"]
    assert Run.objects.get(pk=run_id).finished_at is None


@pytest.mark.parametrize("query", ["limit=0", "limit=501", "limit=x", "status=weird"])
def test_listing_validates_its_query(api, query):
    assert_error(api.get(f"/api/v1/runs?{query}"), 422, "invalid_request")


def test_too_many_query_parameters_are_refused_naming_the_query(api, run_id, team, users):
    """Found by an attacker: past Django's DATA_UPLOAD_MAX_NUMBER_FIELDS (1,000) every
    endpoint that reads a query answered 500, on the agent's and the operator's API."""
    from policies.tokens import operator_token_create

    many = "&".join(f"a{i}=1" for i in range(1001))
    for path in (f"/api/v1/runs?{many}", f"/api/v1/runs/{run_id}/decisions?{many}"):
        error = assert_error(api.get(path), 422, "invalid_request")
        assert error["fields"] == {"query": "at most 1000 parameters"}
    token = operator_token_create(user=users["viewer"], name="many", role="viewer").secret
    operator = Client(HTTP_AUTHORIZATION=f"Bearer {token}")
    assert_error(operator.get(f"/api/v1/teams/{team.slug}/runs?{many}"), 422,
                 "invalid_request")
    assert api.get(f"/api/v1/runs?{'&'.join(f'a{i}=1' for i in range(999))}").status_code == 200


def test_a_404_says_what_was_not_found(api, run_id):
    assert api.get("/api/v1/decisions/99999999").json()["error"]["message"] == \
        "No such decision."
    assert api.get("/api/v1/runs/00000000-0000-0000-0000-000000000000").json()[
        "error"]["message"] == "No such run."


def test_decisions_listing_validates_its_query(api, run_id):
    assert_error(api.get(f"/api/v1/runs/{run_id}/decisions?limit=1001"), 422, "invalid_request")
    assert_error(api.get(f"/api/v1/runs/{run_id}/decisions?after=-1"), 422, "invalid_request")


def test_an_empty_query_parameter_is_an_absent_one(api, run_id):
    """`?status=&agent=&limit=`, as a form or a URL template leaves them, answered 422."""
    listed = api.get("/api/v1/runs?status=&agent=&limit=")
    assert listed.status_code == 200 and [r["run_id"] for r in listed.json()["runs"]] == [run_id]
    decisions = api.get(f"/api/v1/runs/{run_id}/decisions?after=&limit=")
    assert decisions.status_code == 200, decisions.content
    assert_error(api.get("/api/v1/runs?status= "), 422, "invalid_request")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.sampled_from(["action", "name", "args", "type", "progress", "cost_usd",
                                       "last_result", "status", "digest", "check_id"]) | st.text(
        max_size=5), children, max_size=5),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=json_values | st.binary(max_size=200))
def test_random_garbage_never_produces_a_5xx(api, run_id, body):
    raw = body if isinstance(body, bytes) else json.dumps(body)
    response = api.post(f"/api/v1/runs/{run_id}/check", raw, content_type="application/json")
    assert response.status_code < 500
    assert response["Content-Type"].startswith("application/json")


def test_nul_characters_are_refused_as_bad_input(api, run_id):
    raw = '{"action": {"name": "x\\u0000y", "args": {"k": "v"}}}'
    error = assert_error(post(api, f"/api/v1/runs/{run_id}/check", raw, raw=True), 422,
                         "invalid_request")
    assert "action.name" in error["fields"]
    assert_nothing_counted(run_id)
    assert_error(api.get("/api/v1/runs?agent=a%00b"), 422, "invalid_request")


@pytest.mark.parametrize(("path", "body", "field"), [
    ("check", {"action": {"name": "a", "args": {"k\u0000": 1}}}, "action.args"),
    ("check", {"action": {"name": "a"}, "progress": "p\u0000"}, "progress"),
    ("check", {"action": {"name": "a"}, "check_id": "c\u0000"}, "check_id"),
    ("check", {"action": {"name": "a"}, "last_result": {"status": "ok", "error": "\u0000"}},
     "last_result.error"),
    ("finish", {"status": "completed", "output": "o\u0000"}, "output"),
    ("start", {"agent": "bot", "task": "t\u0000"}, "task"),
    ("start", {"agent": "bot", "metadata": {"m": ["\u0000"]}}, "metadata"),
    ("start", {"agent": "bot", "external_id": "e\u0000"}, "external_id"),
])
def test_nul_in_a_known_field_is_refused_naming_that_field(api, run_id, path, body, field):
    url = {"check": f"/api/v1/runs/{run_id}/check", "finish": f"/api/v1/runs/{run_id}/finish",
           "start": "/api/v1/runs"}[path]
    raw = json.dumps(body)
    assert "\\u0000" in raw  # the JSON escape, as a client sends it
    error = assert_error(post(api, url, raw, raw=True), 422, "invalid_request")
    assert field in error["fields"], error
    assert_nothing_counted(run_id)


@pytest.mark.both_stores
def test_nul_in_an_unknown_field_is_ignored_like_the_field(api, run_id):
    """Unknown fields are ignored (SPEC 5.2), whatever they hold: nothing of them is stored."""
    check = ('{"action": {"name": "a", "args": {}, "note\\u0000": "x\\u0000"},'
             ' "extra": "\\u0000", "more": {"deep": ["\\u0000"]}}')
    response = post(api, f"/api/v1/runs/{run_id}/check", check, raw=True)
    assert response.status_code == 200, response.content
    assert response.json()["decision"] == "allow"
    started = post(api, "/api/v1/runs", '{"agent": "bot", "x\\u0000": "\\u0000"}', raw=True)
    assert started.status_code == 201, started.content
    finished = post(api, f"/api/v1/runs/{run_id}/finish",
                    '{"status": "completed", "why": "\\u0000"}', raw=True)
    assert finished.status_code == 200, finished.content


@pytest.mark.parametrize("path", ["/api/v1/runs", "/api/v1/runs/{run}",
                                  "/api/v1/runs/{run}/decisions", "/api/v1/openapi.json",
                                  "/healthz", "/readyz"])
def test_head_answers_as_get_without_the_body(api, run_id, path):
    path = path.format(run=run_id)
    got, head = api.get(path), api.head(path)
    assert got.status_code == head.status_code == 200
    assert head.content == b""
    assert head["Content-Type"] == got["Content-Type"]


@pytest.mark.parametrize("path", ["/api/v1/openapi.json", "/api/v1/runs/{run}"])
def test_a_method_a_read_does_not_take_is_a_json_405_naming_get_and_head(api, run_id, path):
    response = api.put(path.format(run=run_id), "{}", content_type="application/json")
    assert_error(response, 405, "method_not_allowed")
    assert response["Allow"] == "GET, HEAD"


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/metrics"])
@pytest.mark.parametrize("method", ["post", "put", "delete", "patch"])
def test_the_probes_answer_only_get_and_head(path, method):
    # As a probe or a scraper sends them: no CSRF cookie, and Django checking CSRF (the test
    # client skips the check unless asked; these once answered 403 "CSRF verification failed").
    response = getattr(Client(enforce_csrf_checks=True), method)(path)
    assert response.status_code == 405 and response["Allow"] == "GET, HEAD"
    if path != "/metrics":  # Prometheus's text format; the probes answer JSON
        # In the JSON envelope, as every other 405 (found by a newcomer: an empty text/html
        # body).
        assert_error(response, 405, "method_not_allowed")


@pytest.mark.parametrize("path", ["/healthz", "/readyz"])
def test_the_probes_answer_a_load_balancers_plain_http_check_whatever_the_host(path, settings):
    """Found by a newcomer following docs/deploy.md: behind TLS with SECURE_SSL_REDIRECT a
    probe was a 301, with the production ALLOWED_HOSTS a 400 for HAProxy's `Host:
    localhost`, and HAProxy took every node out. The pages still redirect and refuse."""
    settings.SECURE_SSL_REDIRECT = True
    settings.ALLOWED_HOSTS = ["governance.example.com"]
    probe = Client(HTTP_HOST="localhost").get(path)
    assert probe.status_code == 200, probe.content
    assert probe.json()["status"] == "ok"
    assert Client(HTTP_HOST="localhost").head(path).status_code == 200
    assert Client(HTTP_HOST="localhost").get("/accounts/login/").status_code == 400
    page = Client(HTTP_HOST="governance.example.com").get("/accounts/login/")
    assert page.status_code == 301 and page["Location"].startswith("https://")


def test_head_of_a_write_only_route_is_refused(api, run_id):
    response = api.head(f"/api/v1/runs/{run_id}/check")
    assert response.status_code == 405 and "HEAD" not in response["Allow"]


def test_a_path_missing_its_slash_is_a_json_404_not_an_html_redirect(client):
    """Found by an attacker: `/api/v1` answered CommonMiddleware's empty HTML 301 to
    `/api/v1/`; every answer under /api/ is JSON (SPEC 10)."""
    for path in ("/api/v1", "/api/v1/teams/support"):
        answer = client.get(path)
        assert answer.status_code == 404 and answer["Content-Type"] == "application/json"
        assert answer.json()["error"]["code"] == "not_found"


def test_the_bare_api_prefix_is_a_json_404_naming_where_the_api_is(client):
    """`/api` without its slash answered the pages' HTML 404."""
    for method in (client.get, client.post, client.head):
        answer = method("/api")
        assert answer.status_code == 404 and answer["Content-Type"] == "application/json"
    assert "/api/v1/" in client.get("/api").json()["error"]["message"]

