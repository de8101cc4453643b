"""The kill switch through its services, command and screens (SPEC 6, 7, 8).

These run on every stack with Celery eager (the fan-out runs at the engage's commit, in this
process); tests/test_killswitch_stack.py covers the production stack with a real worker.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import transaction
from django.urls import reverse
from django.utils import timezone

from governance.celery import app as celery_app
from policies.models import OperatorEvent
from runs.killswitch.fanout import killswitch_fanout
from runs.killswitch.services import (
    KillSwitchError,
    killswitch_engage,
    killswitch_release,
)
from runs.models import Decision, KillSwitch, Run, WebhookAttempt, WebhookDelivery
from runs.webhooks import delivery as webhooks
from tests.conftest import set_policy
from tests.workers import Receiver, wait_for


@pytest.fixture(autouse=True)
def fast_passwords(settings: Any) -> None:
    """The stock users' PBKDF2 hashing costs seconds per test and proves nothing here."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture(autouse=True)
def eager_celery() -> Iterator[None]:
    """Fan-out in this process, whatever REDIS_URL says: these tests are about the services."""
    before = celery_app.conf.task_always_eager
    celery_app.conf.task_always_eager = True
    yield
    celery_app.conf.task_always_eager = before


@pytest.fixture
def commit(django_capture_on_commit_callbacks: Any) -> Any:
    """Run on_commit callbacks (the fan-out) as a real commit would."""
    return lambda: django_capture_on_commit_callbacks(execute=True)


def start(api: Any, agent: str = "support-bot") -> str:
    response = api.post("/api/v1/runs", {"agent": agent}, content_type="application/json")
    assert response.status_code == 201, response.content
    return response.json()["run_id"]


def start_status(api: Any, agent: str = "support-bot") -> int:
    return api.post("/api/v1/runs", {"agent": agent}, content_type="application/json").status_code


def check(api: Any, run_id: str, name: str = "search.docs", **args: Any) -> dict[str, Any]:
    response = api.post(f"/api/v1/runs/{run_id}/check",
                        {"action": {"name": name, "args": args}}, content_type="application/json")
    assert response.status_code == 200, response.content
    return response.json()


def killed_rows(run_id: str) -> list[Decision]:
    return list(Decision.objects.filter(run_id=run_id, outcome="stop", reason="killed",
                                        action_name=""))


# --- Services ------------------------------------------------------------------------------

def test_a_check_after_the_engage_returned_is_stopped_killed(api, team, commit):
    run_id = start(api)
    assert check(api, run_id, q=1)["decision"] == "allow"
    with commit():
        killswitch_engage(scope="team", team=team, reason="runaway spend")
    answer = check(api, run_id, q=2)
    assert (answer["decision"], answer["reason"]) == ("stop", "killed")
    assert answer["next_action"]


def test_a_retry_stopped_by_a_switch_before_its_fanout_counts_nothing_again(api, team):
    # SPEC 5.2: a check_id the run has seen is not counted again. A retry of an allowed
    # check, sent after the engage and before the fan-out marked the run killed, was
    # decided as a new check: the run ended at step 4 of 3 checks.
    run_id = start(api)
    for n in (1, 2, 3):
        body = {"action": {"name": "search.docs", "args": {"q": n}}, "check_id": f"c{n}"}
        assert api.post(f"/api/v1/runs/{run_id}/check", body,
                        content_type="application/json").json()["decision"] == "allow"
    killswitch_engage(scope="run", run=Run.objects.get(pk=run_id), reason="loops")  # no fan-out
    answer = api.post(f"/api/v1/runs/{run_id}/check", body,
                      content_type="application/json").json()
    assert (answer["decision"], answer["reason"], answer["step"]) == ("stop", "killed", 3)
    run = Run.objects.get(pk=run_id)
    assert (run.status, run.steps) == ("killed", 3)
    row = Decision.objects.filter(run_id=run_id).order_by("-id").first()
    assert (row.outcome, row.reason, row.step, row.check_id) == ("stop", "killed", 3, None)
    # Sent once more, the run is over: its stop again, nothing counted.
    again = api.post(f"/api/v1/runs/{run_id}/check", body,
                     content_type="application/json").json()
    assert (again["decision"], again["step"]) == ("stop", 3)
    assert Run.objects.get(pk=run_id).steps == 3


def test_the_fanout_kills_every_running_covered_run_with_one_audit_record(api, team, commit):
    runs = [start(api) for _ in range(3)]
    check(api, runs[0], q=1)
    check(api, runs[0], q=2)
    with commit():
        switch = killswitch_engage(scope="team", team=team, reason="incident 42")
    for run_id in runs:
        run = Run.objects.get(pk=run_id)
        assert (run.status, run.stop_reason) == ("killed", "killed")
        assert run.ended_at is not None
        [row] = killed_rows(run_id)
        assert row.action_name == "" and row.args is None
        assert row.step == run.steps  # the step is unchanged: no check was counted
        assert row.answer["decision"] == "stop" and row.answer["reason"] == "killed"
        assert "incident 42" in row.answer["message"] and row.answer["next_action"]
        assert row.answer["kill_switch"] == switch.pk
    assert Run.objects.get(pk=runs[0]).steps == 2
    assert KillSwitch.objects.get(pk=switch.pk).fanout_done_at is not None


