"""Kill-switch webhooks: signed POSTs to a team's ``webhook_url``, retried with capped
exponential backoff, every attempt recorded (SPEC 6).

Delivery is at least once. An attempt is claimed (its row written, ``in flight``) in one
transaction, the POST is made outside any transaction, and its outcome recorded in another.
Each task message carries the attempt number it is for, so a message the broker delivers
twice (a worker lost before its ack, a visibility timeout shorter than a backoff delay)
finds its attempt already claimed and stands down instead of starting a second retry chain.
Each attempt ends by a wall-clock deadline (TIMEOUT_S) and reads only the receiver's status
line and headers, so a receiver holds a worker process for at most that long per attempt.

Receivers verify ``X-Governance-Signature: sha256=<hex>``, the HMAC-SHA256 of
``"<X-Governance-Timestamp>.<raw body>"`` keyed with the team's webhook secret, and reject
timestamps older than a few minutes (see ``verify`` and docs/killswitch.md).
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import hmac
import json
import logging
import ssl
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from typing import Any

import httpcore
import httpx
from django.db import connections, transaction
from django.utils import timezone

from governance.errors import AppError
from policies.egress import RefusedTarget, UnresolvedHost, VettedBackend, ascii_url
from policies.models import Team
from policies.services import webhook_secret_id
from runs.models import KillSwitch, WebhookAttempt, WebhookDelivery
from runs.publisher import publisher

log = logging.getLogger(__name__)

PENDING, DELIVERED, FAILED = "pending", "delivered", "failed"
MAX_ATTEMPTS = 8
BASE_DELAY_S = 1.0
MAX_DELAY_S = 60.0
# An attempt's whole time, from resolving the name to the receiver's status line and headers
# (its body is never read): a wall-clock deadline (policies/egress.py VettedBackend), so
# however the receiver dribbles, a worker process is held for at most this long.
TIMEOUT_S = 5.0
# How long a claimed attempt may stay in flight before another worker calls it lost: the
# attempt's deadline plus slack for recording the outcome.
LEASE_S = TIMEOUT_S + 2.0
# How soon a kill switch's delivery waiting for its team's attempt in flight looks again: by
# the time that attempt must have ended, and at least every URGENT_LOOK_S (a receiver that
# answers at once keeps a team's switches apart by about that much, not the 5 s deadline;
# a flood of N switches towards one that hangs costs N quick looks a second, not a process).
URGENT_LOOK_S = 1.0
# What operators see of a failed attempt: what happened, in fixed phrases that point at the
# fix, and the status code; nothing the receiver (or whatever listens at that address) wrote.
REFUSED = "refused: the host resolves to an address that is not public (see WEBHOOK_ALLOWED_HOSTS)"
UNRESOLVED = "DNS failure: the host name does not resolve"
TIMED_OUT = f"timeout: no answer within {TIMEOUT_S:g} s"
UNREACHABLE = "could not connect: the connection was refused or the host is unreachable"
BAD_URL = "the URL cannot be used (save it again in the team settings)"
UNEXPECTED = "failed: an unexpected error (the server log has the details)"
IN_FLIGHT = "in flight"
INTERRUPTED = "interrupted: the worker stopped before the outcome was recorded"
SUPERSEDED = "given up: the team's webhook URL changed, and a test of the new URL was sent"
URL_REMOVED = "given up: the team's webhook URL was removed"
EVENT = "killswitch.engaged"
APPROVAL_REQUESTED = "approval.requested"
APPROVAL_DECIDED = "approval.decided"
TEST_EVENT = "webhook.test"
SIGNATURE_HEADER = "X-Governance-Signature"
TIMESTAMP_HEADER = "X-Governance-Timestamp"
TOLERANCE_S = 300


def backoff(number: int) -> float:
    """Delay after failed attempt ``number`` before the next one: 1, 2, 4 ... capped."""
    return min(MAX_DELAY_S, BASE_DELAY_S * 2 ** (number - 1))


def payload_for(switch: KillSwitch, team: Team, killed: list[str]) -> dict[str, Any]:
    """The JSON body; ``team`` is the notified team (a global switch notifies every team)."""
    return {
        "id": switch.pk,
        "event": EVENT,
        "scope": switch.scope,
        "team": team.slug,
        "agent": switch.agent or None,
        "run": str(switch.run_id) if switch.run_id else None,
        "reason": switch.reason,
        "engaged_by": switch.engaged_by_label,
        "engaged_at": switch.engaged_at.isoformat().replace("+00:00", "Z"),
        "killed_runs": killed,
    }


def approval_payload(approval: Any, event: str) -> dict[str, Any]:
    """The JSON body of an approval notification (SPEC 11): ``approval.requested`` when a
    check starts waiting, ``approval.decided`` once it is approved, denied, expired or
    cancelled. Args are redacted as audited."""
    def iso(moment: Any) -> str | None:
        return moment.isoformat().replace("+00:00", "Z") if moment is not None else None

    return {
        "id": str(approval.pk),
        "event": event,
        "team": approval.team.slug,
        "run": str(approval.run_id),
        "agent": approval.run.agent,
        "status": approval.status,
        "action": {"name": approval.action_name, "type": approval.action_type,
                   "args": approval.args},
        "step": approval.step,
        "requested_at": iso(approval.requested_at),
        "expires_at": iso(approval.expires_at),
        "decided_at": iso(approval.decided_at),
        "decided_by": approval.decided_by_label or None,
        "note": approval.note or None,
    }


# A "Send test" the service refuses: the application's one error (governance/errors.py), its
# message meant for the admin.
SendTestRefused = AppError


NO_WEBHOOK = "This team has no webhook URL: set one in the team settings."
TEST_PENDING = ("A test notification is still pending: its attempts show below. Send another "
                "once it is delivered or has failed.")


def send_test(*, team: Team, sent_by: str) -> WebhookDelivery:
    """A `webhook.test` notification to the team's webhook, delivered (signed, retried,
    recorded) like any other, so an admin sees what a real one would meet: a DNS failure, a
    refused address, a timeout, the receiver's status. One at a time per team: while the
    team's last test is pending, another is refused (SendTestRefused), so a button pressed in a
    loop cannot fill the webhook worker with one team's attempts. A pending test of another
    URL than the team's (the URL was changed since) is given up instead."""
    if not team.webhook_url:
        raise AppError(409, "no_webhook", NO_WEBHOOK)
    now = timezone.now()
    with transaction.atomic():
        # The team's row lock makes "none pending, so create one" one step for concurrent
        # presses. NO KEY: rows that merely reference the team (runs, audit) are not held up.
        url = (Team.objects.select_for_update(no_key=True).filter(pk=team.pk)
               .values_list("webhook_url", flat=True).get())
        if not url:
            raise AppError(409, "no_webhook", NO_WEBHOOK)
        pending = WebhookDelivery.objects.filter(team=team, event=TEST_EVENT, status=PENDING)
        # A test of a URL the team no longer has tests nothing: given up, so that the admin
        # who fixed the URL after a failed test can test the fix now, not once the old URL's
        # retries have run out (up to two minutes of backoff).
        stale = list(pending.exclude(url=url).values_list("pk", "attempts"))
        if stale:
            pending.filter(pk__in=[pk for pk, _ in stale]).update(status=FAILED)
            # Its last line on the kill switch page says why it stopped short of 8 attempts.
            WebhookAttempt.objects.bulk_create(
                WebhookAttempt(delivery_id=pk, number=attempts + 1, at=now, error=SUPERSEDED)
                for pk, attempts in stale)
        if pending.exists():
            raise AppError(409, "test_pending", TEST_PENDING)
        delivery = WebhookDelivery.objects.create(
            team=team, event=TEST_EVENT, url=url,
            payload={"event": TEST_EVENT, "team": team.slug, "sent_by": sent_by,
                     "sent_at": now.isoformat().replace("+00:00", "Z")})
        transaction.on_commit(partial(start_delivery, delivery.pk, urgent=False))
    return delivery


