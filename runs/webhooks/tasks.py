"""The Celery task of webhook delivery: one attempt per message, the next one scheduled by
the attempt before it (runs/webhooks/delivery.py).

Its name stays ``runs.tasks.webhook_deliver``, the name it had when it lived with the kill
switch's tasks: a message queued by an older version is still understood after an upgrade.
The settings route it to the ``webhooks`` queue, which a worker of its own consumes: an attempt
waits on someone else's server (up to its 5 s deadline), which must never hold a process the
kill switch's fan-out waits for.
"""

from __future__ import annotations

from typing import Any

from celery import shared_task
from celery.signals import worker_process_init
from django.db import DatabaseError, InterfaceError
from kombu.exceptions import OperationalError as BrokerError

from runs.webhooks import delivery as webhooks

# Store and broker errors are retried with bounded backoff, as the kill switch's tasks do; a
# delivery that fails at the receiver is retried by delivery.py's own chain instead.
_retry = {"autoretry_for": (DatabaseError, InterfaceError, BrokerError), "retry_backoff": True,
          "retry_backoff_max": 60, "max_retries": 10}


@shared_task(name="runs.tasks.webhook_deliver", acks_late=True,
             reject_on_worker_lost=True, **_retry)
def webhook_deliver_task(delivery_id: int, number: int = 1) -> None:
    """A kill switch's delivery: first in the queue (governance/settings.py routes)."""
    step = webhooks.attempt_delivery(delivery_id=delivery_id, number=number)
    if step is not None:
        webhooks.schedule_delivery(delivery_id, step.number, step.delay, urgent=True)


@shared_task(name="runs.tasks.webhook_deliver_routine", acks_late=True,
             reject_on_worker_lost=True, **_retry)
def webhook_deliver_routine_task(delivery_id: int, number: int = 1) -> None:
    """An approval's or a test's delivery: the same attempt, on the same queue at a lower
    priority, so that no team's approvals, however many and however slow its receiver, are
    ever taken before a kill switch's delivery (found by an attacker: 130 approval
    deliveries to a receiver that never answered held another team's kill-switch webhook
    for 100 s)."""
    step = webhooks.attempt_delivery(delivery_id=delivery_id, number=number)
    if step is not None:
        webhooks.schedule_delivery(delivery_id, step.number, step.delay, urgent=False)


@worker_process_init.connect
def build_tls_context(**_: Any) -> None:
    """Each worker process builds its TLS context as it starts, not during a kill's first
    webhook."""
    webhooks.ssl_context()
