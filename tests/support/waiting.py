"""Waiting for a condition with a deadline: the one way tests wait (never a bare sleep)."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable

import trio

POLL = 0.01


async def wait_until(
    condition: Callable[[], object | Awaitable[object]],
    *,
    timeout: float = 10.0,
    what: str = "the condition",
    interval: float = POLL,
) -> None:
    """Poll ``condition`` (a function, or an async function) until it is truthy; AssertionError naming
    ``what`` after ``timeout`` seconds."""
    with trio.move_on_after(timeout):
        while True:
            result = condition()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return
            await trio.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
