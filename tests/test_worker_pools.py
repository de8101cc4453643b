"""The kill switch's worker pool (SPEC 10, "No tenant slows another"): its fan-out never queues
behind backtests, other bulk work or another team's webhook receiver, because its queue has a
worker of its own, and the webhooks another, in the Makefile's and the README's worker
commands alike (docs/reliability.md, "Worker pools")."""

from __future__ import annotations

import shutil
import subprocess
import time
from datetime import timedelta

import pytest
from django.conf import settings

from backtests.models import Backtest
from backtests.services import backtest_start
from bench.backtest import generate
from governance.celery import app
from policies.models import Policy, Team
from policies.services import agent_key_create, team_ensure
from runs.check.lifecycle import run_start
from runs.killswitch.services import killswitch_engage
from runs.models import KillSwitch, Run, WebhookDelivery
from runs.webhooks import delivery as webhooks
from tests.conftest import ROOT
from tests.faults import hung_listener
from tests.workers import POOLS, Receiver, Worker, new_worker, wait_for, workers_fixture  # noqa: F401

# What must be as prompt as a kill: the fan-out, its sweep, and the approvals' expiry.
PROMPT = {"runs.tasks.killswitch_fanout", "runs.tasks.killswitch_sweep",
          "runs.tasks.approvals_expire"}
# What waits on other people's servers: the webhooks (kill switches', approvals', tests).
WEBHOOKS = {"runs.tasks.webhook_deliver", "runs.tasks.webhook_deliver_routine"}
BULK = {"backtests.tasks.backtest_run", "policies.tasks.prune_audit"}

# SPEC 10's fairness test: a team B kill switch fans out within 1 s (of the engage's return).
# Timed with the machine to itself (`attack_turn`): beside CI's other groups a fan-out that
# was not behind the backtests (every one still running) took 1.28 s once.
FAN_OUT_S = 1.0
# Each draft replays the whole history, so a backtest of this many takes its worker process
# several seconds (about 1.3 s a draft on a 2-core machine): longer than any fan-out.
HISTORY_RUNS = 600
DRAFTS = 8


def pool_queues() -> dict[str, set[str]]:
    return {name: set(queues.split(",")) for name, queues in POOLS.items()}