def body_of(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()


def sign(secret: str, timestamp: str, body: bytes) -> str:
    digest = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return "sha256=" + digest.hexdigest()


def verify(secret: str, timestamp: str, body: bytes, signature: str, *,
           tolerance_s: float = TOLERANCE_S, now: float | None = None) -> bool:
    """What a receiver does: a fresh timestamp and a matching signature, compared in
    constant time. Old timestamps are refused so a captured request cannot be replayed."""
    try:
        age = (time.time() if now is None else now) - int(timestamp)
    except ValueError:
        return False
    if abs(age) > tolerance_s:
        return False
    return hmac.compare_digest(sign(secret, timestamp, body), signature)


@dataclass(frozen=True)
class Next:
    """Run attempt ``number`` of the delivery after ``delay`` seconds."""

    number: int
    delay: float


def _claim(delivery_id: int, number: int) -> tuple[WebhookDelivery, WebhookAttempt] | Next | None:
    """Under the delivery's lock: decide whether attempt ``number`` is this message's to make,
    and if so record it in flight. Returns the claim, a later look (Next), or None (nothing
    left to do: delivered, given up, or a duplicate message)."""
    with transaction.atomic():
        delivery = (WebhookDelivery.objects.select_for_update().select_related("team")
                    .filter(pk=delivery_id).first())
        if delivery is None or delivery.status != PENDING or delivery.attempts > number:
            return None
        now = timezone.now()
        if delivery.attempts == number:
            last = delivery.tries.filter(number=number).first()
            age = (now - last.at).total_seconds() if last is not None else LEASE_S
            if last is not None and last.status_code is None and last.error == IN_FLIGHT:
                if age < LEASE_S:
                    # Maybe another worker is on it right now; look again when its lease ends.
                    return Next(number, LEASE_S - age)
                last.error = INTERRUPTED
                last.save(update_fields=["error"])
                number += 1
            elif age > backoff(number) + LEASE_S:
                # Finished and failed, and its successor is overdue: the worker that should
                # have scheduled it died first. Schedule it (a duplicate would stand down).
                return Next(number + 1, 0)
            else:
                return None
        if number > MAX_ATTEMPTS:
            delivery.status = FAILED
            delivery.save(update_fields=["status"])
            return None
        current = delivery.team.webhook_url
        if current != delivery.url:
            # Retries follow the team's URL: an admin who fixes a failing URL (the overview's
            # banner asks for it) expects the notifications still retrying, a kill's among
            # them, to reach the fixed one, not to spend their attempts on the broken one
            # (found by an operator's tryout). The URL removed: nowhere to send it.
            if not current:
                delivery.status = FAILED
                delivery.save(update_fields=["status"])
                WebhookAttempt.objects.create(delivery=delivery, number=number, at=now,
                                              error=URL_REMOVED)
                return None
            delivery.url = current
            delivery.save(update_fields=["url"])
        if (wait := _team_busy(delivery, now)) is not None:
            # One attempt of a team at a time of each kind (a kill switch's; an approval's or
            # a test's): a team whose receiver hangs holds one of the webhook worker's
            # processes, not all of them (found by attackers: 130 approvals towards a
            # receiver that never answered held every process, and every other team's
            # notifications waited minutes; 12 kill switches of one team did the same to
            # another team's kill-switch webhook, 29 s). A kill switch's never waits for its
            # team's approvals'. Look again once the attempt in flight is over.
            return Next(number, wait)
        delivery.attempts = number
        delivery.save(update_fields=["attempts"])
        attempt = WebhookAttempt.objects.create(delivery=delivery, number=number, at=now,
                                                error=IN_FLIGHT)
    return delivery, attempt


def _team_busy(delivery: WebhookDelivery, now: datetime) -> float | None:
    """None, or how long to wait before looking again: another delivery of the delivery's
    team and of its kind (a kill switch's, or a routine one: an approval's, a test's) has an
    attempt in flight, within its lease. A routine delivery looks again once that lease is
    over; a kill switch's when the attempt must have ended (its deadline) or within
    URGENT_LOOK_S, whichever comes first, so a team's own switches follow each other
    closely."""
    oldest = (WebhookAttempt.objects.filter(
        delivery__team_id=delivery.team_id,
        delivery__switch__isnull=delivery.switch_id is None, error=IN_FLIGHT,
        at__gt=now - timedelta(seconds=LEASE_S)).exclude(delivery_id=delivery.pk)
        .order_by("at").values_list("at", flat=True).first())
    if oldest is None:
        return None
    if delivery.switch_id is None:
        return LEASE_S
    age = (now - oldest).total_seconds()
    # Past its deadline and still in flight: its worker may be gone, which its lease settles.
    ends_in = TIMEOUT_S - age if age < TIMEOUT_S else LEASE_S - age
    return max(0.1, min(URGENT_LOOK_S, ends_in))


@functools.cache
def ssl_context() -> ssl.SSLContext:
    """One per process, shared by its attempts: building it reads the CA bundle, up to a
    quarter of a second of CPU on a busy machine, which a kill's webhook should not wait for.
    Workers build it when their process starts (runs/webhooks/tasks.py)."""
    return httpx.create_ssl_context()


def _post(delivery: WebhookDelivery) -> tuple[int | None, str]:
    body = body_of(delivery.payload)
    # Fresh on every attempt, so a retry passes the receivers' age check.
    timestamp = str(int(time.time()))
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "agent-governance-webhook/1",
        "X-Governance-Event": delivery.event,
        "X-Governance-Delivery": str(delivery.pk),
        TIMESTAMP_HEADER: timestamp,
        SIGNATURE_HEADER: sign(delivery.team.webhook_secret, timestamp, body),
    }
    try:
        # A URL saved before internationalised names were stored in their IDNA form.
        url = ascii_url(delivery.url)
    except RefusedTarget:
        return None, BAD_URL
    try:
        # Straight to a vetted address of the URL's host (policies/egress.py): no proxy from
        # the environment, no redirect, and a name that now resolves to a private address
        # is refused, not connected to.
        # The status line and headers decide; the body is never read (leaving the block
        # closes the connection), so a huge or endless one costs nothing.
        deadline = time.monotonic() + TIMEOUT_S
        with (httpcore.ConnectionPool(network_backend=VettedBackend(deadline=deadline),
                                      ssl_context=ssl_context()) as pool,
              pool.stream("POST", url, headers=headers, content=body) as response):
            status = response.status
    except UnresolvedHost:
        log.info("webhook delivery %s: %s does not resolve", delivery.pk, delivery.url)
        return None, UNRESOLVED
    except RefusedTarget:
        log.warning("webhook delivery %s refused: %s is not a public address", delivery.pk,
                    delivery.url)
        return None, REFUSED
    except httpcore.TimeoutException:
        return None, TIMED_OUT
    except (httpcore.NetworkError, httpcore.ProtocolError, httpcore.UnsupportedProtocol,
            OSError) as exc:
        # The detail (the host's error text) goes to the server log, never to the team's
        # screens: it would describe whatever answers at that address.
        log.info("webhook delivery %s: %s: %s", delivery.pk, type(exc).__name__, exc)
        return None, UNREACHABLE
    except Exception:
        # Whatever else goes wrong is still this attempt's outcome: recorded as failed (and
        # retried), never left "in flight" with the worker's traceback as the only trace.
        log.exception("webhook delivery %s failed unexpectedly", delivery.pk)
        return None, UNEXPECTED
    if 200 <= status < 300:
        return status, ""
    # Only the status: the receiver's body is not read, let alone shown to anyone (it could
    # be an internal service's page).
    return status, f"HTTP {status}"


