"""When a supervised process that died on its own is started again, and when its deaths are a crash
loop that stops its supervisor instead: the one rule of ``cluster-proxy local up`` (its proxy-server
replicas and agents) and of the proxy-server's ``--workers`` parent."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

__all__ = ["RestartPolicy"]


@dataclass(frozen=True)
class RestartPolicy:
    """Restart a process that died on its own after ``delay`` seconds, unless it has already been
    restarted ``limit`` times within the last ``window`` seconds: a crash loop, which restarting
    only hides (its supervisor stops, and says why)."""

    delay: float = 1.0
    limit: int = 5
    window: float = 60.0

    def recent(self, restarted_at: deque[float], now: float) -> int:
        """The restarts within the window before ``now``; older ones are dropped from ``restarted_at``
        (the times of the restarts, oldest first, on one clock with ``now``)."""
        while restarted_at and restarted_at[0] < now - self.window:
            restarted_at.popleft()
        return len(restarted_at)

    def may_restart(self, restarted_at: deque[float], now: float) -> bool:
        """Whether a death at ``now`` is restarted (else it is a crash loop)."""
        return self.recent(restarted_at, now) < self.limit
