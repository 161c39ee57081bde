"""tests/support/waiting.py: the one way tests wait."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from tests.support.waiting import poll_until, wait_at_most, wait_until


async def test_wait_until_returns_what_the_condition_returned(autojump_clock: trio.testing.MockClock) -> None:
    calls = []

    async def third_time() -> str | None:
        calls.append(1)
        return "done" if len(calls) == 3 else None

    assert await wait_until(third_time, timeout=5) == "done"


async def test_wait_until_fails_naming_what_or_saying_the_message(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with pytest.raises(AssertionError, match=r"timed out after 2s waiting for the light"):
        await wait_until(lambda: False, timeout=2, what="the light")
    seen = []
    with pytest.raises(RuntimeError, match=r"^last seen: 3$"):
        await wait_until(
            lambda: seen.append(len(seen)),  # None: never true
            timeout=0.035,
            interval=0.01,
            message=lambda: f"last seen: {seen[-1]}",
            error=RuntimeError,
        )


async def test_a_condition_that_raises_fails_at_once(autojump_clock: trio.testing.MockClock) -> None:
    def exited() -> bool:
        raise AssertionError("the process exited")

    with pytest.raises(AssertionError, match="the process exited"):
        await wait_until(exited, timeout=60)
    assert trio.current_time() == 0


async def test_wait_at_most_says_whether_it_held(autojump_clock: trio.testing.MockClock) -> None:
    assert not await wait_at_most(lambda: False, timeout=1)
    assert trio.current_time() >= 1
    assert await wait_at_most(lambda: True, timeout=1)


def test_poll_until_returns_the_value_or_fails_after_the_timeout() -> None:
    values = iter([0, "", "ready"])
    assert poll_until(lambda: next(values), timeout=5, interval=0) == "ready"
    with pytest.raises(AssertionError, match=r"timed out after 0\.05s waiting for nothing"):
        poll_until(lambda: None, timeout=0.05, what="nothing")
