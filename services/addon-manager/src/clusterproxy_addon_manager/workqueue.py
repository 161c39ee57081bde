"""A work queue of keys, in the manner of client-go's: level-triggered reconciles need to know *what*
to look at, never *what happened*.

- A key added while it waits is not added twice (ten events for one cluster: one reconcile).
- A key is handed to one worker at a time; added while being processed, it runs again afterwards
  (the worker may have read the world before the change).
- A failed key comes back after a per-key exponential backoff; a success resets it.

Lives in the trio thread; other threads add keys through ``trio.from_thread.run_sync``.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

import trio

Key = TypeVar("Key", bound=Hashable)

__all__ = ["WorkQueue"]


class WorkQueue(Generic[Key]):
    def __init__(self, *, retry_initial: float = 0.2, retry_max: float = 30.0) -> None:
        self._pending: OrderedDict[Key, None] = OrderedDict()
        self._processing: set[Key] = set()
        self._dirty: set[Key] = set()  # added while processing
        self._failures: dict[Key, int] = {}
        self._wakeup = trio.Event()
        self._nursery: trio.Nursery | None = None
        self.retry_initial = retry_initial
        self.retry_max = retry_max

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def processing(self) -> int:
        return len(self._processing)

    def add(self, key: Key) -> None:
        if key in self._processing:
            self._dirty.add(key)
            return
        if key not in self._pending:
            self._pending[key] = None
            self._wakeup.set()

    async def get(self) -> Key:
        while not self._pending:
            self._wakeup = trio.Event()
            await self._wakeup.wait()
        key, _ = self._pending.popitem(last=False)
        self._processing.add(key)
        return key

    def done(self, key: Key, *, failed: bool = False) -> float | None:
        """Mark ``key`` processed. A failure schedules a retry (needs :meth:`run`) and returns its
        delay; a key added meanwhile is queued again at once."""
        self._processing.discard(key)
        delay = None
        if failed:
            count = self._failures.get(key, 0)
            self._failures[key] = count + 1
            ceiling = min(self.retry_initial * 2**count, self.retry_max)
            delay = ceiling / 2 + random.random() * ceiling / 2
        else:
            self._failures.pop(key, None)
        if key in self._dirty:
            self._dirty.discard(key)
            self.add(key)
        elif delay is not None:
            self.add_after(key, delay)
        return delay

    def failures(self, key: Key) -> int:
        return self._failures.get(key, 0)

    def add_after(self, key: Key, delay: float) -> None:
        if self._nursery is None:
            raise RuntimeError("WorkQueue.run() is not running: delayed adds need its nursery")

        async def later() -> None:
            await trio.sleep(delay)
            self.add(key)

        self._nursery.start_soon(later)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Host the delayed adds until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()
