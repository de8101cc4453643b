"""A bounded share of a process's time for work that is not the checks' (docs/serving.md).

Work that can be heavy and that a client may ask for again and again (the live screens'
database looks, the agents' bulk reads and uploads) takes turns
under a `TimeShare`: a token bucket of seconds that fills at ``share`` seconds a second, up
to a short burst. A quiet process starts such work at once; a busy one makes the next wait
until what the last took is paid back, so however many ask, together they take at most that
share of the process's time and the checks keep the rest.

Pieces that overlap (the bulk calls run on a pool of threads) owe what they are expected to
take as each starts (`begin`), not only when it ends: counted at the end, every piece asked
for while others ran found nothing owed yet and started with them, so a team's queued reads
ran all at once each time the debt was paid back (found in the benchmark: another team's
check p99 10x in a slice that caught such a burst).
"""

from __future__ import annotations

import time


class TimeShare:
    """Not thread-safe: one thread (or the event loop) spends and asks."""

    def __init__(self, burst_s: float) -> None:
        self.burst_s = burst_s
        self._budget = 0.0
        self._filled_at = time.monotonic()
        # What the last piece of work took: what the next one is expected to take.
        self._last: float | None = None

    def wait_s(self, share: float) -> float:
        """How long the next piece of work must wait (0: it may start now), the bucket
        filled at `share` (a fraction of a second per second) since it was last asked."""
        # A setting of 0 would never refill. The floor is low enough for a test to set a
        # share at which any page owes more than the longest wait (1 ms at a ten-
        # thousandth: at the old floor, a thousandth, a quiet machine's 8 ms page waited
        # its turn and was served, and tests/test_dashboard_pacing.py failed in CI).
        share = min(1.0, max(0.0001, share))
        now = time.monotonic()
        self._budget = min(self.burst_s, self._budget + (now - self._filled_at) * share)
        self._filled_at = now
        return max(0.0, -self._budget / share)

    def forgive(self) -> None:
        """Whatever is still owed is written off (after the longest rest its owner allows):
        one piece of work that took far more than its share delays the next ones once."""
        self._budget, self._filled_at = max(0.0, self._budget), time.monotonic()

    def begin(self) -> float | None:
        """A piece of work starts: what the last one took comes off the bucket now, so that
        a piece asked for while this one runs waits for it too. Returns what was taken off
        (for `spend`), or None while no piece has ended: nothing to expect yet, so the caller
        lets no other piece start until this one's cost is known."""
        if self._last is not None:
            self._budget -= self._last
        return self._last

    def spend(self, seconds: float, begun: float | None = None) -> None:
        """Work done: what it took comes off the bucket, less what `begin` took off for it."""
        self._budget -= seconds - (begun or 0.0)
        self._last = seconds