def test_running_the_fanout_twice_changes_nothing_the_second_time(api, team, commit):
    runs = [start(api) for _ in range(2)]
    with commit():
        switch = killswitch_engage(scope="team", team=team, reason="twice")
    before = list(Decision.objects.order_by("id").values_list("id", "run_id", "reason"))
    states = list(Run.objects.order_by("pk").values_list("pk", "status", "ended_at"))
    again = killswitch_fanout(switch_id=switch.pk)
    assert again is not None and again.killed == [] and again.deliveries == []
    assert list(Decision.objects.order_by("id").values_list("id", "run_id", "reason")) == before
    assert list(Run.objects.order_by("pk").values_list("pk", "status", "ended_at")) == states
    assert all(len(killed_rows(r)) == 1 for r in runs)


def test_the_fanout_leaves_finished_and_uncovered_runs_alone(api, team, other_team, commit):
    done = start(api)
    api.post(f"/api/v1/runs/{done}/finish", {"status": "completed"},
             content_type="application/json")
    other = start(api, agent="billing-bot")
    target = start(api, agent="support-bot")
    with commit():
        killswitch_engage(scope="agent", team=team, agent="support-bot", reason="loops")
    assert Run.objects.get(pk=done).status == "completed"
    assert Run.objects.get(pk=other).status == "running"
    assert Run.objects.get(pk=target).status == "killed"
    assert check(api, other, q=1)["decision"] == "allow"
    assert start_status(api, "support-bot") == 409
    assert start_status(api, "billing-bot") == 201


def test_the_fanout_kills_in_batches_each_run_once_with_its_audit_record(
        api, team, other_team, commit, monkeypatch):
    """Set-based fan-out in several batches: every covered running run killed once, with
    one audit record, in one pass; overlapping switches and a second pass add nothing."""
    from runs.killswitch import fanout as killswitch

    monkeypatch.setattr(killswitch, "FANOUT_BATCH", 2)
    runs = [start(api) for _ in range(5)]
    check(api, runs[0], q=1)
    done = start(api)
    api.post(f"/api/v1/runs/{done}/finish", {"status": "completed"},
             content_type="application/json")
    with commit():
        switch = killswitch_engage(scope="team", team=team, reason="batches")
    for run_id in runs:
        run = Run.objects.get(pk=run_id)
        assert (run.status, run.stop_reason) == ("killed", "killed")
        [row] = killed_rows(run_id)
        assert row.step == run.steps and row.at == run.ended_at
        assert row.answer["usage"]["steps"] == run.steps
        assert row.answer["usage"]["elapsed_s"] == pytest.approx(
            (run.ended_at - run.started_at).total_seconds(), abs=0.0011)
        assert row.elapsed_s == pytest.approx((run.ended_at - run.started_at).total_seconds())
        assert row.answer["limits"]["max_steps"] and row.answer["kill_switch"] == switch.pk
    assert Run.objects.get(pk=done).status == "completed" and killed_rows(done) == []
    with commit():
        killswitch_engage(scope="global", reason="overlap", actor_label="admin")
    assert all(len(killed_rows(r)) == 1 for r in runs)
    again = killswitch_fanout(switch_id=switch.pk)
    assert again is not None and again.killed == []
    assert Decision.objects.filter(reason="killed", action_name="").count() == len(runs)


def test_engaging_an_engaged_target_changes_nothing(team, commit):
    with commit():
        first = killswitch_engage(scope="team", team=team, reason="one")
    with commit():
        second = killswitch_engage(scope="team", team=team, reason="two")
    assert second.pk == first.pk and second.reason == "one"
    assert KillSwitch.objects.filter(active=True).count() == 1
    assert OperatorEvent.objects.filter(action="killswitch.engage").count() == 1


def test_releasing_a_target_that_is_not_engaged_says_so_and_succeeds(team):
    assert killswitch_release(scope="team", team=team, reason="all clear") is None
    assert not OperatorEvent.objects.filter(action="killswitch.release").exists()


@pytest.mark.parametrize("reason", ["", "   ", None])
def test_engage_and_release_need_a_reason(team, reason):
    with pytest.raises(KillSwitchError, match="reason is required"):
        killswitch_engage(scope="team", team=team, reason=reason)
    with pytest.raises(KillSwitchError, match="reason is required"):
        killswitch_release(scope="team", team=team, reason=reason)
    assert not KillSwitch.objects.exists()
    assert not OperatorEvent.objects.filter(action__startswith="killswitch").exists()


