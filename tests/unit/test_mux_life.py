"""A Mux's life: one state, moved forward in one place; `closed` and `finished` follow it."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from clusterproxy_protocol.core import Role
from clusterproxy_protocol.driver import CLOSE_GRACE, NEXT_STATES, IncomingRequest, Mux, MuxState, open_mux


class RecordingMux(Mux):
    """Keeps every state it enters, in order."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.history: list[MuxState] = []

    def _enter(self, state: MuxState) -> None:
        super()._enter(state)
        self.history.append(state)


def test_states_only_move_forward_and_finished_is_the_end() -> None:
    order = list(MuxState)
    for state, successors in NEXT_STATES.items():
        assert all(order.index(after) > order.index(state) for after in successors), state
    assert NEXT_STATES[MuxState.FINISHED] == frozenset()
    assert set(NEXT_STATES) == set(MuxState)


async def test_a_move_not_in_the_table_is_refused() -> None:
    left, _ = trio.testing.memory_stream_pair()
    mux = Mux(left, Role.OPENER, None, None)
    with pytest.raises(RuntimeError, match="from OPEN to STOPPED"):
        mux._enter(MuxState.STOPPED)
    assert mux.state is MuxState.OPEN and not mux.dead


async def test_the_peer_closing_its_side(nursery: trio.Nursery) -> None:
    left, right = trio.testing.memory_stream_pair()
    mux = RecordingMux(left, Role.OPENER, None, None)
    await nursery.start(mux.run)
    await right.aclose()
    with trio.fail_after(5):
        await mux.closed.wait()
        assert mux.state in (MuxState.STOPPED, MuxState.FINISHED)
        await mux.finished.wait()
    assert mux.history == [MuxState.PEER_CLOSED, MuxState.STOPPED, MuxState.FINISHED]
    assert mux.dead and mux.dead_reason == "peer closed the connection"


async def test_closing_here_then_the_peer_reads_the_goaway(nursery: trio.Nursery) -> None:
    left, right = trio.testing.memory_stream_pair()
    opener = RecordingMux(left, Role.OPENER, None, None)
    async with open_mux(right, Role.ACCEPTOR) as acceptor:
        await nursery.start(opener.run)
        opener.close("going away for a test")
        assert opener.state is MuxState.CLOSING and opener.dead  # at once, before any I/O
        assert opener.dead_reason == "going away for a test"
        with trio.fail_after(5):
            await opener.finished.wait()
            await acceptor.closed.wait()
    assert opener.history == [MuxState.CLOSING, MuxState.STOPPED, MuxState.FINISHED]
    assert acceptor.dead_reason == "peer sent GOAWAY 0: going away for a test"


async def test_closed_is_set_once_the_stream_handlers_have_stopped(nursery: trio.Nursery) -> None:
    left, right = trio.testing.memory_stream_pair()
    handler_running = trio.Event()
    handler_ended = trio.Event()

    async def hold(request: IncomingRequest) -> None:
        await request.accept()
        handler_running.set()
        try:
            await trio.sleep_forever()
        finally:
            handler_ended.set()

    async with (
        open_mux(left, Role.OPENER) as opener,
        open_mux(right, Role.ACCEPTOR, handler=hold) as acceptor,
    ):
        stream = await opener.open_connect("target:80")
        await handler_running.wait()
        opener.close("bye")
        with trio.fail_after(5):
            await acceptor.closed.wait()
        assert handler_ended.is_set()
        with pytest.raises(trio.BrokenResourceError, match="tunnel connection lost: bye"):
            await stream.send_all(b"x")


async def test_a_peer_that_never_reads_holds_the_close_two_graces_at_most(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # One grace for the writer to send what was queued, one for the last flush and the peer's close.
    left, _never_read = trio.testing.lockstep_stream_pair()
    mux = Mux(left, Role.OPENER, None, None)
    await nursery.start(mux.run)
    await trio.sleep(10)
    mux.close("bye")
    start = trio.current_time()
    await mux.closed.wait()
    assert trio.current_time() - start == pytest.approx(CLOSE_GRACE)
    await mux.finished.wait()
    assert trio.current_time() - start == pytest.approx(2 * CLOSE_GRACE)


class TaskSteps(trio.abc.Instrument):
    """Counts every step of every task, by the task's name."""

    def __init__(self) -> None:
        self.steps: dict[str, int] = {}

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps[task.name] = self.steps.get(task.name, 0) + 1


async def test_an_idle_connection_wakes_none_of_its_tasks(autojump_clock: trio.testing.MockClock) -> None:
    """Thousands of idle tunnels per worker: without keepalives (their own test) nothing of a tunnel
    runs while nothing arrives; the frame-timeout watch waits for a frame to start, it does not poll."""
    left, right = trio.testing.memory_stream_pair()
    async with open_mux(left, Role.OPENER), open_mux(right, Role.ACCEPTOR):
        await trio.sleep(1)  # the SETTINGS exchange is over
        steps = TaskSteps()
        trio.lowlevel.add_instrument(steps)
        try:
            await trio.sleep(600)
        finally:
            trio.lowlevel.remove_instrument(steps)
    assert {name: n for name, n in steps.steps.items() if ".driver." in name} == {}
