"""SPEC 12 end to end against the production server command: each `per` scope, the sliding
window (rows backdated by the database's own clock, no sleeping), waits that count nothing
and are never replayed, overlapping rules, shadow mode, and the SQL that mirrors fnmatch."""

from __future__ import annotations

import fnmatch
import time
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.db.models import F
from governance_client.rules import REPEAT
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.services import agent_key_create
from runs.check import run_memory
from runs.check.rate_limits import glob_regex
from runs.models import Decision, RateCount, RateSlot, Run
from tests.conftest import Agent, set_policy

LOOSE = {"step_limits": {"max_steps": 1000, "max_repeat_action": 1000,
                         "no_progress_window": 1000},
         "budgets": {"max_seconds": None, "max_usd": None}}


def limit(team: Any, *rules: dict[str, Any], **changes: Any) -> None:
    set_policy(team, **{**LOOSE, "rate_limits": list(rules), **changes})


def rule(match: str = "http.*", per: str = "agent", max: int = 2, window_s: int = 60
         ) -> dict[str, Any]:
    return {"match": match, "per": per, "max": max, "window_s": window_s}


def backdate(seconds: float = 0, **filters: Any) -> None:
    """Move counted actions into the past, relative to their own database-clock stamps."""
    RateSlot.objects.filter(**filters).update(at=F("at") - timedelta(seconds=seconds))


transactional = pytest.mark.django_db(transaction=True)


def assert_waits(answer: dict[str, Any], seconds: float, since: float) -> None:
    """A wait of `seconds` from the counted action, less the time since `since` (a
    monotonic time taken before that action was sent): a busy machine only shortens it."""
    assert answer["decision"] == "wait"
    elapsed = time.monotonic() - since
    assert seconds - elapsed - 0.01 < answer["retry_after_s"] <= seconds


@transactional
def test_a_full_rule_answers_wait_with_every_common_field(agent: Agent, team: Any) -> None:
    limit(team, rule(per="run"))
    rid = agent.start()["run_id"]
    started = time.monotonic()
    assert agent.check(rid, "http.get", {"u": 1})["decision"] == "allow"
    assert agent.check(rid, "http.post", {"u": 2})["decision"] == "allow"

    answer = agent.check(rid, "http.get", {"u": 3}, cost_usd=0.5, progress="new")

    assert (answer["decision"], answer["reason"]) == ("wait", "rate_limited")
    assert answer["step"] == 3
    assert answer["usage"]["steps"] == 2 and answer["usage"]["cost_usd"] == 0
    assert_waits(answer, 60, since=started)
    assert "match='http.*' per=run max=2 window_s=60" in answer["message"]
    assert answer["next_action"]
    for field in ("decision_id", "repeat_key", "repeat_count", "limits", "directive",
                  "shadow", "approval"):
        assert field in answer
    assert (answer["approval"], answer["shadow"], answer["directive"]) == (None, None, None)
    run = Run.objects.get(pk=rid)
    # The wait registered nothing: no progress value or result signature was added.
    assert (run.steps, run.tool_calls, run.cost_usd) == (2, 2, 0)
    assert {kind for kind, _ in run_memory.entries(run.pk)} <= {REPEAT}
    audited = Decision.objects.get(pk=answer["decision_id"])
    assert (audited.outcome, audited.reason, audited.step) == ("wait", "rate_limited", 3)
    # Other actions are not limited by this rule, and the allow carries retry_after_s null.
    other = agent.check(rid, "search.docs")
    assert (other["decision"], other["retry_after_s"], other["step"]) == ("allow", None, 3)


@transactional
@pytest.mark.parametrize("per", ["run", "agent", "team"])
def test_each_scope_counts_its_own_actions(agent: Agent, team: Any, other_team: Any,
                                           per: str) -> None:
    limit(team, rule(per=per, max=1))
    limit(other_team, rule(per=per, max=1))
    first = agent.start("bot-a")["run_id"]
    same_agent = agent.start("bot-a")["run_id"]
    other_agent = agent.start("bot-b")["run_id"]
    other_key = agent_key_create(team=other_team, name="k").token
    outsider = Agent(token=other_key, http=agent.http)
    other_team_run = agent.http.post(
        "/api/v1/runs", json={"agent": "bot-a"},
        headers={"Authorization": f"Bearer {other_key}"}).json()["run_id"]

    assert agent.check(first, "http.get")["decision"] == "allow"
    expected = {
        "run": {first: "wait", same_agent: "allow", other_agent: "allow"},
        "agent": {first: "wait", same_agent: "wait", other_agent: "allow"},
        "team": {first: "wait", same_agent: "wait", other_agent: "wait"},
    }[per]
    seen = {rid: agent.check(rid, "http.get")["decision"] for rid in expected}
    assert seen == expected
    response = outsider.http.post(f"/api/v1/runs/{other_team_run}/check",
                                  json={"action": {"name": "http.get"}},
                                  headers={"Authorization": f"Bearer {other_key}"})
    assert response.json()["decision"] == "allow"  # another team never counts


