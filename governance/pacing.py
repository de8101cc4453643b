"""Cheap answers paced per client address (SPEC 10; docs/serving.md, "Cheap answers are paced
per client address").

A request that does no valid key's work (a failed authentication, a 404, a health probe, an
API call with no credential) costs little on its own, but the event loop and the interpreter
every request shares pay for each one: one address's few kept-alive connections sending them
as fast as they were answered (600 bad keys a second, 2,700 probes) made another team's check
p99 8 to 40x, and its slowest check 3.5 s (found by an attacker). Such answers take a token
from their address's bucket (`AddressPacing`), which fills at ``rate`` a second up to
``burst``; one that finds it empty is sent once its token is due, the wait spent on the event
loop (no thread, no work): a connection's next request comes that much later, so however
fast a client sends, its address gets about ``rate`` cheap answers a second from each
process. Nothing is refused: the answer is the same, only later. A valid key's work is never
paced (governance/asgi.py decides what is cheap), so an address that is a NAT of many agents
and one attacker delays the attacker's failures, never the agents' checks.
"""

from __future__ import annotations

import time
from collections import OrderedDict

# Addresses whose buckets a process keeps at most; past it, the one used longest ago is
# forgotten (a bucket forgotten is a full one: at worst its address gets a burst again).
ADDRESSES_MAX = 10_000


class AddressPacing:
    """Token buckets by client address, each filling at ``rate`` tokens a second up to
    ``burst``; `wait_s` takes one and says how long its answer must wait. A bucket owes at
    most ``most_wait_s`` of tokens: past it, an answer waits that long without owing more,
    so a client holding many connections waits no longer than that each. O(1) a call, at
    most ADDRESSES_MAX buckets. Not thread-safe: only the event loop uses it."""

    def __init__(self, rate: float, burst: float, most_wait_s: float,
                 most_addresses: int = ADDRESSES_MAX) -> None:
        self.rate, self.burst, self.most_wait_s = rate, burst, most_wait_s
        self.most_addresses = most_addresses
        # address -> (tokens, when they were counted); least recently used first.
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def wait_s(self, address: str) -> float:
        """How long a cheap answer to ``address`` must wait before it is sent (0: now)."""
        now = time.monotonic()
        tokens, counted = self._buckets.pop(address, (self.burst, now))
        tokens = min(self.burst, tokens + (now - counted) * self.rate) - 1.0
        wait = -tokens / self.rate if tokens < 0 else 0.0
        if wait > self.most_wait_s:
            tokens, wait = tokens + 1.0, self.most_wait_s  # waits, owing no more
        if len(self._buckets) >= self.most_addresses:
            self._buckets.popitem(last=False)
        self._buckets[address] = (tokens, now)
        return wait

    def __len__(self) -> int:
        return len(self._buckets)