def test_every_task_goes_to_a_queue_a_pool_serves_and_only_the_kill_switchs_to_its_own(
        ) -> None:
    app.loader.import_default_modules()  # what a worker does at start: autodiscovery
    ours = {name for name in app.tasks if not name.startswith("celery.")}
    assert ours >= PROMPT | WEBHOOKS | BULK
    pools = pool_queues()
    assert pools["killswitch"] == {"killswitch"}
    assert pools["webhooks"] == {"webhooks"}
    served = set().union(*pools.values())
    for name in sorted(ours):
        queue = app.amqp.router.route({}, name)["queue"].name
        assert queue in served, f"{name} goes to {queue}, which no worker consumes"
        assert (queue == "killswitch") == (name in PROMPT), (name, queue)
        assert (queue == "webhooks") == (name in WEBHOOKS), (name, queue)
    for name in BULK:
        assert app.amqp.router.route({}, name)["queue"].name == "bulk"


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_the_makefile_and_the_readme_start_the_pools_the_tests_start() -> None:
    recipe = subprocess.run(["make", "-n", "worker"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout
    readme = (ROOT / "README.md").read_text()
    for name, queues in POOLS.items():
        command = f"celery -A governance worker -Q {queues} -n {name}@%h"
        assert command in recipe, recipe
        assert command in readme
    assert recipe.count("celery -A governance worker") == len(POOLS)


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_another_teams_backtests_never_delay_a_kill_switchs_fan_out(
        workers: list[Worker], attack_turn: None) -> None:
    """Team alpha's backtests fill every process of the bulk pool; team bravo's kill switch
    still marks its runs killed and delivers its webhook within 1 s of the engage. With one
    worker for every queue (the old `make worker`), it waited for a backtest to end."""
    alpha = team_ensure(slug="alpha")[0]
    bravo = team_ensure(slug="bravo")[0]
    generate(alpha, runs=HISTORY_RUNS)
    document = Policy.objects.select_related("current").get(
        team=alpha, name="default").current.document
    key = agent_key_create(team=bravo, name="bravo-key").key
    runs = [run_start(key=key, agent="bravo-bot", policy=None, task=None, metadata=None,
                      external_id=None)[0].pk for _ in range(5)]
    receiver = Receiver(secrets={bravo.slug: bravo.webhook_secret}).start()
    try:
        Team.objects.filter(pk=bravo.pk).update(webhook_url=f"{receiver.url}/{bravo.slug}")
        # The Makefile's concurrency: alpha's backtests (as many as a team may run) can occupy
        # every process of the bulk pool. No redelivery of a backtest during the test.
        new_worker(workers, visibility_timeout=120, concurrency=2)
        jobs = [backtest_start(team=alpha, user=None, source="editor",
                               drafts=[{"policy": "default", "document": document}] * DRAFTS,
                               since=timedelta(days=30), limit=HISTORY_RUNS).pk
                for _ in range(settings.BACKTEST_MAX_PER_TEAM)]
        wait_for(lambda: Backtest.objects.filter(pk__in=jobs, status="running").count()
                 == len(jobs), timeout=30, interval=0.05, what="alpha's backtests running")

        switch = killswitch_engage(scope="team", team=bravo, reason="fairness",
                                   actor_label="test")
        returned = time.monotonic()

        def fanned_out() -> bool:
            return (receiver.valid[bravo.slug] >= 1
                    and Run.objects.filter(pk__in=runs, status="killed").count() == len(runs)
                    and KillSwitch.objects.get(pk=switch.pk).fanout_done_at is not None)

        wait_for(fanned_out, timeout=60, interval=0.02, what="bravo's fan-out")
        took = time.monotonic() - returned
        still_running = Backtest.objects.filter(pk__in=jobs, status="running").count()
    finally:
        for worker in workers:
            worker.kill()  # the backtests need not finish
        receiver.stop()
    assert took < FAN_OUT_S, f"bravo's fan-out took {took:.2f} s behind alpha's backtests"
    assert still_running == len(jobs), "the backtests ended first: the test proved nothing"
    assert not receiver.invalid
    print(f"fan-out behind {len(jobs)} backtests: {took:.2f} s")



# Deliveries to team alpha's hung receiver: more than the pools' processes can take at once,
# each holding its process for an attempt's whole deadline.
HUNG_DELIVERIES = 12


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_another_teams_hung_webhook_receiver_never_delays_a_kill_switchs_fan_out(
        workers: list[Worker], attack_turn: None) -> None:
    """Team alpha's webhook receiver accepts connections and never answers, and alpha has
    many deliveries to it; team bravo's kill switch still marks its runs killed and records
    its fan-out done within 1 s of the engage. With the webhooks on the kill switch's queue,
    alpha's attempts held every process of its worker, 5 s each, and bravo's fan-out waited
    behind them."""
    alpha = team_ensure(slug="alpha")[0]
    bravo = team_ensure(slug="bravo")[0]
    key = agent_key_create(team=bravo, name="bravo-key").key
    runs = [run_start(key=key, agent="bravo-bot", policy=None, task=None, metadata=None,
                      external_id=None)[0].pk for _ in range(5)]
    with hung_listener() as hung:
        url = f"http://127.0.0.1:{hung.port}/alpha"
        Team.objects.filter(pk=alpha.pk).update(webhook_url=url)
        new_worker(workers, concurrency=2)  # the Makefile's concurrency
        for n in range(HUNG_DELIVERIES):
            delivery = WebhookDelivery.objects.create(
                team=alpha, event=webhooks.TEST_EVENT, url=url, payload={"n": n})
            webhooks.schedule_delivery(delivery.pk, 1, 0)
        wait_for(lambda: len(hung.held) >= 2, timeout=30, interval=0.05,
                 what="alpha's attempts holding two worker processes")

        switch = killswitch_engage(scope="team", team=bravo, reason="fairness",
                                   actor_label="test")
        returned = time.monotonic()

        def fanned_out() -> bool:
            return (Run.objects.filter(pk__in=runs, status="killed").count() == len(runs)
                    and KillSwitch.objects.get(pk=switch.pk).fanout_done_at is not None)

        try:
            wait_for(fanned_out, timeout=90, interval=0.02, what="bravo's fan-out")
            took = time.monotonic() - returned
            undelivered = WebhookDelivery.objects.filter(team=alpha, status="pending").count()
        finally:
            for worker in workers:
                worker.kill()  # alpha's attempts need not end
    assert took < FAN_OUT_S, f"bravo's fan-out took {took:.2f} s behind alpha's webhooks"
    assert undelivered == HUNG_DELIVERIES, "alpha's receiver answered: the test proved nothing"
    print(f"fan-out beside {HUNG_DELIVERIES} hung webhooks: {took:.2f} s")
