"""Token-bucket rate limiting, one bucket per key (client IP, client certificate, bootstrap token id),
bounded memory."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["RateLimiter"]


@dataclass
class _Bucket:
    tokens: float
    updated: float


class RateLimiter:
    """``burst`` requests at once, refilled at ``rate`` per second, per key.

    At most ``max_keys`` buckets are kept; the least recently used is dropped first (a dropped bucket
    comes back full, which only ever errs on the side of letting a request through).
    """

    def __init__(self, *, burst: float, rate: float, max_keys: int = 10_000) -> None:
        if burst < 1 or rate <= 0 or max_keys < 1:
            raise ValueError("a rate limit needs burst >= 1, rate > 0 and max_keys >= 1")
        self.burst = float(burst)
        self.rate = float(rate)
        self.max_keys = max_keys
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def check(self, key: str, now: float, cost: float = 1.0) -> float:
        """Take ``cost`` from ``key``'s bucket: 0.0 when allowed, else the seconds until it would be."""
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = _Bucket(self.burst, now)
            self._buckets[key] = bucket
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
            bucket.tokens = min(self.burst, bucket.tokens + max(0.0, now - bucket.updated) * self.rate)
            bucket.updated = now
        if bucket.tokens >= cost:
            bucket.tokens -= cost
            return 0.0
        return (cost - bucket.tokens) / self.rate

    def __len__(self) -> int:
        return len(self._buckets)
