"""Celery tasks of the kill switch, on the dedicated ``killswitch`` queue (the settings'
CELERY_TASK_ROUTES), which a worker of its own consumes, so backtests, other bulk work and
webhook receivers never delay a kill. The webhook deliveries the fan-out creates run as
runs/webhooks/tasks.py's task, on the ``webhooks`` queue and its own worker.

Each task takes ids, calls a service and is idempotent: ``acks_late`` with
``reject_on_worker_lost`` means a task whose worker dies is delivered again, and running it
twice changes nothing the second time (runs/killswitch/fanout.py, runs/webhooks/delivery.py).
"""

from __future__ import annotations

import logging
import time

from celery import shared_task
from django.db import DatabaseError, InterfaceError
from kombu.exceptions import OperationalError as BrokerError

from runs.killswitch import fanout, sweep
from runs.models import KillSwitch, Scope
from runs.webhooks import delivery as webhooks

# A run whose start transaction read "no switch" just before the engage committed can commit
# just after the fan-out looked (PostgreSQL, READ COMMITTED): one more pass a little later
# kills it even if it never checks again. Its checks were stopped anyway (SPEC 4.5).
SWEEP_DELAY_S = 5.0

log = logging.getLogger(__name__)

# Store and broker errors (database restarting, connection lost, Redis unreachable while
# scheduling a delivery) are worth retrying with backoff; a bug is not. Bounded: after that
# the message is acked and the failure is in the worker log.
_retry = {"autoretry_for": (DatabaseError, InterfaceError, BrokerError), "retry_backoff": True,
          "retry_backoff_max": 60, "max_retries": 10}


def _done(switch_id: int, result: fanout.FanoutResult | None) -> None:
    """A fan-out's end: its webhook deliveries started, then recorded done."""
    if result is None:
        return
    for delivery_id in result.deliveries:
        webhooks.schedule_delivery(delivery_id, 1, 0, urgent=True)
    fanout.killswitch_fanout_done(switch_id=switch_id)


def _fan_out(switch_id: int) -> None:
    _done(switch_id, fanout.killswitch_fanout(switch_id=switch_id))


# Switches whose fan-out raised in this process, and when: their turns are skipped for a while
# (their own tasks retry them), so that one failing fan-out does not hold every task.
_failing: dict[int, float] = {}
FAILING_SKIP_S = 60.0


def _take_turns(own: int | None) -> None:
    """Run the waiting fan-outs a batch at a time, in turn order (`fanout.next_fanout`): one
    batch at least, whichever switch this task is for, then until ``own``'s fan-out is done
    (None: that one batch). So every task in the queue serves the head of the waiting
    fan-outs: a task whose own switch another task already fanned out still takes a turn
    (found by an attacker: thousands of such tasks, each ending at once, put another team's
    kill 35 to 95 s behind them)."""
    now = time.monotonic()
    for switch_id, since in list(_failing.items()):
        if now - since > FAILING_SKIP_S:
            del _failing[switch_id]
    while (turn := fanout.next_fanout(skip=_failing.keys())) is not None:
        try:
            _done(turn, fanout.killswitch_fanout_turn(switch_id=turn))
        except Exception:
            if turn == own:
                raise  # this task's own: retried by the task's own rules
            log.exception("the fan-out of kill switch %s failed; its own task retries it",
                          turn)
            _failing[turn] = time.monotonic()
        if own is None or fanout.fanout_done(own):
            return
    if own is not None and not fanout.fanout_done(own):
        _fan_out(own)  # skipped as failing in this process: its own task tries it whole


@shared_task(name="runs.tasks.killswitch_fanout", acks_late=True,
             reject_on_worker_lost=True, **_retry)
def killswitch_fanout_task(switch_id: int, sweep: bool = False) -> None:
    """The fan-out of ``switch_id``, taking turns with the other waiting fan-outs
    (`_take_turns`: one team's flood of switches, or its switch over thousands of its own
    runs, does not put another team's kill behind it); ``sweep``: the second pass a few
    seconds later, after one turn of the waiting ones. Eager, in the engaging request,
    there is no queue to wait in: its own only."""
    if killswitch_fanout_task.app.conf.task_always_eager:
        _fan_out(switch_id)
        return  # eager runs in one process with the engage: nothing can slip in between
    if sweep:
        _take_turns(None)
        _fan_out(switch_id)
        return
    _take_turns(switch_id)
    if KillSwitch.objects.filter(pk=switch_id, active=True).exclude(scope=Scope.RUN).exists():
        killswitch_fanout_task.apply_async((switch_id, True), countdown=SWEEP_DELAY_S)


@shared_task(name="runs.tasks.killswitch_sweep", acks_late=True, **_retry)
def killswitch_sweep_task() -> dict[str, int]:
    """Beat, every minute: restart what an outage left behind, a bounded number a pass
    (``stale_work``). A switch engaged while the broker was down never got its fan-out task,
    and a delivery whose chain died with its worker (or whose publish a server gave up on)
    has nothing scheduled; both are idempotent, so restarting them twice is harmless."""
    fanouts, deliveries = sweep.stale_work()
    for switch_id in fanouts:
        killswitch_fanout_task.delay(switch_id)
    for delivery_id, number in deliveries:
        webhooks.schedule_delivery(delivery_id, number, 0)
    return {"fanouts": len(fanouts), "deliveries": len(deliveries)}