@pytest.mark.parametrize(("options", "message"), [
    ({"scope": "team"}, "needs the team"),
    ({"scope": "agent", "agent": "x"}, "^An agent switch needs the team"),
    ({"scope": "agent", "team": True}, "needs the agent name"),
    ({"scope": "agent", "team": True, "agent": "no spaces"}, "needs the agent name"),
    ({"scope": "run"}, "needs the run"),
    ({"scope": "global", "team": True}, "takes no team"),
    ({"scope": "team", "team": True, "agent": "bot"}, "takes no agent"),
    ({"scope": "planet"}, "Unknown scope"),
])
def test_a_switch_must_name_what_its_scope_needs(team, options, message):
    if options.get("team") is True:
        options = {**options, "team": team}
    with pytest.raises(KillSwitchError, match=message):
        killswitch_engage(reason="why", **options)


def test_a_run_switch_takes_its_team_from_the_run(api, team, other_team, commit):
    run = Run.objects.get(pk=start(api))
    with commit():
        switch = killswitch_engage(scope="run", run=run, reason="this one")
    assert switch.team_id == team.pk and switch.target == f"run:{run.pk}"
    assert Run.objects.get(pk=run.pk).status == "killed"
    with pytest.raises(KillSwitchError, match="another team"):
        killswitch_engage(scope="run", run=run, team=other_team, reason="x")
    assert start_status(api) == 201  # a run switch stops that run only


def test_the_global_switch_covers_every_team(api, team, other_team, commit):
    from policies.services import agent_key_create

    mine = start(api)
    token = agent_key_create(team=other_team, name="k").token
    theirs = api.post("/api/v1/runs", {"agent": "b"}, content_type="application/json",
                      HTTP_AUTHORIZATION=f"Bearer {token}").json()["run_id"]
    with commit():
        switch = killswitch_engage(scope="global", reason="all hands", actor_label="ops")
    assert switch.team is None
    assert set(Run.objects.values_list("status", flat=True)) == {"killed"}
    assert {mine, theirs} == {str(pk) for pk in Run.objects.values_list("pk", flat=True)}
    assert start_status(api) == 409


def test_killed_is_enforced_in_shadow_mode(api, team, commit):
    set_policy(team, mode="shadow")
    run_id = start(api)
    with commit():
        killswitch_engage(scope="team", team=team, reason="shadow too")
    answer = check(api, run_id, q=1)
    assert (answer["decision"], answer["reason"]) == ("stop", "killed")


def test_release_keeps_killed_runs_killed_and_lets_new_runs_start(api, team, users, commit):
    run_id = start(api)
    with commit():
        killswitch_engage(scope="team", team=team, reason="stop", actor=users["operator"])
    assert start_status(api) == 409
    released = killswitch_release(scope="team", team=team, reason="fixed",
                                  actor=users["admin"])
    assert released is not None and not released.active
    assert released.released_by == users["admin"] and released.release_reason == "fixed"
    assert Run.objects.get(pk=run_id).status == "killed"
    assert check(api, run_id, q=1)["reason"] == "killed"
    new = start(api)
    assert check(api, new, q=1)["decision"] == "allow"


def test_engage_and_release_are_operator_audit_events(team, users, commit):
    with commit():
        switch = killswitch_engage(scope="agent", team=team, agent="bot", reason="loops",
                                   actor=users["operator"])
    killswitch_release(scope="agent", team=team, agent="bot", reason="patched",
                       actor=users["admin"])
    engage = OperatorEvent.objects.get(action="killswitch.engage")
    release = OperatorEvent.objects.get(action="killswitch.release")
    assert (engage.actor, engage.actor_label, engage.team) == (users["operator"], "operator", team)
    assert engage.detail["scope"] == "agent" and engage.detail["agent"] == "bot"
    assert engage.detail["reason"] == "loops" and engage.detail["switch"] == switch.pk
    assert engage.at is not None and "at" in engage.detail
    assert (release.actor, release.detail["reason"], release.detail["scope"]) == (
        users["admin"], "patched", "agent")


def test_the_engage_refuses_to_run_inside_an_open_transaction(team):
    """Its commit must come before it returns (SPEC 4.5): a caller's transaction would delay it."""
    with pytest.raises(RuntimeError), transaction.atomic():
        killswitch_engage(scope="team", team=team, reason="nested")
    assert not KillSwitch.objects.exists()


