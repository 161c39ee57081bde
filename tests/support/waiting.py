"""Waiting for a condition with a deadline: the one way tests wait (never a bare sleep).

- :func:`wait_until` in trio code, :func:`poll_until` in plain (threaded, blocking) code: poll until the
  condition holds, return what it returned, AssertionError once ``timeout`` has passed.
- :func:`wait_at_most`: the same wait that does not fail, for a settling period whose outcome the
  caller looks at itself (the RSS coming back, the last log lines written).

The failure names ``what`` was waited for; ``message`` (a string, or a function called at the timeout so
that it can say what was seen last) replaces the whole text; ``error`` is its type (a harness that
reports a process that never came up raises RuntimeError, not a test's AssertionError). A condition may raise to fail at once (a
process that exited will never log the line waited for).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

POLL = 0.01

Message = str | Callable[[], str] | None


def _failure(timeout: float, what: str, message: Message, error: type[Exception]) -> Exception:
    if message is None:
        return error(f"timed out after {timeout:g}s waiting for {what}")
    return error(message() if callable(message) else message)


async def _poll(condition: Callable[[], object | Awaitable[object]], timeout: float, interval: float) -> Any:
    """The truthy result of ``condition``, or None once ``timeout`` has passed."""
    with trio.move_on_after(timeout):
        while True:
            result = condition()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return result
            await trio.sleep(interval)
    return None


async def wait_until(
    condition: Callable[[], object | Awaitable[object]],
    *,
    timeout: float = 10.0,
    what: str = "the condition",
    interval: float = POLL,
    message: Message = None,
    error: type[Exception] = AssertionError,
) -> Any:
    """Poll ``condition`` (a function, or an async function) until it is truthy, and return that
    result; ``error`` (AssertionError) naming ``what`` (or saying ``message``) after ``timeout``
    seconds."""
    result = await _poll(condition, timeout, interval)
    if not result:
        raise _failure(timeout, what, message, error)
    return result


async def wait_at_most(
    condition: Callable[[], object | Awaitable[object]], *, timeout: float, interval: float = POLL
) -> bool:
    """Poll ``condition`` until it is truthy or ``timeout`` has passed; whether it held."""
    return bool(await _poll(condition, timeout, interval))


def poll_until(
    condition: Callable[[], Any],
    *,
    timeout: float,
    what: str = "the condition",
    interval: float = POLL,
    message: Message = None,
    error: type[Exception] = AssertionError,
) -> Any:
    """:func:`wait_until` for blocking code: call ``condition`` until it returns something truthy
    (returned), sleeping ``interval`` between calls; ``error`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise _failure(timeout, what, message, error)
        time.sleep(interval)