def attempt_delivery(*, delivery_id: int, number: int) -> Next | None:
    """Make attempt ``number`` (or the one due instead) and record it. Returns when to try
    next, or None when the delivery needs nothing more from this message."""
    claim = _claim(delivery_id, number)
    if not isinstance(claim, tuple):
        return claim
    delivery, attempt = claim
    started = time.monotonic()
    status_code, error = _post(delivery)
    duration_ms = int((time.monotonic() - started) * 1000)
    with transaction.atomic():
        WebhookAttempt.objects.filter(pk=attempt.pk).update(
            status_code=status_code, error=error, duration_ms=duration_ms,
            secret_id=webhook_secret_id(delivery.team.webhook_secret),
        )
        pending = WebhookDelivery.objects.filter(pk=delivery.pk, status=PENDING)
        if not error:
            pending.update(status=DELIVERED, delivered_at=timezone.now())
            return None
        if attempt.number >= MAX_ATTEMPTS:
            pending.update(status=FAILED)
            return None
    log.info("webhook delivery %s attempt %s failed: %s", delivery.pk, attempt.number, error)
    return Next(attempt.number + 1, backoff(attempt.number))


# The embedded default's first attempts under way on this process's threads, which
# `flush_first_attempts` waits for at exit.
_first_attempts: set[threading.Thread] = set()
_first_attempts_lock = threading.Lock()
#: How long a process's exit waits for its first attempts: one attempt's deadline, and a margin.
FLUSH_S = TIMEOUT_S + 1.0


