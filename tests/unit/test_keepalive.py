"""Keepalive: the hub PINGs every interval (its round-trip time is what the health page shows); an agent
PINGs only when it has heard nothing from the hub for 1.5 intervals, so a live tunnel carries one PING
exchange per interval instead of two, and a silent hub is still found. The PINGs of many tunnels that
fall due close together go out together (one wake-up of the process, not one each)."""

from __future__ import annotations

import itertools

import pytest
import trio
import trio.testing

from clusterproxy_protocol.core import Role
from clusterproxy_protocol.driver import Mux, open_mux
from clusterproxy_protocol.keepalive import KEEPALIVE_GRID, QUIET_FACTOR, keepalive_due

INTERVAL = 10.0
TIMEOUT = 20.0


async def test_a_side_that_pings_when_quiet_stays_silent_while_its_peer_pings(
    autojump_clock: trio.testing.MockClock,
) -> None:
    hub_end, agent_end = trio.testing.memory_stream_pair()
    async with (
        open_mux(hub_end, Role.OPENER, keepalive=(INTERVAL, TIMEOUT)) as hub,
        open_mux(agent_end, Role.ACCEPTOR, keepalive=(INTERVAL, TIMEOUT), ping_when_quiet=True) as agent,
    ):
        await trio.sleep(10 * INTERVAL)
        assert hub.last_rtt is not None  # the hub's PINGs went on, answered
        assert agent.last_rtt is None  # the agent never needed one of its own
        assert not hub.dead and not agent.dead


async def test_it_pings_after_one_and_a_half_intervals_of_silence(
    autojump_clock: trio.testing.MockClock,
) -> None:
    hub_end, agent_end = trio.testing.memory_stream_pair()
    async with (
        open_mux(hub_end, Role.OPENER) as hub,  # a peer that never PINGs
        open_mux(agent_end, Role.ACCEPTOR, keepalive=(INTERVAL, TIMEOUT), ping_when_quiet=True) as agent,
    ):
        await trio.sleep(QUIET_FACTOR * INTERVAL - 1)
        assert agent.last_rtt is None
        await trio.sleep(2)
        assert agent.last_rtt is not None
        agent.last_rtt = None  # its answer was the last thing heard: the next PING is as far again
        await trio.sleep(QUIET_FACTOR * INTERVAL - 2)
        assert agent.last_rtt is None
        await trio.sleep(2)
        assert agent.last_rtt is not None and not hub.dead


async def test_a_hub_that_stopped_answering_is_found_within_the_silence_and_the_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The far end of the pipe is never read and never written: a frozen hub.
    agent_end, _frozen_hub = trio.testing.memory_stream_pair()
    started = trio.current_time()
    async with open_mux(
        agent_end, Role.ACCEPTOR, keepalive=(INTERVAL, TIMEOUT), ping_when_quiet=True
    ) as agent:
        await agent.closed.wait()
        took = trio.current_time() - started
    assert "no PING answer within 20s" in agent.dead_reason
    assert took == pytest.approx(QUIET_FACTOR * INTERVAL + TIMEOUT, abs=0.5)


def test_a_due_time_moves_up_to_the_grid_and_never_earlier() -> None:
    step = INTERVAL * KEEPALIVE_GRID
    for when in (0.0, 0.001, step / 2, step, step + 1e-6, 20.1, 1234.5678):
        due = keepalive_due(when, INTERVAL)
        assert when - 1e-6 <= due < when + step
        assert due / step == pytest.approx(round(due / step))


async def test_the_pings_of_tunnels_that_fall_due_together_go_out_in_one_wake_up(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Five hubs' tunnels opened a few ms apart: after each one's first PING (at its start), every PING
    of all five goes out at the same instants, one grid step apart at most from a whole interval."""
    sent: dict[int, list[float]] = {}
    ping = Mux.ping

    async def recorded_ping(self: Mux) -> float:
        sent.setdefault(id(self), []).append(trio.current_time())
        return await ping(self)

    monkeypatch.setattr(Mux, "ping", recorded_ping)

    async def tunnel(delay: float) -> None:
        await trio.sleep(delay)
        hub_end, agent_end = trio.testing.memory_stream_pair()
        async with (
            open_mux(hub_end, Role.OPENER, keepalive=(INTERVAL, TIMEOUT)),
            open_mux(agent_end, Role.ACCEPTOR),
        ):
            await trio.sleep(5.5 * INTERVAL)

    async with trio.open_nursery() as nursery:
        for i in range(5):
            nursery.start_soon(tunnel, 0.001 + 0.013 * i)  # within one grid step, none on it
    step = INTERVAL * KEEPALIVE_GRID
    assert len(sent) == 5
    later = {tuple(round(t, 6) for t in times[1:]) for times in sent.values()}
    assert len(later) == 1  # the same instants for every tunnel
    (instants,) = later
    assert len(instants) == 5
    for before, after in itertools.pairwise(instants):
        assert INTERVAL <= after - before <= INTERVAL + step + 1e-6


def test_a_time_on_the_grid_stays_where_it_is() -> None:
    # 3 steps of 0.1 are 0.30000000000000004 in floating point, a hair above the third grid point:
    # rounding that up would put the PING a whole step later
    step = INTERVAL * KEEPALIVE_GRID
    assert keepalive_due(3 * step, INTERVAL) == pytest.approx(0.3)
    assert keepalive_due(82 * step + INTERVAL, INTERVAL) == pytest.approx(18.2)
