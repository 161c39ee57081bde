"""Token buckets: burst, refill, independent keys, bounded memory."""

from __future__ import annotations

import pytest

from clusterproxy_certsigner.ratelimit import RateLimiter


def test_burst_then_refill() -> None:
    limiter = RateLimiter(burst=3, rate=2.0)
    assert [limiter.check("ip", 0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    wait = limiter.check("ip", 0.0)
    assert wait == pytest.approx(0.5)  # one token refills in 1/rate seconds
    assert limiter.check("ip", 0.25) == pytest.approx(0.25)
    assert limiter.check("ip", 0.5) == 0.0
    assert limiter.check("ip", 0.5) > 0
    # a long pause refills to the burst, never beyond it
    assert [limiter.check("ip", 100.0) for _ in range(4)][:3] == [0.0, 0.0, 0.0]
    assert limiter.check("ip", 100.0) > 0


def test_keys_are_independent() -> None:
    limiter = RateLimiter(burst=1, rate=0.1)
    assert limiter.check("a", 0.0) == 0.0
    assert limiter.check("a", 0.0) == pytest.approx(10.0)
    assert limiter.check("b", 0.0) == 0.0


def test_memory_is_bounded_by_dropping_the_least_recently_used() -> None:
    limiter = RateLimiter(burst=1, rate=0.001, max_keys=3)
    for key in ("a", "b", "c"):
        limiter.check(key, 0.0)
    limiter.check("a", 0.0)  # "a" is now the most recently used (and empty)
    limiter.check("d", 0.0)  # drops "b"
    assert len(limiter) == 3
    assert limiter.check("a", 0.0) > 0  # still remembered: still limited
    assert limiter.check("b", 0.0) == 0.0  # forgotten: a fresh bucket


def test_invalid_settings() -> None:
    for kwargs in ({"burst": 0, "rate": 1}, {"burst": 1, "rate": 0}, {"burst": 1, "rate": 1, "max_keys": 0}):
        with pytest.raises(ValueError):
            RateLimiter(**kwargs)
