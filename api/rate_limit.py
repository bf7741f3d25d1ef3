"""Per-client rate limits of the service's unauthenticated writes (``POST /v1/demand``) and
of its refusals of writes without a valid token (``api.deps``).

A token bucket per client address, in this process's memory: each address may send ``rate``
requests per second on average, ``burst`` at once. Kept in memory on purpose: the limit is a
guard against a client that floods the service, not an accounting; a restart forgets it, and
with ``tuner serve --workers N`` each process counts on its own (an address gets N times the
rate at most). Behind a reverse proxy every request comes from the proxy's address: run
uvicorn with ``--proxy-headers`` and ``--forwarded-allow-ips`` so the client's own address is
the one counted.

At most ``max_keys`` addresses are remembered; past that the least recently seen one is
forgotten (its next request starts with a full bucket), so memory stays bounded whatever the
number of addresses (IPv6 gives a client many).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["TokenBuckets"]


class TokenBuckets:
    def __init__(self, rate: float, burst: float, *, max_keys: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0 or burst < 1 or max_keys < 1:
            raise ValueError(f"rate must be > 0, burst >= 1 and max_keys >= 1, but got "
                             f"{rate}, {burst}, {max_keys}")
        self.rate = rate
        self.burst = burst
        self.max_keys = max_keys
        self._clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tokens, when

    def take(self, key: str) -> float:
        """Take a token of ``key``'s bucket: 0.0 if there was one, else the seconds until
        there is (the request is refused and takes nothing)."""
        now = self._clock()
        tokens = self._tokens(key, now)
        if tokens >= 1:
            self._buckets[key] = (tokens - 1, now)
            return 0.0
        self._buckets[key] = (tokens, now)
        return (1 - tokens) / self.rate

    def queue(self, key: str, max_wait: float) -> float:
        """Take a token of ``key``'s bucket, borrowing one ahead where there is none: the
        seconds until the borrowed one comes (0.0 if one was there), at most ``max_wait``.
        Callers that wait that long before they go on line up at the rate, however many come
        at once; the debt never runs beyond ``max_wait``, so once they stop, a key is back to
        answers at once within ``max_wait`` plus a burst's refill."""
        now = self._clock()
        tokens = max(self._tokens(key, now), 1 - max_wait * self.rate)
        self._buckets[key] = (tokens - 1, now)
        return max(0.0, (1 - tokens) / self.rate)

    def _tokens(self, key: str, now: float) -> float:
        """``key``'s tokens at ``now`` (a full bucket for a key not seen, which may push out
        the least recently seen one), the key made the most recently seen."""
        held = self._buckets.get(key)
        if held is None:
            if len(self._buckets) >= self.max_keys:
                self._buckets.popitem(last=False)
            return self.burst
        self._buckets.move_to_end(key)
        return min(self.burst, held[0] + (now - held[1]) * self.rate)

    def __len__(self) -> int:
        return len(self._buckets)
