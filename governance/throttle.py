"""Throttling of failed authentications, per source *and* presented credential (SPEC 10).

A bucket is (kind, source address, credential): an agent key's prefix, a username, or nothing
(sign-ins per address, whatever the username: below). It counts only credentials that were
checked and found wrong, in a fixed window of ``THROTTLE_WINDOW_SECONDS``; past the limit,
that bucket is refused with 429 ``too_many_failures`` and a ``Retry-After`` until its window
ends (the per-address one is never refused).
Nobody else's bucket is touched: a valid key, or the same key from another address, is never
refused because of it.

The count lives in the database (``policies.AuthFailure``), one conditional upsert per
failure, so it is exact across every server process and does not depend on Redis at all.
Failures are rare (a client with a wrong key, a mistyped password), and the upsert is cheap
(0.6 ms on PostgreSQL, committed without waiting for its WAL flush: docs/reliability.md,
"Failed authentications", has the measurements and the comparison with Redis). Under an
attack, each process remembers the buckets it saw go over the limit until their window ends
and answers them without writing again: that memory can only make a refusal cheaper, never
start or lengthen one.

Agent keys and passwords differ in one way. A key is 256 random bits, so guessing is
hopeless and the point of the throttle is to slow down a misbehaving client: the key is
always checked first, and a valid key is answered whatever its bucket says. A password can
be guessed, so a sign-in attempt in a bucket over its limit is refused before the password
is checked; the attempt is counted when it starts (atomically, so concurrent attempts
cannot slip past the limit) and the count is given back if the password was not checked.
Checking a password is expensive on purpose (a slow hash, also for unknown usernames), so
sign-ins are counted per address too, whatever the usernames; past that bound nobody is
refused (never by source alone), but an unknown username fails without the hash
(governance/passwords.py), which a fresh username per attempt would otherwise cost without
limit.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass

from django.db import DatabaseError, connection, transaction

from policies.models import AuthFailure

from .sources import counted_source, source_of

__all__ = ["Throttle", "Verdict", "counted_source", "source_of"]

log = logging.getLogger(__name__)

_TABLE = AuthFailure._meta.db_table
# One statement: start a new window when the old one is over, else count one more failure
# (capped, so a bucket hammered for hours keeps a small number). Portable: PostgreSQL and
# SQLite (3.35+) both have ON CONFLICT ... DO UPDATE and RETURNING.
_COUNT_SQL = f"""
INSERT INTO {_TABLE} (kind, source, credential, window_start, failures)
VALUES (%s, %s, %s, %s, 1)
ON CONFLICT (kind, source, credential) DO UPDATE SET
    failures = CASE WHEN {_TABLE}.window_start <= %s THEN 1
                    WHEN {_TABLE}.failures >= %s THEN {_TABLE}.failures
                    ELSE {_TABLE}.failures + 1 END,
    window_start = CASE WHEN {_TABLE}.window_start <= %s THEN excluded.window_start
                        ELSE {_TABLE}.window_start END