def test_a_broker_outage_does_not_fail_the_engage_and_the_runs_are_still_killed(
        api, team, commit, monkeypatch):
    from runs.killswitch.tasks import killswitch_fanout_task

    def broker_down(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("Redis is down")

    monkeypatch.setattr(killswitch_fanout_task, "delay", broker_down)
    run_id = start(api)
    with commit():
        switch = killswitch_engage(scope="team", team=team, reason="outage")
    assert switch.active
    assert Run.objects.get(pk=run_id).status == "killed" and len(killed_rows(run_id)) == 1


def test_a_switch_released_before_its_fanout_ran_kills_only_runs_it_covered(api, team):
    old = start(api)
    switch = killswitch_engage(scope="team", team=team, reason="x")  # on_commit not run here
    killswitch_release(scope="team", team=team, reason="y")
    KillSwitch.objects.filter(pk=switch.pk).update(released_at=timezone.now())
    new = start(api)
    killswitch_fanout(switch_id=switch.pk)
    assert Run.objects.get(pk=old).status == "killed"
    assert Run.objects.get(pk=new).status == "running"


def test_a_pass_that_read_its_switch_before_the_release_spares_runs_started_after_it(
        api, team):
    """Found by a tester: a team switch released 29 ms after its engage, and a run started
    5 ms after the release was killed by the fan-out, whose pass had read the switch while
    it was still engaged. The release is read in the batch's own locking statement."""
    from runs.killswitch.fanout import _covered_running, _kill_batch

    old = start(api)
    switch = killswitch_engage(scope="team", team=team, reason="x")  # on_commit not run here
    as_read = KillSwitch.objects.get(pk=switch.pk)
    killswitch_release(scope="team", team=team, reason="y")
    assert KillSwitch.objects.get(pk=switch.pk).released_at is not None
    new = start(api)
    killed = [pk for pk, _ in _kill_batch(as_read, _covered_running(as_read))]
    assert killed == [old]
    assert Run.objects.get(pk=new).status == "running"


# --- Webhooks ------------------------------------------------------------------------------

def test_a_signature_verifies_and_an_old_or_altered_one_does_not():
    body = b'{"id":1}'
    now = int(time.time())
    signature = webhooks.sign("s3cret", str(now), body)
    assert signature.startswith("sha256=") and len(signature) == 7 + 64
    assert webhooks.verify("s3cret", str(now), body, signature)
    assert not webhooks.verify("other", str(now), body, signature)
    assert not webhooks.verify("s3cret", str(now), body + b" ", signature)
    assert not webhooks.verify("s3cret", str(now - 3600), body,
                               webhooks.sign("s3cret", str(now - 3600), body))
    assert not webhooks.verify("s3cret", "not-a-time", body, signature)


def test_backoff_doubles_from_one_second_up_to_a_cap():
    assert [webhooks.backoff(n) for n in range(1, 9)] == [1, 2, 4, 8, 16, 32, 60, 60]


@pytest.fixture
def receiver(team: Any, settings: Any) -> Iterator[Receiver]:
    # The receiver listens on loopback, which webhooks may reach only when allowed
    # (policies/egress.py): what an on-premises receiver's operator would configure.
    settings.WEBHOOK_ALLOWED_HOSTS = ["127.0.0.1"]
    rec = Receiver(secrets={team.slug: team.webhook_secret}).start()
    yield rec
    rec.stop()


@pytest.mark.django_db(transaction=True)
def test_the_team_webhook_receives_a_signed_notification(api, team, receiver):
    team.webhook_url = f"{receiver.url}/{team.slug}"
    team.save()
    run_id = start(api)
    switch = killswitch_engage(scope="team", team=team, reason="page the on-call",
                               actor_label="alice")
    delivery = wait_for(lambda: WebhookDelivery.objects.filter(status="delivered").first(),
                        timeout=10, what="the delivery")
    assert receiver.valid[team.slug] == 1 and not receiver.invalid
    [body] = receiver.bodies
    assert body == {
        "id": switch.pk, "event": "killswitch.engaged", "scope": "team", "team": team.slug,
        "agent": None, "run": None, "reason": "page the on-call", "engaged_by": "alice",
        "engaged_at": body["engaged_at"], "killed_runs": [run_id],
    }
    [attempt] = delivery.tries.all()
    assert (attempt.number, attempt.status_code, attempt.error) == (1, 200, "")
    assert delivery.attempts == 1 and delivery.delivered_at is not None


@pytest.mark.django_db(transaction=True)
def test_failed_attempts_are_recorded_and_retried_until_given_up(team, receiver):
    receiver.status = 503
    team.webhook_url = f"{receiver.url}/{team.slug}"
    team.save()
    switch = KillSwitch.objects.create(scope="team", team=team, target=f"team:{team.pk}",
                                       reason="r", engaged_by_label="x",
                                       engaged_at=timezone.now())
    delivery = WebhookDelivery.objects.create(switch=switch, team=team, url=team.webhook_url,
                                              payload={"id": switch.pk})
    step = webhooks.attempt_delivery(delivery_id=delivery.pk, number=1)
    assert step == webhooks.Next(2, 1.0)
    for number in range(2, webhooks.MAX_ATTEMPTS + 1):
        step = webhooks.attempt_delivery(delivery_id=delivery.pk, number=number)
    assert step is None
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts) == ("failed", webhooks.MAX_ATTEMPTS)
    tries = list(delivery.tries.all())
    assert [t.number for t in tries] == list(range(1, 9))
    assert all(t.status_code == 503 and t.error == "HTTP 503" for t in tries)
    assert receiver.valid[team.slug] == 8
    # A duplicate message for an attempt already made stands down.
    assert webhooks.attempt_delivery(delivery_id=delivery.pk, number=3) is None
    assert delivery.tries.count() == 8


