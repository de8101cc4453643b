"""Per-source throttling of failed sign-ins and bad API keys.

Failures are counted in the Django cache (Redis when configured, so every server process
shares the count; process memory otherwise). A source over its limit is refused before its
credentials are even looked at, so guessing cannot go on at full speed; sources that never
fail pay nothing but a dictionary lookup.
"""

from __future__ import annotations

import threading
import time

from django.core.cache import cache
from django.http import HttpRequest

_local_blocks: dict[str, float] = {}
_lock = threading.Lock()


def source_of(request: HttpRequest) -> str:
    # Behind a proxy, configure it to set REMOTE_ADDR (e.g. granian --forwarded-allow-ips);
    # trusting X-Forwarded-For blindly would let a client pick its own bucket.
    return request.META.get("REMOTE_ADDR") or "unknown"


class Throttle:
    def __init__(self, name: str, *, limit: int, window: int):
        self.name, self.limit, self.window = name, limit, window

    def _key(self, source: str) -> str:
        return f"throttle:{self.name}:{source}"

    def blocked_for(self, source: str) -> float:
        """Seconds this source must still wait, 0 when it may try."""
        with _lock:
            until = _local_blocks.get(self._key(source), 0.0)
        return max(0.0, until - time.monotonic())

    def failed(self, source: str) -> bool:
        """Count one failure; True when the source is now over its limit."""
        key = self._key(source)
        try:
            cache.add(key, 0, timeout=self.window)
            count = cache.incr(key)
        except Exception:  # the cache being down must not turn failures into errors
            return False
        if count > self.limit:
            with _lock:
                _local_blocks[key] = time.monotonic() + self.window
            return True
        return False

    def reset(self, source: str | None = None) -> None:
        with _lock:
            if source is None:
                _local_blocks.clear()
            else:
                _local_blocks.pop(self._key(source), None)
        if source is not None:
            cache.delete(self._key(source))