def _deliver_in_thread(delivery_id: int, number: int) -> None:
    try:
        step = attempt_delivery(delivery_id=delivery_id, number=number)
        if step is not None:
            schedule_delivery(delivery_id, step.number, step.delay)
    except Exception:
        log.exception("webhook delivery %s failed in the background thread", delivery_id)
    finally:
        connections.close_all()  # this thread's own connections
        with _first_attempts_lock:
            _first_attempts.discard(threading.current_thread())


def flush_first_attempts(timeout: float = FLUSH_S) -> bool:
    """Wait until the first attempt of every delivery this process started on a thread (the
    embedded default) is made, or ``timeout``; False on timeout. Called at exit, so that a
    command that exits at once (`manage.py killswitch engage`, `manage.py approvals
    decide`) still sends its webhook (found by a newcomer: on `make demo` their deliveries
    stayed "pending, no worker has taken it yet", 0 attempts, for good). Retries the
    process does not live to make are still lost."""
    deadline = time.monotonic() + timeout
    with _first_attempts_lock:
        threads = list(_first_attempts)
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return not any(thread.is_alive() for thread in threads)


def _task(delivery_id: int, urgent: bool | None) -> Any:
    """The delivery's task: a kill switch's is urgent, an approval's or a test's routine
    (runs/webhooks/tasks.py); None: as the delivery is (one query)."""
    from runs.webhooks.tasks import webhook_deliver_routine_task, webhook_deliver_task

    if urgent is None:
        urgent = WebhookDelivery.objects.filter(pk=delivery_id, switch__isnull=False).exists()
    return webhook_deliver_task if urgent else webhook_deliver_routine_task