@pytest.mark.django_db(transaction=True)
def test_an_unreachable_receiver_is_an_attempt_with_a_fixed_phrase(team, settings):
    settings.WEBHOOK_ALLOWED_HOSTS = ["127.0.0.1"]
    team.webhook_url = "http://127.0.0.1:9/nowhere"
    team.save()
    switch = KillSwitch.objects.create(scope="team", team=team, target=f"team:{team.pk}",
                                       reason="r", engaged_by_label="x",
                                       engaged_at=timezone.now())
    delivery = WebhookDelivery.objects.create(switch=switch, team=team, url=team.webhook_url,
                                              payload={"id": switch.pk})
    assert webhooks.attempt_delivery(delivery_id=delivery.pk, number=1) == webhooks.Next(2, 1.0)
    [attempt] = WebhookAttempt.objects.all()
    assert (attempt.status_code, attempt.error) == (None, webhooks.UNREACHABLE)


@pytest.mark.django_db(transaction=True)
def test_an_attempt_whose_worker_died_is_marked_and_made_again(team, receiver):
    team.webhook_url = f"{receiver.url}/{team.slug}"
    team.save()
    switch = KillSwitch.objects.create(scope="team", team=team, target=f"team:{team.pk}",
                                       reason="r", engaged_by_label="x",
                                       engaged_at=timezone.now())
    delivery = WebhookDelivery.objects.create(switch=switch, team=team, url=team.webhook_url,
                                              payload={"id": switch.pk}, attempts=1)
    lost = WebhookAttempt.objects.create(delivery=delivery, number=1, error=webhooks.IN_FLIGHT,
                                         at=timezone.now())
    # Still within its lease: maybe another worker is on it, so look again later.
    step = webhooks.attempt_delivery(delivery_id=delivery.pk, number=1)
    assert step is not None and step.number == 1 and 0 < step.delay <= webhooks.LEASE_S
    WebhookAttempt.objects.filter(pk=lost.pk).update(
        at=timezone.now() - timedelta(seconds=webhooks.LEASE_S + 1))
    assert webhooks.attempt_delivery(delivery_id=delivery.pk, number=1) is None
    lost.refresh_from_db()
    assert lost.error == webhooks.INTERRUPTED
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts) == ("delivered", 2)
    assert receiver.valid[team.slug] == 1


# --- The command -----------------------------------------------------------------------------

def run_command(*args: str) -> str:
    out = StringIO()
    call_command("killswitch", *args, stdout=out)
    return out.getvalue()


@pytest.mark.django_db(transaction=True)
def test_the_command_engages_and_releases_with_the_same_effect(api, team):
    run_id = start(api)
    out = run_command("engage", "--scope", "team", "--team", "support", "--reason", "night")
    assert "Engaged: team support" in out and "1 running run(s)" in out
    assert Run.objects.get(pk=run_id).status == "killed"
    assert len(killed_rows(run_id)) == 1
    assert start_status(api) == 409
    assert "Already engaged" in run_command("engage", "--scope", "team", "--team", "support",
                                            "--reason", "again")
    event = OperatorEvent.objects.get(action="killswitch.engage")
    assert event.actor is None and event.actor_label.startswith("manage.py killswitch")
    assert "Released: team support" in run_command("release", "--scope", "team", "--team",
                                                   "support", "--reason", "morning")
    assert "Not engaged" in run_command("release", "--scope", "team", "--team", "support",
                                        "--reason", "again")
    assert start_status(api) == 201
    assert Run.objects.get(pk=run_id).status == "killed"


@pytest.mark.django_db(transaction=True)
def test_the_command_kills_one_run_and_one_agent(api, team):
    one, other = start(api), start(api, agent="billing-bot")
    run_command("engage", "--scope", "run", "--run", one, "--reason", "stuck")
    assert Run.objects.get(pk=one).status == "killed"
    assert Run.objects.get(pk=other).status == "running"
    run_command("engage", "--scope", "agent", "--team", "support", "--agent", "billing-bot",
                "--reason", "loops")
    assert Run.objects.get(pk=other).status == "killed"


@pytest.mark.parametrize(("args", "message"), [
    (["engage", "--scope", "team", "--reason", "x"], "--team SLUG is required"),
    (["engage", "--scope", "agent", "--team", "support", "--reason", "x"],
     "--agent NAME is required"),
    (["engage", "--scope", "run", "--reason", "x"], "--run UUID is required"),
    (["engage", "--scope", "run", "--run", "nope", "--reason", "x"], "must be a run id"),
    (["engage", "--scope", "run", "--run", "00000000-0000-0000-0000-000000000000",
      "--reason", "x"], "no run with id"),
    (["engage", "--scope", "team", "--team", "nope", "--reason", "x"], "no team with slug"),
    (["engage", "--scope", "global", "--team", "support", "--reason", "x"], "takes no --team"),
    (["engage", "--scope", "team", "--team", "support", "--reason", " "], "reason is required"),
    (["engage", "--scope", "team", "--team", "support"], "--reason"),
    (["engage", "--scope", "galaxy", "--reason", "x"], "invalid choice"),
    (["pause", "--scope", "global", "--reason", "x"], "invalid choice"),
])
def test_the_command_says_what_is_missing(team, args, message):
    with pytest.raises(CommandError, match=message):
        run_command(*args)
    assert not KillSwitch.objects.exists()


