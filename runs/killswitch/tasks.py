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


def _fan_out(switch_id: int) -> None:
    result = fanout.killswitch_fanout(switch_id=switch_id)
    if result is None:
        return
    for delivery_id in result.deliveries:
        webhooks.schedule_delivery(delivery_id, 1, 0, urgent=True)
    fanout.killswitch_fanout_done(switch_id=switch_id)


@shared_task(name="runs.tasks.killswitch_fanout", acks_late=True,
             reject_on_worker_lost=True, **_retry)
def killswitch_fanout_task(switch_id: int, sweep: bool = False) -> None:
    """The fan-out of ``switch_id``, after the waiting fan-outs whose team's turn comes first
    (`fanout.next_fanout`: one team's flood of switches does not put another team's kill
    behind it). Eager, in the engaging request, there is no queue to wait in: its own only."""
    if sweep or killswitch_fanout_task.app.conf.task_always_eager:
        _fan_out(switch_id)
        return  # eager runs in one process with the engage: nothing can slip in between
    while (turn := fanout.next_fanout(switch_id)) is not None:
        if turn == switch_id:
            _fan_out(switch_id)
            continue
        try:
            _fan_out(turn)
        except Exception:
            # Another switch's failure is its own task's to retry; this one's fan-out must
            # not wait on it (nor retry behind it for ever).
            log.exception("the fan-out of kill switch %s failed; going on with %s's",
                          turn, switch_id)
            _fan_out(switch_id)
            break
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