RETURNING failures, window_start
"""
_GIVE_BACK_SQL = f"""
UPDATE {_TABLE} SET failures = failures - 1
WHERE kind = %s AND source = %s AND credential = %s AND window_start = %s AND failures > 0
"""
PRUNE_EVERY_S = 60.0
# Rows one prune deletes at most: it runs on a request's thread, and how many windows ended
# is the attackers' choice (one row per address and credential they tried).
PRUNE_BATCH = 500
# The request attribute the auth signals set to "failed" or "succeeded" (policies/apps.py).
SIGN_IN_OUTCOME = "_governance_sign_in"
# Set on a sign-in from an address past its bound: an unknown username is failed without the
# equalising hash (governance/passwords.py).
SPARE_UNKNOWN_HASH = "_governance_spare_unknown_hash"
MEMORY_MAX = 10_000


@dataclass(frozen=True)
class Verdict:
    failures: int
    retry_after: int  # seconds; 0 when the bucket is under its limit
    window_start: float = 0.0

    @property
    def refused(self) -> bool:
        return self.retry_after > 0


class Throttle:
    def __init__(self, kind: str, *, limit: int, window: int):
        self.kind, self.limit, self.window = kind, limit, window
        self._lock = threading.Lock()
        self._over: dict[tuple[str, str], float] = {}  # bucket -> window end (time.time())
        self._pruned_at = 0.0
        self._prune_behind = False  # the last prune left ended windows behind

    @staticmethod
    def _bucket(source: str, credential: str) -> tuple[str, str]:
        # Column widths; a NUL cannot be stored by PostgreSQL (and names nobody).
        return counted_source(source)[:64], credential.replace("\x00", "")[:150]

    def _remembered(self, bucket: tuple[str, str], now: float) -> Verdict | None:
        with self._lock:
            until = self._over.get(bucket)
            if until is None:
                return None
            if until <= now:
                del self._over[bucket]
                return None
        return Verdict(self.limit + 1, math.ceil(until - now), until - self.window)

    def _count(self, bucket: tuple[str, str], now: float) -> Verdict:
        """Count one failure (or attempt) in the database; the bucket's verdict after it."""
        cutoff = now - self.window
        params = [self.kind, *bucket, now, cutoff, self.limit + 1, cutoff]
        if connection.vendor == "postgresql" and not connection.in_atomic_block:
            # A count lost in a crash is harmless; waiting for its WAL flush is not free
            # (measured here: 3.8 ms a failure with a synchronous commit, 0.6 ms without).
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute("SET LOCAL synchronous_commit TO OFF")
                cursor.execute(_COUNT_SQL, params)
                failures, window_start = cursor.fetchone()
        else:
            with connection.cursor() as cursor:
                cursor.execute(_COUNT_SQL, params)
                failures, window_start = cursor.fetchone()
        self._prune(now)
        if failures <= self.limit:
            return Verdict(failures, 0, window_start)
        until = window_start + self.window
        with self._lock:
            if len(self._over) >= MEMORY_MAX:
                self._over.clear()
            self._over[bucket] = until
        return Verdict(failures, max(1, math.ceil(until - now)), window_start)

    def _prune(self, now: float) -> None:
        """Drop windows that are over, at most once a minute per process: buckets of
        credentials tried once (random keys, say) must not pile up. At most PRUNE_BATCH rows
        a time, the oldest first; while a prune finds more than that, the next failure
        prunes again, so deleting keeps pace with any number of new buckets (each failure
        adds at most one) and no request deletes more than the batch."""
        if now - self._pruned_at < PRUNE_EVERY_S and not self._prune_behind:
            return
        self._pruned_at = now
        ended = (AuthFailure.objects.filter(kind=self.kind, window_start__lte=now - self.window)
                 .order_by("window_start").values("pk")[:PRUNE_BATCH])
        deleted, _ = AuthFailure.objects.filter(pk__in=ended).delete()
        self._prune_behind = deleted >= PRUNE_BATCH

    def failed(self, source: str, credential: str) -> Verdict:
        """A credential was checked and found wrong: count it. The verdict says whether this
        answer becomes a 429. A database error leaves the answer as it was (logged): the
        failure itself was real, and the throttle must never turn it into a 5xx."""
        bucket = self._bucket(source, credential)
        now = time.time()
        remembered = self._remembered(bucket, now)
        if remembered is not None:
            return remembered
        try:
            return self._count(bucket, now)
        except DatabaseError:
            log.warning("could not count a failed authentication", exc_info=True)
            return Verdict(0, 0)

    def over(self, source: str, credential: str) -> bool:
        """Whether this process saw the bucket go over its limit in a window not yet ended: a
        dictionary lookup, no query (the sign-ins of an address past its bound are paced
        before they reach a thread: governance/asgi.py `Application.page`)."""
        return self._remembered(self._bucket(source, credential), time.time()) is not None

    def attempt(self, source: str, credential: str) -> tuple[Verdict, float | None]:
        """Count an attempt before the credential is checked (sign-in): the verdict, and the
        window to give the count back to (``give_back``) when it turns out not to have been
        a failure. None when nothing was counted."""
        bucket = self._bucket(source, credential)
        now = time.time()
        # A bucket this process saw go over its limit is refused without a write: a flood
        # of attempts from one address costs a dictionary lookup each.
        remembered = self._remembered(bucket, now)
        if remembered is not None:
            return remembered, None
        try:
            verdict = self._count(bucket, now)
        except DatabaseError:
            log.warning("could not count a sign-in attempt", exc_info=True)
            return Verdict(0, 0), None
        # The window even when this count went over the limit: an attempt that turns out not
        # to have failed (a right password) is given back whatever its verdict was.
        return verdict, verdict.window_start

    def give_back(self, source: str, credential: str, window_start: float) -> None:
        """Undo an attempt's count: its credential was never checked (an incomplete form), or
        was right. What this process remembers of the bucket goes too: the next attempt
        counts again. Remembered, attempts that went over the limit together and then
        succeeded kept an address past its bound with no failure counted (found by an
        attacker: 25 right passwords at once, and the address's sign-ins paced for the rest
        of the window)."""
        with self._lock:
            self._over.pop(self._bucket(source, credential), None)
        with connection.cursor() as cursor:
            cursor.execute(_GIVE_BACK_SQL, [self.kind, *self._bucket(source, credential),
                                            window_start])

    def succeeded(self, source: str, credential: str) -> None:
        """The right credential: its bucket starts again from nothing."""
        bucket = self._bucket(source, credential)
        with self._lock:
            self._over.pop(bucket, None)
        AuthFailure.objects.filter(kind=self.kind, source=bucket[0],
                                   credential=bucket[1]).delete()

    def forget(self) -> None:
        """Forget what this process remembers (tests: the counts themselves are rows, which
        each test's transaction or flush removes)."""
        with self._lock:
            self._over.clear()