# --- The screens -----------------------------------------------------------------------------

def login(client: Any, user: Any) -> Any:
    client.force_login(user)
    return client


def engage_url(slug: str = "support") -> str:
    return reverse("runs:killswitch-engage", args=[slug])


def release_url(slug: str = "support") -> str:
    return reverse("runs:killswitch-release", args=[slug])


def test_the_kill_switch_page_shows_state_history_and_deliveries(client, team, users, commit):
    with commit():
        switch = killswitch_engage(scope="team", team=team, reason="page test",
                                   actor=users["operator"])
    delivery = WebhookDelivery.objects.create(switch=switch, team=team,
                                              url="https://hooks.example.com/x", payload={})
    WebhookAttempt.objects.create(delivery=delivery, number=1, at=timezone.now(),
                                  status_code=500, error="HTTP 500: boom", duration_ms=12)
    response = login(client, users["viewer"]).get(reverse("runs:killswitch", args=["support"]))
    assert response.status_code == 200
    html = response.content.decode()
    assert "page test" in html and "team support" in html
    assert "HTTP 500: boom" in html and "https://hooks.example.com/x" in html
    assert 'id="killswitch-banner"' in html
    # A viewer sees the state but no engage form and no release form.
    assert "Stop the whole team" not in html
    assert "Release</button>" not in html


def test_the_banner_offers_release_to_admins_only(client, team, users, commit):
    # Only when the team says so (its default lets operators release their own switches:
    # tests/test_killswitch_release.py).
    team.operator_release = "none"
    team.save()
    with commit():
        killswitch_engage(scope="team", team=team, reason="banner", actor=users["operator"])
    page = reverse("runs:killswitch", args=["support"])
    operator_html = login(client, users["operator"]).get(page).content.decode()
    assert "Kill switch engaged: team support" in operator_html
    assert "Release</button>" not in operator_html
    admin_html = login(client, users["admin"]).get(page).content.decode()
    assert "Release</button>" in admin_html and release_url() in admin_html


@pytest.mark.parametrize(("who", "status"), [
    ("viewer", 403), ("outsider", 403), ("operator", 302), ("admin", 302), ("superuser", 302),
])
def test_who_may_engage_the_team_switch(client, team, users, who, status, commit):
    with commit():
        response = login(client, users[who]).post(
            engage_url(), {"scope": "team", "reason": "r", "confirmed": "1"})
    assert response.status_code == status
    assert KillSwitch.objects.filter(active=True).exists() == (status == 302)


def test_anonymous_is_sent_to_sign_in(client, team):
    response = client.post(engage_url(), {"scope": "team", "reason": "r", "confirmed": "1"})
    assert response.status_code == 302 and "/accounts/login/" in response["Location"]
    assert not KillSwitch.objects.exists()


@pytest.mark.parametrize(("who", "status"), [
    ("viewer", 403), ("operator", 403), ("outsider", 403), ("admin", 302), ("superuser", 302),
])
def test_who_may_release_the_team_switch(client, team, users, who, status, commit):
    with commit():
        killswitch_engage(scope="team", team=team, reason="r")
    response = login(client, users[who]).post(release_url(), {"scope": "team", "reason": "ok"})
    assert response.status_code == status
    assert KillSwitch.objects.filter(active=True).exists() == (status != 302)


def test_an_operator_engages_an_agent_switch_but_may_not_release_it(client, team, users, commit):
    team.operator_release = "none"  # the team's choice; by default they may (issue 26)
    team.save()
    login(client, users["operator"])
    with commit():
        response = client.post(engage_url(), {"scope": "agent", "agent": "support-bot",
                                              "reason": "loops", "confirmed": "1"})
    assert response.status_code == 302
    switch = KillSwitch.objects.get(active=True)
    assert (switch.scope, switch.agent, switch.engaged_by) == ("agent", "support-bot",
                                                               users["operator"])
    assert client.post(release_url(), {"scope": "agent", "agent": "support-bot",
                                       "reason": "x"}).status_code == 403
    login(client, users["admin"])
    assert client.post(release_url(), {"scope": "agent", "agent": "support-bot",
                                       "reason": "fixed"}).status_code == 302
    assert not KillSwitch.objects.filter(active=True).exists()


def test_the_confirmation_names_the_scope_and_what_will_stop(client, api, team, users):
    start(api)
    start(api)
    start(api, agent="other-bot")
    login(client, users["operator"])
    response = client.post(engage_url(), {"scope": "agent", "agent": "support-bot",
                                          "reason": "prefilled"})
    assert response.status_code == 200
    html = response.content.decode()
    assert "Engage the kill switch: agent support-bot of team support" in html
    assert "2 running runs" in html and 'name="confirmed"' in html and "prefilled" in html
    assert not KillSwitch.objects.exists()
    team_html = client.get(engage_url() + "?scope=team").content.decode()
    assert "Engage the kill switch: team support" in team_html and "3 running runs" in team_html