@transactional
def test_the_window_slides(agent: Agent, team: Any) -> None:
    limit(team, rule(per="run", max=2, window_s=60))
    rid = agent.start()["run_id"]
    started = time.monotonic()
    agent.check(rid, "http.get", {"i": 1})
    second = time.monotonic()
    agent.check(rid, "http.get", {"i": 2})
    oldest = RateSlot.objects.filter(scope=rid).order_by("at").first()
    assert oldest is not None

    # The oldest action 55 s ago: room in about 5 s.
    backdate(pk=oldest.pk, seconds=55)
    assert_waits(agent.check(rid, "http.get", {"i": 3}), 5, since=started)

    # 61 s ago: it has left the window, the next action is allowed...
    backdate(pk=oldest.pk, seconds=6)
    assert agent.check(rid, "http.get", {"i": 3})["decision"] == "allow"
    # ...and fills the window again, until the second one leaves it.
    assert_waits(agent.check(rid, "http.get", {"i": 4}), 60, since=second)


@transactional
def test_a_wait_is_never_replayed_and_counts_no_step(agent: Agent, team: Any) -> None:
    limit(team, rule(per="run", max=1))
    rid = agent.start()["run_id"]
    agent.check(rid, "http.get", {"i": 0})
    body: dict[str, Any] = {"check_id": "c-1"}
    first = agent.check(rid, "http.get", {"i": 1}, **body)
    again = agent.check(rid, "http.get", {"i": 1}, **body)
    assert (first["decision"], again["decision"]) == ("wait", "wait")
    assert first["decision_id"] != again["decision_id"]
    assert (first["step"], again["step"]) == (2, 2)
    assert Run.objects.get(pk=rid).steps == 1

    backdate(seconds=61, scope=rid)
    allowed = agent.check(rid, "http.get", {"i": 1}, **body)
    assert (allowed["decision"], allowed["step"]) == ("allow", 2)
    # The allow, once given, is what this check_id replays.
    replay = agent.check(rid, "http.get", {"i": 1}, **body)
    assert replay["decision_id"] == allowed["decision_id"]
    assert Run.objects.get(pk=rid).steps == 2


@transactional
def test_every_overlapping_rule_applies_and_the_longest_wait_is_answered(
        agent: Agent, team: Any) -> None:
    limit(team, rule("http.*", per="agent", max=3, window_s=10),
          rule("http.get", per="run", max=1, window_s=60))
    rid = agent.start()["run_id"]
    started = time.monotonic()
    assert agent.check(rid, "http.get")["decision"] == "allow"
    # http.get: its own rule is full for ~60 s.
    answer = agent.check(rid, "http.get", {"again": 1})
    assert_waits(answer, 60, since=started)
    assert "match='http.get'" in answer["message"]
    # http.post only meets the agent rule: two more fit, then it waits ~10 s.
    assert agent.check(rid, "http.post", {"i": 1})["decision"] == "allow"
    assert agent.check(rid, "http.post", {"i": 2})["decision"] == "allow"
    answer = agent.check(rid, "http.post", {"i": 3})
    assert_waits(answer, 10, since=started)
    assert "match='http.*'" in answer["message"]
    # Both rules full: the answer is the time until both have room.
    backdate(seconds=5)  # the run's actions, in both rules' counts
    assert_waits(agent.check(rid, "http.get", {"again": 2}), 55, since=started)


