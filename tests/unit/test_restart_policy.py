"""RestartPolicy: restarts within the window allow another up to the limit, older ones are forgotten."""

from __future__ import annotations

from collections import deque

from clusterproxy_protocol.restart_policy import RestartPolicy


def test_a_crash_loop_is_the_limit_of_restarts_within_the_window() -> None:
    policy = RestartPolicy(delay=0.5, limit=2, window=60.0)
    restarted: deque[float] = deque()
    assert policy.may_restart(restarted, 10.0)
    restarted.extend([10.5, 20.5])
    assert not policy.may_restart(restarted, 30.0)
    assert policy.recent(restarted, 70.0) == 2  # 10.5 is exactly 59.5 s old: still inside
    assert policy.may_restart(restarted, 71.0)  # 10.5 left the window and was dropped
    assert list(restarted) == [20.5]


def test_no_restart_allowed_with_a_limit_of_zero() -> None:
    assert not RestartPolicy(limit=0).may_restart(deque(), 0.0)
