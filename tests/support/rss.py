"""A process's resident memory (VmRSS from /proc/PID/status), sampled over an attack and waited on
until it is back within a margin of a baseline."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import trio

from tests.support.waiting import wait_until

SAMPLE_INTERVAL = 0.05


def rss_kib(pid: int) -> int:
    """VmRSS of ``pid`` in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS in /proc/{pid}/status (a zombie?)")


@dataclass
class RssWatch:
    """The peak RSS of ``pid`` while :meth:`sample` runs, and the wait for its return."""

    pid: int
    baseline_kib: int = 0
    peak_kib: int = 0
    last_kib: int = 0

    @classmethod
    def from_now(cls, pid: int) -> RssWatch:
        now = rss_kib(pid)
        return cls(pid, baseline_kib=now, peak_kib=now, last_kib=now)

    def read(self) -> int:
        self.last_kib = rss_kib(self.pid)
        self.peak_kib = max(self.peak_kib, self.last_kib)
        return self.last_kib

    async def sample(self) -> None:
        """Read every SAMPLE_INTERVAL until cancelled (run it in a nursery beside the attack)."""
        while True:
            self.read()
            await trio.sleep(SAMPLE_INTERVAL)

    async def wait_within(self, margin_kib: int, *, timeout: float) -> int:
        """Wait until RSS is at most ``margin_kib`` above the baseline; the RSS then, in KiB. Fails
        after ``timeout`` seconds naming the baseline, the peak and the last reading."""

        def back() -> bool:
            return self.read() <= self.baseline_kib + margin_kib

        try:
            await wait_until(back, timeout=timeout, interval=SAMPLE_INTERVAL, what="the RSS to come back")
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}: RSS {self.last_kib} KiB, baseline {self.baseline_kib} KiB + margin {margin_kib} KiB"
                f" (peak {self.peak_kib} KiB)"
            ) from None
        return self.last_kib