@transactional
def test_shadow_mode_allows_and_reports_the_rate_limit(agent: Agent, team: Any) -> None:
    limit(team, rule(per="run", max=1), mode="shadow")
    rid = agent.start()["run_id"]
    agent.check(rid, "http.get")
    answer = agent.check(rid, "http.get", {"i": 2})
    assert (answer["decision"], answer["reason"]) == ("allow", "step_ok")
    assert answer["shadow"]["reason"] == "rate_limited"
    assert answer["retry_after_s"] is None
    assert Decision.objects.get(pk=answer["decision_id"]).outcome == "would_stop"
    # Counted like an allow: the action runs, so it holds its place in the window.
    assert RateCount.objects.get(scope=rid).n == 2
    assert Run.objects.get(pk=rid).steps == 2


@transactional
def test_a_kill_switch_and_a_terminal_run_answer_stop_not_wait(agent: Agent, team: Any) -> None:
    limit(team, rule(per="run", max=1))
    rid = agent.start()["run_id"]
    agent.check(rid, "http.get")
    agent.http.post(f"/api/v1/runs/{rid}/finish", json={"status": "completed"})
    answer = agent.check(rid, "http.get", {"i": 2})
    assert (answer["decision"], answer["reason"]) == ("stop", "run_finished")


@transactional
def test_the_decisions_list_shows_waits(agent: Agent, team: Any) -> None:
    limit(team, rule(per="run", max=1))
    rid = agent.start()["run_id"]
    agent.check(rid, "http.get")
    agent.check(rid, "http.get", {"i": 2})
    listed = agent.http.get(f"/api/v1/runs/{rid}/decisions").json()["decisions"]
    assert [d["outcome"] for d in listed] == ["allow", "wait"]


# --- The SQL's glob is fnmatch's --------------------------------------------------------------

PATTERNS = ["http.*", "*", "?", "a?c", "[ab]*", "[!ab]x", "[a-c]", "[z-a]", "[!z-a]", "[]]",
            "[!]]", "[", "a[", "[a-]", "[-a]", "x\\y", "a.b", "a+b", "(a)", "a|b", "^a$",
            "[[:alpha:]]", "[\\]", "é*", "{a,b}", "a**b", "[a-c-e]", "[a&&b]", "[^a]"]
NAMES = ["http.get", "", "a", "b", "x", "ax", "cx", "]", "[", "a[", "-", "x\\y", "a.b", "axb",
         "aab", "a+b", "(a)", "a|b", "^a$", "é", "éa", "{a,b}", "ab", "a-c", "e", "d", "&",
         ":", "\\", "^", "a\nb"]


@pytest.mark.postgres
@pytest.mark.django_db
def test_the_sql_pattern_agrees_with_fnmatch_on_known_cases() -> None:
    with connection.cursor() as cursor:
        for pattern in PATTERNS:
            regex = glob_regex(pattern)
            for name in NAMES:
                cursor.execute("SELECT %s ~ %s", [name, regex])
                assert cursor.fetchone()[0] == fnmatch.fnmatchcase(name, pattern), (
                    pattern, name, regex)


@pytest.mark.postgres
@pytest.mark.django_db
@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ab-[]!*?.\\^$é", max_size=8),
       st.lists(st.text(alphabet="ab-[]!.\\^$é\n", max_size=6), min_size=1, max_size=8))
def test_the_sql_pattern_agrees_with_fnmatch(pattern: str, names: list[str]) -> None:
    regex = glob_regex(pattern)
    with connection.cursor() as cursor:
        for name in names:
            cursor.execute("SELECT %s ~ %s", [name, regex])
            assert cursor.fetchone()[0] == fnmatch.fnmatchcase(name, pattern), (
                pattern, name, regex)



# --- Dashboard and metrics --------------------------------------------------------------------

def waited_run(api: Any, team: Any, **changes: Any) -> str:
    limit(team, rule(per="run", max=1), **changes)
    rid = api.post("/api/v1/runs", {"agent": "bot"}, content_type="application/json"
                   ).json()["run_id"]
    for i in range(2):
        api.post(f"/api/v1/runs/{rid}/check", {"action": {"name": "http.get", "args": {"i": i}}},
                 content_type="application/json")
    return rid


@pytest.mark.django_db
@pytest.mark.both_stores
def test_the_timeline_shows_the_wait_row(client: Any, api: Any, team: Any,
                                         users: dict[str, Any]) -> None:
    rid = waited_run(api, team)
    client.force_login(users["viewer"])
    text = client.get(f"/teams/{team.slug}/runs/{rid}/").content.decode()
    assert 'class="step outcome-wait"' in text
    assert "retry after" in text and "not counted as a step" in text
    assert "match=&#x27;http.*&#x27; per=run max=1 window_s=60" in text


