"""Outlier ejection: a tunnel whose agent fails dials far more often than its cluster's other tunnels
leaves routing for a cool-down (pure logic, no I/O; the clock is a parameter).

Only *agent-level* failures count (the relayer decides which those are, see ``relaying.dial_fault``):
an answer the agent gave about itself (a 5xx not marked as the target's own failure) or no answer
within the agent answer timeout. A target that refused or was unreachable says nothing about the
agent that dialed it, and a healthy agent of a cluster whose targets are all down must not be
ejected for it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class EjectionPolicy:
    cooldown: float = 30.0  # seconds an ejected tunnel stays out of routing
    min_dials: int = 5  # agent-level outcomes within the window before a tunnel can be judged
    failure_rate: float = 0.5  # a tunnel's share of failed dials that can eject it
    window: float = 60.0  # seconds of outcomes that count

    def __post_init__(self) -> None:
        if self.cooldown <= 0 or self.window <= 0:
            raise ValueError("ejection cool-down and window must be greater than 0")
        if self.min_dials < 1:
            raise ValueError(f"ejection min dials {self.min_dials} must be at least 1")
        if not 0 < self.failure_rate <= 1:
            raise ValueError(f"ejection failure rate {self.failure_rate} outside (0, 1]")


@dataclass
class TunnelHealth:
    """One tunnel's recent dial outcomes and its ejection, if any."""

    outcomes: deque[tuple[float, bool]] = field(default_factory=deque)  # (when, failed)
    ejected_until: float | None = None
    ejections: int = 0

    def prune(self, now: float, window: float) -> None:
        while self.outcomes and self.outcomes[0][0] < now - window:
            self.outcomes.popleft()

    def counts(self) -> tuple[int, int]:
        """(failed, total) of the outcomes kept."""
        return sum(1 for _, failed in self.outcomes if failed), len(self.outcomes)

    def ejected(self, now: float) -> bool:
        if self.ejected_until is None:
            return False
        if now < self.ejected_until:
            return True
        # Back from the cool-down with a clean slate: its old failures were already paid for.
        self.ejected_until = None
        self.outcomes.clear()
        return False


@dataclass(frozen=True)
class Ejection:
    """What :meth:`OutlierEjection.record` decided, for the log line and the metrics."""

    failed: int
    total: int
    others_failed: int
    others_total: int
    cooldown: float

    @property
    def rate(self) -> float:
        return self.failed / self.total

    @property
    def others_rate(self) -> float:
        return self.others_failed / self.others_total if self.others_total else 0.0


class OutlierEjection:
    """Judges a tunnel against the other tunnels of its cluster after each agent-level outcome.

    A tunnel is ejected when, over the window, it has at least ``min_dials`` outcomes, its failure
    share is at least ``failure_rate`` *and* at least twice the pooled share of the cluster's other
    tunnels, and at least one other tunnel of the cluster is in routing. "Twice the others" keeps a
    cluster-wide problem (every agent failing alike) from ejecting anyone: ejection would not help.
    """

    def __init__(self, policy: EjectionPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.clock = clock

    def is_ejected(self, health: TunnelHealth) -> bool:
        return health.ejected(self.clock())

    def record(self, health: TunnelHealth, failed: bool, others: Iterable[TunnelHealth]) -> Ejection | None:
        """Count one dial outcome of the tunnel ``health`` belongs to; an :class:`Ejection` when it
        leaves routing now. ``others``: the health of the cluster's other live tunnels."""
        policy = self.policy
        now = self.clock()
        if health.ejected(now):
            return None  # a dial that started before the ejection: nothing new to decide
        health.prune(now, policy.window)
        health.outcomes.append((now, failed))
        if not failed:
            return None
        count, total = health.counts()
        if total < policy.min_dials or count / total < policy.failure_rate:
            return None
        others_failed = others_total = 0
        in_routing = 0
        for other in others:
            if other is health or other.ejected(now):
                continue
            in_routing += 1
            other.prune(now, policy.window)
            f, t = other.counts()
            others_failed += f
            others_total += t
        if in_routing == 0:
            return None  # nowhere else to send its streams
        others_rate = others_failed / others_total if others_total else 0.0
        if count / total < 2 * others_rate:
            return None
        health.ejected_until = now + policy.cooldown
        health.ejections += 1
        return Ejection(count, total, others_failed, others_total, policy.cooldown)