def test_a_reason_is_required_and_nothing_changes_without_one(client, api, team, users):
    run_id = start(api)
    login(client, users["operator"])
    response = client.post(engage_url(), {"scope": "team", "reason": "  ", "confirmed": "1"})
    assert response.status_code == 200
    assert "A reason is required" in response.content.decode()
    assert not KillSwitch.objects.exists() and Run.objects.get(pk=run_id).status == "running"
    assert not OperatorEvent.objects.filter(action__startswith="killswitch").exists()


def test_a_release_without_reason_is_refused_with_a_form_error(client, team, users, commit):
    with commit():
        killswitch_engage(scope="team", team=team, reason="r")
    response = login(client, users["admin"]).post(release_url(), {"scope": "team"})
    assert response.status_code == 200 and "A reason is required" in response.content.decode()
    assert KillSwitch.objects.filter(active=True).exists()


def test_an_operator_kills_a_run_after_confirming(client, api, team, users, commit):
    run_id = start(api)
    other = start(api)
    url = reverse("runs:killswitch-run", args=["support", run_id])
    login(client, users["operator"])
    html = client.get(url).content.decode()
    assert f"Engage the kill switch: run {run_id[:8]} of team support" in html
    assert 'data-covered="1"' in html
    with commit():
        response = client.post(url, {"reason": "stuck in a loop", "confirmed": "1"})
    assert response.status_code == 302
    assert Run.objects.get(pk=run_id).status == "killed"
    assert Run.objects.get(pk=other).status == "running"
    [row] = killed_rows(run_id)
    assert "stuck in a loop" in row.answer["message"]
    assert check(api, run_id, q=1)["reason"] == "killed"


@pytest.mark.parametrize("target", ["on", "x" * 600, "home", "runs:approvals"])
def test_a_next_that_is_not_a_path_goes_back_to_the_page_not_a_500(client, api, team, users,
                                                                     commit, target):
    # Found by an attacker: `next` came back from redirect() as a view name to reverse, so a
    # word without "/" or "." answered 500 after the switch was engaged (or released), and a
    # view's name went wherever that view is.
    run_id = start(api)
    login(client, users["admin"])
    with commit():
        engaged = client.post(engage_url(), {"scope": "agent", "agent": "support-bot",
                                             "reason": "loops", "confirmed": "1",
                                             "next": target})
    assert engaged.status_code == 302
    assert engaged["Location"] == reverse("runs:killswitch", args=["support"])
    assert Run.objects.get(pk=run_id).status == "killed"
    released = client.post(release_url(), {"scope": "agent", "agent": "support-bot",
                                            "reason": "fixed", "next": target})
    assert released.status_code == 302
    assert released["Location"] == reverse("runs:killswitch", args=["support"])
    other = start(api)
    killed = client.post(reverse("runs:killswitch-run", args=["support", other]),
                         {"reason": "stuck", "confirmed": "1", "next": target})
    assert killed.status_code == 302
    assert killed["Location"] == reverse("runs:run", args=["support", other])


def test_under_htmx_the_run_kill_answers_fragments(client, api, team, users, commit):
    run_id = start(api)
    url = reverse("runs:killswitch-run", args=["support", run_id])
    login(client, users["operator"])
    confirm = client.get(url, HTTP_HX_REQUEST="true").content.decode()
    assert confirm.lstrip().startswith("<div id=\"killswitch-confirm\"") and "hx-post" in confirm
    with commit():
        done = client.post(url, {"reason": "now", "confirmed": "1"}, HTTP_HX_REQUEST="true")
    assert done.status_code == 200 and done["HX-Trigger"] == "killswitch-changed"
    assert "Kill switch engaged" in done.content.decode()
    assert Run.objects.get(pk=run_id).status == "killed"


def test_a_viewer_may_not_kill_a_run_and_another_team_cannot_see_it(client, api, team, users):
    run_id = start(api)
    url = reverse("runs:killswitch-run", args=["support", run_id])
    assert login(client, users["viewer"]).post(url, {"reason": "x", "confirmed": "1"}
                                               ).status_code == 403
    assert login(client, users["outsider"]).get(url).status_code == 403
    billing = reverse("runs:killswitch-run", args=["billing", run_id])
    assert login(client, users["outsider"]).post(billing, {"reason": "x", "confirmed": "1"}
                                                 ).status_code == 404
    assert not KillSwitch.objects.exists()


@pytest.mark.parametrize("who", ["viewer", "operator", "admin", "outsider"])
def test_only_a_superuser_may_touch_the_global_switch(client, team, users, who):
    login(client, users[who])
    assert client.get(reverse("runs:killswitch-global")).status_code == 403
    assert client.post(reverse("runs:killswitch-global-engage"),
                       {"reason": "x", "confirmed": "1"}).status_code == 403
    assert client.post(reverse("runs:killswitch-global-release"),
                       {"reason": "x"}).status_code == 403
    assert not KillSwitch.objects.exists()


