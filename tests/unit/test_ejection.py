"""Outlier ejection's rule (clusterproxy_server.ejection) on a hand-driven clock."""

from __future__ import annotations

import pytest

from clusterproxy_server.ejection import EjectionPolicy, OutlierEjection, TunnelHealth


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def judge(**policy: float) -> tuple[OutlierEjection, Clock]:
    clock = Clock()
    return OutlierEjection(EjectionPolicy(**policy), clock), clock  # type: ignore[arg-type]


def test_a_tunnel_failing_far_more_than_the_others_is_ejected_at_min_dials() -> None:
    ejection, _ = judge(min_dials=5, failure_rate=0.5)
    bad, good = TunnelHealth(), TunnelHealth()
    for _ in range(10):
        assert ejection.record(good, False, [bad]) is None
    decisions = [ejection.record(bad, True, [good]) for _ in range(5)]
    assert decisions[:4] == [None] * 4
    assert decisions[4] is not None
    assert (decisions[4].failed, decisions[4].total, decisions[4].others_rate) == (5, 5, 0.0)
    assert ejection.is_ejected(bad) and not ejection.is_ejected(good)


def test_the_cool_down_ends_with_a_clean_slate() -> None:
    ejection, clock = judge(min_dials=2, cooldown=30)
    bad, good = TunnelHealth(), TunnelHealth()
    ejection.record(bad, True, [good])
    assert ejection.record(bad, True, [good]) is not None
    clock.now += 29.9
    assert ejection.is_ejected(bad)
    clock.now += 0.2
    assert not ejection.is_ejected(bad)
    assert bad.outcomes == type(bad.outcomes)()  # its old failures were paid for
    assert ejection.record(bad, True, [good]) is None  # one new failure is below min_dials again


def test_a_cluster_wide_failure_ejects_nobody() -> None:
    ejection, _ = judge(min_dials=3)
    tunnels = [TunnelHealth() for _ in range(3)]
    for _ in range(5):
        for tunnel in tunnels:
            others = [t for t in tunnels if t is not tunnel]
            assert ejection.record(tunnel, True, others) is None


def test_not_clearly_worse_than_the_others_is_not_ejected() -> None:
    ejection, _ = judge(min_dials=5, failure_rate=0.5)
    worse, other = TunnelHealth(), TunnelHealth()
    for failed in (True, True, False, True, False):  # 40 % of the other's dials failed
        ejection.record(other, failed, [worse])
    results = [ejection.record(worse, failed, [other]) for failed in (True, True, True, False, True, False)]
    assert results == [None] * 6  # 67 % is above the failure rate but below twice the others' 40 %


def test_the_only_tunnel_in_routing_is_never_ejected() -> None:
    ejection, _ = judge(min_dials=2)
    alone = TunnelHealth()
    assert [ejection.record(alone, True, []) for _ in range(5)] == [None] * 5
    ejected_peer = TunnelHealth(ejected_until=10_000.0)
    assert ejection.record(alone, True, [ejected_peer]) is None


def test_outcomes_older_than_the_window_do_not_count() -> None:
    ejection, clock = judge(min_dials=3, window=60)
    bad, good = TunnelHealth(), TunnelHealth()
    ejection.record(bad, True, [good])
    ejection.record(bad, True, [good])
    clock.now += 61
    assert ejection.record(bad, True, [good]) is None
    assert len(bad.outcomes) == 1


@pytest.mark.parametrize(
    "policy",
    [{"cooldown": 0}, {"window": -1}, {"min_dials": 0}, {"failure_rate": 0}, {"failure_rate": 1.5}],
)
def test_invalid_policies_are_refused(policy: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        EjectionPolicy(**policy)  # type: ignore[arg-type]
