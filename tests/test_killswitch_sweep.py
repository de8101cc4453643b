"""The beat sweep restarts kill-switch work an outage left behind."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from runs.killswitch.sweep import stale_work
from runs.killswitch.tasks import killswitch_sweep_task
from runs.models import KillSwitch, WebhookDelivery

pytestmark = pytest.mark.django_db


def make_switch(team, *, ago: timedelta, done: bool) -> KillSwitch:
    at = timezone.now() - ago
    return KillSwitch.objects.create(
        scope="team", team=team, target=f"team:{team.pk}", reason="r", engaged_by_label="ops",
        engaged_at=at, fanout_done_at=at if done else None)


def test_it_names_only_old_unfinished_fanouts(team, other_team):
    old = make_switch(team, ago=timedelta(minutes=5), done=False)
    make_switch(other_team, ago=timedelta(seconds=5), done=False)
    assert stale_work()[0] == [old.pk]


def test_how_old_a_fanout_must_be_is_the_sweeps_period(team, other_team, settings):
    """KILLSWITCH_SWEEP_SECONDS: a deployment that wants a lost fan-out back sooner than in
    a minute or two sweeps more often, and the sweep restarts what is older than one period."""
    settings.KILLSWITCH_SWEEP_SECONDS = 5
    old = make_switch(team, ago=timedelta(seconds=6), done=False)
    make_switch(other_team, ago=timedelta(seconds=3), done=False)
    assert stale_work()[0] == [old.pk]


def test_it_names_old_pending_deliveries_with_their_next_attempt(team):
    switch = make_switch(team, ago=timedelta(minutes=5), done=True)
    delivery = WebhookDelivery.objects.create(switch=switch, team=team, url="http://x.invalid/",
                                              payload={}, attempts=2)
    WebhookDelivery.objects.filter(pk=delivery.pk).update(
        created_at=timezone.now() - timedelta(minutes=5))
    assert stale_work()[1] == [(delivery.pk, 2)]
    WebhookDelivery.objects.filter(pk=delivery.pk).update(status="delivered")
    assert stale_work()[1] == []


def test_a_pass_names_a_bounded_number_oldest_first(team, monkeypatch):
    """An outage can leave thousands behind; one pass of the sweep publishes a bounded
    number (the next pass takes the next ones), not all of them at once."""
    from runs.killswitch import sweep

    monkeypatch.setattr(sweep, "STALE_BATCH", 3, raising=False)
    switches = [KillSwitch.objects.create(
        scope="agent", team=team, agent=f"bot-{n}", target=f"agent:{team.pk}:bot-{n}",
        reason="r", engaged_by_label="ops", engaged_at=timezone.now() - timedelta(minutes=10 - n))
        for n in range(5)]
    deliveries = []
    for n in range(5):
        delivery = WebhookDelivery.objects.create(switch=switches[n], team=team,
                                                  url="http://x.invalid/", payload={})
        WebhookDelivery.objects.filter(pk=delivery.pk).update(
            created_at=timezone.now() - timedelta(minutes=10 - n))
        deliveries.append(delivery.pk)
    fanouts, pending = stale_work()
    assert fanouts == [switch.pk for switch in switches[:3]]
    assert pending == [(pk, 1) for pk in deliveries[:3]]


@pytest.fixture
def eager_tasks():
    """The tasks the sweep enqueues run here and now, as a worker would run them."""
    from governance.celery import app

    previous = app.conf.task_always_eager
    app.conf.task_always_eager = True
    yield
    app.conf.task_always_eager = previous


def test_the_sweep_finishes_a_fanout_the_broker_never_got(team, agent_token, api, eager_tasks):
    run = api.post("/api/v1/runs", {"agent": "bot"}, content_type="application/json").json()
    make_switch(team, ago=timedelta(minutes=5), done=False)
    assert killswitch_sweep_task() == {"fanouts": 1, "deliveries": 0}
    from runs.models import Run

    assert Run.objects.get(pk=run["run_id"]).status == "killed"
    assert stale_work() == ([], [])
