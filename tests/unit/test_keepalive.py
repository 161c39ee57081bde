"""Keepalive: the hub PINGs every interval (its round-trip time is what the health page shows); an agent
PINGs only when it has heard nothing from the hub for 1.5 intervals, so a live tunnel carries one PING
exchange per interval instead of two, and a silent hub is still found."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from clusterproxy_protocol.core import Role
from clusterproxy_protocol.driver import QUIET_FACTOR, open_mux

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