@pytest.mark.django_db
@pytest.mark.both_stores
def test_the_overview_counts_rate_limited_checks(client: Any, api: Any, team: Any,
                                                 users: dict[str, Any]) -> None:
    waited_run(api, team)
    client.force_login(users["viewer"])
    text = client.get(f"/teams/{team.slug}/").content.decode()
    assert "Rate limited" in text
    assert "data-rate-limited-count>1<" in text
    assert "<code>http.get</code>" in text


@pytest.mark.django_db
@pytest.mark.both_stores
def test_the_waits_are_counted_in_the_metrics_by_team_and_rule(api: Any, team: Any,
                                                               settings: Any) -> None:
    settings.METRICS_TOKEN = "m"
    from prometheus_client import REGISTRY

    before = REGISTRY.get_sample_value(
        "governance_rate_limit_waits_total",
        {"team": "support", "rule": "http.*", "per": "run", "outcome": "wait"}) or 0
    waited_run(api, team)
    after = REGISTRY.get_sample_value(
        "governance_rate_limit_waits_total",
        {"team": "support", "rule": "http.*", "per": "run", "outcome": "wait"})
    assert after == before + 1


# --- SPEC 15: the common answer fields --------------------------------------------------------

COMMON = ["decision_id", "step", "repeat_key", "repeat_count", "message", "next_action", "usage",
          "limits", "directive", "shadow", "approval", "retry_after_s"]


@pytest.mark.django_db
def test_the_openapi_document_says_every_answer_carries_the_common_fields(client: Any) -> None:
    schema = client.get("/api/v1/openapi.json").json()
    check_out = schema["components"]["schemas"]["CheckOut"]
    assert set(COMMON) <= set(check_out["required"])
    assert check_out["properties"]["decision"]["enum"] == ["allow", "stop", "pending", "wait"]
    for nullable in ("message", "next_action", "directive", "shadow", "approval",
                     "retry_after_s"):
        variants = check_out["properties"][nullable].get("anyOf", [])
        assert {"type": "null"} in variants, nullable


@pytest.mark.django_db
@pytest.mark.both_stores
def test_allow_stop_and_wait_answers_all_carry_the_common_fields(api: Any, team: Any) -> None:
    limit(team, rule(per="run", max=1), step_limits={"max_steps": 2, "max_repeat_action": 9,
                                                      "no_progress_window": 9})
    rid = api.post("/api/v1/runs", {"agent": "bot"}, content_type="application/json"
                   ).json()["run_id"]
    answers = [api.post(f"/api/v1/runs/{rid}/check", {"action": {"name": name, "args": {"i": i}}},
                        content_type="application/json").json()
               for i, name in enumerate(["http.get", "http.get", "other", "other"])]
    assert [a["decision"] for a in answers] == ["allow", "wait", "allow", "stop"]
    for answer in answers:
        assert set(COMMON) <= set(answer), answer


@pytest.mark.django_db
def test_the_sweep_forgets_counts_no_window_can_reach(team: Any) -> None:
    import uuid

    from django.utils import timezone

    from runs.check.rate_limits import READ_REFRESH, prune_hits
    from runs.check.tasks import idle_sweep_task
    from runs.models import RateRule

    now = timezone.now()
    day, second = timedelta(seconds=86_400), timedelta(seconds=1)
    key = uuid.uuid4()
    # "a" counted an action a day minus a second ago, "b" its last a day and a second ago.
    RateCount.objects.create(rule_key=key, scope="a", n=2, last_at=now - day + second)
    RateSlot.objects.create(rule_key=key, scope="a", slot=0, at=now - day - second)
    RateSlot.objects.create(rule_key=key, scope="a", slot=1, at=now - day + second)
    RateCount.objects.create(rule_key=key, scope="b", n=1, last_at=now - day - second)
    RateSlot.objects.create(rule_key=key, scope="b", slot=0, at=now - day - second)
    for age, match in ((day + READ_REFRESH + second, "old"), (day, "recent")):
        RateRule.objects.create(key=uuid.uuid4(), team_id=team.pk, per="agent", match=match,
                                regex=match, max=1, read_at=now - age)

    assert idle_sweep_task()["hits_pruned"] == 1
    assert sorted(RateSlot.objects.values_list("scope", "slot")) == [("a", 0), ("a", 1)]
    assert list(RateCount.objects.values_list("scope", flat=True)) == ["a"]
    assert list(RateRule.objects.values_list("match", flat=True)) == ["recent"]
    assert prune_hits(now=now) == 0