def schedule_delivery(delivery_id: int, number: int, delay: float, *,
                      urgent: bool | None = None) -> None:
    """Start attempt ``number`` after ``delay`` seconds: a Celery task on the ``webhooks``
    queue, published here (a worker's follow-up; the broker's socket timeouts bound it), or,
    in the embedded default (no Redis, eager tasks), a background thread, since an eager task
    would run the whole backoff inside the engaging request. From a request, use
    ``start_delivery``. ``urgent``: a kill switch's delivery (None: looked up)."""
    from runs.webhooks.tasks import webhook_deliver_task

    # The task's own app (the project's Celery app once it is loaded), not an import of it.
    if webhook_deliver_task.app.conf.task_always_eager:
        timer = threading.Timer(delay, _deliver_in_thread, args=(delivery_id, number))
        timer.daemon = True
        if number == 1:
            with _first_attempts_lock:
                _first_attempts.add(timer)
        timer.start()
        return
    _task(delivery_id, urgent).apply_async((delivery_id, number), countdown=delay)


def start_delivery(delivery_id: int, *, urgent: bool | None = None) -> None:
    """Start a delivery from a request, after the commit that created it: its first attempt
    is published by the process's publisher thread (runs/publisher.py), so the request never
    waits for the broker (SPEC 10). A publish that is lost (the broker down for long, the
    process gone) is restarted by the beat sweep: the delivery is still pending."""
    from runs.webhooks.tasks import webhook_deliver_task

    if webhook_deliver_task.app.conf.task_always_eager:
        schedule_delivery(delivery_id, 1, 0)
        return
    publisher.submit(_task(delivery_id, urgent).name, delivery_id, 1)


atexit.register(flush_first_attempts)