def test_a_superuser_engages_and_releases_the_global_switch(client, api, team, users, commit):
    run_id = start(api)
    login(client, users["superuser"])
    assert client.get(reverse("runs:killswitch-global")).status_code == 200
    confirm = client.post(reverse("runs:killswitch-global-engage"), {"reason": "all"})
    assert "Engage the kill switch: global" in confirm.content.decode()
    with commit():
        response = client.post(reverse("runs:killswitch-global-engage"),
                               {"reason": "all stop", "confirmed": "1"})
    assert response.status_code == 302
    assert Run.objects.get(pk=run_id).status == "killed"
    html = client.get(reverse("runs:killswitch", args=["support"])).content.decode()
    assert "Kill switch engaged: global" in html
    assert reverse("runs:killswitch-global-release") in html  # the banner's release form
    assert client.post(reverse("runs:killswitch-global-release"),
                       {"reason": "over"}).status_code == 302
    assert not KillSwitch.objects.filter(active=True).exists()
    assert start_status(api) == 201


def test_next_only_redirects_within_the_site(client, team, users, commit):
    login(client, users["operator"])
    with commit():
        response = client.post(engage_url(), {"scope": "team", "reason": "r", "confirmed": "1",
                                              "next": "https://evil.example.com/"})
    assert response["Location"] == reverse("runs:killswitch", args=["support"])


def test_other_teams_switches_are_not_shown(client, team, other_team, users, commit):
    with commit():
        killswitch_engage(scope="team", team=other_team, reason="billing secret")
    html = login(client, users["admin"]).get(
        reverse("runs:killswitch", args=["support"])).content.decode()
    assert "billing secret" not in html and 'id="killswitch-banner"' not in html


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_racing_engages_of_one_target_tell_one_caller_it_engaged(team):
    """SPEC 6: engaging a scope already engaged changes nothing, and its caller is told so.
    Six engages of one agent's switch at once, from threads of their own: one switch, one
    audit event, and one caller told it engaged it (the others were told so too when each
    compared the switch's time with its own start: found by a tester with five tokens)."""
    from concurrent.futures import ThreadPoolExecutor
    from threading import Barrier

    from django.db import connection

    for round_ in range(4):
        barrier = Barrier(6)

        def engage(i: int, agent: str = f"bot-{round_}", barrier: Barrier = barrier) -> bool:
            barrier.wait()
            try:
                return killswitch_engage(scope="agent", team=team, agent=agent,
                                         reason="race", actor_label=f"token {i}").engaged_now
            finally:
                connection.close()

        with ThreadPoolExecutor(max_workers=6) as pool:
            told = list(pool.map(engage, range(6)))
        assert told.count(True) == 1, (round_, told)
        assert KillSwitch.objects.filter(agent=f"bot-{round_}").count() == 1
        assert OperatorEvent.objects.filter(action="killswitch.engage",
                                            detail__agent=f"bot-{round_}").count() == 1


def test_a_run_switch_engaged_again_after_its_run_ended_changes_nothing(api, team, commit):
    """SPEC 6: engaging a scope already engaged changes nothing. The fan-out retires a run
    switch once its run is over, and an engage sent again after it (a retry, a second
    operator) engaged a new switch, told it had (found by a tester: two and three "engaged"
    answers for one run, each a fan-out of its own). A run that is over without a switch
    has nothing to kill."""
    from runs.killswitch.services import KillSwitchError

    run_id = start(api)
    run = Run.objects.get(pk=run_id)
    with commit():
        first = killswitch_engage(scope="run", run=run, reason="looping")
    assert first.engaged_now
    assert Run.objects.get(pk=run_id).status == "killed"
    assert not KillSwitch.objects.get(pk=first.pk).active  # retired by its fan-out
    events = OperatorEvent.objects.filter(action="killswitch.engage").count()
    with commit():
        again = killswitch_engage(scope="run", run=run, reason="looping, again")
    assert (again.pk, again.engaged_now) == (first.pk, False)
    assert KillSwitch.objects.filter(run_id=run_id).count() == 1
    assert OperatorEvent.objects.filter(action="killswitch.engage").count() == events

    done = start(api)
    api.post(f"/api/v1/runs/{done}/finish", {"status": "completed"},
             content_type="application/json")
    with pytest.raises(KillSwitchError, match="already completed: there is nothing to kill"):
        killswitch_engage(scope="run", run=Run.objects.get(pk=done), reason="late")
    assert not KillSwitch.objects.filter(run_id=done).exists()


def test_killing_a_run_that_ended_meanwhile_says_so_on_the_page(api, team, users, client):
    """The run's Kill button was pressed as the run finished: nothing to kill, said as a
    message on the run's page, not an error page."""
    run_id = start(api)
    api.post(f"/api/v1/runs/{run_id}/finish", {"status": "completed"},
             content_type="application/json")
    client.force_login(users["operator"])
    url = reverse("runs:killswitch-run", args=[team.slug, run_id])
    answer = client.post(url, {"reason": "looping", "confirmed": "1"}, follow=True)
    assert answer.status_code == 200
    assert "already completed: there is nothing to kill" in answer.content.decode()
    assert not KillSwitch.objects.filter(run_id=run_id).exists()