@transactional
def test_a_rule_counts_the_teams_other_policies_from_its_save(agent: Agent, team: Any) -> None:
    """SPEC 12: a `per: team` rule counts every action of the team whose name fits it,
    whatever the policy of its run. Registered by the first check of its own policy only,
    the rule missed the actions before that check: a second action in its window was
    allowed (found by a tester). It is registered when its policy is saved."""
    from policies.document import parse_policy
    from policies.services import policy_save

    limit(team)  # the default policy: no rule
    policy_save(team=team, document=parse_policy({
        "name": "texting", **LOOSE,
        "rate_limits": [rule("sms.*", per="team", max=1, window_s=60)]}),
        actor=None, source="test")
    plain = agent.start()["run_id"]
    assert agent.check(plain, "sms.send", {"to": 1})["decision"] == "allow"
    texting = agent.start(policy="texting")["run_id"]
    answer = agent.check(texting, "sms.send", {"to": 2})
    assert (answer["decision"], answer["reason"]) == ("wait", "rate_limited"), answer


@pytest.mark.django_db
def test_the_prune_keeps_the_rules_of_current_policies_only(team: Any) -> None:
    """A day without a check of its policy does not forget a current rule (the other
    policies' actions would then go uncounted until its next read); a rule no current
    policy has is forgotten."""
    from django.utils import timezone

    from runs.check.rate_limits import prune_hits, rule_key
    from runs.models import RateRule

    kept, dropped = rule("mail.*", per="team", max=3), rule("sms.*", per="team", max=1)
    limit(team, dropped)
    limit(team, kept)
    keys = {name: rule_key(as_rule(r), team_id=team.pk)
            for name, r in (("kept", kept), ("dropped", dropped))}
    assert set(RateRule.objects.values_list("key", flat=True)) == set(keys.values())
    prune_hits(now=timezone.now() + timedelta(days=3))
    assert set(RateRule.objects.values_list("key", flat=True)) == {keys["kept"]}


def as_rule(r: dict[str, Any]) -> Any:
    from governance_client.rules import RateLimit

    return RateLimit(match=r["match"], per=r["per"], max=r["max"], window_s=r["window_s"])


def test_a_run_of_stars_is_one_star_in_sql() -> None:
    assert glob_regex("a**b") == "^a.*b$"
    assert glob_regex("*" * 195 + "q") == "^.*q$"
    assert glob_regex("*?*") == "^.*..*$"


@pytest.mark.postgres
@pytest.mark.django_db
def test_a_teams_rules_of_star_runs_cost_postgresql_no_seconds() -> None:
    # Found by an attacker: 200 rules whose patterns were 195 stars and a suffix (each valid,
    # SPEC 12's 200 characters) made every check of the team match 200 runs of 195 ".*":
    # 6 s of PostgreSQL's CPU a check, 40 s with six at once.
    regexes = [glob_regex("*" * 195 + f"q{i:04d}") for i in range(200)]
    started = time.monotonic()
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM unnest(%s::text[]) r WHERE %s ~ r",
                       [regexes, "z" * 200])
        assert cursor.fetchone()[0] == 0
    assert time.monotonic() - started < 2.0


@pytest.mark.django_db
def test_the_hourly_registration_repairs_a_rule_left_in_an_older_sql_form(team) -> None:
    # A process of the previous release, during an upgrade, may register a rule after
    # runs/0021 rewrote the others, in the form PostgreSQL took seconds to match; a check's
    # registration never writes a known rule (it takes no row lock), so the beat's does.
    from django.utils import timezone

    from runs.check import rate_limits
    from runs.models import RateRule

    rule = {"match": "**http.*", "per": "run", "max": 5, "window_s": 60}
    set_policy(team, rate_limits=[rule])
    key = rate_limits.rule_key(as_rule(rule), team_id=team.pk)
    RateRule.objects.filter(key=key).update(regex="^.*.*http\\..*$")
    rate_limits._kept_at = None
    rate_limits.keep_current_rules(now=timezone.now())
    assert RateRule.objects.get(key=key).regex == glob_regex("**http.*") == "^.*http\\..*$"
